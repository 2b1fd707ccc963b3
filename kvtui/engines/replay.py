"""Recording a run to JSON lines, and replaying it as an engine, without torch or a UI.

A record is one header line (`{"kind": "header", "format": "kvtui-record", "version": 1, ...}`
with the settings, device and model), then every event of the run as
`kvtui.engines.protocol.to_json` writes it. `kvtui bench --record FILE` writes one on a GPU box
over SSH; `--engine replay:FILE` plays it back on a laptop at the recorded pace (each step takes
its measured `step_seconds`, divided by `replay_speed`; 0 plays as fast as it can).

A record is read whole and checked before it plays (`read_record`), so a file that is not one is
one line before any UI opens: a regular file of at most 256 MiB (MAX_RECORD_BYTES), lines of at
most 1 MiB, every event of its declared types (kvtui.engines.protocol), in the order a run writes
them (one `started` first; each loop's steps numbered 0, 1, 2... at the positions after the
prompt; at most one `finished` per loop, after its steps), with at least one step, no step longer
than an hour (a replay sleeps each step's time) and no more steps than `MAX_TOKENS` per loop.
Every string a record holds (a model's name, a loop's message, a step's text) is made safe as it
is read (kvtui.format.safe_text: control characters written as escapes, newlines too except in
generated text, `TEXT_FIELDS`), since a record is a file anyone may hand over.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import IO, Any, TypeVar

from kvtui.engines.capabilities import REPLAY
from kvtui.engines.protocol import (
    MAX_TOKENS,
    Event,
    Loop,
    RunFailed,
    RunFinished,
    RunProgress,
    RunSettings,
    RunStarted,
    ServerMetrics,
    StepSample,
    event_from_json,
    to_json,
)
from kvtui.errors import EngineError
from kvtui.format import safe_text
from kvtui.inputs import MIB, InputError, parse_json, read_lines

FORMAT, VERSION = "kvtui-record", 1

MAX_RECORD_BYTES = 256 * MIB
"""The largest record read: a run of MAX_TOKENS tokens in both loops is about 160 MB."""
MAX_LINE_BYTES = MIB
"""The longest line read (a step is about 300 bytes; the header holds the prompt)."""
MAX_POSITIONS = 2**24
"""The most positions (and layers, heads, head size) a recorded run's model may state: 16,777,216,
as kvtui.sim.hf_config's MAX_SIZE."""
MAX_STEP_SECONDS = 3600.0
"""The longest step replayed: replay sleeps each step's time, and an hour per step is past any
run worth replaying."""


class RecordWriter:
    """Writes a record: the header first, then each event as it comes, flushed per line."""

    def __init__(self, out: IO[str], settings: RunSettings, **header: object) -> None:
        self._out = out
        line = {
            "kind": "header",
            "format": FORMAT,
            "version": VERSION,
            "settings": settings.to_json(),
            **header,
        }
        self._write(line)

    def _write(self, data: dict[str, Any]) -> None:
        try:  # JSON has no NaN or Infinity: a record holding one could never be read back
            line = json.dumps(data, separators=(",", ":"), allow_nan=False)
        except ValueError:
            raise EngineError(
                f"cannot record the {data.get('kind', 'an')} event: it holds a number that is not "
                "a finite number (NaN or infinity)"
            ) from None
        self._out.write(line + "\n")
        self._out.flush()

    def write(self, event: Event) -> None:
        self._write(to_json(event))


def read_record(path: Path) -> tuple[dict[str, Any], list[Event]]:
    """The header and events of a record; `EngineError` with one clear line if it is not one
    (see the module's docstring for what is checked)."""
    if not path.exists() and not path.is_symlink():
        raise EngineError(f"no recorded run at {path} (kvtui bench --record {path} makes one)")
    try:
        with contextlib.closing(read_lines(path, MAX_RECORD_BYTES, MAX_LINE_BYTES)) as lines:
            header = _read_header(path, next(lines, (1, ""))[1])
            order = _RunOrder(path)
            events: list[Event] = []
            for number, line in lines:
                if not line.strip():
                    continue
                try:
                    event = safe_strings(event_from_json(parse_json(line)))
                except ValueError as exc:
                    raise EngineError(f"{path}, line {number}: corrupt record ({exc})") from None
                order.check(number, event)
                events.append(event)
    except InputError as exc:
        raise EngineError(str(exc)) from None
    order.finish()
    return header, events


