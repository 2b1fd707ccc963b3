"""A token stream: the generated text so far, its newest token marked, always showing the tail."""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget


def printable(text: str) -> str:
    """Text safe to lay out: control and unprintable characters (a random model emits them)
    become "·", so they cannot shift the panel's border."""
    return "".join(ch if ch.isprintable() or ch == "\n" else "·" for ch in text)


class TokenStream(Widget):
    """Generated text in a bordered panel; the newest token is highlighted (the current step)."""

    DEFAULT_CSS = """
    TokenStream {
        border: round $primary 40%;
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
    placeholder: reactive[str] = reactive("waiting for the first token...")

    def __init__(self, title: str, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.border_title = title

    def show(self, text: str, current: str, steps: int, *, prompt: str = "") -> None:
        """The text so far and the newest token's text (already at the end of `text`), after
        the prompt (dimmed: the model's input, not its output)."""
        self.prompt, self.text, self.current = prompt, text, current
        self.border_subtitle = f"{steps:,} tokens" if steps else ""

    def render(self) -> RenderableType:
        if not self.text and not self.prompt:
            return Text(
                self.placeholder, style=self.get_component_rich_style("stream--placeholder")
            )
        head = self.text[: len(self.text) - len(self.current)] if self.current else self.text
        prompt = self.prompt
        # Only the tail can show: wrap no more than twice what the panel holds.
        room = 2 * max(1, self.content_size.width) * max(1, self.content_size.height)
        if len(head) > room:
            head, prompt = head[-room:], ""
        body = Text(printable(prompt), style=self.get_component_rich_style("stream--prompt"))
        body.append(printable(head))
        if self.current:
            body.append(
                printable(self.current), style=self.get_component_rich_style("stream--current")
            )
        width, height = self.content_size.width, self.content_size.height
        if width <= 0 or height <= 0:
            return body
        lines = body.wrap(self.app.console, width)
        if len(lines) > height:
            lines = lines[len(lines) - height :]
        return Text("\n").join(lines)
