"""The Textual app of `kvcli top`: instance table, fleet charts, a detail screen, keys in the footer."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Header, Input, Static

from .chart import Chart
from .format import cells, clip, fit_columns, mbps
from .model import SORT_KEYS, Fleet, InstanceView, Point
from .help import HELP
from .sources import Source


INTERVALS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def _pct_fmt(x: float) -> str:
    return f"{100 * x:.1f}%"


def _mb_fmt(x: float) -> str:
    return f"{mbps(x)} MB/s"


class DetailScreen(Screen[None]):
    """Everything one instance reports, with its own charts; escape goes back."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,backspace", "app.pop_screen", "back"),
        Binding("q", "app.quit", "quit"),
    ]

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

        head = Text(
            f"{view.id} is {'up' if view.up else 'DOWN: ' + str(view.reason)}"
            + ("" if view.up else " (last known status below)"),
            style="bold green" if view.up else "bold red",
        )
        body.update(Group(head, *render(view.url, view.status)))


class HelpScreen(ModalScreen[None]):
    """Keys, states, colour thresholds and columns (`?`)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark,q", "app.pop_screen", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    #help { width: auto; max-width: 100%; height: auto; max-height: 100%; border: round $accent;
            padding: 0 1; background: $surface; overflow-y: auto; }
    """

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help")


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
    #filter { dock: bottom; height: 1; border: none; padding: 0 1; display: none; }
    #filter.shown { display: block; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
        Binding("slash", "filter", "filter"),
        Binding("p", "pause", "pause"),
        Binding("r", "refresh_now", "refresh"),
        Binding("plus,equals_sign", "faster", "faster", show=False),
        Binding("minus", "slower", "slower", show=False),
        Binding("s", "cycle_sort", "sort"),
        Binding("enter,d", "details", "details"),
        Binding("escape", "clear_filter", "clear filter", show=False),
    ]

    def __init__(self, source: Source, interval: float = 2.0, window: float = 300.0, autopoll: bool = True) -> None:
        super().__init__()
        self.source = source
        self.interval = interval
        self.window = window
        self.autopoll = autopoll
        self.fleet = Fleet(history_len=max(10, int(window / interval)))
        self.sort = "id"
        self.filter_text = ""
        self.paused = False
        self.columns: tuple[str, ...] = ()
        self._timer: Timer | None = None
        self._lock = asyncio.Lock()

    def compose(self) -> ComposeResult:
        yield Header()
        yield DataTable(id="instances", cursor_type="row", zebra_stripes=True)
        with Horizontal(id="charts"):
            yield Chart("fleet throughput (stored + retrieved)", _mb_fmt, id="throughput")
            yield Chart("fleet token hit rate", _pct_fmt, fixed_max=1.0, id="hitrate")
        yield Static(id="statusline")
        yield Input(placeholder="filter: id, url, state, model or tenant (enter keeps, escape clears)", id="filter")
        yield Footer()

    async def on_mount(self) -> None:
        self.sub_title = self.source.label
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
            self._timer = self.set_interval(self.interval, self._tick)

    async def _tick(self) -> None:
        if not self.paused:
            await self.poll_now()

    async def poll_now(self) -> None:
        """One poll of the source (in a thread: sources block) and a redraw."""
        if self._lock.locked():
            return  # the previous poll is still out (a slow instance); skip this tick
        async with self._lock:
            try:
                snapshots = await asyncio.to_thread(self.source.poll)
            except Exception:
                if self.is_running:
                    raise
                return  # the app closed, and closed its source, while this poll was out
            if not self.is_running:
                return  # the app is closing: its widgets are going, there is nothing to draw
            self.fleet.update(snapshots)
            self.redraw()

    def window_seconds(self, history: list[Point]) -> float:
        return history[-1].t - history[0].t if len(history) > 1 else 0.0

    def redraw(self) -> None:
        table = self.query_one("#instances", DataTable)
        selected = self.selected_id()
        rows = self.fleet.rows(self.sort, self.filter_text)
        every = list(self.fleet.views.values())
        now = max((v.last_seen or 0.0 for v in every), default=0.0) or None
        shown = [(view, cells(view, now)) for view in rows]
        columns, note_width = fit_columns(
            [c for _, c in shown] or [cells(v, now) for v in every], max(40, self.size.width - 2)
        )
        if columns != self.columns:
            table.clear(columns=True)
            for col in columns:
                table.add_column(col, key=col)
            self.columns = columns
        else:
            table.clear()
        for view, cell in shown:
            table.add_row(
                *[clip(cell[c], note_width) if c == "note" else Text.from_markup(cell[c]) for c in columns], key=view.id
            )
        ids = [v.id for v in rows]
        if selected in ids:
            table.move_cursor(row=ids.index(selected))
        history = list(self.fleet.history)
        window = self.window_seconds(history)
        self.query_one("#throughput", Chart).set_values([p.bytes_s for p in history], window)
        self.query_one("#hitrate", Chart).set_values([p.hit_rate for p in history], window)
        self._render_status()
        if isinstance(self.screen, DetailScreen):
            self.screen.update_from(self)

    def _render_status(self) -> None:
        views = list(self.fleet.views.values())
        down = sum(v.state == "DOWN" for v in views)
        auth = sum(v.state == "AUTH" for v in views)
        line = f"{len(views)} instances, {down} down" + (f", {auth} AUTH" if auth else "")
        if self.filter_text:
            line += f"   filter: {self.filter_text!r} ({len(self.fleet.rows(self.sort, self.filter_text))} shown)"
        line += f"   interval {self.interval:g}s   sort: {self.sort}   polls: {self.fleet.polls}"
        line += "   PAUSED (p resumes)" if self.paused else ""
        self.query_one("#statusline", Static).update(Text(line, style="bold yellow" if self.paused else ""))

    def on_resize(self) -> None:
        if self.fleet.polls:
            self.redraw()

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

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._render_status()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("shown")
        box.value = self.filter_text
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.remove_class("shown")
        box.value = ""
        self.filter_text = ""
        self.query_one("#instances", DataTable).focus()
        self.redraw()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.redraw()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.remove_class("shown")
        self.query_one("#instances", DataTable).focus()

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
    console = Console(
        width=width,
        height=height,
        file=io.StringIO(),
        record=True,
        force_terminal=True,
        color_system=None,
        legacy_windows=False,
        safe_box=False,
    )
    console.print(app.screen._compositor.render_update(full=True))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())
