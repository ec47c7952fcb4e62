"""Helpers for the HTTP, metrics and fleet tests: keyspace JSON bodies, prompts, and Prometheus text
read with prometheus-client's own parser (so invalid exposition fails the test)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvprotocol import KeySpace

CHUNK = 32  # servers in these tests run with --chunk-size 32 and kvhelpers.tiny_layout(CHUNK)


def keys_body(ks: KeySpace, tokens: Sequence[int], **extra: Any) -> dict[str, Any]:
    """JSON body of /v1/query, /v1/pin and /v1/unpin."""
    return {"model": ks.model, "world_size": ks.world_size, "groups": list(ks.groups), "tokens": list(tokens), **extra}


def prompt(n_chunks: int, seed: int = 0, tail: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(n_chunks * CHUNK + tail)]


def fill(chunk: int, group: int) -> bytes:
    """Object bytes for kvhelpers.store: tiny_layout(CHUNK) objects are 2 KiB."""
    return bytes([(chunk * 7 + group) % 251]) * 2048


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Every sample of an exposition text, keyed by (sample name, labels); raises on invalid text."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)
