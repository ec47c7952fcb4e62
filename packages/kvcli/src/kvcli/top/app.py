"""The Textual app of `kvcli top`: instance table, fleet charts, a detail screen, keys in the footer."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Header, Static

from .chart import Chart
from .format import COLUMNS, mbps, row
from .model import SORT_KEYS, Fleet, InstanceView, Point
from .sources import Source

INTERVALS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def _pct_fmt(x: float) -> str:
    return f"{100 * x:.1f}%"


def _mb_fmt(x: float) -> str:
    return f"{mbps(x)} MB/s"


class DetailScreen(Screen[None]):
    """Everything one instance reports, with its own charts; escape goes back."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,backspace", "app.pop_screen", "back"),
                                             Binding("q", "app.quit", "quit")]

    def __init__(self, instance_id: str) -> None:
        super().__init__()
        self.instance_id = instance_id

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="detail-charts"):
            yield Chart("throughput", _mb_fmt, id="detail-throughput")
            yield Chart("hit rate", _pct_fmt, fixed_max=1.0, id="detail-hitrate")
        with VerticalScroll():
            yield Static(id="detail-body")
        yield Footer()

    def on_mount(self) -> None:
        self.update_from(self.app)  # type: ignore[arg-type]

    def update_from(self, app: TopApp) -> None:
        from .._commands.describe import render

        view = app.fleet.views.get(self.instance_id)
        self.title = f"kvcli top: {self.instance_id}"
        body = self.query_one("#detail-body", Static)
        if view is None:
            body.update(f"no instance {self.instance_id}")
            return
        history = list(app.fleet.instance_history.get(self.instance_id, []))
        window = app.window_seconds(history)
        self.query_one("#detail-throughput", Chart).set_values([p.bytes_s for p in history], window)
        self.query_one("#detail-hitrate", Chart).set_values([p.hit_rate for p in history], window)
        if view.status is None:
            body.update(Text(f"{view.id} is down: {view.reason}", style="bold red"))
            return
        from rich.console import Group

        head = Text(f"{view.id} is {'up' if view.up else 'DOWN: ' + str(view.reason)}"
                    + ("" if view.up else " (last known status below)"),
                    style="bold green" if view.up else "bold red")
        body.update(Group(head, *render(view.url, view.status)))


class TopApp(App[None]):
    """Live dashboard; polls its source every `interval` seconds in a worker thread."""

    TITLE = "kvcli top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #instances { height: auto; max-height: 60%; }
    #charts { height: 1fr; min-height: 7; }
    #detail-charts { height: 9; }
    #charts Chart, #detail-charts Chart { width: 1fr; height: 1fr; }
    #statusline { height: 1; padding: 0 1; color: $text-muted; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("r", "refresh_now", "refresh"),
        Binding("plus,equals_sign", "faster", "faster"),
        Binding("minus", "slower", "slower"),
        Binding("s", "cycle_sort", "sort"),
        Binding("enter,d", "details", "details"),
    ]

    def __init__(self, source: Source, interval: float = 2.0, window: float = 300.0, autopoll: bool = True) -> None:
        super().__init__()
        self.source = source
        self.interval = interval
        self.window = window
        self.autopoll = autopoll
        self.fleet = Fleet(history_len=max(10, int(window / interval)))
        self.sort = "id"
        self._timer: Timer | None = None
        self._lock = asyncio.Lock()

    def compose(self) -> ComposeResult:
        yield Header()
        yield DataTable(id="instances", cursor_type="row", zebra_stripes=True)
        with Horizontal(id="charts"):
            yield Chart("fleet throughput (stored + retrieved)", _mb_fmt, id="throughput")
            yield Chart("fleet token hit rate", _pct_fmt, fixed_max=1.0, id="hitrate")
        yield Static(id="statusline")
        yield Footer()

    async def on_mount(self) -> None:
        self.sub_title = self.source.label
        table = self.query_one("#instances", DataTable)
        for col in COLUMNS:
            table.add_column(col, key=col)
        self._render_status()
        await self.poll_now()
        self._schedule()

    def on_unmount(self) -> None:
        self.source.close()

    # -- polling ---------------------------------------------------------------------------------
    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        if self.autopoll:
            self._timer = self.set_interval(self.interval, self.poll_now)

    async def poll_now(self) -> None:
        """One poll of the source (in a thread: sources block) and a redraw."""
        if self._lock.locked():
            return  # the previous poll is still out (a slow instance); skip this tick
        async with self._lock:
            snapshots = await asyncio.to_thread(self.source.poll)
            self.fleet.update(snapshots)
            self.redraw()

    def window_seconds(self, history: list[Point]) -> float:
        return history[-1].t - history[0].t if len(history) > 1 else 0.0

    def redraw(self) -> None:
        table = self.query_one("#instances", DataTable)
        selected = self.selected_id()
        table.clear()
        rows = self.fleet.rows(self.sort)
        now = max((v.last_seen or 0.0 for v in rows), default=0.0) or None
        for view in rows:
            table.add_row(*[Text.from_markup(c) for c in row(view, now)], key=view.id)
        if selected is not None and selected in self.fleet.views:
            table.move_cursor(row=[v.id for v in rows].index(selected))
        history = list(self.fleet.history)
        window = self.window_seconds(history)
        self.query_one("#throughput", Chart).set_values([p.bytes_s for p in history], window)
        self.query_one("#hitrate", Chart).set_values([p.hit_rate for p in history], window)
        self._render_status()
        if isinstance(self.screen, DetailScreen):
            self.screen.update_from(self)

    def _render_status(self) -> None:
        views = list(self.fleet.views.values())
        down = sum(not v.up for v in views)
        self.query_one("#statusline", Static).update(
            f"{len(views)} instances, {down} down   interval {self.interval:g}s   sort: {self.sort}   "
            f"polls: {self.fleet.polls}")

    def selected_id(self) -> str | None:
        table = self.query_one("#instances", DataTable)
        if table.row_count == 0:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return str(key.value) if key.value is not None else None

    def view(self, instance_id: str) -> InstanceView | None:
        return self.fleet.views.get(instance_id)

    # -- keys ------------------------------------------------------------------------------------
    async def action_refresh_now(self) -> None:
        await self.poll_now()

    def action_faster(self) -> None:
        self._set_interval(max((i for i in INTERVALS if i < self.interval), default=INTERVALS[0]))

    def action_slower(self) -> None:
        self._set_interval(min((i for i in INTERVALS if i > self.interval), default=INTERVALS[-1]))

    def _set_interval(self, interval: float) -> None:
        self.interval = interval
        self._schedule()
        self._render_status()

    def action_cycle_sort(self) -> None:
        self.sort = SORT_KEYS[(SORT_KEYS.index(self.sort) + 1) % len(SORT_KEYS)]
        self.redraw()

    def action_details(self) -> None:
        selected = self.selected_id()
        if selected is not None and not isinstance(self.screen, DetailScreen):
            self.push_screen(DetailScreen(selected))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_details()


def screen_text(app: App[Any]) -> str:
    """The current screen as plain text, the way a terminal shows it (docs captures, tests)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, force_terminal=True,
                      color_system=None, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())
