"""Driving kvtui headless, for tests: a scripted engine, and the app at a size, read back as text.

The design card names three users of kvtui; the third is a developer driving its screens in a
headless test. This module is their kit, and kvtui's own screen tests use it:

- `ScriptedEngine`: the app's `EngineHandle` contract (kvtui.run.process: start, events, pause,
  resume, stop, close, alive) in this process, no child process. Its events come from a list
  (synthetic steps), from a record `kvtui bench --record FILE` wrote
  (`ScriptedEngine.from_record`), or from a `sim:` or `replay:` engine run here as fast as it can
  (`ScriptedEngine.from_settings`).
- `headless(...)`: the app from `kvtui.app.make_app`, started with `App.run_test` at a terminal
  size, as a `HeadlessRun`: its `app` and `pilot`, the screen as plain text (`text()`), a stat
  card's figure by widget id (`figure("total")`), the run's state as the header shows it,
  `press(...)`, bounded waits (`wait_for`, `until_done`) and the notifications the app posted;
  in presenter mode (`headless(..., present=True)`), the slide a room sees (`slide()`: its
  figures, their rows of large type, whether the node's paced part of the run is all shown,
  `until_shown`).

    import pytest

    from kvtui.testing import RunSettings, headless

    @pytest.mark.asyncio  # pytest-asyncio's strict mode runs only marked tests
    async def test_the_lessons_total():
        async with headless(RunSettings("sim:llama-3.1-8b@h100", tokens=24, lesson=True)) as run:
            assert await run.until_done() == "done"
            assert run.figure("total") == "300"  # 24 tokens, a 1-token prompt: 24 * 25 / 2

Everything is read through public API: Textual's (`run_test`, `Pilot`, the app's workers, its
screenshot), the app's one factory (`make_app`) and the widgets on screen (a `StatCard`'s
`value`, the `RunHeader`'s state class), never the app's internal state, so a test written with it
reads what a person would see.

No torch, ever: the torch engines (`tiny`, `shape:`, `hf:`) run in a child process of their own in
the app, and a test that needs their figures replays a record of one (`kvtui bench --engine tiny
--record run.jsonl`, then `replay:run.jsonl`). Asking for one here is a ValueError that says so.
"""

from __future__ import annotations

import asyncio
import html
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from textual.color import Color
from textual.message import Message
from textual.notifications import Notify
from textual.pilot import Pilot

from kvtui.app import KVApp, make_app
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine, parse_engine, recorded_start
from kvtui.engines.protocol import Event, RunFailed, RunSettings, StepSource
from kvtui.reports.table import InProcessTable
from kvtui.run.process import EngineFactory, EngineHandle
from kvtui.screens.base import LessonScreen
from kvtui.screens.present import PresentScreen, ShownFigure, Slide
from kvtui.screens.tricks import TableFactory
from kvtui.widgets.cards import StatCard
from kvtui.widgets.header import RunHeader

__all__ = [
    "NO_GPU_PROBE",
    "RUN_STATES",
    "Card",
    "HeadlessRun",
    "Cells",
    "RunSettings",
    "ScriptedEngine",
    "ShownFigure",
    "Slide",
    "drive",
    "headless",
    "notifications_in",
    "refuse_torch",
    "screen_cells",
    "screen_text",
    "wait_for",
]

NO_GPU_PROBE: dict[str, Any] = {
    "probe": "null",
    "description": "CPU, no GPU: NVML library not found (libnvidia-ml.so.1)",
    "label": "CPU, no GPU",
    "name": None,
}
"""A fixed device probe (a CPU machine, no NVML) so that a headless run does not probe the real
device and its text is the same on every machine. Pass `probe=` for another (a GPU's summary, as
`kvtui.gpu.probe.probe_summary` returns it)."""

RUN_STATES = ("starting", "running", "paused", "done", "failed", "stopped")
"""The run states the header shows (each as its `-STATE` CSS class)."""

ENDED_STATES = ("done", "failed", "stopped")
"""The states `until_done` waits for: the run ended, one way or another."""


def refuse_torch(settings: RunSettings) -> None:
    """Raise ValueError if `settings.engine` is a torch engine (tiny, shape:, hf:) or not an
    engine name at all; `sim:` and `replay:` engines pass. kvtui.testing never imports torch: a
    test of a torch engine's figures replays a record of its run."""
    spec = parse_engine(settings.engine)  # an EngineError (a ValueError) for a bad name
    if spec.can.torch:  # the app runs it in its own process; here it is refused
        raise ValueError(
            f"kvtui.testing runs engines in the test's own process and never imports torch, so "
            f"it cannot run {settings.engine!r} (a torch engine). Record a run once with "
            f"`kvtui bench --engine {settings.engine} --record run.jsonl` and replay it: "
            "ScriptedEngine.from_record('run.jsonl'), or the engine 'replay:run.jsonl'. "
            "'sim:MODEL@GPU' runs here as it is."
        )


