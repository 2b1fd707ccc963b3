"""The loop that drives an engine, without a UI: one `RunStarted`, then the steps of one loop or
both (in turns of TURN_SECONDS of their measured steps, or one loop after the other), then a
`RunFinished` per loop; `RunControl` pauses and stops it from another thread, between steps."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Literal

from kvtui.engines.protocol import (
    Event,
    Loop,
    RunFinished,
    RunSettings,
    ServerMetrics,
    StepSample,
    StepSource,
)


class RunControl:
    """Pause and stop, set from another thread, honoured between steps."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._running.set()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def wait_while_paused(self) -> None:
        self._running.wait()


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
