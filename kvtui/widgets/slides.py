"""Presenter mode's pictures of the run: the staircase of work, the race of the two loops, and a
memory bar as tall as its box (kvtui.widgets.vram's, drawn on more rows).

Each draws what it is given, as the screen read it off the run at the step a room has been
shown; none of them reads the run or changes anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

from kvtui.widgets.cache_grid import fit
from kvtui.widgets.plain import plain
from kvtui.widgets.vram import VramBar

EIGHTHS = " ▁▂▃▄▅▆▇█"


def _titles(widget: Widget, titles: Sequence[str], subtitles: Sequence[str]) -> None:
    """The first of each wording (fullest first) that fits the border, as plain text."""
    room = max(8, widget.outer_size.width - 6)
    widget.border_title = plain(fit(list(titles), room)) if titles else ""
    widget.border_subtitle = plain(fit(list(subtitles), room)) if subtitles else ""


class Staircase(Widget):
    """Positions computed at each step, a column a step: without a cache, a staircase whose area
    is the total; the newest step in the accent colour."""

    DEFAULT_CSS = """
    Staircase {
        border: round $primary;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
        height: 1fr;
    }
    Staircase > .stairs--step { color: $primary; }
    Staircase > .stairs--newest { color: $warning-darken-3; }
    Staircase > .stairs--axis { color: $text-muted; }
    """

    COMPONENT_CLASSES = {"stairs--step", "stairs--newest", "stairs--axis"}

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.per_step: tuple[int, ...] = ()
        self.steps = 1
        self.tallest = 1
        self._titles: tuple[Sequence[str], Sequence[str]] = ((), ())

    def show(
        self,
        per_step: Sequence[int],
        steps: int,
        tallest: int,
        titles: Sequence[str],
        subtitles: Sequence[str] = (),
    ) -> None:
        """Draw `per_step` (positions of each step shown) in a frame of `steps` columns and
        `tallest` positions, under the first of `titles` that fits."""
        shown = (tuple(per_step), max(1, steps), max(1, tallest))
        if shown != (self.per_step, self.steps, self.tallest):
            self.per_step, self.steps, self.tallest = shown
            self.refresh()
        self._titles = (titles, subtitles)
        _titles(self, titles, subtitles)

    def on_resize(self) -> None:
        _titles(self, *self._titles)

    def render(self) -> RenderableType:
        width, height = self.content_size
        rows = height - 1  # the last for the axis
        if width <= 0 or rows <= 0:
            return Text("")
        columns = min(self.steps, width)
        bars: list[int] = []  # eighths of a cell, a column each
        for c in range(columns):
            first = c * self.steps // columns
            last = (c + 1) * self.steps // columns
            values = self.per_step[first:last]
            if values:
                bars.append(round(max(values) / self.tallest * rows * 8))
        cells = [(c + 1) * width // columns - c * width // columns for c in range(columns)]
        newest = len(bars) - 1
        step = self.get_component_rich_style("stairs--step")
        accent = self.get_component_rich_style("stairs--newest")
        text = Text(no_wrap=True, end="")
        for r in range(rows):
            level = (rows - 1 - r) * 8  # eighths below this row
            line = Text(no_wrap=True, end="")
            for c, eighths in enumerate(bars):
                part = max(0, min(8, eighths - level))
                each = cells[c]
                glyph = EIGHTHS[part] * max(1, each - (1 if each > 2 else 0))
                line.append(glyph.ljust(each), style=accent if c == newest else step)
            text.append_text(line)
            text.append("\n")
        first, last = "step 1", f"step {self.steps:,}"
        axis = first + last.rjust(max(1, width - len(first)))
        text.append(axis[:width], style=self.get_component_rich_style("stairs--axis"))
        return text


@dataclass(frozen=True)
class Lane:
    """One loop in the race: its name, steps shown of all, the seconds they took, and whether
    it has finished."""

    name: str
    steps: int
    total: int
    seconds: float
    finished: bool


class Race(Widget):
    """Two loops on the same answer, a bar each, filling as their measured steps are shown."""

    DEFAULT_CSS = """
    Race {
        border: round $primary;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
        height: auto;
        max-height: 10;
    }
    Race > .race--done { color: $text-success; }
    Race > .race--going { color: $primary; }
    Race > .race--left { color: $text-muted; }
    """

    COMPONENT_CLASSES = {"race--done", "race--going", "race--left"}

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.lanes: tuple[Lane, ...] = ()
        self.thick = 1
        self._titles: tuple[Sequence[str], Sequence[str]] = ((), ())

    def show(
        self,
        lanes: Sequence[Lane],
        titles: Sequence[str],
        subtitles: Sequence[str] = (),
        thick: int = 1,
    ) -> None:
        """Draw `lanes`, each `thick` rows, under the first of `titles` that fits."""
        if (tuple(lanes), thick) != (self.lanes, self.thick):
            layout = thick != self.thick or len(lanes) != len(self.lanes)
            self.lanes, self.thick = tuple(lanes), thick
            self.refresh(layout=layout)
        self._titles = (titles, subtitles)
        _titles(self, titles, subtitles)

    def on_resize(self) -> None:
        _titles(self, *self._titles)

    def get_content_height(self, container: object, viewport: object, width: int) -> int:
        return max(1, len(self.lanes) * self.thick)

    def render(self) -> RenderableType:
        width = self.content_size.width
        if width <= 0 or not self.lanes:
            return Text("")
        name = max(len(lane.name) for lane in self.lanes) + 1
        stats = [
            f" {lane.steps:,}/{lane.total:,} {_seconds(lane.seconds)}"
            + (" ✓" if lane.finished else "  ")
            for lane in self.lanes
        ]
        room = max(1, width - name - max(len(s) for s in stats))
        text = Text(no_wrap=True, end="")
        for i, lane in enumerate(self.lanes):
            filled = round(room * lane.steps / max(1, lane.total))
            look = "race--done" if lane.finished else "race--going"
            for row in range(self.thick):
                if i or row:
                    text.append("\n")
                middle = row == (self.thick - 1) // 2
                text.append((lane.name if middle else "").ljust(name))
                text.append("█" * filled, style=self.get_component_rich_style(look))
                text.append(
                    "░" * (room - filled), style=self.get_component_rich_style("race--left")
                )
                text.append(stats[i] if middle else "")
        return text


def _seconds(seconds: float) -> str:
    """Seconds as the race shows them: "12 ms", "1.4 s"."""
    if seconds < 1:
        return f"{seconds * 1000:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"
    return f"{seconds:,.1f} s"


class TallBar(VramBar):
    """A `VramBar` whose bar takes every row of its box but the legend's, its parts named on the
    middle row; a legend too wide for the bar in any of its wordings is left out (the bar's
    border says the figures that matter), never cut."""

    def render(self) -> RenderableType:
        drawn = super().render()
        if not isinstance(drawn, Text) or "\n" not in drawn.plain:
            return drawn
        bar, legend = drawn.split("\n", allow_blank=True)[:2]
        width = self.content_size.width
        if legend.cell_len > width:
            legend = Text("")
        rows = max(1, self.content_size.height - (1 if legend.plain else 0))
        unnamed = Text(
            "".join(ch if ch in "▒ " else " " for ch in bar.plain), spans=list(bar.spans)
        )
        text = Text(no_wrap=True, end="")
        for row in range(rows):
            if row:
                text.append("\n")
            text.append_text(bar if row == (rows - 1) // 2 else unnamed)
        if legend.plain:
            text.append("\n")
            text.append_text(legend)
        return text
