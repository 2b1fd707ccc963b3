"""One engine's KV pool on one line, as screen 4's race shows each of its two engines'."""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget


class PoolLine(Widget):
    """One engine's KV pool on one line: the bytes taken as a bar, then how many and the tokens
    held; red once the pool has run out."""

    DEFAULT_CSS = """
    PoolLine { height: 1; width: 1fr; }
    PoolLine > .pool--taken { color: $warning-darken-3; }
    PoolLine > .pool--free { color: $text-muted; }
    PoolLine.-full > .pool--taken { color: $error; }
    PoolLine.-full { color: $text-error; text-style: bold; }
    """
    COMPONENT_CLASSES = {"pool--taken", "pool--free"}

    share: reactive[float] = reactive(0.0)
    words: reactive[str] = reactive("")

    def show(self, share: float, words: str, full: bool) -> None:
        self.share, self.words = max(0.0, min(1.0, share)), words
        self.set_class(full, "-full")

    def render(self) -> RenderableType:
        width = self.content_size.width
        words = f" {self.words}"
        cells = max(4, width - len(words))
        taken = round(self.share * cells)
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append("█" * taken, style=self.get_component_rich_style("pool--taken"))
        line.append("░" * (cells - taken), style=self.get_component_rich_style("pool--free"))
        line.append(words)
        return line
