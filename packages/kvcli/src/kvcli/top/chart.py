"""A small bar chart widget: the last minutes of one series, scaled to the widget's size.

Textual's Sparkline scales to its data's min and max, which makes a steady 90% hit rate look like
noise; here a hit rate keeps a fixed 0-100% scale and throughput scales from zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.text import Text
from textual.widget import Widget

BLOCKS = " ▁▂▃▄▅▆▇█"


def bars(values: Sequence[float | None], width: int, height: int, top: float) -> list[str]:
    """Rows (top first) of a bar chart of the last `width` values on a 0..top scale."""
    vals: list[float | None] = list(values)[-width:] if width > 0 else []
    pad: list[float | None] = [None] * (width - len(vals))
    vals = pad + vals
    rows = []
    for r in range(height):
        floor = (height - 1 - r) * 8
        line = []
        for v in vals:
            if v is None:
                line.append("·" if r == height - 1 else " ")
                continue
            level = round(max(0.0, min(v, top)) / top * height * 8) if top > 0 else 0
            line.append(BLOCKS[max(0, min(8, level - floor))])
        rows.append("".join(line))
    return rows


class Chart(Widget):
    """Bars of a series with a legend line: latest value, maximum shown, window length."""

    DEFAULT_CSS = """
    Chart { height: 7; border: round $primary 60%; padding: 0 1; }
    """

    def __init__(
        self, title: str, fmt: Callable[[float], str], fixed_max: float | None = None, id: str | None = None
    ) -> None:
        super().__init__(id=id)
        self.border_title = title
        self.fmt = fmt
        self.fixed_max = fixed_max
        self.values: list[float | None] = []
        self.window_s = 0.0

    def set_values(self, values: Sequence[float | None], window_s: float) -> None:
        self.values = list(values)
        self.window_s = window_s
        self.refresh()

    def render(self) -> Text:
        width, height = self.content_size.width, max(1, self.content_size.height - 1)
        shown = [v for v in self.values[-width:] if v is not None] if width else []
        top = self.fixed_max or max(shown, default=0.0) or 1.0
        text = Text("\n".join(bars(self.values, width, height, top)), style="bold cyan")
        latest = next((v for v in reversed(self.values) if v is not None), None)
        legend = (
            f"now {self.fmt(latest) if latest is not None else '-'}   "
            f"scale {self.fmt(top)}   last {self.window_s / 60:.1f} min"
        )
        text.append("\n" + legend[:width], style="dim")
        return text
