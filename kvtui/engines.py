"""Decode engines behind one protocol, and the loop that runs them, without a UI or torch.

An engine is chosen by name (`RunSettings.engine`):

- `tiny`: the shipped byte-level model in assets/, in torch (kvtui.gpu.engine);
- `shape:NAME`: a catalog model's exact shape with random weights, in torch;
- `sim:NAME@GPU`: no torch at all; steps from kvtui.sim, timed by the roofline (kvtui.sim.engine);
- `replay:FILE`: a run recorded by `kvtui bench --record` (kvtui.replay);
- `hf:DIR`: a local Hugging Face model directory, via transformers (kvtui.gpu.hf; `--model DIR`).

`open_engine` imports torch only for the torch engines. `run_events` drives any engine: one
`RunStarted`, then the steps of each loop (in lockstep when both run), then one `RunFinished` per
loop, honouring a `RunControl` (pause, stop) between steps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

from kvtui.sim.steps import (
    EngineError,
    Event,
    Loop,
    RunFinished,
    RunSettings,
    RunStarted,
    StepSample,
)

__all__ = ["ENGINE_FORMS", "Engine", "EngineError", "RunControl", "open_engine", "run_events"]


class Engine(Protocol):
    def started(self) -> RunStarted:
        """What runs, and where; sent before the first step."""
        ...

    def steps(self, loop: Loop) -> Iterator[StepSample | RunFinished]:
        """The steps of one loop; may end with its own `RunFinished` (out of memory, say)."""
        ...

    def close(self) -> None: ...


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

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def wait_while_paused(self) -> None:
        self._running.wait()


ENGINE_FORMS = "tiny, shape:MODEL, sim:MODEL@GPU, replay:FILE, hf:DIR"


def open_engine(settings: RunSettings) -> Engine:
    """The engine `settings.engine` names; `EngineError` for a bad name or a run that can't fit."""
    name = settings.engine.strip()
    kind, _, arg = name.partition(":")
    if name == "tiny" or kind == "shape":
        if kind == "shape" and not arg:
            raise EngineError("shape: needs a model name, e.g. shape:llama-3.2-1b")
        from kvtui.gpu.engine import open_torch_engine

        return open_torch_engine(settings)
    if kind == "sim":
        from kvtui.sim.engine import SimEngine

        return SimEngine.from_settings(settings)
    if kind == "replay":
        from kvtui.replay import ReplayEngine

        return ReplayEngine.open(arg, settings)
    if kind == "hf":
        from kvtui.gpu.hf import open_hf_engine

        return open_hf_engine(settings)
    raise EngineError(f"unknown engine {name!r}: use one of {ENGINE_FORMS}")


def check_engine(settings: RunSettings) -> None:
    """Refuse a run that cannot start, before a UI opens: `EngineError` with one clear line.

    Cheap and torch-free: names are looked up in the catalogs, a replay file is read, a model
    directory is looked at; whether a torch model fits in memory is still the engine's to say.
    """
    name = settings.engine.strip()
    kind, _, arg = name.partition(":")
    if name == "tiny":
        return
    if kind in ("sim", "replay"):
        open_engine(settings).close()
    elif kind == "shape":
        from kvtui.sim.catalog import UnknownNameError, get_model

        if not arg:
            raise EngineError("shape: needs a model name, e.g. shape:llama-3.2-1b")
        try:
            get_model(arg)
        except UnknownNameError as exc:
            raise EngineError(str(exc)) from None
    elif kind == "hf":
        from pathlib import Path

        directory = Path(arg).expanduser()
        if not (directory / "config.json").is_file():
            raise EngineError(f"{directory} is not a Hugging Face model directory (no config.json)")
    else:
        raise EngineError(f"unknown engine {name!r}: use one of {ENGINE_FORMS}")


def run_events(
    engine: Engine,
    settings: RunSettings,
    control: RunControl | None = None,
    *,
    lockstep: bool = True,
) -> Iterator[Event]:
    """Every event of a run: started, steps, one finished per loop.

    In `lockstep` the loops take one step each in turn (so a screen can compare the streams as
    they grow); otherwise each loop runs to its end before the next starts (cleaner timings).
    """
    control = control or RunControl()
    yield engine.started()
    iterators = {loop: engine.steps(loop) for loop in settings.loops}
    counts = dict.fromkeys(iterators, 0)
    try:
        while iterators:
            for loop in list(iterators) if lockstep else list(iterators)[:1]:
                control.wait_while_paused()
                if control.stopped:
                    for left in list(iterators):
                        iterators.pop(left).close()
                        yield RunFinished(left, "cancelled", counts[left], "stopped")
                    return
                event = next(iterators[loop], None)
                if isinstance(event, StepSample):
                    counts[loop] += 1
                    yield event
                    continue
                iterators.pop(loop).close()
                yield event if event is not None else RunFinished(loop, "done", counts[loop])
    finally:
        for iterator in iterators.values():
            iterator.close()
