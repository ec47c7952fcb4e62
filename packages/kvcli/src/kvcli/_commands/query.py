"""`kvcli query`: which chunks of a token sequence are cached, in which tier, and the reusable prefix.

Keys depend on the layout, so without `--layout-fingerprint` the keyspaces come from the engines
registered for the model (describe's "engines"): one answer per distinct (world size, layouts).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click

from .._auth import token_options
from .._output import emit_json, fail, stdout_console
from .._source import DEFAULT_URL, URL, Unreachable, fetch_status, is_http, zmq_request

NON_TIER_FIELDS = {"hash", "objects", "index"}


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


def keyspaces_for(status: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """Distinct keyspaces ({model, world_size, groups}) of the engines registered for a model."""
    from kvprotocol import LayoutDescriptor

    seen: dict[tuple[int, tuple[str, ...]], dict[str, Any]] = {}
    for engine in status.get("engines", []):
        if engine.get("model") != model:
            continue
        groups = tuple(LayoutDescriptor.from_wire(g).fingerprint for g in engine.get("groups", []))
        seen.setdefault((engine["world_size"], groups),
                        {"model": model, "world_size": engine["world_size"], "groups": list(groups)})
    return list(seen.values())


def run_query(url: str, model: str, tokens: list[int], salt: str, fingerprints: tuple[str, ...],
              world_size: int, timeout: float) -> dict[str, Any]:
    from kvprotocol import pack_tokens

    if fingerprints:
        keyspaces = [{"model": model, "world_size": world_size, "groups": list(fingerprints)}]
    else:
        keyspaces = keyspaces_for(fetch_status(url, timeout), model)
        if not keyspaces:
            raise Unreachable(f"no engine registered for model {model!r} on {url}; "
                              "pass --layout-fingerprint to name the layout")
    packed = pack_tokens(tokens)
    answers = []
    for ks in keyspaces:
        fields: dict[str, Any] = {"keyspace": ks, "tokens": packed}
        if salt:
            fields["salt"] = salt
        result, _ = zmq_request(url, "query", timeout, **fields)
        chunks = [{"index": i, **chunk} for i, chunk in enumerate(result["chunks"])]
        answers.append({**ks, "chunk_size": result["chunk_size"], "prefix_tokens": result["prefix_tokens"],
                        "chunks": chunks})
    return {"url": url, "model": model, "tokens": len(tokens), "salt": bool(salt), "keyspaces": answers}


def _tiers(chunks: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for chunk in chunks:
        names += [k for k in chunk if k not in NON_TIER_FIELDS and k not in names]
    return names


def render(answer: dict[str, Any]) -> list[Any]:
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = []
    for ks in answer["keyspaces"]:
        tiers = _tiers(ks["chunks"])
        title = (f"{answer['model']} world={ks['world_size']} layouts={','.join(ks['groups'])}: "
                 f"reusable prefix {ks['prefix_tokens']} of {answer['tokens']} tokens "
                 f"(chunk {ks['chunk_size']})")
        out.append(Text(title, style="bold"))
        table = Table()
        table.add_column("chunk", justify="right")
        table.add_column("tokens", justify="right")
        table.add_column("hash")
        for tier in tiers:
            table.add_column(tier, justify="right")
        table.add_column("prefix")
        prefix_chunks = ks["prefix_tokens"] // ks["chunk_size"]
        for chunk in ks["chunks"]:
            i, size = chunk["index"], ks["chunk_size"]
            cells = [f"{chunk.get(t, 0)}/{chunk['objects']}" for t in tiers]
            table.add_row(str(i), f"{i * size}-{(i + 1) * size - 1}", chunk["hash"][:16], *cells,
                          "yes" if i < prefix_chunks else "")
        out.append(table)
    return out


@click.command(name="query")
@click.option("--url", type=URL, default=DEFAULT_URL, show_default=True,
              help="Server ZMQ url (host:port, tcp:// or ipc://).")
@click.option("--model", required=True, help="Model name the engines registered.")
@click.option("--tokens", "tokens_text", default=None, help="Token ids, e.g. 1,2,3.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="File of token ids (JSON list, or integers separated by commas/whitespace).")
@click.option("--salt", default="", help="Cache salt (tenant isolation) the engine used.")
@click.option("--layout-fingerprint", "fingerprints", multiple=True,
              help="Layout fingerprint per object group (repeat); default: from registered engines.")
@click.option("--world-size", default=1, show_default=True, type=click.IntRange(1, 4096),
              help="With --layout-fingerprint.")
@click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(0.01, 3600))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (also on failure: ok false and the reason).")
@token_options
def command(url: str, model: str, tokens_text: str | None, tokens_file: Path | None, salt: str,
            fingerprints: tuple[str, ...], world_size: int, timeout: float, as_json: bool) -> None:
    """Per-chunk hash and presence per tier of a token sequence, and its reusable prefix in tokens."""
    if (tokens_text is None) == (tokens_file is None):
        raise click.UsageError("give exactly one of --tokens and --tokens-file")
    if is_http(url):
        raise click.UsageError("query speaks ZMQ: give the server's tcp:// url")
    tokens = parse_tokens(tokens_text if tokens_text is not None else tokens_file.read_text())  # type: ignore[union-attr]
    try:
        answer = run_query(url, model, tokens, salt, fingerprints, world_size, timeout)
    except Unreachable as exc:
        fail(str(exc), as_json, url=url, model=model)
    if as_json:
        emit_json(answer)
        return
    console = stdout_console()
    for renderable in render(answer):
        console.print(renderable)