# --- the scripted engine -----------------------------------------------------------------------


class ScriptedEngine:
    """An engine handle (the contract of `kvtui.run.process.EngineHandle`) that hands the app a
    scripted run's events, in this process.

    `ScriptedEngine(events, settings=...)` plays a list (or any iterable) of events as they are;
    `from_record` plays a record written by `kvtui bench --record`; `from_settings` runs a `sim:`
    or `replay:` engine here, as fast as it can. Give the app one per run through its engine
    factory (`make_app(engine_factory=lambda s: ScriptedEngine.from_settings(s))`), or let
    `headless` do it.

    Hooks for tests: `hold_at=i` holds the stream before event `i` until the engine is closed (a
    run stalled mid-step); `fail_start=exc` makes `start()` raise it (an engine that cannot
    start); `pause()` holds the stream until `resume()`, `stop()` and `close()` end it. `sent`
    is every event handed out so far, `ended` whether the script ran to its end, `paused_calls`
    how often the app paused it.
    """

    def __init__(
        self,
        events: Iterable[Event],
        *,
        settings: RunSettings | None = None,
        hold_at: int | None = None,
        fail_start: BaseException | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings or RunSettings()
        """The settings of the run the events are of (what the app asked for, or what a record
        says ran)."""
        self._events = events
        self._hold_at = hold_at
        self._fail_start = fail_start
        self._on_close = on_close
        self._close_lock = threading.Lock()
        self._streaming = False
        self._closed = threading.Event()
        self._resumed = threading.Event()
        self._resumed.set()
        self.started = False
        """Whether `start()` has been called (and did not raise)."""
        self.ended = False
        """Whether the events ran out: the whole script was handed to the app."""
        self.paused_calls = 0
        """How many times `pause()` was called."""
        self.sent: list[Event] = []
        """The events handed to the app so far."""

    # -- constructors --

    @classmethod
    def from_settings(cls, settings: RunSettings, **hooks: Any) -> ScriptedEngine:
        """The engine `settings.engine` names, run in this process: `sim:MODEL@GPU` (modelled
        steps) or `replay:FILE` (a recorded run), through `kvtui.engines.drive.run_events` as
        the engine's own process would, but with `replay_speed` 0 (as fast as it can, not at the
        recorded or modelled pace). ValueError for a torch engine (see `refuse_torch`);
        `kvtui.engines.protocol.EngineError` (a ValueError) for settings the engine refuses.
        `hooks` are the constructor's (`hold_at`, `fail_start`)."""
        refuse_torch(settings)
        fast = replace(settings, replay_speed=0)
        source = open_engine(fast)
        ran = getattr(source, "settings", fast)  # a replay runs what was recorded
        return cls._running(source, ran, **hooks)

    @classmethod
    def from_record(
        cls, path: str | Path, settings: RunSettings | None = None, **hooks: Any
    ) -> ScriptedEngine:
        """A run `kvtui bench --record FILE` recorded (on a GPU box, say), replayed as fast as it
        can, as the `replay:FILE` engine plays it in the app. The record is read and checked now:
        `EngineError` (a ValueError) with one line if it is not one. What ran is what was
        recorded; `settings` give only the engine's name in the app (default `replay:PATH`)."""
        from kvtui.engines.replay import ReplayEngine

        path = Path(path)
        asked = replace(settings or RunSettings(), engine=f"replay:{path}", replay_speed=0)
        source = ReplayEngine.open(path, asked, upgrade=recorded_start)
        return cls._running(source, source.settings, **hooks)

    @classmethod
    def _running(cls, source: StepSource, settings: RunSettings, **hooks: Any) -> ScriptedEngine:
        return cls(run_events(source, settings), settings=settings, on_close=source.close, **hooks)

    # -- the EngineHandle contract --

    def start(self) -> None:
        if self._fail_start is not None:
            raise self._fail_start
        self.started = True

    def events(self) -> Iterator[Event]:
        """The script's events, one at a time, held while paused (and at `hold_at`), until it
        runs out or the engine is stopped or closed."""
        self._streaming = True
        stream = iter(self._events)
        try:
            for i, event in enumerate(stream):
                if self._hold_at is not None and i >= self._hold_at:
                    self._closed.wait()
                self._resumed.wait()
                if self._closed.is_set():
                    return
                self.sent.append(event)
                yield event
            self.ended = True
        finally:
            close = getattr(stream, "close", None)
            if close is not None:  # a generator (run_events): let it close its engine's loops
                close()
            self._close_source()  # here, on the thread that ran it, not the one closing us

    def pause(self) -> None:
        self.paused_calls += 1
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()

    def stop(self) -> None:
        self._closed.set()
        self._resumed.set()

    def close(self, timeout: float = 1.0) -> None:
        self._closed.set()
        self._resumed.set()
        if not self._streaming:  # else the stream closes its engine as it ends
            self._close_source()

    def _close_source(self) -> None:
        with self._close_lock:
            on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    @property
    def alive(self) -> bool:
        """Started, and neither closed nor run out (as a child process that has not exited)."""
        return self.started and not self._closed.is_set() and not self.ended


def _in_process(settings: RunSettings) -> EngineHandle:
    """`headless`'s default engine factory: `ScriptedEngine.from_settings`; an engine it cannot
    run here (a torch engine chosen from the command palette, a bad record) fails the run as
    the real engine would, with a `RunFailed` that says why, instead of raising into the app."""
    try:
        return ScriptedEngine.from_settings(settings)
    except ValueError as exc:
        return ScriptedEngine([RunFailed(str(exc))], settings=settings)


# --- reading the app ---------------------------------------------------------------------------

_SVG_TEXT = re.compile(
    r'<text class="[^"]*" x="([\d.]+)" y="[\d.]+" textLength="[\d.]+" '
    r'clip-path="url\(#[\w-]*line-(\d+)\)">([^<]*)</text>'
)
_CELL_WIDTH = 12.2
"""Width of one terminal cell in Textual's SVG screenshots."""


def screen_text(app: KVApp) -> str:
    """What the terminal shows right now, as plain text: one line per row, trailing spaces cut.

    Read from the app's own screenshot (`App.export_screenshot`, the same cells a terminal
    receives), so a line that is clipped by its container or pushed off the screen is missing
    here too."""
    width, height = app.size
    rows = [[" "] * width for _ in range(height)]
    for x, line, text in _SVG_TEXT.findall(app.export_screenshot()):
        if int(line) >= height:
            continue
        row, column = rows[int(line)], round(float(x) / _CELL_WIDTH)
        for offset, char in enumerate(html.unescape(text).replace("\xa0", " ")):
            if 0 <= column + offset < width:
                row[column + offset] = char
    return "\n".join("".join(row).rstrip() for row in rows)


_SVG_CLASS = re.compile(r"\.[\w-]+-(r\d+) \{ fill: (#[0-9a-f]{6})")
_SVG_RUN = re.compile(
    r'<text class="[\w-]+-(r\d+)" x="([\d.]+)" y="[\d.]+" textLength="[\d.]+" '
    r'clip-path="url\(#[\w-]*line-(\d+)\)">([^<]*)</text>'
)
_SVG_BACKGROUND = re.compile(
    r'<rect fill="(#[0-9a-f]{6})" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" '
    r'height="[\d.]+" shape-rendering="crispEdges"/>'
)
_LINE_HEIGHT = 24.4
"""Height of one terminal row in Textual's SVG screenshots."""


@dataclass(frozen=True)
class Cells:
    """A run of cells as the terminal draws them: where, what, and in which colours."""

    row: int
    column: int
    text: str
    foreground: Color
    background: Color


def screen_cells(app: KVApp) -> list[Cells]:
    """What the terminal shows right now, as runs of cells with the colours they are drawn in
    (foreground after dimming, and the background under each cell), read from the app's own
    screenshot (`App.export_screenshot`): what a room sees, not what a stylesheet meant. A run
    whose background changes part-way is split where it does; runs of spaces are not listed."""
    svg = app.export_screenshot()
    fills = dict(_SVG_CLASS.findall(svg))
    width, height = app.size
    backgrounds: list[list[str]] = [["#000000"] * width for _ in range(height)]
    for fill, x, y, w in _SVG_BACKGROUND.findall(svg):
        row = round((float(y) - 1.5) / _LINE_HEIGHT)
        start = round(float(x) / _CELL_WIDTH)
        if 0 <= row < height:
            for column in range(start, min(width, start + round(float(w) / _CELL_WIDTH))):
                backgrounds[row][column] = fill
    cells: list[Cells] = []
    for style, x, line, raw in _SVG_RUN.findall(svg):
        row, start = int(line), round(float(x) / _CELL_WIDTH)
        text = html.unescape(raw).replace("\xa0", " ")
        if row >= height or style not in fills:
            continue
        foreground = Color.parse(fills[style])
        column = start
        under = [backgrounds[row][min(width - 1, start + i)] for i in range(len(text))]
        for same, chunk in _split_by(text, under):
            if chunk.strip():
                cells.append(Cells(row, column, chunk, foreground, Color.parse(same)))
            column += len(chunk)
    return cells


def _split_by(text: str, keys: Sequence[str]) -> Iterator[tuple[str, str]]:
    """`text` in pieces over which its characters' `keys` stay the same: (key, piece)."""
    start = 0
    for i in range(1, len(text) + 1):
        if i == len(text) or keys[i] != keys[start]:
            yield keys[start], text[start:i]
            start = i


def notifications_in(messages: Iterable[Message]) -> list[str]:
    """The text of every notification among messages (those a `run_test(message_hook=...)`
    saw), oldest first."""
    return [m.notification.message for m in messages if isinstance(m, Notify)]


async def wait_for(
    pilot: Pilot[Any], condition: Callable[[], object], timeout: float = 30.0
) -> None:
    """Let the app run until `condition()` holds; AssertionError after `timeout` seconds (a bound
    for a loaded machine, not a goal: it returns as soon as the condition holds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {condition}")
        await pilot.pause(0.01)


@dataclass(frozen=True)
class Card:
    """A stat card as shown: its label (in the border), its figure and its note (under it)."""

    label: str
    value: str
    note: str
    bad: bool
    """Shown as a warning (the `-bad` class: the error colour)."""


@dataclass
class HeadlessRun:
    """The app running headless, and what a test reads of it (see `headless` and `drive`)."""

    app: KVApp
    pilot: Pilot[int]
    messages: list[Message] = field(default_factory=list)
    """Every message the app handled, in order (`run_test(message_hook=...)`)."""
    engines: list[EngineHandle] = field(default_factory=list)
    """Every engine the app started, oldest first (filled by `headless`'s engine factory; empty
    for an app `drive` was given)."""

    @property
    def engine(self) -> EngineHandle | None:
        """The engine of the latest run, if `headless` made it."""
        return self.engines[-1] if self.engines else None

    @property
    def notifications(self) -> list[str]:
        """The text of every notification the app posted so far, oldest first."""
        return notifications_in(self.messages)

    def text(self) -> str:
        """The screen as plain text, as the terminal shows it now (`screen_text`)."""
        return screen_text(self.app)

    def card(self, widget_id: str) -> Card:
        """The stat card `#widget_id` on the screen shown (`total`, `wasted` on screen 1; `with`,
        `speedup` on screen 2; `kv`, `max-context` on screen 3...); LookupError naming the cards
        there if it has none of that id."""
        cards = {c.id: c for c in self.app.screen.query(StatCard) if c.id}
        if widget_id not in cards:
            shown = ", ".join(sorted(cards)) or "none"
            raise LookupError(f"no stat card #{widget_id} on this screen (its cards: {shown})")
        c = cards[widget_id]
        return Card(
            str(c.border_title or ""), c.value, str(c.border_subtitle or ""), c.has_class("-bad")
        )

    def figure(self, widget_id: str) -> str:
        """The figure the stat card `#widget_id` shows, as text ("300", "12.5x", "…")."""
        return self.card(widget_id).value

    def figures(self) -> dict[str, str]:
        """Every stat card's figure on the screen shown, by widget id."""
        return {c.id: c.value for c in self.app.screen.query(StatCard) if c.id}

    @property
    def state(self) -> str | None:
        """The run's state as the shown screen's header says it (one of RUN_STATES), or None
        where the screen shown has no header (help, the quiz)."""
        for header in self.app.screen.query(RunHeader):
            for state in RUN_STATES:
                if header.has_class(f"-{state}"):
                    return state
        return None

    def slide(self) -> Slide:
        """Presenter mode as a room sees it: the node, its title, each figure revealed (label,
        figure with its unit, caption, rows of large type) and whether the node has shown all
        of its part of the run; LookupError where presenter mode is not the screen shown."""
        screen = self.app.screen
        if not isinstance(screen, PresentScreen):
            raise LookupError(f"presenter mode is not shown ({type(screen).__name__} is)")
        return screen.slide()

    async def until_shown(self, timeout: float = 30.0) -> Slide:
        """Wait until presenter mode's node has shown all of its part of the run (its pace ran
        out and its run ended), then return the slide, drawn."""
        await self.wait_for(lambda: self.slide().done, timeout)
        await self.settle()
        return self.slide()

    async def press(self, *keys: str) -> None:
        """Press keys as a user would (`Pilot.press`: "r", "space", "shift+right"...)."""
        await self.pilot.press(*keys)

    async def wait_for(self, condition: Callable[[], object], timeout: float = 30.0) -> None:
        """Let the app run until `condition()` holds; AssertionError after `timeout` seconds."""
        await wait_for(self.pilot, condition, timeout)

    async def settle(self) -> None:
        """Let the app handle what is pending, then draw the shown screen from the run now
        rather than at its next redraw tick."""
        await self.pilot.pause()
        if isinstance(self.app.screen, LessonScreen):
            self.app.screen.redraw_now()
        await self.pilot.pause()

    async def until_done(self, timeout: float = 30.0) -> str:
        """Wait until the run has ended (both loops finished, or it failed or was stopped) and the
        screen shows it; return the state its header shows ("done", "failed" or "stopped").
        AssertionError after `timeout` seconds: an engine held by `hold_at` never ends, and below
        80x24 a screen shows only its too-small note, header and figures not drawn."""
        deadline = time.monotonic() + timeout
        workers = list(self.app.workers)  # the engine's reader ends when its stream does
        try:
            waits = asyncio.gather(*(w.wait() for w in workers), return_exceptions=True)
            await asyncio.wait_for(waits, timeout)
        except TimeoutError:
            raise AssertionError(
                f"timed out after {timeout} s waiting for the run to end "
                f"(the screen shows it {self.state or 'without a header'})"
            ) from None
        await self.settle()
        await self.wait_for(
            lambda: self.state in ENDED_STATES, max(0.1, deadline - time.monotonic())
        )
        state = self.state
        assert state is not None
        return state


@asynccontextmanager
async def drive(
    app: KVApp,
    size: tuple[int, int] = (80, 24),
    *,
    engines: list[EngineHandle] | None = None,
) -> AsyncIterator[HeadlessRun]:
    """Run an app you built (with `kvtui.app.make_app`) headless at `size` (columns, rows),
    animations off, every message it handles collected. `engines` is the list its engine
    factory fills, if you keep one. The app is shut down (its engine closed) on leaving."""
    run_messages: list[Message] = []
    app.animation_level = "none"  # notifications and scrolls appear at once: deterministic
    async with app.run_test(size=size, message_hook=run_messages.append) as pilot:
        run = HeadlessRun(app, pilot, run_messages, engines if engines is not None else [])
        await pilot.pause()
        yield run


@asynccontextmanager
async def headless(
    settings: RunSettings | str = "sim:llama-3.1-8b@h100",
    screen: int = 1,
    *,
    size: tuple[int, int] = (80, 24),
    engine: EngineFactory | Sequence[Event] | None = None,
    probe: dict[str, Any] | None = None,
    autostart: bool = True,
    table: TableFactory | None = None,
    present: bool = False,
    theme: str = "dark",
) -> AsyncIterator[HeadlessRun]:
    """kvtui headless at `size`, on `screen` (1 to 4), running `settings` (or an engine name),
    in presenter mode if `present` (`slide()` reads it; space moves on), in `theme`:

        async with headless(RunSettings(engine="sim:llama-3.1-8b@h100", tokens=24), 2) as run:
            await run.until_done()
            run.figure("with")

    `engine` says where each run's events come from: None (the default) runs the engine the
    settings name in this process (`ScriptedEngine.from_settings`: `sim:` or `replay:`; a torch
    engine is a ValueError now, and one chosen later in the app fails that run, as an engine that
    cannot start does); a list of events plays them for every run (`ScriptedEngine`); or an
    engine factory, `RunSettings -> EngineHandle`, is called for every run (screen 4's race too).
    `probe` is the device the app is told it runs on (default NO_GPU_PROBE: the same text on
    every machine). `table` measures screen 4's table (default: `InProcessTable`, in this
    process: `sim:` engines; a torch engine's table says it runs elsewhere)."""
    if isinstance(settings, str):
        settings = RunSettings(engine=settings)
    if engine is None:
        refuse_torch(settings)
        factory: EngineFactory = _in_process
    elif callable(engine):
        factory = engine
    else:
        script = list(engine)

        def factory(s: RunSettings) -> EngineHandle:
            return ScriptedEngine(script, settings=s)

    engines: list[EngineHandle] = []

    def started(s: RunSettings) -> EngineHandle:
        made = factory(s)
        engines.append(made)
        return made

    app = make_app(
        settings,
        screen,
        probe=dict(probe if probe is not None else NO_GPU_PROBE),
        engine_factory=started,
        autostart=autostart,
        table_factory=table or InProcessTable,
        present=present,
        theme=theme,
    )
    async with drive(app, size, engines=engines) as run:
        yield run
