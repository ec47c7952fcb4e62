"""`kvserver start`: flags, KVSERVER_* env vars and an optional TOML config file."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click
from kvprotocol import DEFAULT_CHUNK_SIZE, DEFAULT_HTTP_PORT, DEFAULT_PORT

from .config import ADMISSIONS, ServerConfig, load_config_file
from .l1.eviction import POLICIES
from .security.tenant_cli import tenant


def _load_config_file(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value:
        try:
            ctx.default_map = {**(ctx.default_map or {}), **load_config_file(value)}
        except (OSError, ValueError) as exc:
            raise click.BadParameter(str(exc)) from exc
    return value


@click.group(context_settings={"auto_envvar_prefix": "KVSERVER", "help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvserver")
def main() -> None:
    """The KV cache server."""


@main.command(context_settings={"auto_envvar_prefix": "KVSERVER"})  # KVSERVER_<OPTION>, not _START_
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=_load_config_file,
    help="TOML file with option names as keys.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="ZMQ bind address.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=int, help="ZMQ port.")
@click.option("--l1-size-gb", default=4.0, show_default=True, type=float, help="Shared-memory L1 size.")
@click.option(
    "--ec-size-gb",
    default=1.0,
    show_default=True,
    type=float,
    help="Encoder-cache budget (its own shm segment, apart from L1).",
)
@click.option(
    "--prefault/--no-prefault",
    default=False,
    show_default=True,
    help="Allocate the arenas' shared memory at start, in the background (about 0.3 s per GiB), "
    "so engines' first writes into L1 do not each fault in a fresh page.",
)
@click.option(
    "--cold/--warm",
    default=False,
    show_default=True,
    help="--cold discards the L1 arena a previous server on this port left; by default it is adopted "
    "(its committed objects are verified and served again).",
)
@click.option("--chunk-size", default=DEFAULT_CHUNK_SIZE, show_default=True, type=int, help="Tokens per cached chunk.")
@click.option("--eviction-policy", default="lhd", show_default=True, type=click.Choice(sorted(POLICIES)))
@click.option(
    "--lease-ttl",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds a lease or store lives, and a whole-request reservation without a commit.",
)
@click.option(
    "--reservation-lifetime",
    default=300.0,
    show_default=True,
    type=float,
    help="Seconds a whole-request reservation (kv_producer) may live in all, commits or not.",
)
@click.option(
    "--engine-ttl",
    default=600.0,
    show_default=True,
    type=float,
    help="Seconds without a keyed request after which an engine registration this server cannot "
    "check (another host or container) expires; local engines expire when their process exits.",
)
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
@click.option("--shm-prefix", default="kvserver", show_default=True, help="Prefix of the /dev/shm segment name.")
@click.option("--http-host", default="127.0.0.1", show_default=True, help="Admin API bind address.")
@click.option(
    "--http-port", default=DEFAULT_HTTP_PORT, show_default=True, type=int, help="Admin API port (0 disables it)."
)
@click.option(
    "--api-token",
    envvar="KVSERVER_API_TOKEN",
    show_envvar=True,
    default=None,
    help="API token every ZMQ op but ping and every HTTP endpoint but probes/status/metrics "
    "need. Default: generated at first start into $KVSERVER_STATE_DIR/token-<port> (0600).",
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
    "--tenants-file",
    default=None,
    type=click.Path(dir_okay=False),
    metavar="PATH",
    help="Tenants and their token digests and limits (default: $KVSERVER_STATE_DIR/tenants-<port>.json, "
    "written by `kvserver tenant add`; re-read when it changes). See docs/security.md.",
)
@click.option(
    "--idle-timeout",
    default=10.0,
    show_default=True,
    type=float,
    help="Seconds a connection may stay without a complete HTTP request head or a finished ZMQ "
    "handshake before it is closed (connections that never speak hold no descriptor for long).",
)
@click.option(
    "--http-max-connections",
    default=1024,
    show_default=True,
    type=int,
    help="HTTP connections held at once; a new one past it closes the longest-idle one.",
)
@click.option(
    "--insecure",
    is_flag=True,
    default=False,
    help="Allow a non-loopback bind without a configured API token (or without CURVE).",
)
@click.option(
    "--curve/--no-curve",
    default=None,
    help="Encrypt the ZMQ plane with CURVE (default: on exactly when --host is not loopback); "
    "clients need the server's public key ($KVSERVER_SERVER_KEY).",
)
@click.option("--coordinator", default=None, metavar="URL", help="Fleet coordinator to register with.")
@click.option(
    "--heartbeat-interval", default=5.0, show_default=True, type=float, help="Seconds between coordinator heartbeats."
)
@click.option(
    "--l2",
    multiple=True,
    metavar="URL",
    help="L2 tier below L1, repeatable, in lookup order: fs:///path, redis://host:port/db, "
    "redis+cluster://host:port, s3://bucket/prefix (see docs/l2.md).",
)
@click.option(
    "--l2-compression",
    default="none",
    show_default=True,
    type=click.Choice(["none", "lz4", "zstd"]),
    help="Compress objects written to L2 (kept only when smaller).",
)
@click.option(
    "--l2-encryption-key-file",
    default=None,
    type=click.Path(dir_okay=False),
    metavar="PATH",
    help="AES-GCM key for L2 objects (hex, base64 or raw 16/24/32 bytes); or put the key itself "
    "in KVSERVER_L2_ENCRYPTION_KEY. Never logged or shown.",
)
@click.option(
    "--l2-queue-size",
    default=1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="Write-behind queue length (objects); overflow is dropped and counted.",
)
@click.option(
    "--l2-prefetch-timeout",
    default=0.5,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a lookup waits for L2 objects to load into L1.",
)
@click.option(
    "--l2-admission",
    default="all",
    show_default=True,
    type=click.Choice(list(ADMISSIONS)),
    help="Write every commit to L2; or only objects a lookup hit in L1 (second-hit), or also those "
    "stored before (tinylfu): no one-hit wonders in L2. Or write on L1 eviction what L2 lacks (evicted; "
    "evicted-hit: only objects hit in L1): the tiers as one cache.",
)
@click.option(
    "--l2-capacity-gb",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="With --l2-admission evicted*: L2's bound, kept by this server (evicting by --l2-eviction-policy, "
    "tail first). Unset: unbounded here (the store's own bound applies).",
)
@click.option(
    "--l2-eviction-policy",
    default="lru",
    show_default=True,
    type=click.Choice(sorted(POLICIES)),
    help="With --l2-admission evicted* and --l2-capacity-gb: the policy that evicts from L2.",
)
@click.option(
    "--l2-negative-ttl",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, 3600),
    help="Seconds an L2 tier's 'absent' answer is remembered, sparing lookups a round trip (0: off).",
)
@click.option(
    "--l2-verify",
    default="reader",
    show_default=True,
    type=click.Choice(["reader", "server"]),
    help="What checks the body of a plain fs object read straight into L1: 'reader' leaves it to the "
    "kvsum64 every reader verifies on its copy (a damaged object is reported, checked by the server and "
    "dropped); 'server' also hashes it on arrival (one more pass over the bytes).",
)
@click.option(
    "--l2-retry-keys",
    default=4096,
    show_default=True,
    type=click.IntRange(0, 1 << 24),
    help="Per tier: writes missed while it was down, written once it answers again.",
)
@click.option(
    "--kv-events-endpoint",
    default=None,
    metavar="URL",
    help="Publish KV events for KV-aware routers on this ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557 "
    "(off by default; see docs/kv-events.md).",
)
@click.option(
    "--kv-events-replay-endpoint",
    default=None,
    metavar="URL",
    help="ZMQ ROUTER endpoint where subscribers fetch batches they missed, e.g. tcp://127.0.0.1:5558.",
)
@click.option(
    "--kv-events-buffer",
    default=10_000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Event batches kept for replay.",
)
@click.option(
    "--kv-events-replay-max-bytes",
    default=4 << 20,
    show_default=True,
    type=click.IntRange(1 << 16, 1 << 30),
    help="Bytes of batches one replay request is answered with (at least one batch); the subscriber "
    "asks again from the next seq for the rest.",
)
@click.option(
    "--kv-events-replay-rate",
    default=16 << 20,
    show_default=True,
    type=click.IntRange(1 << 16, 1 << 34),
    help="Bytes a second the replay socket sends, all requests together.",
)
@click.option(
    "--kv-events-topic",
    default="kv@{host}@{model}",
    show_default=True,
    help="ZMQ topic of each batch; {host} is this host's name, {model} the model of its events.",
)
@click.option(
    "--kv-events-hash-format",
    default="bytes",
    show_default=True,
    type=click.Choice(["bytes", "int"]),
    help="Block hashes as our 32-byte chunk hashes, or their low 64 bits as ints (like "
    "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).",
)
def start(**options: Any) -> None:
    """Start the cache server in the foreground."""
    options["api_token"] = options.get("api_token") or None  # an empty env var means "no token"
    token_file = options.pop("api_token_file", None)
    if token_file and not options["api_token"]:
        from kvprotocol._credentials import CredentialError, read_private

        try:
            options["api_token"] = read_private(Path(token_file), strict=False)
        except CredentialError as exc:
            click.echo(f"kvserver: --api-token-file: {exc}", err=True)
            sys.exit(2)
    try:
        config = ServerConfig(**options)
    except ValueError as exc:
        click.echo(f"kvserver: {flag_names(str(exc))}", err=True)
        sys.exit(2)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(asyncio.run(_run(config)))


def flag_names(message: str) -> str:
    """A configuration error as the operator typed it: `l1_size_gb must ...` becomes `--l1-size-gb must ...`
    (the field's env var and config-file key follow from the flag; see docs/configuration.md)."""
    import re
    from dataclasses import fields

    names = {f.name for f in fields(ServerConfig)}
    return re.sub(
        r"(?<![\w-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+|port|host|l2|coordinator|curve|insecure)(?![\w-])",
        lambda m: "--" + m.group(1).replace("_", "-") if m.group(1) in names else m.group(1),
        message,
    )


async def _run(config: ServerConfig) -> int:
    from .runtime.server import KVServer

    t0 = time.perf_counter()
    try:
        server = KVServer(config)
    except Exception as exc:
        click.echo(f"kvserver: cannot start: {exc}", err=True)
        return 1
    if config.insecure and not config.api_token:
        logging.getLogger("kvserver").warning("--insecure: admin endpoints accept unauthenticated requests")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    from kvprotocol import __version__

    stale = " (removed a stale segment)" if server.arena.removed_stale else ""
    if server.warm is not None and server.arena.adopted:
        w = server.warm
        stale = f" (adopted: {w.l1.adopted} objects to verify, {w.l1.dropped} dropped; ec: {w.ec.adopted})"
    click.echo(
        f"kvserver {__version__} ready in {time.perf_counter() - t0:.2f}s: zmq={config.zmq_url} "
        f"l1={config.l1_bytes / (1 << 30):.2f} GiB shm=/dev/shm/{server.arena.name}{stale} "
        f"ec={config.ec_bytes / (1 << 30):.2f} GiB "
        f"policy={config.eviction_policy} chunk={config.chunk_size}"
        + (f" http=http://{config.http_host}:{server.http.port}" if server.http else "")
        + (f" kv_events={config.kv_events_endpoint}" if config.kv_events_endpoint else "")
        + f" {server.auth.describe()}",
        err=False,
    )
    sys.stdout.flush()
    try:
        await server.serve()
    finally:
        server.close()
    return 0


main.add_command(tenant)
