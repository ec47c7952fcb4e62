"""`kvcli describe`: one server's configuration, tiers, hit rates, engines and sessions."""

from __future__ import annotations

from typing import Any

import click

from .._auth import token_options
from .._output import emit_json, fail, human_bytes, percent, ratio, stdout_console
from .._source import DEFAULT_URL, URL, Unreachable, fetch_status


def derived(status: dict[str, Any]) -> dict[str, Any]:
    """Figures an operator wants that describe() leaves to the reader: rates and fill levels."""
    c = status.get("counters", {})
    l1 = status.get("l1", {})
    return {
        "token_hit_rate": ratio(c.get("lookup_hit_tokens", 0), c.get("lookup_tokens", 0)),
        "l1_used_fraction": ratio(l1.get("used_bytes", 0), l1.get("capacity_bytes", 0)),
        "l2_objects": sum(t.get("objects", 0) or 0 for t in status.get("l2", []) or []),
        "l2_bytes": sum(t.get("bytes", 0) or 0 for t in status.get("l2", []) or []),
        "engines": len(status.get("engines", [])),
    }


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def render(url: str, status: dict[str, Any]) -> list[Any]:
    """The rich renderables `describe` prints (also used by docs and tests)."""
    from rich.table import Table

    d = derived(status)
    l1, c = status.get("l1", {}), status.get("counters", {})
    out: list[Any] = [
        _kv_table(
            f"kvserver {status.get('version', '?')} at {url}",
            [
                ("protocol", str(status.get("protocol"))),
                ("uptime", f"{status.get('uptime_s', 0):.0f} s"),
                ("engines", str(d["engines"])),
                ("sessions", str(status.get("sessions", 0))),
                ("stores in flight", str(status.get("stores_in_flight", 0))),
                (
                    "token hit rate",
                    f"{percent(d['token_hit_rate'])} ({c.get('lookup_hit_tokens', 0)} of "
                    f"{c.get('lookup_tokens', 0)} tokens)",
                ),
            ],
        )
    ]
    cfg = status.get("config", {})
    out.append(_kv_table("config", [(k, str(v)) for k, v in cfg.items() if v not in (None, [], ())]))
    out.append(
        _kv_table(
            "L1",
            [
                (
                    "used",
                    f"{human_bytes(l1.get('used_bytes'))} of {human_bytes(l1.get('capacity_bytes'))} "
                    f"({percent(d['l1_used_fraction'])})",
                ),
                *[
                    (k, str(l1.get(k)))
                    for k in ("objects", "writing", "leased", "pinned", "evictions", "arena")
                    if k in l1
                ],
            ],
        )
    )
    ec = status.get("ec")
    if isinstance(ec, dict):  # the encoder cache: its own segment and budget, shown apart from L1's KV
        ec_c = ec.get("counters", {})
        asked = ec_c.get("hits", 0) + ec_c.get("misses", 0)
        out.append(
            _kv_table(
                "encoder cache (EC)",
                [
                    ("used", f"{human_bytes(ec.get('used_bytes'))} of {human_bytes(ec.get('capacity_bytes'))}"),
                    ("objects", f"{ec.get('objects', 0)} ({human_bytes(ec.get('object_bytes'))})"),
                    (
                        "hit rate",
                        f"{percent(ec_c.get('hits', 0) / asked if asked else None)} "
                        f"({ec_c.get('hits', 0)} of {asked} items)",
                    ),
                    *[(k, str(ec_c.get(k))) for k in ("stores", "evictions", "no_space") if k in ec_c],
                    ("leases", str(ec.get("leases", 0))),
                    ("arena", str(ec.get("arena", "-"))),
                ],
            )
        )
    tiers = status.get("l2") or []
    if tiers:
        cols = ["url", "up", "objects", "bytes", "puts", "gets", "hits", "misses", "errors", "dropped"]
        table = Table(title="L2", title_justify="left")
        for col in cols:
            table.add_column(col, justify="left" if col == "url" else "right")
        for tier in tiers:
            table.add_row(*[human_bytes(tier.get(col)) if col == "bytes" else str(tier.get(col, "-")) for col in cols])
        out.append(table)
    engines = status.get("engines", [])
    if engines:
        table = Table(title="engines", title_justify="left")
        for col in ("id", "model", "world", "rank", "groups", "host", "pid"):
            table.add_column(col)
        for e in engines:
            table.add_row(
                str(e.get("id")),
                str(e.get("model")),
                str(e.get("world_size")),
                str(e.get("rank")),
                str(len(e.get("groups", []))),
                str(e.get("host") or "-"),
                str(e.get("pid") or "-"),
            )
        out.append(table)
    out.append(_kv_table("counters", [(k, str(v)) for k, v in c.items()]))
    blend = status.get("blend")
    if isinstance(blend, dict) and (blend.get("stores") or blend.get("lookups")):  # only once CacheBlend is used
        out.append(
            _kv_table("blend (approximate reuse; not in the prefix counters)", [(k, str(v)) for k, v in blend.items()])
        )
    ops = status.get("ops", {})
    if ops:
        out.append(_kv_table("ops", [(k, str(v)) for k, v in sorted(ops.items())]))
    out.append(
        _kv_table("errors", [(k, str(v)) for k, v in sorted(status.get("errors", {}).items())] or [("none", "")])
    )
    return out


@click.command(name="describe")
@click.option(
    "--url",
    type=URL,
    default=DEFAULT_URL,
    show_default=True,
    help="host:port, tcp:// or ipc:// (ZMQ) or http(s):// (/v1/status).",
)
@click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(0.01, 3600))
@click.option("--json", "as_json", is_flag=True, help="Print the server's status map plus derived figures as JSON.")
@token_options
def command(url: str, timeout: float, as_json: bool) -> None:
    """Configuration, L1/L2 usage, objects, hit rates, engines and sessions of one kvserver."""
    try:
        status = fetch_status(url, timeout)
    except Unreachable as exc:
        fail(str(exc), as_json, url=url)
    if as_json:
        emit_json({"url": url, **status, "derived": derived(status)})
        return
    console = stdout_console()
    for renderable in render(url, status):
        console.print(renderable)
        console.print()