TEXT_FIELDS = frozenset({"text", "prompt_text", "prompt_pieces", "prompt"})
"""The fields of an event (and of the run's settings) that hold generated or prompt text: their
newlines and tabs are kept. Every other string is one line."""

_Safe = TypeVar("_Safe")


def safe_strings(data: _Safe) -> _Safe:
    """An event (or the run's settings) with every string field, and each string of a tuple
    field, made safe to draw and print: `safe_text`, one line unless the field is one of
    TEXT_FIELDS. The same object when nothing needed it."""
    changes: dict[str, Any] = {}
    for f in fields(data):  # type: ignore[arg-type]
        if not f.init:
            continue
        value = getattr(data, f.name)
        one_line = f.name not in TEXT_FIELDS
        if isinstance(value, str):
            safe: Any = safe_text(value, one_line=one_line)
        elif isinstance(value, tuple) and any(isinstance(v, str) for v in value):
            safe = tuple(
                safe_text(v, one_line=one_line) if isinstance(v, str) else v for v in value
            )
        else:
            continue
        if safe != value:
            changes[f.name] = safe
    return replace(data, **changes) if changes else data  # type: ignore[type-var]


def _read_header(path: Path, line: str) -> dict[str, Any]:
    try:
        header: Any = parse_json(line)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise EngineError(f"{path} is not a kvtui record (no kvtui-record header on line 1)")
    if header.get("version") != VERSION:
        shown = repr(header.get("version"))[:20]
        raise EngineError(f"{path} is a version {shown} record; this kvtui reads {VERSION}")
    try:
        RunSettings.from_json(header.get("settings", {}))
    except ValueError as exc:
        raise EngineError(f"{path}, line 1: corrupt record ({exc})") from None
    return header


class _RunOrder:
    """Checks, event by event, that a record holds one run as `run_events` writes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started: RunStarted | None = None
        self.steps: dict[str, int] = {}
        self.finished: set[str] = set()

    def _bad(self, number: int, why: str) -> EngineError:
        return EngineError(f"{self.path}, line {number}: {why}")

    def check(self, number: int, event: Event) -> None:
        if isinstance(event, RunProgress):
            return  # said while an engine got ready: harmless, and nothing to replay
        if isinstance(event, RunFailed):
            raise self._bad(number, f"the recorded run failed: {event.message[:200]}")
        if isinstance(event, RunStarted):
            if self.started is not None:
                raise self._bad(number, "a second 'started' event: a record holds one run")
            self._check_started(number, event)
            self.started = event
            return
        if self.started is None:
            raise self._bad(number, f"a '{event.kind}' event before the run's 'started' event")
        if isinstance(event, ServerMetrics):  # a served run's polls: between any steps
            return
        loop, done = event.loop, self.steps.get(event.loop, 0)
        if loop in self.finished:
            raise self._bad(number, f"a '{event.kind}' event after the {loop} loop finished")
        if isinstance(event, RunFinished):
            if event.steps != done:
                raise self._bad(
                    number, f"the {loop} loop finished after {event.steps:,} steps, not {done:,}"
                )
            self.finished.add(loop)
            return
        if event.step != done:
            raise self._bad(number, f"{loop} step {event.step:,} out of order (expected {done:,})")
        if event.position != self.started.prompt_tokens + event.step:
            raise self._bad(
                number,
                f"{loop} step {event.step:,} at position {event.position:,}, not "
                f"{self.started.prompt_tokens + event.step:,} (prompt + step)",
            )
        if done >= min(self.started.tokens, MAX_TOKENS):
            raise self._bad(
                number,
                f"more {loop} steps than the {min(self.started.tokens, MAX_TOKENS):,} "
                "a run may have",
            )
        if event.positions_computed > self.started.batch * (event.position + 1):
            raise self._bad(
                number,
                f"{loop} step {event.step:,} computed {event.positions_computed:,} positions, "
                f"more than its batch of {self.started.batch} has at position {event.position:,}",
            )
        if event.step_seconds > MAX_STEP_SECONDS:
            raise self._bad(
                number,
                f"a step of {event.step_seconds:,.0f} s (a replay sleeps each step's time; "
                f"kvtui replays steps of at most {MAX_STEP_SECONDS:,.0f} s)",
            )
        self.steps[loop] = done + 1

    def _check_started(self, number: int, started: RunStarted) -> None:
        """The sizes a run's start states, each within what a run can have (a batch of 0, or a
        pool of blocks of no tokens, would be divided by; the batch is RunStarted's own check)."""
        ranges = {
            "tokens": (started.tokens, 1, MAX_TOKENS),
            "prompt_tokens": (started.prompt_tokens, 0, MAX_POSITIONS),
            "layers": (started.layers, 0, MAX_POSITIONS),  # 0: not known (a served run)
            "kv_heads": (started.kv_heads, 0, MAX_POSITIONS),
            "head_dim": (started.head_dim, 0, MAX_POSITIONS),
            "threads": (started.threads, 0, MAX_POSITIONS),
        }
        if started.kv_block_tokens is not None or started.kv_capacity_bytes is not None:
            ranges["kv_block_tokens"] = (started.kv_block_tokens or 0, 1, MAX_POSITIONS)
            ranges["kv_bytes_per_token"] = (started.kv_bytes_per_token, 1, 2**40)
        for name, (value, low, high) in ranges.items():
            if not low <= value <= high:
                raise self._bad(number, f"{name} is {value:,}; a run has {low:,} to {high:,}")

    def finish(self) -> None:
        if self.started is None:
            raise EngineError(f"{self.path} holds no run (no 'started' event)")
        if not any(self.steps.values()):
            raise EngineError(f"{self.path} holds an empty run (no steps)")


