"""The header line: where the engine runs, which engine and model, and the run state."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class RunHeader(Static):
    """One line: device · engine and model · run state. Its state is a CSS class."""

    DEFAULT_CSS = """
    RunHeader {
        height: 1;
        width: 1fr;
        background: $panel;
        color: $text;
        padding: 0 1;
    }
    """

    def show(self, device: str, engine: str, model: str, state: str, status: str) -> None:
        marks = {"running": "▶ ", "paused": "⏸ ", "done": "✓ ", "failed": "✗ ", "stopped": "■ "}
        text = Text(no_wrap=True, overflow="ellipsis", end="")
        text.append(marks.get(state, "… ") + status, style="bold")
        text.append("  │  ", style="dim")
        text.append(engine, style="bold")
        if model and model != engine:
            text.append(f" ({model})")
        text.append("  │  ", style="dim")
        text.append(device)
        for name in ("running", "paused", "done", "failed", "stopped", "starting"):
            self.set_class(name == state, f"-{name}")
        self.update(text)
