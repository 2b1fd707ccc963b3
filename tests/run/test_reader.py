"""The one reader (kvtui.run.process) and the one owner of engines (kvtui.run.process.Engines),
without a UI: a burst of events is handed on in a few batches at a bounded rate, the reader always
closes its engine, and the owner ends every engine still open."""

from __future__ import annotations

import threading
import time

import pytest

from kvtui.engines.protocol import RunFailed, RunSettings
from kvtui.run.process import BATCH_INTERVAL_S, Engines, read_engine
from kvtui.testing import ScriptedEngine

SIM = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=200, replay_speed=0)


def _reported() -> tuple[list[list], list[float], object]:
    batches: list[list] = []
    times: list[float] = []

    def report(events: list) -> None:
        batches.append(events)
        times.append(time.monotonic())

    return batches, times, report


def test_a_burst_is_handed_on_whole_in_order_in_few_batches_at_a_bounded_rate():
    engine = ScriptedEngine.from_settings(SIM)  # 1 + 2 x 200 + 2 events, as fast as it can
    batches, times, report = _reported()
    assert read_engine(engine, report, lambda: False) is True
    handed = [event for batch in batches for event in batch]
    assert handed == engine.sent and len(handed) == 1 + 2 * 200 + 2
    assert len(batches) < len(handed) / 10  # coalesced: not an event at a time
    gaps = [b - a for a, b in zip(times, times[1:-1], strict=False)]  # the last goes at once
    assert all(gap >= BATCH_INTERVAL_S * 0.99 for gap in gaps), gaps
    assert not engine.alive  # closed


def test_a_stopped_read_ends_within_an_interval_and_closes_the_engine():
    engine = ScriptedEngine.from_settings(SIM, hold_at=5)  # stalls mid-run, like a long step
    stop = threading.Event()
    batches, _, report = _reported()
    threading.Timer(0.3, stop.set).start()
    began = time.monotonic()
    assert read_engine(engine, report, stop.is_set) is False
    assert time.monotonic() - began < 0.3 + 5 * BATCH_INTERVAL_S  # a bound, not a goal
    assert [e for b in batches for e in b] == engine.sent[:5]
    assert not engine.alive


def test_an_engine_that_cannot_start_is_closed_and_the_error_raised():
    closed = []
    engine = ScriptedEngine([], fail_start=RuntimeError("no engine here"))
    engine.close = lambda timeout=1.0: closed.append(timeout)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="no engine here"):
        read_engine(engine, lambda events: None, lambda: False)
    assert closed == [1.0]


def test_a_broken_stream_ends_the_run_with_a_failure_that_says_so():
    class Broken(ScriptedEngine):
        def events(self):
            yield from ()
            raise OSError("pipe closed")

    batches, _, report = _reported()
    assert read_engine(Broken([]), report, lambda: False) is True
    (failed,) = [e for b in batches for e in b]
    assert isinstance(failed, RunFailed) and failed.message == "engine stream broke: pipe closed"


def test_the_owner_reads_what_it_made_and_ends_every_engine_still_open():
    made: list[ScriptedEngine] = []
    closed: list[ScriptedEngine] = []

    def make(settings: RunSettings) -> ScriptedEngine:
        engine = ScriptedEngine.from_settings(settings, hold_at=3)  # stalls at its 3rd event
        close = engine.close

        def counted(timeout: float = 1.0) -> None:
            closed.append(engine)
            close(timeout)

        engine.close = counted  # type: ignore[method-assign]
        made.append(engine)
        return engine

    engines = Engines(make)
    engines.prepare(RunSettings(engine="tiny"))
    assert engines.spare is None  # engines of its own `make` take no spare
    run, race, never_started = engines(SIM), engines(SIM), engines(SIM)
    readers = [
        threading.Thread(target=engines.read, args=(e, lambda events: None, lambda: False))
        for e in (run, race)
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 10
    while not (len(run.sent) == len(race.sent) == 3) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.alive and race.alive and closed == []  # held, mid-run
    engines.close()  # quitting: every engine it made that no reader has closed
    assert (
        {id(e) for e in closed} == {id(e) for e in made} == {id(run), id(race), id(never_started)}
    )
    for reader in readers:
        reader.join(5)
        assert not reader.is_alive()  # their readers ended with them
    assert not any(e.alive for e in made) and [len(e.sent) for e in made] == [3, 3, 0]


def test_the_owner_forgets_an_engine_its_reader_has_closed():
    engines = Engines(ScriptedEngine.from_settings)
    engine = engines(SIM)
    assert engines.read(engine, lambda events: None, lambda: False) is True
    again: list[float] = []
    engine.close = again.append  # type: ignore[method-assign]
    engines.close()
    assert again == []  # closed by its reader, and not held after
