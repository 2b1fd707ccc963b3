"""Snapshots of the three screens over a deterministic engine (the fake sim run, fixed probe)."""

from __future__ import annotations

from conftest import build

from kvtui.app import KVApp


def _settled(app: KVApp):
    async def run_before(pilot) -> None:
        await app.workers.wait_for_complete()
        await pilot.pause()
        app.screen.redraw_now()
        await pilot.pause()

    return run_before


def test_screen1_100x30(snap_compare):
    app = build(1, 24)
    assert snap_compare(app, terminal_size=(100, 30), run_before=_settled(app))


def test_screen2_100x30(snap_compare):
    app = build(2, 32)
    assert snap_compare(app, terminal_size=(100, 30), run_before=_settled(app))


def test_screen3_100x30(snap_compare):
    app = build(3)
    assert snap_compare(app, terminal_size=(100, 30), run_before=_settled(app))


def test_screen3_overflow_80x24(snap_compare):
    app = build(3)

    async def run_before(pilot) -> None:
        await pilot.press("plus", "plus")
        await _settled(app)(pilot)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_screen1_80x24(snap_compare):
    app = build(1, 24)
    assert snap_compare(app, terminal_size=(80, 24), run_before=_settled(app))


def test_screen2_80x24(snap_compare):
    app = build(2, 32)
    assert snap_compare(app, terminal_size=(80, 24), run_before=_settled(app))
