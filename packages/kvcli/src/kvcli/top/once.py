"""`kvcli top --once`: two polls an interval apart, printed as a table or JSON (scripts, logs)."""

from __future__ import annotations

import time
from typing import Any

from .format import cells, clip, fit_columns
from .model import Fleet
from .sources import Source


def collect(source: Source, interval: float, sort: str = "id") -> Fleet:
    fleet = Fleet()
    fleet.update(source.poll())
    time.sleep(interval)
    fleet.update(source.poll())
    return fleet


def as_json(fleet: Fleet, sort: str) -> dict[str, Any]:
    history = list(fleet.history)
    last = history[-1] if history else None
    return {
        "instances": [v.to_json() for v in fleet.rows(sort)],
        "fleet": {
            "bytes_s": last.bytes_s if last else None,
            "hit_rate": last.hit_rate if last else None,
            "ops_s": last.ops_s if last else None,
            "up": sum(v.up for v in fleet.views.values()),
            "down": sum(not v.up for v in fleet.views.values()),
        },
    }


def table(fleet: Fleet, sort: str, title: str, width: int | None = None) -> Any:
    """The sample as a rich table: every column, or those that fit `width` (key columns first, like the
    dashboard)."""
    from rich.table import Table
    from rich.text import Text

    views = fleet.rows(sort)
    now = max((v.last_seen or 0.0 for v in views), default=0.0) or None
    rows = [cells(view, now) for view in views]
    columns, note_width = fit_columns(rows, width or 10_000, padding=3)  # 3: rich's borders and padding
    out = Table(title=title, title_justify="left")
    for col in columns:
        out.add_column(
            col,
            justify="left" if col in ("instance", "state", "note", "L2", "model", "tenants") else "right",
            no_wrap=True,
        )
    for cell in rows:
        out.add_row(*[clip(cell[c], note_width) if c == "note" else Text.from_markup(cell[c]) for c in columns])
    return out
