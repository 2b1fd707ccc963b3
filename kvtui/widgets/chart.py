"""A plotext chart that draws only on request, with series cut down to its width first.

plotext is the expensive part of a frame (a 160x48 line chart of 1,000 points took ~70 ms in a
trial, 4,000 points ~230 ms), so callers hand `draw` a function that plots already-downsampled
series, and call it from a throttled timer rather than per engine step. The plot reaches the
screen as `plot_text` makes it, without the ANSI string between plotext and rich.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache

from plotext._utility import colors_to_ansi
from rich.style import Style
from rich.text import Span, Text
from textual.app import RenderResult
from textual.color import Color
from textual.widgets import Static
from textual_plotext import PlotextPlot
from textual_plotext.plot import Plot

from kvtui.format import format_tick

RGB = tuple[int, int, int]

SERIES: dict[str, tuple[str, float]] = {
    "uncached": ("primary", 1.0),
    "cached": ("success", 1.0),
    "formula": ("foreground", 0.55),
    "time": ("warning", 1.0),
    "memory": ("warning", 1.0),
    "overflow": ("error", 1.0),
    "capacity": ("error", 1.0),
    "marker": ("foreground", 0.6),
}
"""Every kind of series the screens draw: a theme colour and how far it is blended from the
background (1.0: the colour itself). `series_colour` then makes it readable."""

MIN_CONTRAST = 3.0
"""WCAG 2's contrast for graphics a room must read (1.4.11, non-text contrast)."""


def _luminance(color: Color) -> float:
    """WCAG 2 relative luminance of an sRGB colour."""

    def channel(value: int) -> float:
        c = value / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    return 0.2126 * channel(color.r) + 0.7152 * channel(color.g) + 0.0722 * channel(color.b)


