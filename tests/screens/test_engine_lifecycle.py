"""The engine's process from the app's side: pause, restart, quit mid-run, failures."""

from __future__ import annotations

from dataclasses import replace

from conftest import build, notifications, wait_for
from fakes import FakeEngine
from textual.worker import WorkerState

from kvtui.engines.protocol import RunFailed

SIZE = (100, 30)


async def test_quitting_mid_run_ends_the_engine_and_the_worker():
    app = build(1, hold_at=10)  # the engine stalls mid-run, like a long step
    async with app.run_test(size=SIZE) as pilot:
        engine = FakeEngine.instances[-1]
        await wait_for(pilot, lambda: engine.alive)  # started by the reader worker
        workers = [w for w in app.workers if w.group == "decode"]
        await pilot.press("q")
    assert not engine.alive
    assert all(w.state in (WorkerState.CANCELLED, WorkerState.SUCCESS) for w in workers)


async def test_space_pauses_and_resumes():
    app = build(1, hold_at=10)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.live.state == "running")
        await pilot.press("space")
        assert app.live.state == "paused"
        assert FakeEngine.instances[-1].paused_calls == 1
        await pilot.press("space")
        assert app.live.state == "running"


async def test_restart_replaces_the_engine():
    app = build(1, hold_at=10)
    async with app.run_test(size=SIZE) as pilot:
        first = FakeEngine.instances[-1]
        await wait_for(pilot, lambda: first.alive)  # running, so the restart has one to end
        await pilot.press("r")
        second = FakeEngine.instances[-1]
        assert second is not first
        await wait_for(pilot, lambda: not first.alive and second.alive)


async def test_a_worker_failure_becomes_a_notification():
    app = build(1, fail_start=RuntimeError("no engine here"))
    seen = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await wait_for(
            pilot,
            lambda: (
                app.live.state == "failed"
                and any("no engine here" in m for m in notifications(seen))
            ),
        )
        assert app.is_running  # the app stays up


async def test_a_dying_engine_says_so_and_offers_restart():
    events = [RunFailed("decode engine killed by signal 9")]
    app = build(1, events=events)
    seen = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await wait_for(pilot, lambda: any("signal 9" in m for m in notifications(seen)))
        app.screen.redraw_now()
        header = str(app.screen.query_one("RunHeader").render())
        assert "killed by signal 9" in header and "r restarts" in header


async def test_r_runs_exactly_the_chosen_length_longer_or_shorter():
    app = build(1, 32, hold_at=10)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.live.started is not None)
        await pilot.press(*["right"] * 8)  # 32 -> 40
        note = app.screen.query_one("#run-note")
        await wait_for(pilot, lambda: "r runs 40 tokens (this run: 32)" in str(note.render()))
        assert note.has_class("-beyond")
        await pilot.press("r")
        assert FakeEngine.instances[-1].settings.tokens == 40 == app.live.run_tokens
        await wait_for(pilot, lambda: not note.has_class("-beyond"))  # redrawn for the new run
        await pilot.press(*["left"] * 10, "r")  # shorter: it runs shorter
        assert FakeEngine.instances[-1].settings.tokens == 30 == app.live.run_tokens


async def test_restart_is_capped_at_the_longest_length():
    app = build(2, 24, hold_at=10)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*["shift+right"] * 10, "r")  # the length doubles up to 4,096
        assert app.length == 4096
        await wait_for(pilot, lambda: app.screen.length == 4096)
        assert FakeEngine.instances[-1].settings.tokens == 4096


async def test_an_engine_that_refuses_the_length_says_why():
    from conftest import SETTINGS
    from fakes import sim_events

    from kvtui.engines.protocol import RunFinished

    why = "4,140 positions is past the model's 4,096"
    started = replace(sim_events(SETTINGS)[0], max_positions=4096)
    events = [
        started,
        RunFinished("uncached", "error", 0, why),
        RunFinished("cached", "error", 0, why),
    ]
    app = build(1, events=events)
    seen = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await wait_for(
            pilot,
            lambda: app.live.state == "failed" and any(why in m for m in notifications(seen)),
        )
        app.screen.redraw_now()
        header = str(app.screen.query_one("RunHeader").render())
        assert why in header and "r restarts" in header
        told = [m for m in notifications(seen) if why in m]
        assert len(told) == 1 and "r runs 32 tokens (at most 4,087 fit)" in told[0]


async def test_restart_stays_within_the_models_positions():
    from dataclasses import replace

    from conftest import SETTINGS
    from fakes import sim_events

    events = sim_events(SETTINGS)
    limit = events[0].prompt_tokens + 50  # a model that holds 50 answer tokens after the prompt
    events = [replace(events[0], max_positions=limit), *events[1:]]
    app = build(1, 24, events=events)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.live.started is not None)  # the model's limit known
        await pilot.press(*["right"] * 60, "r")
        assert app.length == 50  # capped: the model holds no more after its prompt
        assert FakeEngine.instances[-1].settings.tokens == 50
