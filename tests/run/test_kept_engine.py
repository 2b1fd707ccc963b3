"""A torch run's engine process is kept once its run is over or stopped, model loaded, and the
next torch run adopts it: a KV budget change resizes the pool in place, with no process started
and no model loaded (issue 34: every budget change cost a ~5 s restart)."""

from __future__ import annotations

from dataclasses import replace

from kvtui.engines.protocol import (
    Event,
    RunFinished,
    RunProgress,
    RunSettings,
    RunStarted,
    StepSample,
)
from kvtui.run.process import Engines

TINY = RunSettings(engine="tiny", device="cpu", tokens=8, loops=("cached",))


def read(engines: Engines, settings: RunSettings, stop_after_steps: int | None = None):
    """Run `settings` to its end (or stop it after that many steps): its events and its pid."""
    engine = engines(settings)
    events: list[Event] = []
    pids: list[int | None] = []

    def report(batch: list[Event]) -> None:
        pids.append(engine.pid)
        events.extend(batch)

    def stopped() -> bool:
        steps = sum(isinstance(e, StepSample) for e in events)
        return stop_after_steps is not None and steps >= stop_after_steps

    engines.read(engine, report, stopped)
    return events, pids[0]


def phrases(events: list[Event]) -> list[str]:
    return [e.phrase for e in events if isinstance(e, RunProgress)]


def test_a_budget_change_runs_in_the_same_process_on_the_loaded_model():
    engines = Engines()
    try:
        first, pid = read(engines, TINY)
        assert isinstance(first[-1], RunFinished) and first[-1].reason == "done"
        budget = 256 * 1024  # 5 blocks of 16 rows of 3,072 bytes: 80 slots
        second, again = read(engines, replace(TINY, kv_budget_bytes=budget, tokens=40))
        assert again == pid  # the same process: no child started, no torch imported
        assert phrases(second) == ["the model is loaded: a new KV pool, no restart"]
        started = next(e for e in second if isinstance(e, RunStarted))
        assert started.kv_capacity_bytes == budget and started.kv_pool_source == "--kv-budget"
        finished = second[-1]
        assert isinstance(finished, RunFinished) and finished.reason == "out_of_memory"
        assert finished.steps == 80 - started.prompt_tokens + 1  # the resized pool's stop
    finally:
        engines.close()


def test_a_stopped_run_hands_its_process_to_the_next_and_a_new_model_loads_fresh():
    engines = Engines()
    try:
        long = replace(TINY, tokens=2000, loops=("uncached",))
        stopped, pid = read(engines, long, stop_after_steps=3)
        assert not any(isinstance(e, RunFinished) and e.reason == "done" for e in stopped)
        events, again = read(engines, replace(TINY, kv_budget_bytes=1 << 20))
        assert again == pid and phrases(events)[0].startswith("the model is loaded")
        events, third = read(engines, replace(TINY, seed=7))  # another seed: another model
        assert third == pid  # the process still, torch and all
        assert not any(p.startswith("the model is loaded") for p in phrases(events))
        assert isinstance(events[-1], RunFinished) and events[-1].reason == "done"
    finally:
        engines.close()
