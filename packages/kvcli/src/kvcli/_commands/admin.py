"""`kvcli clear`, `kvcli pin`, `kvcli unpin`: the admin API's key operations from the command line.

Over ZMQ (host:port, tcp://, ipc://) they are the `clear`/`pin`/`unpin` ops; over http(s):// the
`POST /v1/clear|pin|unpin` endpoints. Both need the server's API token (the one every kvcli command
finds, or --token). `clear` destroys cached KV, so it asks first (on stdin; no answer is no)
unless --yes; under --json, which is for scripts, it never prompts and refuses without --yes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .._auth import token_options
from .._output import emit_json, fail
from .._source import DEFAULT_URL, URL, Unreachable, http_json, is_http, zmq_request
from ._keyspace_args import keyspace_options, read_tokens, resolve_keyspaces


def _common(func: Any) -> Any:
    func = token_options(func)
    func = click.option(
        "--json", "as_json", is_flag=True, help="Print JSON (also on failure: ok false and the reason)."
    )(func)
    func = click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(0.01, 3600))(func)
    func = click.option(
        "--url",
        type=URL,
        default=DEFAULT_URL,
        show_default=True,
        help="Server: host:port, tcp://, ipc:// (ZMQ) or http(s):// (admin API).",
    )(func)
    return func


def _call(url: str, op: str, timeout: float, fields: dict[str, Any], http_body: dict[str, Any] | None) -> Any:
    if is_http(url):
        return http_json(url, f"/v1/{op}", timeout, method="POST", json_body=http_body)
    result, _ = zmq_request(url, op, timeout, **fields)
    return result


@click.command(name="clear")
@_common
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
def clear_command(url: str, timeout: float, as_json: bool, yes: bool) -> None:
    """Remove every ready, unleased object (pinned ones too) from a server's L1 (L2 tiers keep theirs)."""
    if not yes:
        if as_json:
            fail("clear removes every cached object: confirm with --yes", as_json, url=url)
        click.confirm(f"Remove every cached object from L1 of {url}?", abort=True, err=True)
    try:
        result = _call(url, "clear", timeout, {}, None)
    except Unreachable as exc:
        fail(str(exc), as_json, url=url)
    removed = result.get("removed", 0) if isinstance(result, dict) else 0
    if as_json:
        emit_json({"ok": True, "url": url, "removed": removed})
    else:
        click.echo(f"{url}: removed {removed} objects from L1")


def _keys_command(op: str, verb: str, doc: str) -> click.Command:
    @click.command(name=op, help=doc)
    @_common
    @keyspace_options
    def command(
        url: str,
        timeout: float,
        as_json: bool,
        model: str,
        tokens_text: str | None,
        tokens_file: Path | None,
        salt: str,
        fingerprints: tuple[str, ...],
        world_size: int,
    ) -> None:
        tokens = read_tokens(tokens_text, tokens_file)
        try:
            keyspaces = resolve_keyspaces(url, model, fingerprints, world_size, timeout)
            from kvprotocol import pack_tokens

            total = 0
            for ks in keyspaces:
                fields: dict[str, Any] = {"keyspace": ks, "tokens": pack_tokens(tokens)}
                if salt:
                    fields["salt"] = salt
                body = {**ks, "tokens": tokens, "salt": salt or None}
                result = _call(url, op, timeout, fields, body)
                total += int(result.get("objects", 0)) if isinstance(result, dict) else 0
        except Unreachable as exc:
            fail(str(exc), as_json, url=url, model=model)
        if as_json:
            emit_json(
                {
                    "ok": True,
                    "url": url,
                    "model": model,
                    "tokens": len(tokens),
                    "keyspaces": len(keyspaces),
                    "objects": total,
                }
            )
        else:
            click.echo(f"{url}: {verb} {total} objects of {len(tokens)} tokens ({model})")

    return command


pin_command = _keys_command(
    "pin",
    "pinned",
    "Pin the ready objects of a token sequence in L1 so eviction never takes them (until unpin or clear).",
)
unpin_command = _keys_command("unpin", "unpinned", "Make pinned objects of a token sequence evictable again.")
command = clear_command
