"""`kvcli query`: which chunks of a token sequence are cached, in which tier, and the reusable prefix.

Keys depend on the layout, so without `--layout-fingerprint` the keyspaces come from the engines
registered for the model (describe's "engines"): one answer per distinct (world size, layouts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .._auth import token_options
from .._output import emit_json, fail, stdout_console
from .._source import DEFAULT_URL, URL, Unreachable, is_http, zmq_request
from ._keyspace_args import keyspace_options, read_tokens, resolve_keyspaces

NON_TIER_FIELDS = {"hash", "objects", "index"}


def run_query(
    url: str, model: str, tokens: list[int], salt: str, fingerprints: tuple[str, ...], world_size: int, timeout: float
) -> dict[str, Any]:
    from kvprotocol import pack_tokens

    keyspaces = resolve_keyspaces(url, model, fingerprints, world_size, timeout)
    packed = pack_tokens(tokens)
    answers = []
    for ks in keyspaces:
        fields: dict[str, Any] = {"keyspace": ks, "tokens": packed}
        if salt:
            fields["salt"] = salt
        result, _ = zmq_request(url, "query", timeout, **fields)
        chunks = [{"index": i, **chunk} for i, chunk in enumerate(result["chunks"])]
        answers.append(
            {**ks, "chunk_size": result["chunk_size"], "prefix_tokens": result["prefix_tokens"], "chunks": chunks}
        )
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
        title = (
            f"{answer['model']} world={ks['world_size']} layouts={','.join(ks['groups'])}: "
            f"reusable prefix {ks['prefix_tokens']} of {answer['tokens']} tokens "
            f"(chunk {ks['chunk_size']})"
        )
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
            table.add_row(
                str(i),
                f"{i * size}-{(i + 1) * size - 1}",
                chunk["hash"][:16],
                *cells,
                "yes" if i < prefix_chunks else "",
            )
        out.append(table)
    return out


@click.command(name="query")
@click.option(
    "--url", type=URL, default=DEFAULT_URL, show_default=True, help="Server ZMQ url (host:port, tcp:// or ipc://)."
)
@keyspace_options
@click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(0.01, 3600))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (also on failure: ok false and the reason).")
@token_options
def command(
    url: str,
    model: str,
    tokens_text: str | None,
    tokens_file: Path | None,
    salt: str,
    fingerprints: tuple[str, ...],
    world_size: int,
    timeout: float,
    as_json: bool,
) -> None:
    """Per-chunk hash and presence per tier of a token sequence, and its reusable prefix in tokens."""
    if is_http(url):
        raise click.UsageError("query speaks ZMQ: give the server's tcp:// url")
    tokens = read_tokens(tokens_text, tokens_file)
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
