"""Helpers for the L2 server tests: prompts, deterministic object bytes, describe polling."""

from __future__ import annotations

import time
from typing import Any

from kvtestkit.kvhelpers import payload, register, store, tiny_layout
from kvprotocol import Client, KeySpace, ObjectKey, chunk_hashes, pack_tokens

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
CHUNK = 256
SIZE = tiny_layout().object_bytes  # 16 KiB objects


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Poll until predicate() is truthy; returns its value or fails the test with `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def prompt(n_chunks: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31 + seed) % 50000 for i in range(n_chunks * CHUNK)]


def data(seed: int):  # type: ignore[no-untyped-def]
    """data_of(chunk, group) for kvhelpers.store: distinct bytes per prompt seed, chunk and group."""
    return lambda ch, g: payload(seed * 1000 + ch * 10 + g, SIZE)


def tier(c: Client, index: int = 0) -> dict[str, Any]:
    return c.call("describe").result["l2"][index]


def wait_tier(c: Client, field: str, at_least: int, index: int = 0, timeout: float = 10.0) -> dict[str, Any]:
    return wait_until(
        lambda: (t := tier(c, index))[field] >= at_least and t, timeout, what=f"l2[{index}].{field} >= {at_least}"
    )


def object_keys(ks: KeySpace, tokens: list[int], salt: str = "", rank: int = 0) -> list[str]:
    """The L2 keys (ObjectKey.to_str) of every (chunk, group) object, chunk-major."""
    return [
        ObjectKey(ks.model, fp, ks.world_size, rank, g, salt, h).to_str()
        for h in chunk_hashes(pack_tokens(tokens), CHUNK)
        for g, fp in enumerate(ks.groups)
    ]


def store_in_l2(c: Client, n_chunks: int, seed: int) -> tuple[KeySpace, list[int]]:
    """Register, store a prompt of `n_chunks` chunks (bytes `data(seed)`), wait until L2 holds them."""
    tokens = prompt(n_chunks, seed=seed)
    ks, _ = register(c)
    store(c, ks, tokens, data(seed))
    wait_tier(c, "puts", n_chunks)
    return ks, tokens
