"""`kvcoordinator` (also `kvcli coordinator` when this package is installed): run the fleet coordinator
(FastAPI + uvicorn) in the foreground."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any, NoReturn

import click


class CoordinatorError(click.ClickException):
    """A start-up failure, printed as one line on stderr; exit status 1."""

    exit_code = 1

    def show(self, file: Any = None) -> None:
        click.echo(f"kvcoordinator: {self.format_message()}", err=True)


def fail(reason: str) -> NoReturn:
    raise CoordinatorError(reason)


@click.command(name="coordinator")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address.")
@click.option("--port", default=9090, show_default=True, type=click.IntRange(0, 65535), help="Port.")
@click.option(
    "--instance-timeout",
    default=15.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600),
    help="Seconds without a heartbeat after which an instance is dropped.",
)
@click.option(
    "--fanout-timeout",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0.05, 60),
    help="Seconds to wait for each instance in fleet status and fleet lookup.",
)
@click.option(
    "--api-token",
    envvar="KVSERVER_API_TOKEN",
    show_envvar=True,
    default=None,
    help="Bearer token every endpoint but /healthz needs (and /metrics off loopback); without "
    "one a token is generated into <state dir>/token-<port> (0600). A configured token is "
    "also the fleet token sent to trusted instances (same-user loopback ones, --trust-host).",
)
@click.option(
    "--api-token-file",
    envvar="KVSERVER_API_TOKEN_FILE",
    show_envvar=True,
    default=None,
    type=click.Path(dir_okay=False),
    metavar="PATH",
    help="Read the API token from this file.",
)
@click.option(
    "--instance-token-file",
    default=None,
    type=click.Path(dir_okay=False),
    metavar="PATH",
    help="Token presented to instances (fleet status, fan-out, KV-events feeds), e.g. a server's "
    "token file; default: the configured --api-token, else none.",
)
@click.option(
    "--trust-host",
    "trusted_hosts",
    multiple=True,
    metavar="HOST",
    help="Non-loopback instance host the fleet token may be sent to (repeatable); instances "
    "elsewhere are asked without credentials.",
)
@click.option("--insecure", is_flag=True, default=False, help="Allow a non-loopback bind without an API token.")
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
def command(
    host: str,
    port: int,
    instance_timeout: float,
    fanout_timeout: float,
    api_token: str | None,
    api_token_file: str | None,
    instance_token_file: str | None,
    trusted_hosts: tuple[str, ...],
    insecure: bool,
    log_level: str,
) -> None:
    """Run the fleet coordinator: soft-state membership, fleet status and fleet lookup over HTTP."""
    from pathlib import Path

    from kvprotocol import CredentialError, listen_socket
    from kvprotocol._credentials import read_private

    from .binding import exposure_problem

    api_token = api_token or None
    if api_token is None and not api_token_file:
        from kvprotocol._credentials import legacy_token

        api_token = legacy_token()
    if api_token is None and api_token_file:
        try:
            api_token = read_private(Path(api_token_file), strict=False)
        except CredentialError as exc:
            fail(f"--api-token-file: {exc}")
    if api_token is not None and any(ch.isspace() for ch in api_token):
        fail("--api-token must contain no whitespace")
    instance_token = api_token
    if instance_token_file:
        try:
            instance_token = read_private(Path(instance_token_file), strict=False)
        except CredentialError as exc:
            fail(f"--instance-token-file: {exc}")
    problem = exposure_problem(host, api_token, insecure)
    if problem:
        click.echo(f"kvcoordinator: {problem}", err=True)
        sys.exit(2)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "debug":  # one INFO line per fan-out request would drown the log
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if insecure and api_token is None:
        logging.getLogger("kvcoordinator").warning("--insecure: every endpoint accepts unauthenticated requests")
    try:
        sock = listen_socket(host, port, backlog=512)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    token_note = ""
    if api_token is None and not insecure:  # authenticated by default, like kvserver
        from kvprotocol._credentials import load_or_new_token, publish_token, token_path

        bound = sock.getsockname()[1]
        try:
            api_token = load_or_new_token(bound)
            publish_token([bound], api_token)
        except (CredentialError, OSError) as exc:
            fail(f"cannot write the generated token: {exc}")
        token_note = f" token={token_path(bound)}"
    import uvicorn  # heavy imports only once the socket is ours

    from .app import CoordinatorSettings, create_app

    settings = CoordinatorSettings(
        host,
        sock.getsockname()[1],
        instance_timeout,
        fanout_timeout,
        api_token,
        insecure,
        tuple(trusted_hosts),
        instance_token,
    )
    config = uvicorn.Config(
        create_app(settings),
        log_config=None,
        log_level=log_level,
        access_log=log_level == "debug",
        server_header=False,
        timeout_graceful_shutdown=3,
    )
    click.echo(f"kvcoordinator ready: http://{host}:{settings.port} instance-timeout={instance_timeout:g}s{token_note}")
    sys.stdout.flush()
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


def main() -> None:
    """The `kvcoordinator` console script."""
    command(prog_name="kvcoordinator")
