"""A VRAM bar: weights | KV cache | runtime and other | free, red past the GPU's capacity."""

from __future__ import annotations

from rich.console import RenderableType
from rich.style import Style
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from kvtui.format import format_bytes
from kvtui.sim.memory import VramSplit


class VramBar(Widget):
    """One bar the width of the widget, its parts in proportion to the GPU's memory, and a legend.

    `overflow` is a reactive turned into the `-overflow` CSS class: the KV part, the border and
    the legend's overflow note take the theme's error colour.
    """

    DEFAULT_CSS = """
    VramBar {
        height: 4;
        border: round $primary 40%;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
    }
    VramBar > .vram--weights { background: $primary; color: $text; }
    VramBar > .vram--kv { background: $warning; color: $text; }
    VramBar > .vram--reserve { background: $secondary 70%; color: $text; }
    VramBar > .vram--free { background: $surface-lighten-1; color: $text-muted; }
    VramBar > .vram--over { color: $error; text-style: bold; }
    VramBar.-overflow { border: round $error; border-title-color: $error; }
    VramBar.-overflow > .vram--kv { background: $error; color: $text; }
    """

    COMPONENT_CLASSES = {"vram--weights", "vram--kv", "vram--reserve", "vram--free", "vram--over"}

    overflow: reactive[bool] = reactive(False)
    split: reactive[VramSplit | None] = reactive(None)
    _wanted: tuple[int, int, int, int] | None = None

    def watch_overflow(self, overflow: bool) -> None:
        self.set_class(overflow, "-overflow")

    def show(
        self, split: VramSplit, title: str, wanted: tuple[int, int, int, int] | None = None
    ) -> None:
        """Draw `split`; the legend gives the `wanted` sizes (weights, KV, runtime, free) when
        they differ from the clipped ones shown in the bar."""
        self.border_title = title
        self._wanted = wanted
        self.overflow = split.overflow_bytes > 0
        self.split = split

    def _widths(self, split: VramSplit, width: int) -> list[int]:
        """Cells per part: proportional, at least one for any part that is not empty."""
        parts = [split.weights_bytes, split.kv_bytes, split.reserve_bytes, split.free_bytes]
        total = max(1, split.vram_bytes)
        cells = [0 if p <= 0 else max(1, round(width * p / total)) for p in parts]
        while sum(cells) > width:
            i = cells.index(max(cells))
            cells[i] -= 1
        if sum(cells) < width:
            i = cells.index(max(cells))
            cells[i] += width - sum(cells)
        return cells

    def render(self) -> RenderableType:
        split = self.split
        width = self.content_size.width
        if split is None or width <= 0:
            return Text("")
        names = ("weights", "KV cache", "runtime", "free")
        classes = ("vram--weights", "vram--kv", "vram--reserve", "vram--free")
        sizes = self._wanted or (
            split.weights_bytes,
            split.kv_bytes,
            split.reserve_bytes,
            split.free_bytes,
        )
        bar = Text(no_wrap=True)
        for cells, name, cls in zip(self._widths(split, width), names, classes, strict=False):
            if cells <= 0:
                continue
            label = f" {name}"[:cells].ljust(cells)
            bar.append(label, style=self.get_component_rich_style(cls))
        legend = Text(no_wrap=True, overflow="ellipsis")
        for name, cls, size in zip(names, classes, sizes, strict=False):
            if name == "free" and split.overflow_bytes:
                continue  # nothing is free: the overflow note says by how much
            swatch = self.get_component_rich_style(cls)
            legend.append("■", style=Style(color=swatch.bgcolor))
            legend.append(f" {name} {format_bytes(size)}  ")
        if split.overflow_bytes:
            legend.append(
                f"{format_bytes(split.overflow_bytes)} over",
                style=self.get_component_rich_style("vram--over"),
            )
        return Text("\n").join([bar, legend])