def contrast_ratio(a: Color, b: Color) -> float:
    """WCAG 2 contrast ratio of two colours: 1 (the same) to 21 (black on white)."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def readable(
    color: Color, background: Color, minimum: float = MIN_CONTRAST, *, also: Sequence[Color] = ()
) -> Color:
    """`color`, moved towards white on a dark background or black on a light one, just far
    enough to reach `minimum` contrast against `background` and every colour in `also` (other
    backgrounds of the same kind it is drawn on); unchanged if it already does."""
    target = Color(255, 255, 255) if _luminance(background) < 0.18 else Color(0, 0, 0)
    for step in range(21):
        moved = color.blend(target, step / 20)
        if all(contrast_ratio(moved, b) >= minimum for b in (background, *also)):
            return moved
    return target


def series_colour(variables: Mapping[str, str], series: str) -> RGB:
    """The readable RGB of a kind of series (`SERIES`) under a theme's resolved variables
    (`App.theme_variables`: "background", "primary", ...): readable both on the screen's
    background, where a legend draws its mark, and on the chart's, `surface` (textual-plotext's
    canvas)."""
    name, alpha = SERIES[series]
    background = Color.parse(variables["background"])
    surface = Color.parse(variables.get("surface", variables["background"]))
    color = background.blend(Color.parse(variables[name]), alpha)
    color = readable(color, background, also=(surface,))
    return (color.r, color.g, color.b)


def downsample(
    xs: Sequence[float], ys: Sequence[float], points: int
) -> tuple[list[float], list[float]]:
    """At most about `points` (x, y) pairs, evenly strided, always keeping the last one."""
    n = len(xs)
    if n <= points or points <= 0:
        return list(xs), list(ys)
    stride = -(-n // points)
    idx = list(range(0, n, stride))
    if idx[-1] != n - 1:
        idx.append(n - 1)
    return [xs[i] for i in idx], [ys[i] for i in idx]


def sample_points(last: int, points: int, first: int = 1) -> list[int]:
    """About `points` integers from first to last inclusive, evenly spread."""
    if last < first:
        return []
    if last - first + 1 <= points:
        return list(range(first, last + 1))
    step = (last - first) / max(1, points - 1)
    values = sorted({first + round(i * step) for i in range(points)} | {last})
    return values


def rolling_median(
    values: Sequence[float], window: int = 9, at: Sequence[int] | None = None
) -> list[float]:
    """The median of the `window` values centred on each index (fewer at the ends): a step-time
    series without its jitter, where a single slow step does not show as a spike. `at` picks the
    indices to compute (all by default), so a long series costs only the points drawn."""
    half = max(0, window // 2)
    n = len(values)
    return [
        statistics.median(values[max(0, i - half) : min(n, i + half + 1)])
        for i in (range(n) if at is None else at)
    ]


def step_line(xs: Sequence[int], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """A staircase through (x, y): each value held flat across its step."""
    sx: list[float] = []
    sy: list[float] = []
    for x, y in zip(xs, ys, strict=False):
        sx += [x - 0.5, x + 0.5]
        sy += [y, y]
    return sx, sy


GLYPHS = {"formula": "•", "marker": "│"}
"""How a series shows in a legend, where not as a line ("━")."""


class Caption(Static):
    """A chart's legend: each `{series}` in the template becomes that series' mark, in the very
    colour the chart draws it (readable on the theme), refreshed when the theme changes."""

    def __init__(self, template: str, *, classes: str | None = None) -> None:
        super().__init__("", classes=classes)
        self.template = template

    def on_mount(self) -> None:
        self.watch(self.app, "theme", self._theme_changed, init=True)

    def show(self, template: str) -> None:
        """Show another legend (the same series, other words), if it is another."""
        if template != self.template:
            self.template = template
            if self.is_mounted:
                self._fill()

    def _theme_changed(self, _theme: str) -> None:
        self._fill()
        self.call_after_refresh(self._fill)  # once the theme's variables are the new ones

    def _fill(self) -> None:
        variables = self.app.theme_variables
        marks = {}
        for series in SERIES:
            r, g, b = series_colour(variables, series)
            marks[series] = f"[#{r:02x}{g:02x}{b:02x}]{GLYPHS.get(series, '━')}[/]"
        self.update(self.template.format(**marks))


def _decoded_style(colors: tuple[object, object, object]) -> Style | None:
    """The rich style of a run of cells of these plotext colours (fullground, style,
    background): the very style `Text.from_ansi` gives the escape codes plotext writes."""
    codes = colors_to_ansi(*colors)
    spans = Text.from_ansi(codes + "x").spans if codes else []
    return spans[0].style if spans else None  # type: ignore[return-value]


_cached_style = lru_cache(maxsize=1024)(_decoded_style)


def _run_style(colors: tuple[object, object, object]) -> Style | None:
    try:
        return _cached_style(colors)
    except TypeError:  # a colour given as a list: unhashable, decode it each time
        return _decoded_style(colors)


def plot_text(plt: Plot) -> Text:
    """The figure as rich Text: what `Text.from_ansi(plt.build())` returns, the same characters
    and spans, made from plotext's matrix of cells directly. Writing the matrix out as ANSI
    codes and parsing them back was about half of it: screen 1's plot at 160x48 (96x35 cells)
    took 30 ms that way and takes 16 ms this way (headless, on a 2-core machine)."""
    plt._set_sizes()
    plt._build_matrix()  # plt.build() without the ANSI canvas
    matrix = plt.monitor.matrix
    parts: list[str] = []
    spans: list[Span] = []
    at = 0
    for row in reversed(matrix.Rows):  # plotext's row 0 is the bottom line
        markers, fulls = matrix.marker[row], matrix.fullground[row]
        styles, backs = matrix.style[row], matrix.background[row]
        start, cols = 0, matrix.cols
        while start < cols:
            colors = (fulls[start], styles[start], backs[start])
            end = start + 1
            while end < cols and (fulls[end], styles[end], backs[end]) == colors:
                end += 1
            chunk = "".join(markers[start:end])
            style = _run_style(colors)
            if style:
                spans.append(Span(at, at + len(chunk), style))
            parts.append(chunk)
            at += len(chunk)
            start = end
        parts.append("\n")
        at += 1
    return Text("".join(parts), spans=spans)


class Chart(PlotextPlot):
    """A PlotextPlot redrawn from a `draw(plt, width)` function, coloured from the theme."""

    DEFAULT_CSS = """
    Chart {
        height: 1fr;
        width: 1fr;
        min-height: 6;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._draw: Callable[[Plot, int], None] | None = None
        self._pending = False
        """A `draw` came while held: replotted on `release`."""
        self._held = False

    def colour(self, series: str) -> RGB:
        """The RGB of a kind of series (`SERIES`) in the current theme, readable on its
        background (at least MIN_CONTRAST)."""
        return series_colour(self.app.theme_variables, series)

    @property
    def rows(self) -> int:
        """About how many rows the plot itself gets (the title, the frame and the x labels take
        the rest): for spacing the y ticks."""
        return max(1, self.size.height - 4)

    @property
    def points(self) -> int:
        """How many points a series should have at most: about two per column."""
        return max(16, 2 * max(self.size.width - 12, 8))

    def draw(self, draw: Callable[[Plot, int], None]) -> None:
        """Replace the chart's contents with what `draw` plots, and refresh this widget only.

        Called as often as the screen redraws (at most as often as the run changes: the one
        throttle is where the engine's events enter the app); while held, the latest `draw` waits
        for `release`, so the last state is never lost."""
        self._draw = draw
        if self._held:
            self._pending = True
            return
        self._replot()

    def hold(self) -> None:
        """Replot nothing until `release` (a screen keeps a key's frame to itself); `draw_now`
        still replots."""
        self._held = True

    def release(self) -> None:
        """Replot what was held back."""
        self._held = False
        if self._pending:
            self._replot()

    def draw_now(self) -> None:
        """Replot now, held or not (a screen shown, a test reading it)."""
        self._replot()

    def _replot(self) -> None:
        self._pending = False
        if self._draw is None:
            return
        self.plt.clear_data()
        self.plt.clear_figure()
        self._draw(self.plt, self.points)
        self.refresh()

    def on_resize(self) -> None:
        self._replot()

    def on_mount(self) -> None:
        self.watch(self.app, "theme", self._theme_changed, init=False)

    def _theme_changed(self, _theme: str) -> None:
        """Replot in the new theme's series colours (a `draw` reads them), once its variables
        are the new ones: a run that has ended draws nothing more by itself."""
        self.call_after_refresh(self._replot)

    def render(self) -> RenderResult:
        # PlotextPlot.render, with plot_text for Text.from_ansi(plt.build())
        plt = self.plt
        plt.plotsize(self.size.width, self.size.height)
        plt._set_size(self.size.width, self.size.height)
        plt.theme(self._get_plotext_theme_name(self.app.theme))
        return plot_text(plt)


def nice_ticks(top: float, count: int = 4, bottom: float = 0.0) -> list[float]:
    """About `count` round ticks from `bottom` to `top`: 1, 2, 2.5 or 5 times a power of 10."""
    span = top - bottom
    if span <= 0:
        return [bottom]
    raw = span / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(bottom / step) * step
    ticks = []
    value = first
    while value <= top + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    return ticks


def fitting_ticks(top: float, count: int, rows: int, bottom: float = 0.0) -> list[float]:
    """`nice_ticks`, but at most one tick per two rows of the plot: plotext keeps only one of
    two labels that land on the same row, and which one is not stable from run to run."""
    most = max(2, (rows - 1) // 2 + 1)
    for wanted in range(max(1, count), 0, -1):
        ticks = nice_ticks(top, wanted, bottom)
        if len(ticks) <= most:
            return ticks
    return ticks[:: -(-len(ticks) // most)]


def capacity_ticks(top: float, capacity: float, rows: int) -> tuple[list[float], list[str]]:
    """The y axis's ticks (GiB) with the GPU's capacity among them, labelled with its own value,
    so the capacity line is named on the row it is drawn on; nice ticks that would share or
    crowd that row (within two: plotext's rows are rounded) make way."""

    def row(value: float) -> int:
        return round(value / top * (rows - 1)) if top > 0 else 0

    ticks = [t for t in fitting_ticks(top, 4, rows) if abs(row(t) - row(capacity)) > 2]
    ticks = sorted([*ticks, capacity])
    return ticks, [f"{format_tick(t)} GiB" for t in ticks]
