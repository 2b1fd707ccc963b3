"""Stat cards: a label, one big figure and a note, the way the lesson shows its numbers."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Digits

from kvtui.widgets.note import Note

_DIGIT_CHARS = set("0123456789.x+-")


class StatCard(Widget):
    """A bordered card: LABEL in the border, the figure in big digits when it fits (plain bold
    text when it does not, has letters, or the card is one line tall), and a short note under
    it."""

    DEFAULT_CSS = """
    StatCard {
        height: 5;
        width: 1fr;
        border: round $primary 60%;
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
        color: $error;
    }
    StatCard.-good > Digits, StatCard.-good > .card--text {
        color: $success;
    }
    """

    value: reactive[str] = reactive("", layout=False)
    note: reactive[str] = reactive("")

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
        self.border_subtitle = self.note

    def on_resize(self) -> None:
        self._show()

    def watch_value(self) -> None:
        self._show()

    def watch_note(self, note: str) -> None:
        self.border_subtitle = note

    def _show(self) -> None:
        if not self.children:  # not composed yet
            return
        digits, text = self.query_one(Digits), self.query_one(".card--text", Note)
        width, height = self.content_size.width, self.content_size.height
        big = set(self.value) <= _DIGIT_CHARS and 3 * len(self.value) <= width and height >= 3
        digits.display, text.display = big, not big
        if big:
            digits.update(self.value)
        else:
            text.show(self.value)
