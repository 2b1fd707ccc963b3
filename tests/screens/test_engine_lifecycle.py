"""The engine's process from the app's side: pause, restart, quit mid-run, failures."""

from __future__ import annotations

from conftest import build
from fakes import FakeEngine
from textual.worker import WorkerState

from kvtui.sim.steps import RunFailed

SIZE = (100, 30)


async def test_quitting_mid_run_ends_the_engine_and_the_worker():
    app = build(1, hold_at=10)  # the engine stalls mid-run, like a long step
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        engine = FakeEngine.instances[-1]
        assert engine.alive
        workers = [w for w in app.workers if w.group == "decode"]
        await pilot.press("q")
    assert not engine.alive
    assert all(w.state in (WorkerState.CANCELLED, WorkerState.SUCCESS) for w in workers)


async def test_space_pauses_and_resumes():
    app = build(1, hold_at=10)
    async with app.run_test(size=SIZE) as pilot:
        while app.live.state != "running":
            await pilot.pause()
        await pilot.press("space")
        assert app.live.state == "paused"
        assert FakeEngine.instances[-1].paused_calls == 1
        await pilot.press("space")
        assert app.live.state == "running"


async def test_restart_replaces_the_engine():
    app = build(1, hold_at=10)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        first = FakeEngine.instances[-1]
        await pilot.press("r")
        await pilot.pause()
        second = FakeEngine.instances[-1]
        assert second is not first
        for _ in range(50):
            if not first.alive:
                break
            await pilot.pause(0.02)
        assert not first.alive


async def test_a_worker_failure_becomes_a_notification():
    app = build(1, fail_start=RuntimeError("no engine here"))
    async with app.run_test(size=SIZE) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.live.state == "failed"
        messages = [n.message for n in app._notifications]
        assert any("no engine here" in m for m in messages)
        assert app.is_running  # the app stays up


async def test_a_dying_engine_says_so_and_offers_restart():
    events = [RunFailed("decode engine killed by signal 9")]
    app = build(1, events=events)
    async with app.run_test(size=SIZE) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        app.screen.mark_dirty()
        app.screen._tick()
        header = str(app.screen.query_one("RunHeader").render())
        assert "killed by signal 9" in header and "r restarts" in header
        assert any("signal 9" in n.message for n in app._notifications)
