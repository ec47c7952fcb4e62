"""Cell formatting shared by the dashboard and `top --once` (rich markup, fixed widths)."""

from __future__ import annotations

from rich.markup import escape

from .._output import human_bytes
from .model import InstanceView

COLUMNS = ("instance", "state", "hit% int", "hit% all", "L1 used", "L1%", "L2", "EC", "ops/s", "evict/s",
           "errors", "MB/s", "engines", "note")


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def mbps(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:,.1f}"


def ec_cell(v: InstanceView) -> str:
    """Encoder cache: objects, bytes used, and its item hit rate (apart from the KV columns)."""
    if not v.ec_capacity:
        return "-"
    hit = f" {pct(v.ec_hit_rate_total)}%" if v.ec_hit_rate_total is not None else ""
    return f"{v.ec_objects} obj {human_bytes(v.ec_used)}{hit}"


def row(v: InstanceView, now: float | None = None) -> list[str]:
    """The dashboard row of one instance; a down one keeps its last known sizes, dimmed."""
    state = "[bold green]up[/]" if v.up else "[bold red]DOWN[/]"
    note = ""
    if not v.up:
        ago = f" (last up {now - v.last_seen:.0f}s ago)" if now is not None and v.last_seen else ""
        reason = (v.reason or "unreachable").replace(f" at {v.id}", "")  # the row already names it
        note = escape(f"{reason}{ago}")
    errors = f"{v.errors_total}" + (f" (+{v.errors_s:.1f}/s)" if v.errors_s else "")
    l1_used = human_bytes(v.l1_used) if v.l1_capacity else "-"
    cells = [escape(v.id), state, pct(v.hit_rate), pct(v.hit_rate_total), l1_used,
             pct(v.l1_fraction), f"{v.l2_objects} obj" if v.l2_objects else "-", ec_cell(v), num(v.ops_s),
             num(v.evictions_s),
             errors, mbps(v.bytes_s), str(v.engines), note]
    if not v.up:
        cells = [cells[0], cells[1], *[f"[dim]{c}[/]" for c in cells[2:-1]], f"[red]{note}[/]"]
    return cells
