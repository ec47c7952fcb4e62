"""Cell formatting shared by the dashboard and `top --once` (rich markup), colour thresholds, and the
choice of columns that fit a terminal: the key columns first, the rest as width allows.

Thresholds (also in `?` help and docs/cli.md): L1 at least 95% full is red (85%: yellow); an interval
hit rate 20 points under the since-start rate is yellow (50 points: red); rising errors, stores
refused for space and an L2 tier down are red; evictions while L1 is full are yellow.
"""

from __future__ import annotations

from rich.markup import escape
from rich.text import Text

from .._output import human_bytes
from .model import InstanceView

# display order, left to right
COLUMNS = (
    "instance",
    "state",
    "hit% int",
    "hit% all",
    "L1 used",
    "L1%",
    "p99 ms",
    "ops/s",
    "evict/s",
    "nospace/s",
    "errors",
    "MB/s",
    "L2",
    "EC",
    "engines",
    "model",
    "tenants",
    "note",
)
# which columns stay when the terminal is narrow: earlier ones first (the note takes what is left)
PRIORITY = (
    "instance",
    "state",
    "hit% int",
    "L1%",
    "errors",
    "p99 ms",
    "ops/s",
    "nospace/s",
    "L2",
    "evict/s",
    "MB/s",
    "engines",
    "model",
    "hit% all",
    "L1 used",
    "tenants",
    "EC",
)
NOTE_MIN, NOTE_WANT = 8, 40
KEY_COLUMNS = 7  # the first PRIORITY columns, kept even when the note must be cut to NOTE_MIN

L1_FULL, L1_HIGH = 0.95, 0.85
HIT_DROP_WARN, HIT_DROP_BAD = 0.20, 0.50


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def mbps(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:,.1f}"


def ms(x: float | None) -> str:
    if x is None:
        return "-"
    return ">10000" if x == float("inf") else f"{1000 * x:,.2f}" if x < 0.1 else f"{1000 * x:,.0f}"


def ec_cell(v: InstanceView) -> str:
    """Encoder cache: objects, bytes used, and its item hit rate (apart from the KV columns)."""
    if not v.ec_capacity:
        return "-"
    hit = f" {pct(v.ec_hit_rate_total)}%" if v.ec_hit_rate_total is not None else ""
    return f"{v.ec_objects} obj {human_bytes(v.ec_used)}{hit}"


def l2_cell(v: InstanceView) -> str:
    """Per-tier state: `fs redis` when all are up, a down tier in red, then queue depth and drops."""
    if not v.tiers:
        return "-"
    names = [
        f"[bold red]{escape(str(t.get('tier')))}↓[/]" if t.get("up") is False else escape(str(t.get("tier")))
        for t in v.tiers
    ]
    extra = f" q{v.l2_queue}" if v.l2_queue else ""
    extra += f" [red]-{v.l2_dropped}[/]" if v.l2_dropped else ""
    return " ".join(names) + extra


def _names(items: list[str], limit: int = 18) -> str:
    if not items:
        return "-"
    text = items[0] if len(items) == 1 else f"{items[0]} +{len(items) - 1}"
    return escape(text if len(text) <= limit else text[: limit - 1] + "…")


def alerts(v: InstanceView) -> list[str]:
    """What is wrong with an instance that is up, worst first (the note column says it in words)."""
    out = []
    if v.tiers_down:
        out.append("L2 " + ",".join(v.tiers_down) + " down")
    if v.no_space_s:
        out.append("stores refused: L1 full")
    if v.errors_s:
        out.append("errors rising")
    frac = v.l1_fraction
    if frac is not None and frac >= L1_FULL:
        out.append("L1 full")
    drop = hit_drop(v)
    if drop is not None and drop >= HIT_DROP_WARN:
        out.append(f"hit rate down {100 * drop:.0f} pts")
    return out


def hit_drop(v: InstanceView) -> float | None:
    if v.hit_rate is None or v.hit_rate_total is None:
        return None
    return v.hit_rate_total - v.hit_rate


def _colour(text: str, style: str | None) -> str:
    return f"[{style}]{text}[/]" if style else text


