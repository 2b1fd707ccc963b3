"""Large type that fills its box: a figure, a headline, the title card (kvtui.bigtext draws it).

A `BigText` draws its text in the largest font of kvtui.bigtext's ladder that fits the cells it
was laid out with, so it grows with the terminal. Widgets in one `FontGroup` share the largest
font all of them fit (a node's three figures stay one size), each judged on its `sizing` text
(the widest it will show: a figure counting up keeps its size). Where even the smallest font
does not fit, the text is drawn in words, wrapped, never cut.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from kvtui.bigtext import Big, fit, title_card


class FontGroup:
    """BigTexts that share one font: the largest every one of them fits (one that fits none is
    drawn in words)."""

    def __init__(self) -> None:
        self.members: list[BigText] = []

    def font(self) -> int | None:
        shown = [m for m in self.members if m.sizing and m.content_size.area]
        fonts = [f for f in (m.best_font() for m in shown) if f is not None]
        return min(fonts) if fonts else None


class BigText(Widget):
    """Text in large type, as large as its box allows (see the module's docstring)."""

    DEFAULT_CSS = """
    BigText {
        height: 1fr;
        width: 1fr;
        color: $text;
        text-style: bold;
    }
    """

    def __init__(
        self,
        *,
        wrap: bool = False,
        gap: int = 1,
        group: FontGroup | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(id=id, classes=classes)
        self.text = ""
        self.sizing = ""
        """The text its font is chosen for (the widest it will show); `text` when empty."""
        self.wrap = wrap
        self.gap = gap
        self.group = group
        if group is not None:
            group.members.append(self)
        self.drawn: Big | None = None
        """What the last frame drew in large type (None: in words, or nothing)."""

    def show(self, text: str, sizing: str = "") -> None:
        """Draw `text`, in the font chosen for `sizing` (default: `text` itself)."""
        if (text, sizing) == (self.text, self.sizing):
            return
        self.text, self.sizing = text, sizing
        if self.group is not None:
            for member in self.group.members:
                member.refresh()
        else:
            self.refresh()

    def best_font(self) -> int | None:
        """The largest font its sizing text fits its box in, or None."""
        width, height = self.content_size
        big = fit(self.sizing or self.text, width, height, wrap=self.wrap, gap=self.gap)
        return big.font if big is not None else None

    @property
    def rows(self) -> int:
        """Rows of large type shown (0 where the text is in words or empty)."""
        return self.drawn.rows if self.drawn is not None else 0

    def render(self) -> RenderableType:
        width, height = self.content_size
        if not self.text or width <= 0 or height <= 0:
            self.drawn = None
            return Text("")
        most = self.group.font() if self.group is not None else None
        big = None
        if self.group is None or most is not None:
            big = fit(self.text, width, height, wrap=self.wrap, gap=self.gap, most=most)
        self.drawn = big
        if big is None:  # too small for the smallest font: in words, wrapped
            return Text(self.text)
        return Text("\n".join(line.rstrip() for line in big.lines), no_wrap=True, end="")


class TitleCard(Widget):
    """The title slide (kvtui.bigtext.title_card): the name and subtitle large, the sentence."""

    DEFAULT_CSS = """
    TitleCard {
        height: 1fr;
        width: 1fr;
    }
    TitleCard > .card--title { color: $text-primary; text-style: bold; }
    TitleCard > .card--subtitle { color: $text; text-style: bold; }
    TitleCard > .card--idea { color: $text; }
    """

    COMPONENT_CLASSES = {"card--title", "card--subtitle", "card--idea"}

    def render(self) -> RenderableType:
        width, height = self.content_size
        styles: dict[str, Style] = {
            kind: self.get_component_rich_style(f"card--{kind}")
            for kind in ("title", "subtitle", "idea")
        }
        text = Text(no_wrap=True, end="")
        for i, line in enumerate(title_card(width, height + 2)[:height]):
            if i:
                text.append("\n")
            text.append(line.text.rstrip(), style=styles.get(line.kind, Style()))
        return text
