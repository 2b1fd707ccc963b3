"""What every lesson screen shares: the header line, the too-small note, and a redraw that follows
the App's run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Container
from textual.events import Resize, ScreenResume
from textual.reactive import var
from textual.screen import Screen
from textual.widgets import Static

from kvtui.engines.protocol import RunSettings, RunStarted
from kvtui.format import format_count
from kvtui.run.live import LiveRun
from kvtui.widgets.chart import Chart
from kvtui.widgets.footer import KeysFooter
from kvtui.widgets.header import RunHeader
from kvtui.widgets.note import Note
from kvtui.widgets.too_small import TooSmall, too_small

HELD_AT_MOST_S = 0.3
"""Keys held down (auto-repeat) hold the run's redraws back at most this long (`hold_redraws`)."""


def compact_footer(width: int) -> bool:
    """Whether the footer is compact at `width`: every key fits 80 columns."""
    return width < 100


def size_classes(screen: Screen[Any], width: int, height: int) -> list[str]:
    """The breakpoint classes `screen` gets at `width` x `height`: the class of the largest
    breakpoint each dimension reaches, of the screen's breakpoints or else the app's (Textual's
    rule, `Screen._on_resize` in textual/screen.py)."""
    app = screen.app
    horizontal, vertical = screen.HORIZONTAL_BREAKPOINTS, screen.VERTICAL_BREAKPOINTS
    classes = []
    for dimension, breakpoints in (
        (width, (app.HORIZONTAL_BREAKPOINTS if horizontal is None else horizontal) or []),
        (height, (app.VERTICAL_BREAKPOINTS if vertical is None else vertical) or []),
    ):
        reached = [(at, name) for at, name in breakpoints if dimension >= at]
        if reached:
            classes.append(max(reached)[1])
    return classes


class LessonScreen(Screen):
    """A screen of the lesson: header, title, body (from `compose_body`), footer.

    Subclasses implement `compose_body` and `redraw`, and may follow the run in `follow_run`.
    The screen follows the App's `run` (bound with `data_bind`): each new snapshot is followed,
    then drawn, once, if this screen is the one shown (else when it is shown next), so the rate
    of redraws is the rate the run changes at (kvtui.run.live.RUN_UPDATES_PER_SECOND), and a
    paused app draws nothing. `redraw` only reads: it changes no state. A key that changes a
    line calls `hold_redraws`, so that its frame is not also the frame of a redraw.
    """

    TITLE_TEXT = ""

    run: var[LiveRun] = var(LiveRun(RunSettings()).snapshot(), init=False)
    """The App's run, read-only: what this screen draws."""

    def __init__(self, run: LiveRun, *, name: str | None = None) -> None:
        super().__init__(name=name)
        self.set_reactive(LessonScreen.run, run)
        # The classes the screen's size gives it, before its widgets are styled: given only
        # once it was shown, they restyled every widget of the app's first frame a second time.
        width, height = self.app.size
        self.add_class(*size_classes(self, width, height), update=False)
        self.set_class(too_small(width, height), "-too-small", update=False)
        self._dirty = True
        self._held = False
        self._redrawn_at = 0.0
        self.ready = False
        """True once composed and mounted: before that there are no widgets to update."""
        self._resumed = False
        """Whether the screen has been shown (resumed) since it was mounted."""

    def compose(self) -> ComposeResult:
        yield RunHeader()
        yield Static(self.TITLE_TEXT, classes="lesson-title")
        with Container(classes="lesson-body"):
            yield from self.compose_body()
        yield TooSmall()
        yield KeysFooter(show_command_palette=False, compact=compact_footer(self.app.size.width))

    def compose_body(self) -> ComposeResult:
        yield from ()

    def on_mount(self) -> None:
        self.ready = True
        self.follow_run(self.run)
        self._check_size(self.app.size.width, self.app.size.height)

    def watch_run(self, run: LiveRun) -> None:
        self.follow_run(run)
        self._dirty = True
        if not self._held or time.monotonic() - self._redrawn_at >= HELD_AT_MOST_S:
            self._redraw_if_changed()

    def follow_run(self, run: LiveRun) -> None:
        """Bring this screen's own state along with a new run (never drawing): a hook."""

    def _on_screen_resume(self, event: ScreenResume) -> None:
        """Textual restyles every widget of a screen each time it is resumed (its styles may
        have gone stale while it was hidden: textual/screen.py); the first resume follows the
        mount, where every widget was just styled, so it is not restyled then (a tenth of the
        app's first frame)."""
        if not self._resumed:
            self._resumed = True
            event.refresh_styles = False
        super()._on_screen_resume(event)

    def on_screen_resume(self) -> None:
        self.redraw_now()

    def on_resize(self, event: Resize) -> None:
        self._check_size(event.size.width, event.size.height)

    def _check_size(self, width: int, height: int) -> None:
        self.query_one(KeysFooter).compact = compact_footer(width)
        small = too_small(width, height)
        self.set_class(small, "-too-small")
        if small:
            self.query_one(TooSmall).show_size(width, height)
        else:  # what was held back while too small
            self._redraw_if_changed()

    def mark_dirty(self) -> None:
        """Redraw when next possible (now, if this screen is shown and not held back) even if
        the run has not changed."""
        self._dirty = True
        if not self._held:
            self._redraw_if_changed()

    def redraw_now(self) -> None:
        """Draw the run now (when this screen is shown), charts included."""
        self._dirty = True
        self._redraw_if_changed()
        for chart in self.query(Chart):
            chart.draw_now()

    def hold_redraws(self) -> None:
        """Keep the run's redraws out of the next frame: a key changed a line, and that frame
        should cost the line, not the cards, streams and plots of a redraw (tens of ms on a small
        CPU). Released once the frame is drawn (then what was held back is drawn); keys held
        down (auto-repeat) delay a redraw by at most HELD_AT_MOST_S, so the run keeps moving."""
        if self._held or not self.is_current:
            return
        self._held = True
        for chart in self.query(Chart):
            chart.hold()
        self.call_after_refresh(self._release_redraws)

    def _release_redraws(self) -> None:
        self._held = False
        for chart in self.query(Chart):
            chart.release()
        self._redraw_if_changed()

    def _redraw_if_changed(self) -> None:
        if not self.ready or not self.is_current or self.has_class("-too-small"):
            return
        if not self._dirty:
            return
        self._dirty = False
        self._redrawn_at = time.monotonic()
        # NVML's reading in full where it read a GPU; else plain words ("CPU, no GPU", "GPU,
        # NVML unavailable"), the reason in help (`?`), never a library's name in the header.
        nvml = (self.run.probe or {}).get("probe") == "nvml"
        engine = brief = self.run.settings.engine
        if self.run.replayed:  # where and when it was recorded, before the record's name
            engine = f"replayed: {self.run.recorded}"
            brief = engine.replace(": recorded on ", ": ")
        self.query_one(RunHeader).show(
            self.run.device_description if nvml else self.run.device_label,
            engine,
            self._model_words(),
            self.run.state,
            self._status_words(),
            device_label=self.run.device_label,
            engine_short=brief,
            status_short=self._status_words(brief=True),
            status_least=self.run.status_line(least=True),
        )
        self.redraw()

    def _model_words(self) -> str:
        started = self.run.started
        if started is None:
            return ""
        parts = [] if started.model in self.run.settings.engine else [started.model]
        if self.run.replayed:  # the engine's place says where and when: here, which record
            parts.insert(0, Path(self.run.settings.engine.removeprefix("replay:")).name)
        elif not self.run.can.modelled:  # sim:'s device is in its name
            parts.append(started.device)
        parts.append(started.dtype)
        if started.threads > 0:
            parts.append(format_count(started.threads, "thread"))
        return ", ".join(parts)

    def _status_words(self, brief: bool = False) -> str:
        words = self.run.status_line(brief)
        if self.run.state in ("failed", "done", "stopped"):
            words += " · r restarts"
        return words

    def redraw(self) -> None:
        """Push the run and this screen's settings into its widgets."""