def cells(v: InstanceView, now: float | None = None) -> dict[str, str]:
    """The dashboard cells (rich markup) of one instance; a down one keeps its last known sizes, dimmed."""
    state = {"up": "[bold green]up[/]", "AUTH": "[bold magenta]AUTH[/]"}.get(v.state, "[bold red]DOWN[/]")
    frac = v.l1_fraction
    drop = hit_drop(v)
    out = {
        "instance": escape(v.id),
        "state": state,
        "hit% int": _colour(
            pct(v.hit_rate),
            "bold red"
            if drop is not None and drop >= HIT_DROP_BAD
            else "yellow"
            if drop is not None and drop >= HIT_DROP_WARN
            else None,
        ),
        "hit% all": pct(v.hit_rate_total),
        "L1 used": human_bytes(v.l1_used) if v.l1_capacity else "-",
        "L1%": _colour(
            pct(frac),
            "bold red"
            if frac is not None and frac >= L1_FULL
            else "yellow"
            if frac is not None and frac >= L1_HIGH
            else None,
        ),
        "p99 ms": ms(v.p99_s),
        "ops/s": num(v.ops_s),
        "evict/s": _colour(
            num(v.evictions_s), "yellow" if v.evictions_s and frac is not None and frac >= L1_FULL else None
        ),
        "nospace/s": _colour(num(v.no_space_s), "bold red" if v.no_space_s else None),
        "errors": _colour(
            f"{v.errors_total}" + (f" +{num(v.errors_s, 0 if v.errors_s >= 9.95 else 1)}/s" if v.errors_s else ""),
            "bold red" if v.errors_s else None,
        ),
        "MB/s": mbps(v.bytes_s),
        "L2": l2_cell(v),
        "EC": ec_cell(v),
        "engines": str(v.engines),
        "model": _names(v.models),
        "tenants": _names(v.tenants, 12),
        "note": "",
    }
    if v.up:
        problems = alerts(v)
        out["note"] = f"[yellow]{escape('; '.join(problems))}[/]" if problems else ""
        return out
    ago = f" (last up {now - v.last_seen:.0f}s ago)" if now is not None and v.last_seen else ""
    reason = (v.reason or "unreachable").replace(f" at {v.id}", "")  # the row already names it
    if v.auth:  # the whole reason is in the detail screen; the row says what to do
        reason = "token refused: give --token or KVSERVER_API_TOKEN"
    for key in out:
        if key not in ("instance", "state", "note"):
            out[key] = f"[dim]{escape(Text.from_markup(out[key]).plain)}[/]"
    out["note"] = f"[{'magenta' if v.auth else 'red'}]{escape(reason + ago)}[/]"
    return out


def row(v: InstanceView, now: float | None = None, columns: tuple[str, ...] = COLUMNS) -> list[str]:
    c = cells(v, now)
    return [c[name] for name in columns]


def width_of(markup: str) -> int:
    return Text.from_markup(markup).cell_len


def fit_columns(rows: list[dict[str, str]], width: int, padding: int = 2) -> tuple[tuple[str, ...], int]:
    """The columns that fit `width` cells (in display order) and the width left for the note."""
    need = {name: max([len(name), *(width_of(r[name]) for r in rows)]) + padding for name in COLUMNS}
    note_want = min(NOTE_WANT, max(NOTE_MIN, need["note"] - padding))
    chosen: set[str] = set()
    used = 0
    for i, name in enumerate(PRIORITY):
        reserve = NOTE_MIN if i < KEY_COLUMNS else note_want  # the rest only while the note keeps its room
        if used + need[name] + reserve + padding <= width:
            chosen.add(name)
            used += need[name]
    note_width = max(NOTE_MIN, width - used - padding)
    return tuple(name for name in COLUMNS if name in chosen or name == "note"), note_width


def clip(markup: str, width: int) -> Text:
    """A cell as Text, cut to `width` cells with an ellipsis (the note on a narrow terminal)."""
    text = Text.from_markup(markup)
    if text.cell_len > width:
        text.truncate(width, overflow="ellipsis")
    return text
