"""A memory bar: named parts in proportion to a capacity, a legend, red when it overflows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import RenderableType
from rich.style import Style
from rich.text import Text
from textual.color import Color
from textual.reactive import reactive
from textual.widget import Widget
from textual_plotext.plot import Plot

from kvtui.format import format_bytes, format_tick
from kvtui.sim.budget import Budget, VramSplit
from kvtui.sim.catalog import GIB, ModelSpec
from kvtui.sim.memory import kv_bytes
from kvtui.sim.parallel import shard
from kvtui.widgets.chart import Chart, capacity_ticks, contrast_ratio, nice_ticks, sample_points
from kvtui.widgets.plain import plain


@dataclass(frozen=True)
class Part:
    """One part of a bar: its name, its bytes, and its look (a component class of `VramBar`)."""

    name: str
    bytes: int
    look: str
    """"weights", "kv", "tail", "reserve" or "free"."""
    detail: str = ""
    """Said after its size in the legend: "(278 tokens)"."""
    short: str = ""
    """A shorter name for a narrow legend ("KV" for "KV filled"); the name itself if empty."""


@dataclass(frozen=True)
class Bar:
    """What a `VramBar` draws: parts that fill `capacity_bytes` (clipped to it in order), how
    many bytes did not fit, and whether the bar is red."""

    parts: tuple[Part, ...]
    capacity_bytes: int
    overflow_bytes: int = 0
    full: bool = False
    """Red without an overflow: a pool that ran out (the next block had nowhere to go)."""
    note: str = ""
    """Said at the end of the legend: "weights 13.3 MiB beside it"."""

    @property
    def red(self) -> bool:
        return self.full or self.overflow_bytes > 0


def whatif_bar(split: VramSplit, wanted: tuple[int, int, int, int]) -> Bar:
    """A budget's GPU as weights | KV cache | runtime | free: the bar clipped to the GPU
    (`split`), the legend the sizes wanted."""
    weights, kv, reserve, free = wanted
    parts = (
        Part("weights", weights, "weights"),
        Part("KV cache", kv, "kv"),
        Part("runtime", reserve, "reserve"),
        Part("free", free if not split.overflow_bytes else 0, "free"),
    )
    return Bar(parts, split.vram_bytes, split.overflow_bytes)


class VramBar(Widget):
    """One bar the width of the widget, its parts in proportion to a capacity, and a legend.

    `red` is a reactive turned into the `-overflow` CSS class: the KV parts, the border and the
    legend's overflow note take the theme's error colour.
    """

    DEFAULT_CSS = """
    VramBar {
        height: 4;
        border: round $primary;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
    }
    VramBar > .vram--weights { background: $primary; }
    VramBar > .vram--kv { background: $warning-darken-3; }
    VramBar > .vram--tail { color: $warning-darken-3; }
    VramBar > .vram--reserve { background: $text-secondary; }
    VramBar > .vram--free { background: $surface-lighten-1; color: $text-muted; }
    VramBar > .vram--over { color: $text-error; text-style: bold; }
    VramBar.-overflow { border: round $error; border-title-color: $text-error; }
    VramBar.-overflow > .vram--kv { background: $error; }
    VramBar.-overflow > .vram--tail { color: $error; }
    """
    # Every part's colour holds 3:1 against the screen on dark and light themes alike, for its
    # swatch in the legend; a part's label on it is black or white, whichever reads (`_legible`).

    COMPONENT_CLASSES = {
        "vram--weights",
        "vram--kv",
        "vram--tail",
        "vram--reserve",
        "vram--free",
        "vram--over",
    }

    red: reactive[bool] = reactive(False)
    bar: reactive[Bar | None] = reactive(None)

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._titles: tuple[str, ...] = ()
        self._subtitles: tuple[str, ...] = ()

    def watch_red(self, red: bool) -> None:
        self.set_class(red, "-overflow")

    def show(
        self, bar: Bar, title: str | Sequence[str], subtitle: str | Sequence[str] = ""
    ) -> None:
        """Draw `bar`; `title` and `subtitle` are one wording or several, fullest first: the
        first that fits the border is shown (the last, cut, if none does), as plain text (they
        name models, devices and pools from files and engines), never markup."""
        self._titles = (title,) if isinstance(title, str) else tuple(title)
        self._subtitles = (subtitle,) if isinstance(subtitle, str) else tuple(subtitle)
        self._fit_titles()
        self.red = bar.red
        self.bar = bar

    def on_resize(self) -> None:
        self._fit_titles()

    def _fit_titles(self) -> None:
        room = self.outer_size.width - 6  # the corners and a dash and a space each side
        for attribute, wordings in (
            ("border_title", self._titles),
            ("border_subtitle", self._subtitles),
        ):
            fits = [w for w in wordings if len(w) <= room]
            setattr(self, attribute, plain(fits[0] if fits else wordings[-1] if wordings else ""))

    @staticmethod
    def widths(bar: Bar, width: int) -> list[int]:
        """Cells per part, clipped to the capacity in order: proportional, at least one for any
        part that is shown at all."""
        left, shown = bar.capacity_bytes, []
        for part in bar.parts:
            size = max(0, min(part.bytes, left))
            shown.append(size)
            left -= size
        total = max(1, bar.capacity_bytes)
        cells = [0 if p <= 0 else max(1, round(width * p / total)) for p in shown]
        while sum(cells) > width:
            cells[cells.index(max(cells))] -= 1
        if 0 < sum(cells) < width:
            cells[cells.index(max(cells))] += width - sum(cells)
        return cells

    def render(self) -> RenderableType:
        bar = self.bar
        width = self.content_size.width
        if bar is None or width <= 0:
            return Text("")
        line = Text(no_wrap=True)
        for cells, part in zip(self.widths(bar, width), bar.parts, strict=True):
            if cells > 0:
                style = _legible(self.get_component_rich_style(f"vram--{part.look}"))
                label = "▒" * cells if part.look == "tail" else f" {part.name}"
                if len(label) > cells:  # named whole or not at all: the legend names it
                    label = ""
                line.append(label.ljust(cells), style=style)
        legends = [self._legend(bar, *wording) for wording in LEGENDS]
        legend = next((text for text in legends if text.cell_len <= width), legends[-1])
        return Text("\n").join([line, legend])

    def _legend(
        self, bar: Bar, details: bool, gap: str, short: bool = False, tight: bool = False
    ) -> Text:
        """Each part's swatch, name (or `short` name) and size (and its detail, if `details`),
        `gap` apart; `tight`: a size without the space before its unit ("32.9GiB")."""
        legend = Text(no_wrap=True, overflow="ellipsis")
        for part in bar.parts:
            if part.look == "free" and bar.red and part.bytes <= 0:
                continue  # nothing is free: the overflow note says by how much
            look = self.get_component_rich_style(f"vram--{part.look}")
            glyph = GLYPHS.get(part.look, "■")
            legend.append(glyph, style=Style(color=look.color if glyph != "■" else look.bgcolor))
            detail = f" {part.detail}" if part.detail and details else ""
            name = part.short if short and part.short else part.name
            size = format_bytes(part.bytes).replace(" ", "") if tight else format_bytes(part.bytes)
            legend.append(f" {name} {size}{detail}{gap}")
        if bar.overflow_bytes:
            legend.append(
                f"{format_bytes(bar.overflow_bytes)} over",
                style=self.get_component_rich_style("vram--over"),
            )
        if bar.note:
            legend.append(bar.note)
        legend.rstrip()
        return legend


def _legible(style: Style) -> Style:
    """`style` with its text black or white, whichever has the more contrast (WCAG 2) on its
    background colour: Textual's `auto` weighs colours its own way, and picked white on the
    dark theme's $text-secondary, 4.0:1 against black's 5.2:1."""
    if style.bgcolor is None:
        return style
    r, g, b = style.bgcolor.get_truecolor()
    back = Color(r, g, b)
    white, black = Color(255, 255, 255), Color(0, 0, 0)
    text = white if contrast_ratio(white, back) >= contrast_ratio(black, back) else black
    return style + Style(color=text.rich_color)


GLYPHS = {"tail": "▒", "free": "□"}
"""Swatches that are not a block of their part's colour: the last block's unused slots are
hatched in the KV colour (taken, not filled), in the bar too; the free pool is an empty square.
Others are a block of their colour, as in the bar, where their name is written on it."""

LEGENDS = (
    (True, "  ", False, False),
    (True, " ", False, False),
    (False, " ", False, False),
    (False, " ", True, False),
    (False, " ", True, True),
)
"""The legend's wordings, fullest first: with each part's detail, two spaces apart; one space;
without the details; with the parts' short names; with their sizes tight. The first that fits
the bar is drawn."""


def memory_curve(
    plt: Plot, chart: Chart, b: Budget, spec: ModelSpec, context: int, points: int
) -> None:
    """Screen 3's what-if chart: one GPU's memory (weights, reserve and the KV cache) against
    the context, the GPU's capacity, and the context chosen (the lesson's formula)."""
    share = shard(spec, b.tp)  # one GPU's part, as every what-if figure is
    fixed = b.weights_bytes_per_gpu + b.reserve_bytes
    longest = min(b.max_context_tokens or context, spec.max_context)
    right = max(context, longest) * 1.25
    xs = sample_points(int(right), points, first=0)
    ys = [(fixed + kv_bytes(share, x, b.batch, b.kv_dtype)) / GIB for x in xs]
    color = chart.colour("memory" if b.fits else "overflow")
    plt.plot(xs, ys, color=color, marker="braille")
    plt.hline(b.vram_bytes / GIB, color=chart.colour("capacity"))
    plt.vline(context, color=chart.colour("marker"))
    top = max(ys[-1], b.vram_bytes / GIB) * 1.08
    plt.xlim(0, right)
    plt.ylim(0, top)
    xt = nice_ticks(right, 4)
    plt.xticks(xt, [format_tick(t) for t in xt])
    plt.yticks(*capacity_ticks(top, b.vram_bytes / GIB, chart.rows))
