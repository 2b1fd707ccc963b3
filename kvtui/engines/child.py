"""The engine's own process, the child side, without a UI: the `RunSettings` read as one JSON line
on stdin, then `pause`, `resume` or `stop` lines; every event written as one JSON line on stdout
(kvtui.run.process starts it and reads it). A CUDA failure, a crash, a refusal: each ends as one
`RunFailed` line, never a traceback on the app's terminal.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Callable
from typing import IO

from kvtui.engines.protocol import (
    FLOP_COUNTER_PHRASE,
    MAX_PROGRESS_CHARS,
    Event,
    RunFailed,
    RunProgress,
    RunSettings,
    StepSample,
    to_json,
)
from kvtui.engines.schedule import RunControl
from kvtui.errors import EngineError
from kvtui.format import safe_text


def _read_commands(control: RunControl) -> None:
    """Apply `pause` / `resume` / `stop` lines from stdin; EOF (the parent went away) stops."""
    for line in sys.stdin:
        command = line.strip()
        if command == "pause":
            control.pause()
        elif command == "resume":
            control.resume()
        elif command == "stop":
            control.stop()
    control.stop()


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
        return _run_child(writer.write, warm)
    finally:
        writer.close()


def _run_child(emit: Callable[[Event], None], warm: bool) -> int:
    from kvtui.engines.factory import open_engine
    from kvtui.engines.schedule import run_events

    def progress(phrase: str) -> None:
        emit(RunProgress(safe_text(phrase, one_line=True)[:MAX_PROGRESS_CHARS]))

    if warm:
        _warm_up(progress)
    try:
        settings = RunSettings.from_json(json.loads(sys.stdin.readline()))
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        emit(RunFailed(safe_text(f"bad run settings: {exc}", one_line=True)))
        return 2
    control = RunControl()
    threading.Thread(target=_read_commands, args=(control,), daemon=True).start()
    engine = None
    try:
        engine = open_engine(settings, progress)
        for event in run_events(engine, settings, control, watch=True):
            emit(event)
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
