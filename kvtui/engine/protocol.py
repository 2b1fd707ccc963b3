"""The engine protocol: what a decode engine is, the records it emits, and the loop that drives
it. No UI, no torch.

A `StepSource` (the torch `tiny` model, a `shape:` or `hf:` model, the roofline `sim:` engine, a
`replay:` file) turns `RunSettings` into a stream of events, and `run_events` drives any of them:
one `RunStarted`, then `StepSample`s of one or both loops, then one `RunFinished` per loop.
Screens and `kvtui bench` only ever see these records, so they never care which engine produced
them. Each record round-trips through a JSON dict (`to_json` / `event_from_json`) so that it can
cross a pipe from the engine's own process.

The counting rule, the one every engine, formula and test in kvtui uses: the step that emits token
t (1-based) after a P-token prompt computes

- without a cache: P + t - 1 positions (the whole sequence so far, again);
- with a cache: P on the first step (the prefill) and 1 on every later step.

With a one-token prompt this is the lesson exactly: 24 tokens cost 300 positions without a cache
and 24 with it (276 wasted); 4,096 tokens cost 8,390,656 against 4,096. kvtui.sim.work computes
the same counts in closed form.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Protocol

Loop = Literal["cached", "uncached"]
LOOPS: tuple[Loop, ...] = ("uncached", "cached")

DEFAULT_PROMPT = "It is a truth universally acknowledged, that"


class EngineError(ValueError):
    """The engine cannot run these settings: one line for a person to read."""


@dataclass(frozen=True)
class RunSettings:
    """What to run: plain values, so a run can be started in another process."""

    engine: str = "tiny"
    """`tiny`, `shape:NAME`, `sim:NAME@GPU` or `replay:FILE`."""
    device: str = "auto"
    """`auto` (CUDA when present, else CPU), `cpu` or `cuda`."""
    tokens: int = 256
    """Tokens to generate after the prompt."""
    prompt: str = DEFAULT_PROMPT
    seed: int = 0
    greedy: bool = False
    temperature: float = 0.8
    top_k: int = 40
    loops: tuple[Loop, ...] = LOOPS
    """Which loops to run."""
    threads: int = 1
    """torch intra-op threads in the engine's process (1 beside a busy UI: more threads there
    made decode slower, not faster, on a 2-core machine)."""
    replay_speed: float = 1.0
    """For `replay:`: 1.0 is the recorded pace, 0 (or less) means as fast as possible."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "loops": list(self.loops)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSettings:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "loops" in values:
            values["loops"] = tuple(values["loops"])
        return cls(**values)


@dataclass(frozen=True)
class RunStarted:
    """Sent once, before the first step: what is running, and where."""

    engine: str
    model: str
    device: str
    """Where the steps run, in words: `cpu`, `cuda:0 (NVIDIA H100 80GB HBM3)`, `sim: h100`."""
    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    weights_bytes: int
    prompt_tokens: int
    tokens: int
    threads: int = 1
    peak_bandwidth_bytes_per_s: float | None = None
    device_memory_total_bytes: int | None = None
    max_positions: int | None = None
    """The most positions (prompt + answer) the model can run, where it has a limit."""
    kind: str = field(default="started", init=False)


@dataclass(frozen=True)
class StepSample:
    """One decode step of one loop, as measured."""

    loop: Loop
    step: int
    """0-based index of the generated token."""
    position: int
    """Position of the new token in the sequence (prompt_tokens + step)."""
    token_id: int
    text: str
    """The text this token completes (UTF-8 safe: may be empty mid-character)."""
    positions_computed: int
    """Positions whose keys and values this step computed: with a cache, prompt_tokens on the
    first step (the prefill) and 1 after; without, every position so far (position itself)."""
    flops: int
    bytes_read: int
    step_seconds: float
    """Wall time of the step, measured after synchronising the device."""
    kv_bytes: int
    """KV-cache bytes held after the step (0 for the uncached loop, which keeps none)."""
    device_memory_bytes: int | None = None
    kind: str = field(default="step", init=False)


@dataclass(frozen=True)
class RunFinished:
    """Sent once per loop when it ends."""

    loop: Loop
    reason: Literal["done", "cancelled", "out_of_memory", "error"]
    steps: int
    message: str = ""
    kv_bytes_allocated: int | None = None
    """Bytes of the KV-cache buffers this loop allocated, measured from the tensors."""
    kind: str = field(default="finished", init=False)


@dataclass(frozen=True)
class RunFailed:
    """The run could not start or the engine died: one line for a person to read."""

    message: str
    kind: str = field(default="failed", init=False)


Event = RunStarted | StepSample | RunFinished | RunFailed

_KINDS: dict[str, type] = {
    "started": RunStarted,
    "step": StepSample,
    "finished": RunFinished,
    "failed": RunFailed,
}


def to_json(event: Event) -> dict[str, Any]:
    """A JSON-ready dict of an event, with its `kind`."""
    return asdict(event)


def event_from_json(data: dict[str, Any]) -> Event:
    """The event a `to_json` dict describes; ValueError if it is not one."""
    try:
        cls = _KINDS[data["kind"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a kvtui event: {str(data)[:80]}") from exc
    init = {f.name for f in fields(cls) if f.init}
    try:
        return cls(**{k: v for k, v in data.items() if k in init})
    except TypeError as exc:
        raise ValueError(f"malformed {data['kind']} event: {exc}") from exc


# --- engines and the loop that drives them ----------------------------------------------------


class StepSource(Protocol):
    """A decode engine: what it runs, then the steps of each loop."""

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

    def wait_while_paused(self) -> None:
        self._running.wait()


def run_events(
    engine: StepSource,
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