MIN_LENGTH = 1
MAX_LENGTH = 4096


def length_step(length: int) -> int:
    """How far one press of left/right moves the answer length: finer when it is short."""
    if length < 64:
        return 1
    if length < 512:
        return 16
    return 128


def longest_run(started: RunStarted) -> int:
    """The most tokens a run of this model may generate: MAX_LENGTH, or fewer where its
    positions (prompt + answer) run out first."""
    if started.max_positions is None:
        return MAX_LENGTH
    return max(MIN_LENGTH, min(MAX_LENGTH, started.max_positions - started.prompt_tokens))


class WorkScreen(LessonScreen):
    """A lesson screen about the live run's decode work (screens 1 and 2).

    Every figure is the run's own, as the engine counted and timed it; `length` follows the
    App's chosen answer length (bound with `data_bind`), which the keys change and `r` runs."""

    BINDINGS = [
        Binding("right,plus,equals_sign", "app.longer", "Length", key_display="←→"),
        Binding("left,minus", "app.shorter", "Length -", show=False),
        Binding("shift+right,ctrl+right", "app.double", "x2", show=False),
        Binding("shift+left,ctrl+left", "app.halve", "/2", show=False),
        Binding("l", "app.lesson", "Lesson", show=False),
    ]

    length: var[int] = var(256, init=False)
    """The App's answer length (bound): a `var`, since the screen repaints only the line that
    shows it, not itself."""

    def watch_length(self, length: int) -> None:
        self.hold_redraws()
        self.show_run_note()

    def on_mount(self) -> None:
        super().on_mount()
        self.show_run_note()

    def pending(self) -> bool:
        """True when `r` would run another length than the live run's (never for a replay,
        which plays what was recorded)."""
        return self.length != self.run.run_tokens and not self.run.replayed

    def run_note(self) -> str:
        """Which run the figures are, and what `r` would run, in a line."""
        live = self.run
        words = []
        if live.replayed:
            prompt = format_count(live.prompt_tokens, "prompt token")
            words.append(f"a recording: {prompt} (r replays)")
        elif live.settings.lesson:
            words.append("lesson mode: a 1-token prompt (l: the full prompt)")
        elif live.started is not None:
            words.append(f"{format_count(live.prompt_tokens, 'prompt token')} (l: lesson mode)")
        if self.pending():
            words.append(f"r runs {self.length:,} tokens (this run: {live.run_tokens:,})")
        if (past := live.past_training()) is not None:
            words.append(f"from token {past:,} past the context the model was trained on")
        if live.server is not None:
            words.append("a vLLM server always keeps its KV cache: no uncached loop (screen 3)")
        return " · ".join(words)

    def show_run_note(self) -> None:
        """Put `run_note` in the `#run-note` line; `-beyond` marks a length `r` would change."""
        if not self.ready:
            return
        note = self.query_one("#run-note", Note)
        note.show(self.run_note())
        note.set_class(
            self.pending() or self.run.past_training() is not None or self.run.server is not None,
            "-beyond",
        )