def as_written(started: RunStarted) -> RunStarted:
    """A recorded start as it was written."""
    return started


@dataclass
class ReplayEngine:
    """Plays a record back through the engine protocol."""

    settings: RunSettings
    header: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    upgrade: Callable[[RunStarted], RunStarted] = as_written
    """What the recorded start becomes before it is sent: kvtui.engines.factory.recorded_start
    gives a record written before starts said what their engine can do its engine's (`can`)."""

    @classmethod
    def open(
        cls,
        path: Path,
        settings: RunSettings,
        upgrade: Callable[[RunStarted], RunStarted] = as_written,
    ) -> ReplayEngine:
        header, events = read_record(path)
        recorded = safe_strings(RunSettings.from_json(header.get("settings", {})))  # checked
        # What ran is what was recorded; only the pace is the caller's.
        merged = replace(recorded, engine=settings.engine, replay_speed=settings.replay_speed)
        return cls(merged, header, events, upgrade)

    def started(self) -> RunStarted:
        """The recorded start, saying when it was recorded (from the header, for a record
        written before `RunStarted.recorded_at` was) and that it is a replay of a run that
        could do what its engine could (`Capabilities.replayed`)."""
        started = self.upgrade(next(e for e in self.events if isinstance(e, RunStarted)))
        started = replace(started, can=(started.can or REPLAY).replayed())
        if started.recorded_at:
            return started
        when = self.header.get("recorded_at")
        return replace(started, recorded_at=when if isinstance(when, str) and when else "unknown")

    def steps(self, loop: Loop) -> Generator[StepSample | RunFinished | ServerMetrics, None, None]:
        for event in self.events:
            if isinstance(event, StepSample) and event.loop == loop:
                if self.settings.replay_speed > 0:
                    pace = event.step_seconds / self.settings.replay_speed
                    time.sleep(min(pace, MAX_STEP_SECONDS))
                yield event
            elif isinstance(event, ServerMetrics) and loop == "cached":
                yield event  # a served run's polls, where they came (its one loop is cached)
            elif isinstance(event, RunFinished) and event.loop == loop:
                yield event
                return

    def close(self) -> None:
        pass
