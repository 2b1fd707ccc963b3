"""The kvtui App: the lesson's screens as modes, app-wide keys, and the run they show.

The engine runs in a process of its own (kvtui.run.process), so the UI never imports torch and a
busy UI cannot slow the steps it measures. The App owns every engine process through `engines`
(its run's, and screen 4's race's, which that screen is handed). A thread worker reads the run's
engine with the one reader (kvtui.run.process), which hands it the events in batches, at most
RUN_UPDATES_PER_SECOND a second; the App folds them into its `LiveRun` and, once for a burst
(`RunChanged` coalesces), sets `live_run` to a read-only snapshot that the screens follow with
`data_bind`: they redraw when it changes, and nothing a screen draws is written by it.

State that two screens share has one owner, the App: the run, the next run's length, batch and KV
budget (with the cap the running model sets, `longest_run`), whether the cache is on and the GPU
the probe matched are App vars the screens follow; their keys call the App's actions, or (screen
3's) set them through the interface that screen is given. Anything an engine or a file says is
shown as text, never as markup.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.binding import Binding
from textual.driver import Driver
from textual.message import Message
from textual.reactive import var
from textual.screen import Screen
from textual.worker import Worker, WorkerState, get_current_worker

from kvtui import collector
from kvtui.commands import PaletteApp
from kvtui.engines.factory import fit_tokens
from kvtui.engines.protocol import Event, RunFailed, RunFinished, RunSettings, RunStarted
from kvtui.format import safe_text
from kvtui.options import THEMES, UsageError
from kvtui.run.live import LiveRun
from kvtui.run.process import EngineFactory, EngineHandle
from kvtui.screens.base import MAX_LENGTH, MIN_LENGTH, length_step, longest_run
from kvtui.screens.recompute import RecomputeScreen
from kvtui.sim.catalog import GPUSpec, gpu_from_probe
from kvtui.terminal import DriverError, checked_driver, ended_by_signals

if TYPE_CHECKING:
    from kvtui.screens.tricks import TableFactory

MODES = ("recompute", "cache", "memory", "tricks")
"""The lesson's screens, in order: keys 1, 2, 3 and 4."""


@dataclass(frozen=True)
class AppConfig:
    """Plain values the CLI (or a test) hands the app."""

    settings: RunSettings = field(default_factory=RunSettings)
    screen: int = 1
    """The screen to open on: 1, 2 or 3."""
    probe: dict[str, Any] | None = None
    """A device probe summary to show; None probes the device at startup, off the UI thread."""
    autostart: bool = True
    """Start the engine as soon as the app is up."""
    present: bool = False
    """Open in presenter mode (kvtui.screens.present; `p` toggles it)."""
    theme: str = "dark"
    """The colours to open with, a key of kvtui.options.THEMES."""
    kv_events: str | None = None
    """--kv-events: where screen 2 listens for a served run's KV cache events (checked)."""
    table_factory: TableFactory | None = None
    """Screen 4's table's maker; None: kvtui.reports.table's child (imported with screen 4)."""


