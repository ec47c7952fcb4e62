"""`kvserver tenant add | remove | list`: the tenants file an operator manages (docs/security.md).

Apart from `kvserver start`'s options: it edits a file the running server re-reads, and needs none
of the server's modules but `tenants`.
"""

from __future__ import annotations

import math
from pathlib import Path

import click
from kvprotocol import DEFAULT_PORT


@click.group()
def tenant() -> None:
    """Manage tenants: each gets its own token, key namespace, L1 quota and caps (docs/security.md)."""


def _tenants_file(port: int, path: str | None) -> Path:
    from .tenants import tenants_path

    return Path(path) if path else tenants_path(port)


_port_opt = click.option(
    "--port",
    default=DEFAULT_PORT,
    show_default=True,
    type=int,
    envvar="KVSERVER_PORT",
    help="The server's ZMQ port (names its default tenants file).",
)
_file_opt = click.option(
    "--tenants-file",
    default=None,
    type=click.Path(dir_okay=False),
    metavar="PATH",
    envvar="KVSERVER_TENANTS_FILE",
    help="Tenants file (default: per port, in the state dir).",
)


def _finite(_ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A size in GiB must be a number (FloatRange lets nan through: nan compares false to both bounds)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a size in GiB (0 to {1 << 20})", param=param)
    return value


@tenant.command("add")
@click.argument("name")
@_port_opt
@_file_opt
@click.option(
    "--l1-quota-gb",
    type=click.FloatRange(min=0, max=1 << 20),
    default=None,
    callback=_finite,
    help="L1 bytes this tenant may hold.",
)
@click.option("--max-sessions", type=click.IntRange(1, 1 << 20), default=1024, show_default=True)
@click.option("--max-stores", type=click.IntRange(1, 1 << 20), default=1024, show_default=True)
@click.option(
    "--max-session-objects",
    type=click.IntRange(1, 1 << 22),
    default=1 << 20,
    show_default=True,
    help="Chunk hashes + leased keys its live sessions may hold (the server holds 4194304 in all).",
)
@click.option(
    "--max-reservation-gb",
    type=click.FloatRange(min=0, max=1 << 20),
    default=None,
    callback=_finite,
    help="L1 bytes its whole-request reservations may book together (default: 1/4 of L1, within its quota).",
)
@click.option(
    "--ec-quota-gb",
    type=click.FloatRange(min=0, max=1 << 20),
    default=None,
    callback=_finite,
    help="Encoder-cache bytes this tenant may hold (default: half the server's EC segment).",
)
@click.option(
    "--ec-max-stores",
    type=click.IntRange(1, 1 << 20),
    default=256,
    show_default=True,
    help="EC stores in flight (the server holds at most 1024 in all).",
)
@click.option(
    "--ec-max-leases",
    type=click.IntRange(1, 1 << 20),
    default=1 << 14,
    show_default=True,
    help="Live EC read leases (the server holds at most 65536 in all).",
)
@click.option(
    "--allow-shm",
    is_flag=True,
    default=False,
    help="Let this tenant use shm mode. An shm client maps the whole arena and can read and overwrite "
    "every tenant's objects: only for a tenant trusted with all of them (see docs/security.md).",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the new token into this 0600 file instead of printing it.",
)
def tenant_add(
    name: str,
    port: int,
    tenants_file: str | None,
    l1_quota_gb: float | None,
    max_sessions: int,
    max_stores: int,
    ec_quota_gb: float | None,
    ec_max_stores: int,
    ec_max_leases: int,
    max_session_objects: int,
    max_reservation_gb: float | None,
    allow_shm: bool,
    token_file: str | None,
) -> None:
    """Add a tenant (or give it a new token); prints its token once: only a digest is stored."""
    from kvprotocol._credentials import write_private

    from . import tenants

    quota = None if l1_quota_gb is None else int(l1_quota_gb * (1 << 30))
    ec_quota = None if ec_quota_gb is None else int(ec_quota_gb * (1 << 30))
    try:
        token = tenants.add(
            _tenants_file(port, tenants_file),
            name,
            quota,
            max_sessions,
            max_stores,
            ec_quota,
            ec_max_stores,
            ec_max_leases,
            max_session_objects,
            None if max_reservation_gb is None else int(max_reservation_gb * (1 << 30)),
            allow_shm,
        )
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    if token_file:
        write_private(Path(token_file), token + "\n")
        click.echo(f"tenant {name}: token written to {token_file}")
    else:
        click.echo(token)


@tenant.command("remove")
@click.argument("name")
@_port_opt
@_file_opt
def tenant_remove(name: str, port: int, tenants_file: str | None) -> None:
    """Remove a tenant: its token stops working within a second; its cached objects age out."""
    from . import tenants

    if not tenants.remove(_tenants_file(port, tenants_file), name):
        raise click.ClickException(f"no tenant {name!r}")


@tenant.command("list")
@_port_opt
@_file_opt
def tenant_list(port: int, tenants_file: str | None) -> None:
    """Tenants and their limits (never tokens)."""
    from . import tenants

    for t in tenants.load(_tenants_file(port, tenants_file)).values():
        quota = "-" if t.l1_quota_bytes is None else f"{t.l1_quota_bytes / (1 << 30):.3f} GiB"
        reserve = "1/4 of L1" if t.max_reserved_bytes is None else f"{t.max_reserved_bytes / (1 << 30):.3f} GiB"
        ec_quota = "1/2 of the EC segment" if t.ec_quota_bytes is None else f"{t.ec_quota_bytes / (1 << 30):.3f} GiB"
        click.echo(
            f"{t.name}\tl1_quota={quota}\tmax_sessions={t.max_sessions}\tmax_stores={t.max_stores}"
            f"\tec_quota={ec_quota}\tec_max_stores={t.ec_max_stores}\tec_max_leases={t.ec_max_leases}"
            f"\tmax_session_objects={t.max_session_objects}\tmax_reservation={reserve}"
            f"\tshm={'allowed' if t.allow_shm else 'no'}"
        )
