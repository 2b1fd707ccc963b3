"""A token stream: the generated text so far, its newest token marked, always showing the tail."""

from __future__ import annotations

import re

from rich.console import RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from kvtui.format import format_count

_LINE_BREAK = re.compile(r"(?<!\n)\n(?!\n)")


def printable(text: str) -> str:
    """Text safe to lay out: control and unprintable characters (a random model emits them)
    become "·", so they cannot shift the panel's border."""
    return "".join(ch if ch.isprintable() or ch == "\n" else "·" for ch in text)


def reflowed(text: str) -> str:
    """Text as a paragraph a panel can wrap: a lone line break (the novels' text, and the model
    trained on it, breaks lines at about 70 columns) becomes a space; a blank line between
    paragraphs stays. Character for character, so positions in `text` still hold."""
    return _LINE_BREAK.sub(" ", text)


WAITING = "waiting for the first token..."
"""What a stream shows before its first token."""


class TokenStream(Widget):
    """Generated text in a bordered panel; the newest token is highlighted (the current step)."""

    DEFAULT_CSS = """
    TokenStream {
        border: round $primary;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
        height: 1fr;
        width: 1fr;
    }
    TokenStream > .stream--current {
        background: $accent 40%;
        color: $text;
        text-style: bold;
    }
    TokenStream > .stream--placeholder {
        color: $text-muted;
        text-style: italic;
    }
    TokenStream > .stream--prompt {
        color: $text-muted;
    }
    """

    COMPONENT_CLASSES = {"stream--current", "stream--placeholder", "stream--prompt"}

    prompt: reactive[str] = reactive("")
    text: reactive[str] = reactive("")
    current: reactive[str] = reactive("")
    placeholder: reactive[str] = reactive(WAITING)

    def __init__(self, title: str, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.border_title = title

    def show(
        self, text: str, current: str, steps: int, *, prompt: str = "", placeholder: bool = False
    ) -> None:
        """The text so far and the newest token's text (already at the end of `text`), after
        the prompt (dimmed: the model's input, not its output). `placeholder`: the text is not
        a model's (a modelled run's stand-in), and the panel says so."""
        self.prompt, self.text, self.current = prompt, text, current
        count = format_count(steps, "token") if steps else ""
        wordings = (
            [f"placeholder text · {count}", f"placeholder · {count}", "placeholder text"]
            if placeholder
            else [count]
        )
        room = self.outer_size.width - 6  # the corners and a dash and a space each side
        self.border_subtitle = next((w for w in wordings if len(w) <= room), wordings[-1])

    def render(self) -> RenderableType:
        if not self.text and not self.prompt:
            return Text(
                self.placeholder, style=self.get_component_rich_style("stream--placeholder")
            )
        # Only the tail can show: wrap no more than twice what the panel holds.
        room = 2 * max(1, self.content_size.width) * max(1, self.content_size.height)
        text, prompt, current = self.text, self.prompt, len(self.current)
        if len(text) > room + current:
            text, prompt = text[-room - current :], ""
        whole = printable(reflowed(prompt + text))  # both keep every character's place
        body = Text(whole[: len(prompt)], style=self.get_component_rich_style("stream--prompt"))
        body.append(whole[len(prompt) : len(whole) - current])
        if current:
            body.append(
                whole[len(whole) - current :],
                style=self.get_component_rich_style("stream--current"),
            )
        width, height = self.content_size.width, self.content_size.height
        if width <= 0 or height <= 0:
            return body
        lines = body.wrap(self.app.console, width)
        if len(lines) > height:
            lines = lines[len(lines) - height :]
        return Text("\n").join(lines)
