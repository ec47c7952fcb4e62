"""The options that name a token sequence's keys (model, tokens, salt, layouts), shared by `query`,
`pin` and `unpin`, and the keyspaces they resolve to."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Callable

import click

from .._source import Unreachable, fetch_status

F = TypeVar("F", bound=Callable[..., Any])


def keyspace_options(func: F) -> F:
    """--model, --tokens / --tokens-file, --salt, --layout-fingerprint, --world-size."""
    options = [
        click.option("--model", required=True, help="Model name the engines registered."),
        click.option("--tokens", "tokens_text", default=None, help="Token ids, e.g. 1,2,3."),
        click.option(
            "--tokens-file",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            default=None,
            help="File of token ids (JSON list, or integers separated by commas/whitespace).",
        ),
        click.option("--salt", default="", help="Cache salt (tenant isolation) the engine used."),
        click.option(
            "--layout-fingerprint",
            "fingerprints",
            multiple=True,
            help="Layout fingerprint per object group (repeat); default: from registered engines.",
        ),
        click.option(
            "--world-size",
            default=1,
            show_default=True,
            type=click.IntRange(1, 4096),
            help="With --layout-fingerprint.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def parse_tokens(text: str) -> list[int]:
    """Token ids from a JSON list or from integers separated by commas and/or whitespace."""
    text = text.strip()
    try:
        if text.startswith("["):
            values = json.loads(text)
            if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise ValueError("expected a JSON list of integers")
        else:
            values = [int(t) for t in re.split(r"[,\s]+", text) if t]
    except ValueError as exc:
        raise click.BadParameter(f"cannot parse token ids: {exc}") from None
    if not values:
        raise click.BadParameter("no token ids given")
    if any(not 0 <= v <= 0xFFFFFFFF for v in values):
        raise click.BadParameter("token ids must be in [0, 2**32)")
    return values


def read_tokens(tokens_text: str | None, tokens_file: Path | None) -> list[int]:
    """The token ids of exactly one of --tokens and --tokens-file."""
    if tokens_file is not None and tokens_text is None:
        return parse_tokens(tokens_file.read_text())
    if tokens_text is not None and tokens_file is None:
        return parse_tokens(tokens_text)
    raise click.UsageError("give exactly one of --tokens and --tokens-file")


def keyspaces_for(status: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """Distinct keyspaces ({model, world_size, groups}) of the engines registered for a model."""
    from kvprotocol import LayoutDescriptor

    seen: dict[tuple[int, tuple[str, ...]], dict[str, Any]] = {}
    for engine in status.get("engines", []):
        if engine.get("model") != model:
            continue
        groups = tuple(LayoutDescriptor.from_wire(g).fingerprint for g in engine.get("groups", []))
        seen.setdefault(
            (engine["world_size"], groups), {"model": model, "world_size": engine["world_size"], "groups": list(groups)}
        )
    return list(seen.values())


def resolve_keyspaces(
    url: str, model: str, fingerprints: tuple[str, ...], world_size: int, timeout: float
) -> list[dict[str, Any]]:
    """The named layouts, or those of the engines registered for the model (Unreachable if none)."""
    if fingerprints:
        return [{"model": model, "world_size": world_size, "groups": list(fingerprints)}]
    keyspaces = keyspaces_for(fetch_status(url, timeout), model)
    if not keyspaces:
        raise Unreachable(
            f"no engine registered for model {model!r} on {url}; pass --layout-fingerprint to name the layout"
        )
    return keyspaces
