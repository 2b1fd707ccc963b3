"""Recording a run to JSON lines, and replaying it as an engine, without torch or a UI.

A record is one header line (`{"kind": "header", "format": "kvtui-record", "version": 1, ...}`
with the settings, device and model), then every event of the run as `kvtui.engine.protocol.to_json`
writes it. `kvtui bench --record FILE` writes one on a GPU box over SSH; `--engine replay:FILE`
plays it back on a laptop at the recorded pace (each step takes its measured `step_seconds`,
divided by `replay_speed`; 0 plays as fast as it can).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from kvtui.engine.protocol import (
    EngineError,
    Event,
    Loop,
    RunFinished,
    RunSettings,
    RunStarted,
    StepSample,
    event_from_json,
    to_json,
)

FORMAT, VERSION = "kvtui-record", 1


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

    def _write(self, data: dict) -> None:
        self._out.write(json.dumps(data, separators=(",", ":")) + "\n")
        self._out.flush()

    def write(self, event: Event) -> None:
        self._write(to_json(event))


def read_record(path: Path) -> tuple[dict, list[Event]]:
    """The header and events of a record; `EngineError` with one clear line if it is not one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise EngineError(f"no recorded run at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EngineError(f"cannot read {path}: {exc}") from None
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise EngineError(f"{path} is not a kvtui record (no kvtui-record header on line 1)")
    if header.get("version") != VERSION:
        raise EngineError(
            f"{path} is a version {header.get('version')} record; this kvtui reads {VERSION}"
        )
    events: list[Event] = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            events.append(event_from_json(json.loads(line)))
        except (json.JSONDecodeError, ValueError) as exc:
            raise EngineError(f"{path}, line {number}: corrupt record ({exc})") from None
    if not any(isinstance(e, RunStarted) for e in events):
        raise EngineError(f"{path} holds no run (no 'started' event)")
    return header, events


@dataclass
class ReplayEngine:
    """Plays a record back through the engine protocol."""

    settings: RunSettings
    header: dict
    events: list[Event] = field(default_factory=list)

    @classmethod
    def open(cls, path: Path, settings: RunSettings) -> ReplayEngine:
        header, events = read_record(path)
        recorded = RunSettings.from_json(header.get("settings", {}))
        # What ran is what was recorded; only the pace is the caller's.
        merged = replace(recorded, engine=settings.engine, replay_speed=settings.replay_speed)
        return cls(merged, header, events)

    def started(self) -> RunStarted:
        return next(e for e in self.events if isinstance(e, RunStarted))

    def steps(self, loop: Loop) -> Iterator[StepSample | RunFinished]:
        for event in self.events:
            if isinstance(event, StepSample) and event.loop == loop:
                if self.settings.replay_speed > 0:
                    time.sleep(event.step_seconds / self.settings.replay_speed)
                yield event
            elif isinstance(event, RunFinished) and event.loop == loop:
                yield event
                return

    def close(self) -> None:
        pass
