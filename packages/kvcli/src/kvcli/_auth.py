"""`--token` / `--token-file`: the one credential a kvcli command sends, to servers and the coordinator.

Every command (and the `kvcli` group itself) takes both flags; without them the lookup is the one
every client shares (kvprotocol `resolve_token`): $KVSERVER_API_TOKEN, $KVSERVER_API_TOKEN_FILE, then
the server's default token file for a loopback URL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])
_explicit: list[str] = []  # the token given on the command line (at most one)


def reset() -> None:
    """Forget a previous invocation's flag (kvcli's main runs more than once in one process under tests)."""
    _explicit.clear()


def cli_token() -> str | None:
    """The token given with --token/--token-file, or None (then clients resolve it themselves)."""
    return _explicit[-1] if _explicit else None


def token_for(url: str) -> str | None:
    """The token to send to `url`: the flag's, else the shared lookup."""
    from kvprotocol import resolve_token

    return resolve_token(cli_token(), url)


def _set_token(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if not value:
        return
    if param.name == "token_file":
        from kvprotocol import CredentialError
        from kvprotocol._credentials import read_private

        try:
            value = read_private(Path(value), strict=False)
        except CredentialError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    elif any(ch.isspace() for ch in value) or len(value) > 1024:
        raise click.BadParameter("a token is 1-1024 characters without whitespace", ctx=ctx, param=param)
    _explicit[:] = [value]


def token_options(func: F) -> F:
    """Add --token and --token-file to a command (eager callbacks; the command's signature is unchanged)."""
    func = click.option(
        "--token-file",
        type=click.Path(dir_okay=False),
        metavar="PATH",
        default=None,
        expose_value=False,
        callback=_set_token,
        help="Read the API token from this file (else $KVSERVER_API_TOKEN_FILE).",
    )(func)
    func = click.option(
        "--token",
        default=None,
        expose_value=False,
        callback=_set_token,
        metavar="TOKEN",
        help="API token of the server or coordinator (else $KVSERVER_API_TOKEN, then the "
        "server's own token file for a loopback url).",
    )(func)
    return func
