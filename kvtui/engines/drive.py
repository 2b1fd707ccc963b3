"""What drives an engine, without a UI: `run_events`, the loop that turns an engine's steps into
one run's events (one `RunStarted`, the steps of one loop or both in turns of TURN_SECONDS of
their measured time, a `RunFinished` per loop), paused and stopped by a `RunControl` between
steps; and the engine's own process (`child_main`, started by kvtui.run.process), which reads its
`RunSettings` as one JSON line on stdin, then `pause`, `resume` or `stop` lines, and writes every
event as one JSON line on stdout. A CUDA failure, a crash, a refusal: each ends as one `RunFailed`
line, never a traceback on the app's terminal. `kvtui bench` and kvtui.testing call `run_events`
in their own process."""

from __future__ import annotations

import contextlib
import json
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import IO, Literal

from kvtui.engines.protocol import (
    FLOP_COUNTER_PHRASE,
    MAX_PROGRESS_CHARS,
    Event,
    Loop,
    RunControl,
    RunFailed,
    RunFinished,
    RunProgress,
    RunSettings,
    ServerMetrics,
    StepSample,
    StepSource,
    to_json,
)
from kvtui.errors import EngineError
from kvtui.format import safe_text

Schedule = Literal["fair", "sequential"]

TURN_SECONDS = 0.05
"""Under the fair schedule, the measured step time a loop spends before the other may take the
engine. A step that runs right after the other loop's has its caches evicted: in turns of one
step, the tiny model's first cached step after an uncached one took 1.6-1.9x its warm time, and
the cached loop ran 1.1-1.2x slower over a run (benchmarks/sharing_cost.py), which measured the
sharing, not the loop. A twentieth of a second keeps both streams moving in every frame the app
draws (10 a second)."""


def run_events(
    engine: StepSource,
    settings: RunSettings,
    control: RunControl | None = None,
    *,
    schedule: Schedule = "fair",
    watch: bool = False,
    turn_seconds: float = TURN_SECONDS,
) -> Iterator[Event]:
    """Every event of a run: started, steps, one finished per loop; a served engine's
    `ServerMetrics` as they come. With `watch`, an engine that can (`vllm:`, its `watch`) goes on
    sending its server's metrics after its loops end, until the run is stopped (the app's engine
    process watches; `kvtui bench` does not).

    `fair`: the loops share the engine's time, each turn going to the loop that has spent the
    least measured step time so far, for `turn_seconds` of it (at least one step); so the cached
    loop, whose steps are short, races ahead and finishes while the uncached one is still
    climbing its staircase, as two requests served side by side would. Each step's own time is
    measured alone either way: steps never overlap.
    `sequential`: each loop runs to its end before the next starts (`kvtui bench`).
    """
    control = control or RunControl()
    yield engine.started()
    iterators = {loop: engine.steps(loop) for loop in settings.loops}
    counts = dict.fromkeys(iterators, 0)
    spent = dict.fromkeys(iterators, 0.0)
    turn: Loop = "cached"
    turn_ends = 0.0  # the spent time at which `turn` hands the engine on (none has it yet)
    try:
        while iterators:
            if schedule == "sequential":
                loop = next(iter(iterators))
            else:
                if turn not in iterators or spent[turn] >= turn_ends:
                    turn = min(iterators, key=spent.__getitem__)
                    turn_ends = spent[turn] + turn_seconds
                loop = turn
            control.wait_while_paused()
            if control.stopped:
                for left in list(iterators):
                    iterators.pop(left).close()
                    yield RunFinished(left, "cancelled", counts[left], "stopped")
                return
            event = next(iterators[loop], None)
            if isinstance(event, ServerMetrics):
                yield event
                continue
            if isinstance(event, StepSample):
                counts[loop] += 1
                spent[loop] += max(0.0, event.step_seconds)
                yield event
                continue
            iterators.pop(loop).close()
            yield event if event is not None else RunFinished(loop, "done", counts[loop])
        keep_watching = getattr(engine, "watch", None) if watch else None
        if keep_watching is not None:
            yield from keep_watching(control)
    finally:
        for iterator in iterators.values():
            iterator.close()


# --- the engine's own process --------------------------------------------------------------------


IDLE_LINE = '{"idle":true}'
"""What the engine's process writes once a run is over, on a line of its own: it waits for the
settings of another run on its stdin (kvtui.run.process keeps it, model and all, for the next)."""