class KVApp(PaletteApp):
    """kvtui: see, and measure, why LLM decoding needs a KV cache."""

    TITLE = "kvtui"
    CSS_PATH = "kvtui.tcss"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-medium"), (140, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall"), (42, "-taller")]
    """Size classes on every screen, for the stylesheet: 80x24 is -narrow -short."""

    # `var`, not `reactive`: the App draws none of these, and a reactive would repaint the whole
    # screen on every change (a key press), where the widgets that show them refresh themselves.
    live_run: var[LiveRun] = var(LiveRun(RunSettings()).snapshot(), init=False)
    """The run as the screens see it (`run`): a read-only snapshot of `live`, new on each change."""
    longest_run: var[int] = var(MAX_LENGTH, init=False)
    """The most tokens `r` may ask for: MAX_LENGTH, or fewer where the running model's positions
    (prompt + answer) run out first; `length` is kept within it."""
    length: var[int] = var(256, init=False)
    """The answer length: `r` runs this many tokens (screens 1 and 2 show the run's own)."""
    cache_on: var[bool] = var(True, init=False)
    """Whether screen 2 shows the cached loop beside the uncached one."""
    device_gpu: var[GPUSpec | None] = var(None, init=False)
    """The GPU this machine's device is: its catalog entry (matched by name and memory), or its
    own name and memory where the catalog has none; None without a GPU NVML can read."""
    batch: var[int] = var(1, init=False)
    """Sequences `r` decodes together (`--batch`, then screen 3's n)."""
    kv_budget: var[int | None] = var(None, init=False)
    """The KV pool `r` asks for (`--kv-budget`, then screen 3's keys); None: the engine's."""

    BINDINGS = [
        Binding("1", "screen(1)", "Screens", key_display="1-4"),
        Binding("2", "screen(2)", "Cache", show=False),
        Binding("3", "screen(3)", "Memory", show=False),
        Binding("4", "screen(4)", "Tricks", show=False),
        Binding("space", "pause", "Pause"),
        Binding("r", "restart", "Run"),
        Binding("l", "lesson", "Lesson", show=False),
        Binding("t", "quiz", "Quiz"),
        Binding("p", "present", "Present", show=False),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit", priority=True),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),  # as htop and nvitop
    ]

    @dataclass
    class EngineReported(Message, bubble=False):
        """A batch of the run's engine's events arrived from its reader."""

        run_id: int
        events: list[Event]

    @dataclass
    class EngineClosed(Message, bubble=False):
        """A run's reader has closed its engine (the process has ended) and ended itself."""

        run_id: int
        ended: bool
        """Whether the engine's event stream had ended (the child exited), not been stopped."""

    @dataclass
    class DeviceProbed(Message, bubble=False):
        """The device probe answered."""

        summary: dict[str, Any]

    class RunChanged(Message, bubble=False):
        """The live run changed; a burst of these is handled once, as the latest."""

        def can_replace(self, message: Message) -> bool:
            return isinstance(message, KVApp.RunChanged)

    def __init__(self, config: AppConfig, engine_factory: EngineFactory | None = None) -> None:
        """`engine_factory` makes each engine, the run's and screen 4's race's (default: a child
        process each, with a spare started between runs); the App's `engines` owns them all."""
        # Screen 1, the usual first, is composed in no mode (`get_default_screen`); 2-4 switch to
        self.DEFAULT_MODE = MODES[0] if config.screen <= 1 else KVApp.DEFAULT_MODE
        super().__init__()
        self.config = config
        from kvtui.run.process import Engines  # subprocess and friends: not before now

        self.engines = Engines(engine_factory)
        """The one owner of the engines: it makes each, and ends those still open on quitting."""
        self.live = LiveRun(config.settings)
        """The run as it folds: only the App writes it, and the screens read `run`, its copy."""
        self.engine: EngineHandle | None = None
        self._run_id = 0
        self._engine_run = 0
        """The run `engine` is of (0: none)."""
        self._readers: set[int] = set()
        """Runs whose reader has not yet closed its engine: `engine`'s, and one ending at most."""
        self._stop_reading = threading.Event()
        """Set to end `engine`'s reader, which then closes the engine."""
        self._start_waiting = False
        """A run waits to start until the engine ending now has ended."""
        self.set_reactive(KVApp.live_run, self.live.snapshot())
        self.set_reactive(KVApp.length, self.validate_length(config.settings.tokens))
        self.set_reactive(KVApp.kv_budget, config.settings.kv_budget_bytes)
        self.set_reactive(KVApp.batch, config.settings.batch)
        self._presented_from = MODES[0]
        """The screen presenter mode was entered from, and leaves to."""
        if config.autostart:  # the engine gets ready while the app draws its first frame
            self.engines.prepare(self.live.settings)

    # --- the terminal (kvtui.terminal guards what Textual does not survive) -------------------

    def get_driver_class(self) -> type[Driver]:
        return checked_driver(super().get_driver_class)

    # --- startup and screens -----------------------------------------------------------------

    def get_default_screen(self) -> Screen[Any]:
        """The screen the app opens on, composed first and in no mode, so without a restyle."""
        mode = self.DEFAULT_MODE  # else Textual's own, which on_mount leaves for --screen's
        return self._build_screen(mode) if mode in MODES else super().get_default_screen()

    def _build_screen(self, mode: str) -> Screen[Any]:
        """`mode`'s screen, as Textual first enters it (on the App's pump: data_bind); the other
        screens' modules are imported with the first of them shown."""
        run, live = self.live_run, KVApp.live_run
        if mode == "recompute":
            return RecomputeScreen(run).data_bind(KVApp.length, run=live)
        from kvtui.reports.table import TableProcess
        from kvtui.screens import cache, memory, present, tricks

        if mode == "cache":
            made = cache.CacheScreen(run, kv_events=self.config.kv_events)
            return made.data_bind(KVApp.length, KVApp.cache_on, run=live)
        if mode == "memory":
            return memory.MemoryScreen(run, next_run=self).data_bind(
                KVApp.device_gpu, KVApp.kv_budget, KVApp.length, batch_next=KVApp.batch, run=live
            )
        if mode == "tricks":
            tables = self.config.table_factory or TableProcess
            made = tricks.TricksScreen(run, engines=self.engines, table_factory=tables)
            return made.data_bind(run=live)
        return present.PresentScreen(run).data_bind(run=live)

    def on_mount(self) -> None:
        self.theme = THEMES[self.config.theme]
        for mode in (*MODES, "present"):  # only now: entering one restyles (the first's unused)
            if mode == "cache" and self.config.kv_events:  # its feed listens from the start
                self.install_screen(self._build_screen(mode), mode)
                self.add_mode(mode, mode)
            else:
                self.add_mode(mode, lambda mode=mode: self._build_screen(mode))
        if self.config.probe is not None:
            self._probed(self.config.probe)
        self.switch_mode(MODES[max(1, min(len(MODES), self.config.screen)) - 1])
        if self.config.present:
            self.action_present()
        if self.config.autostart:
            self.start_run()

    def on_ready(self) -> None:
        """A first frame is drawn (perhaps of the screen the shown one replaces): after the shown
        one's, the launch's hold on the collector ends (kvtui.collector); the device is probed."""
        self.call_after_refresh(collector.release, freeze=True)
        if self.config.probe is None:
            self.call_after_refresh(self._probe_device)

    def action_screen(self, number: int) -> None:
        self.switch_mode(MODES[number - 1])

    def action_present(self) -> None:
        """Presenter mode on (from the screen shown) or off (back to that screen)."""
        if self.current_mode == "present":
            self.switch_mode(self._presented_from)
        else:
            self._presented_from = self.current_mode if self.current_mode in MODES else MODES[0]
            self.switch_mode("present")

    def action_quiz(self) -> None:
        from kvtui.screens.quiz import QuizScreen

        self.push_screen(QuizScreen())

    def action_help(self) -> None:
        from kvtui.screens.help import HelpScreen

        self.push_screen(HelpScreen(self.live.device_description))

    # --- the answer length and the cache toggle (screens 1 and 2 follow them) -----------------

    def validate_length(self, length: int) -> int:
        return max(MIN_LENGTH, min(self.longest_run, int(length)))

    def watch_longest_run(self, longest: int) -> None:
        self.length = min(self.length, longest)

    def _run_changed(self) -> None:
        """Tell the screens, soon and once for a burst: the handler snapshots the run."""
        self.post_message(self.RunChanged())

    @on(RunChanged)
    def _snapshot_run(self) -> None:
        self.live_run = self.live.snapshot()

    def action_longer(self) -> None:
        self.length += length_step(self.length)

    def action_shorter(self) -> None:
        self.length -= length_step(self.length - 1)

    def action_double(self) -> None:
        self.length *= 2

    def action_halve(self) -> None:
        self.length //= 2

    def action_cache_on(self) -> None:
        """`c` on screen 1: turn the cache on, which is screen 2."""
        self.cache_on = True
        self.switch_mode("cache")

    def action_toggle_cache(self) -> None:
        self.cache_on = not self.cache_on

    # --- the device probe --------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="probe", exit_on_error=False)
    def _probe_device(self) -> None:
        from kvtui.gpu.probe import probe_summary

        self.post_message(self.DeviceProbed(probe_summary()))

    @on(DeviceProbed)
    def _device_probed(self, message: DeviceProbed) -> None:
        self._probed(message.summary)

    def _probed(self, summary: dict[str, Any]) -> None:
        self.live.set_probe(summary)
        self._run_changed()
        self.device_gpu = gpu_from_probe(summary)

    # --- the engine --------------------------------------------------------------------------

    def start_run(self, settings: RunSettings | None = None) -> None:
        """(Re)start the engine with these settings (the current ones by default).

        The screens show the new run at once; its engine starts when no other engine is still
        ending, so that a burst of restarts (`r` held down) runs the last one asked for, with at
        most one engine running and one ending at any moment (each is a process with a model in
        memory)."""
        self._run_id += 1
        self.live.reset(settings or self.live.settings)
        self.longest_run = MAX_LENGTH  # until the new run's model says
        self._run_changed()
        if self._readers - {self._engine_run}:  # one is still ending: start when it has ended
            self._start_waiting = True
            return
        self._launch()

    def _launch(self) -> None:
        """Retire the running engine, if any (its reader closes it), and start the latest run's."""
        if self.engine is not None:
            self.engine.stop()
        self._stop_reading.set()
        self.engine = self.engines(self.live.settings)
        self._engine_run = self._run_id
        self._readers.add(self._run_id)
        self._stop_reading = threading.Event()
        self._read_engine(self.engine, self._run_id, self._stop_reading)

    @on(EngineClosed)
    def _engine_closed(self, message: EngineClosed) -> None:
        running = self.live.state in ("running", "paused", "starting")
        if message.ended and message.run_id == self._run_id and running:
            self.live.apply(RunFailed("the engine exited before finishing"))
            self._run_changed()
            self._say_stopped("The engine exited before finishing. Press r to restart.")
        self._readers.discard(message.run_id)
        if self._start_waiting and not self._readers - {self._engine_run}:
            self._start_waiting = False
            self._launch()

    def restart_with(self, engine: str) -> None:
        self.start_run(replace(self.live.settings, engine=engine))
        self.notify(f"Restarted with engine {safe_text(engine)}", timeout=3, markup=False)

    def action_restart(self) -> None:
        """Run again: the chosen length (capped to what the model holds), batch and KV budget."""
        chosen = replace(
            self.live.settings, tokens=self.length, kv_budget_bytes=self.kv_budget, batch=self.batch
        )
        if said := self._start_fitted(chosen):
            self.notify(said, timeout=6)

    def _start_fitted(self, settings: RunSettings) -> str:
        """Start a run of these settings, its tokens capped to the model's positions (so that
        `r` and `l` always run something); the line saying it capped them, or ""."""
        settings, said = fit_tokens(settings)
        self.length = settings.tokens
        self.start_run(settings)
        return safe_text(said)

    def action_lesson(self) -> None:
        """Lesson mode on (a one-token prompt, 24 tokens: the lesson's figures, measured) or off
        (the full prompt again, at the same length); the run restarts either way."""
        if self.live.can.replay:
            self.notify(
                "A replay plays the run as it was recorded: l is for live engines", timeout=4
            )
            return
        lesson = not self.live.settings.lesson
        if lesson:
            self.length = 24
        said = self._start_fitted(replace(self.live.settings, lesson=lesson, tokens=self.length))
        self.notify(
            "Lesson mode: a one-token prompt, so the counts are the lesson's"
            if lesson
            else "Lesson mode off: the full prompt" + (f"; {said}" if said else ""),
            timeout=6 if said else 4,
        )

    def action_pause(self) -> None:
        if self.engine is None:
            return
        if self.live.state == "running":
            self.engine.pause()
            self.live.set_state("paused")
        elif self.live.state == "paused":
            self.engine.resume()
            self.live.set_state("running")
        self._run_changed()

    def close_engine(self, timeout: float = 1.0) -> None:
        """End the engines' processes now (quitting): cancel the run's reader, then close every
        engine still open (screen 4's race's too) and the spare."""
        self.engine = None
        self._stop_reading.set()
        self._start_waiting = False
        self.workers.cancel_group(self, "decode")
        self.engines.close(timeout=timeout)

    async def action_quit(self) -> None:
        self.close_engine()
        self.exit(0)

    def on_unmount(self) -> None:
        self.close_engine()

    # Not exclusive: a replaced run's reader is told to end (`stop`) rather than cancelled, so
    # that it always closes its engine and says so (a worker cancelled before it ran would not).
    @work(thread=True, group="decode", exit_on_error=False)
    def _read_engine(self, engine: EngineHandle, run_id: int, stop: threading.Event) -> None:
        """Read the run's engine with the one reader (it starts it, hands on its events in
        batches until it ends or `stop` is set or we are cancelled, then closes it), posting each
        batch; then say it is closed, and whether its stream had ended (`EngineClosed`)."""
        worker = get_current_worker()

        def report(events: list[Event]) -> None:
            self.post_message(self.EngineReported(run_id, events))

        ended = False
        try:
            ended = self.engines.read(engine, report, lambda: stop.is_set() or worker.is_cancelled)
        finally:
            self.post_message(self.EngineClosed(run_id, ended))

    @on(EngineReported)
    def _engine_reported(self, message: EngineReported) -> None:
        if message.run_id != self._run_id:
            return
        self._run_changed()
        for event in message.events:
            told = self.live.failure
            self.live.apply(event)
            if isinstance(event, RunStarted):
                self.longest_run = longest_run(event)
            # A loop that stopped by design (its KV pool full) is said by the header and screen
            # 3's pool, not by a notification over the panel that shows it.
            error = isinstance(event, RunFinished) and event.reason == "error"
            if error and event.message and event.message != told:
                fix = f" r runs {self.length:,} tokens (at most {self.longest_run:,} fit)."
                said = f"The {event.loop} loop stopped: {safe_text(event.message)}."
                self._say_stopped(said + fix)
            if isinstance(event, RunFailed):
                said = f"The engine stopped: {safe_text(event.message)}. Press r to restart."
                self._say_stopped(said, "Engine failed")
        if self.live.state in ("done", "failed"):  # between runs: get the next one's ready
            self.engines.prepare(self.live.settings)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state != WorkerState.ERROR:
            return
        if event.worker.group == "probe":
            self.live.set_probe({"description": "device unknown (the probe failed)"})
            self._run_changed()
        if event.worker.group != "decode":
            return
        error = event.worker.error
        words = f"{type(error).__name__}: {error}" if error else "unknown error"
        self.live.apply(RunFailed(words))
        self._run_changed()
        self._say_stopped(
            f"The engine could not run: {safe_text(words)}. Press r to retry.", "Engine failed"
        )

    def _say_stopped(self, words: str, title: str = "Engine stopped") -> None:
        """Notify that the run's engine stopped or failed (`words` as text, never markup)."""
        self.notify(words, title=title, markup=False, severity="error", timeout=8)


def make_app(
    settings: RunSettings | None = None,
    screen: int = 1,
    *,
    engine_factory: EngineFactory | None = None,
    **options: Any,
) -> KVApp:
    """The one factory that builds the app, for the CLI and for the tests; `options` are
    AppConfig's other fields (probe, autostart, present, theme, table_factory, kv_events)."""
    config = AppConfig(settings=settings or RunSettings(), screen=screen, **options)
    return KVApp(config, engine_factory)


def run_app(settings: RunSettings, screen: int = 1, **options: Any) -> int:
    """Open the app on a screen, run it, and return its exit code (SIGINT, SIGTERM and SIGHUP
    end it as `q` does: kvtui.terminal.ended_by_signals); `options`: AppConfig's."""
    try:
        app = make_app(settings, screen, **options)
    except DriverError as exc:
        raise UsageError(f"kvtui: {exc}") from None
    with ended_by_signals(app.exit, lambda: app.engines.close(timeout=0.5)):
        try:
            result = app.run()
        finally:
            app.close_engine()
    return int(result or 0)
