"""The header line: where the engine runs, which engine and model, and the run state."""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

MARKS = {"running": "▶ ", "paused": "⏸ ", "done": "✓ ", "failed": "✗ ", "stopped": "■ "}


class RunHeader(Widget):
    """One line: run state · engine and model · device. Its state is a CSS class.

    The line is fitted to the width when it is drawn: first the separators tighten, then the
    device loses its detail (the full reason stays in help, `?`), then the engine loses the
    model's words, the device goes, and the status is said in fewer words and then in the
    fewest (the state, and what stopped or shapes the run); the state and the engine are kept to
    the last: where even they do not fit, the engine's end is cut with an ellipsis.
    """

    DEFAULT_CSS = """
    RunHeader {
        height: 1;
        width: 1fr;
        background: $panel;
        color: $text;
        padding: 0 1;
    }
    """

    def __init__(self) -> None:
        super().__init__()
        self._parts: tuple[str, ...] = ("",) * 8

    def show(
        self,
        device: str,
        engine: str,
        model: str,
        state: str,
        status: str,
        *,
        device_label: str,
        engine_short: str = "",
        status_short: str = "",
        status_least: str = "",
    ) -> None:
        """`device` in full (the probe's `description`); `device_label` in a few words (its
        `label`), used when the line is narrow; `engine_short`, the engine in fewer words, when
        even that is too long; `status_short`, the status in fewer words, then `status_least`,
        the fewest, last of all (kvtui.run.live.LiveRun.status_line)."""
        for name in ("running", "paused", "done", "failed", "stopped", "starting"):
            self.set_class(name == state, f"-{name}")
        mark = MARKS.get(state, "… ")
        parts = (mark + status, engine, model, device, device_label, engine_short or engine)
        parts += (mark + (status_short or status), mark + (status_least or status_short or status))
        if parts != self._parts:  # a redraw that changed nothing repaints nothing
            self._parts = parts
            self.refresh()

    def variants(self) -> list[Text]:
        """The header's line, from the fullest wording to the shortest."""
        status, full, model, device, short, brief, brief_status, least = self._parts
        wordings = [(status, full, model, device), (status, full, model, short)]
        wordings.append((status, full, "", short))
        wordings.append((status, brief, "", short))
        wordings.append((status, brief, "", ""))  # the device left to help rather than cut
        for fewer in dict.fromkeys((brief_status, least)):  # then the status in fewer words
            if fewer != status:
                wordings += [(fewer, brief, "", short), (fewer, brief, "", "")]
        lines = []
        for said, engine, words, where in wordings:
            for separator in ("  │  ", " │ "):
                text = Text(no_wrap=True, overflow="ellipsis", end="")
                text.append(said, style="bold")
                text.append(separator, style="dim")
                text.append(engine, style="bold")
                if words and words != engine:
                    text.append(f" ({words})")
                if where:
                    text.append(separator, style="dim")
                    text.append(where)
                lines.append(text)
        return lines

    def render(self) -> RenderableType:
        if not any(self._parts):
            return Text("")
        width = self.content_size.width
        variants = self.variants()
        for text in variants:
            if text.cell_len <= width:
                return text
        return variants[-1]  # the state and the engine: its end cut where it must be
