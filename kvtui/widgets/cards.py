"""Stat cards: a label, one big figure and a note, the way the lesson shows its numbers."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Digits

from kvtui.widgets.note import Note

_DIGIT_CHARS = set("0123456789.,x+-")
"""What big digits draw (a thousands comma as a space: Textual's Digits has no comma)."""
PLACEHOLDERS = ("…", "—", "")
"""Figures not had yet (or not had at all): they do not hold a row's big digits back."""


class StatCard(Widget):
    """A bordered card: LABEL in the border, the figure, and a short note under it.

    The same kind of figure looks the same across a row: the cards beside each other (the
    StatCards of one parent) draw their figures in big digits only when every one of them can
    (a number whose digits fit, on a card at least three lines tall), else all in plain bold
    text, so that a small "4,205" never sits beside a big "101"."""

    DEFAULT_CSS = """
    StatCard {
        height: 5;
        width: 1fr;
        border: round $primary;
        border-title-color: $text-muted;
        border-title-style: bold;
        border-subtitle-color: $text-muted;
        padding: 0 1;
        content-align: center middle;
    }
    StatCard > Digits {
        width: 100%;
        text-align: center;
        color: $text;
    }
    StatCard > .card--text {
        width: 100%;
        height: 1fr;
        content-align: center middle;
        text-style: bold;
        color: $text;
    }
    StatCard.-bad {
        border: round $error;
    }
    StatCard.-bad > Digits, StatCard.-bad > .card--text {
        color: $text-error;
    }
    StatCard.-good {
        border: round $text-success;
    }
    StatCard.-good > Digits {
        color: $text-success;
    }
    """

    value: reactive[str] = reactive("", layout=False)
    note: reactive[str | tuple[str, ...]] = reactive("")
    """The line under the figure; or its wordings, fullest first: the first that fits the
    card's border is shown (the last, cut, if none does)."""

    def __init__(
        self, label: str, value: str = "", note: str = "", *, id: str | None = None
    ) -> None:
        super().__init__(id=id)
        self.border_title = label
        self.set_reactive(StatCard.value, value)
        self.set_reactive(StatCard.note, note)

    def compose(self) -> ComposeResult:
        yield Digits(self.value)
        yield Note(self.value, classes="card--text")

    def on_mount(self) -> None:
        self._show()
        self._show_note()

    def on_resize(self) -> None:
        self._show()
        self._show_note()

    def watch_value(self) -> None:
        self._show()

    def watch_note(self) -> None:
        self._show_note()

    def _show_note(self) -> None:
        wordings = (self.note,) if isinstance(self.note, str) else self.note
        room = self.outer_size.width - 6  # the corners and a dash each side
        fits = [w for w in wordings if len(w) <= room]
        self.border_subtitle = fits[0] if fits else (wordings[-1] if wordings else "")

    def _show(self) -> None:
        """Draw this card's row again: big digits for all of its figures, or for none."""
        row = list(self.parent.query_children(StatCard)) if self.parent else [self]
        big = all(card._can_be_big() for card in row)
        for card in row:
            card._draw(big)

    def _can_be_big(self) -> bool:
        if self.value in PLACEHOLDERS:
            return True
        width, height = self.content_size.width, self.content_size.height
        return set(self.value) <= _DIGIT_CHARS and 3 * len(self.value) <= width and height >= 3

    def _draw(self, big: bool) -> None:
        if not self.children:  # not composed yet
            return
        digits, text = self.query_one(Digits), self.query_one(".card--text", Note)
        big = big and self.value not in PLACEHOLDERS
        digits.display, text.display = big, not big
        if big:
            digits.update(self.value.replace(",", " "))
        else:
            text.show(self.value)
