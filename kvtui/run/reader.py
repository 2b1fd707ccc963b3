"""The one reader of an engine's events, without a UI: the app's run and screen 4's race alike.

An engine (`EngineHandle`: a child process, `kvtui.run.process.EngineProcess`, or a test's
scripted one) hands out its events one at a time, as fast as it decodes. `read_engine` starts it,
reads its stream on a helper thread that blocks on the pipe, and hands the events on in batches,
at most one batch every BATCH_INTERVAL_S (RUN_UPDATES_PER_SECOND a second): the one throttle where
an engine's events enter the app, so a burst of steps costs the UI one batch. It closes the engine
however the read ends. It knows no Textual: the app and screen 4 each call it from a thread worker
of theirs, with a `report` that posts a batch as a message (thread-safe, non-blocking) and a
`stopped` that says when to stop (the worker cancelled, the run replaced).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from kvtui.engines.protocol import Event, RunFailed, RunSettings
from kvtui.run.live import RUN_UPDATES_PER_SECOND

BATCH_INTERVAL_S = 1 / RUN_UPDATES_PER_SECOND
"""The reader hands on at most one batch of events per this many seconds, and checks `stopped` at
least this often."""


class EngineHandle(Protocol):
    """A running engine as the app sees it (`kvtui.run.process.EngineProcess` is one;
    `kvtui.testing.ScriptedEngine` another): start it, read its events, pause, resume, stop and
    close it."""

    def start(self) -> None: ...
    def events(self) -> Iterator[Event]: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def stop(self) -> None: ...
    def close(self, timeout: float = 1.0) -> None: ...
    @property
    def alive(self) -> bool: ...


EngineFactory = Callable[[RunSettings], EngineHandle]
"""What makes a run's engine from its settings (`kvtui.run.process.Engines`, in the app)."""

_END = object()
"""The helper thread's last item: the engine's stream has ended."""


def read_engine(
    engine: EngineHandle,
    report: Callable[[list[Event]], None],
    stopped: Callable[[], bool],
    *,
    name: str = "kvtui-engine-pipe",
) -> bool:
    """Start `engine`, then hand its events to `report` in batches until its stream ends or
    `stopped()` says to stop (checked at least every BATCH_INTERVAL_S; what arrived since the last
    batch is then dropped); then close it, however the read ended (`start` raising included).
    True if the stream ended (the engine is done, or its process exited), False if stopped.

    A helper thread (`name`) blocks on the engine's stream and feeds a queue, so this loop wakes
    every BATCH_INTERVAL_S to check `stopped` and to hand on what has arrived: a batch at most
    every BATCH_INTERVAL_S, and the last one at once. A stream that breaks ends with a `RunFailed`
    that says so."""
    inbox: queue.Queue[object] = queue.Queue()

    def pump() -> None:
        try:
            for event in engine.events():
                inbox.put(event)
        except Exception as exc:  # the pipe broke: say so as the run's failure
            inbox.put(RunFailed(f"engine stream broke: {exc}"))
        finally:
            inbox.put(_END)

    try:
        engine.start()
        threading.Thread(target=pump, name=name, daemon=True).start()
        pending: list[Event] = []
        last_report = 0.0
        ended = False
        while not ended and not stopped():
            try:
                item = inbox.get(timeout=BATCH_INTERVAL_S)
                while True:
                    if item is _END:
                        ended = True
                        break
                    pending.append(item)  # type: ignore[arg-type]
                    item = inbox.get_nowait()
            except queue.Empty:
                pass
            now = time.monotonic()
            if pending and (ended or now - last_report >= BATCH_INTERVAL_S):
                report(pending)
                pending, last_report = [], now
        return ended
    finally:
        engine.close(timeout=1.0)