class Commands:
    """The child's stdin, read on a thread of its own: `pause`, `resume` and `stop` go to the
    current run's control; any other line is a run's settings (JSON), for `next_settings`; EOF
    (the parent went away) stops the run and ends the waiting."""

    def __init__(self) -> None:
        self.control = RunControl()
        """The control of the run whose settings came last: later commands are its."""
        self._settings: queue.Queue[tuple[str, RunControl] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            command = line.strip()
            if command == "pause":
                self.control.pause()
            elif command == "resume":
                self.control.resume()
            elif command == "stop":
                self.control.stop()
            elif command:  # a run's settings (refused in one line where they do not parse)
                self.control = RunControl()
                self._settings.put((command, self.control))
        self.control.stop()
        self._settings.put(None)

    def next_settings(self) -> tuple[str, RunControl] | None:
        """The next run's settings line and its control, or None once stdin ends."""
        return self._settings.get()


def _warm_up(progress: Callable[[str], None]) -> None:
    """Get a torch engine ready before its settings come (a spare): import torch and the models,
    and pay FlopCounterMode's first use, saying so. Where that fails, the run that follows says
    why."""
    try:
        progress("importing torch")
        import kvtui.engines.torch_engine  # noqa: F401  (torch, the decoder)
        from kvtui.gpu.counting import warm_flop_counter

        progress(FLOP_COUNTER_PHRASE)
        warm_flop_counter()
    except Exception:  # no torch, say: the run's own start reports it, in one line
        import traceback

        traceback.print_exc()


FLUSH_SECONDS = 1 / 30
"""The longest a step's event waits in the engine before it is sent to the app (which draws 10
times a second). Each step's line flushed on its own woke the app a thousand times a second on the
tiny model, and the engine, woken back, changed cores: its cached steps ran 7-12% slower."""


class EventWriter:
    """The child's events, as JSON lines on `stream` (bytes, buffered): a step's line goes out
    within FLUSH_SECONDS (a thread flushes what is left, so that a long step holds back nothing),
    any other event at once. JSON has no NaN: one in an event raises ValueError."""

    def __init__(self, stream: IO[bytes], every: float = FLUSH_SECONDS) -> None:
        self._stream = stream  # a BufferedWriter: its own lock makes write and flush safe
        self._every = every
        self._pending = threading.Event()
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_pending, daemon=True)
        self._flusher.start()

    def write(self, event: Event) -> None:
        line = json.dumps(to_json(event), separators=(",", ":"), allow_nan=False) + "\n"
        self._stream.write(line.encode())
        if isinstance(event, StepSample):
            self._pending.set()
        else:
            self.flush()

    def flush(self) -> None:
        self._pending.clear()
        self._stream.flush()

    def idle(self) -> None:
        """Say the run is over and the process waits for another (IDLE_LINE), at once."""
        self._stream.write((IDLE_LINE + "\n").encode())
        self.flush()

    def close(self) -> None:
        self._closed.set()
        self._pending.set()  # wakes the flusher to end
        self._flusher.join()
        with contextlib.suppress(BrokenPipeError, ValueError):
            self.flush()

    def _flush_pending(self) -> None:
        while self._pending.wait() and not self._closed.is_set():
            try:
                self.flush()
            except (BrokenPipeError, ValueError):  # the app went away: the next write says so
                return
            self._closed.wait(self._every)


def child_main(warm: bool = False) -> int:
    writer = EventWriter(sys.stdout.buffer)
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the event stream
    try:
        return _run_child(writer, warm)
    finally:
        writer.close()


def _run_child(writer: EventWriter, warm: bool) -> int:
    """Runs, one after another, until stdin ends: each run's settings on a line, its events out,
    then IDLE_LINE. An engine that can (`reopen`: a torch model kept, its KV pool resized) runs
    the next settings without loading again."""
    from kvtui.engines.factory import open_engine, reopen_engine

    emit = writer.write

    def progress(phrase: str) -> None:
        emit(RunProgress(safe_text(phrase, one_line=True)[:MAX_PROGRESS_CHARS]))

    if warm:
        _warm_up(progress)
    commands = Commands()
    engine: StepSource | None = None
    try:
        while (run := commands.next_settings()) is not None:
            line, control = run
            try:
                settings = RunSettings.from_json(json.loads(line))
            except (json.JSONDecodeError, TypeError, ValueError) as exc:
                emit(RunFailed(safe_text(f"bad run settings: {exc}", one_line=True)))
                return 2
            if engine is not None:  # the last run's: kept where it can take these settings
                engine = reopen_engine(engine, settings, progress)  # else closed and dropped
            if engine is None:
                engine = open_engine(settings, progress)
            for event in run_events(engine, settings, control, watch=True):
                emit(event)
            writer.idle()
    except EngineError as exc:
        emit(RunFailed(safe_text(str(exc), one_line=True)))  # may quote a file
        return 2
    except BrokenPipeError:
        return 0
    except Exception as exc:  # the engine crashed: tell the UI in one line, keep the traceback
        import traceback

        traceback.print_exc()
        why = safe_text(f"{type(exc).__name__}: {exc}", one_line=True)
        emit(RunFailed(f"decode engine failed: {why}"))
        return 1
    finally:
        if engine is not None:
            engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main())
