"""Pilot tests: press the keys a user presses, then read what the screens show."""

from __future__ import annotations

from conftest import build
from textual.widgets import Static

from kvtui.screens.cache import CacheScreen
from kvtui.screens.memory import MemoryScreen
from kvtui.screens.quiz import QuizScreen
from kvtui.screens.recompute import RecomputeScreen
from kvtui.widgets.cards import StatCard
from kvtui.widgets.vram import VramBar

SIZE = (100, 30)


def card(app, card_id: str) -> str:
    return app.screen.query_one(f"#{card_id}", StatCard).value


async def settle(app, pilot) -> None:
    """Let the fake run finish and the screens draw it."""
    await app.workers.wait_for_complete()
    await pilot.pause()
    app.screen.redraw_now()
    await pilot.pause()


async def test_screen1_cards_for_the_lesson_length():
    app = build(1, 24)
    async with app.run_test(size=SIZE):
        assert isinstance(app.screen, RecomputeScreen)
        assert (card(app, "per-step"), card(app, "total"), card(app, "wasted")) == (
            "24x",
            "300",
            "276",
        )


async def test_screen1_length_keys_move_the_cards():
    app = build(1, 24)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*["right"] * 8)
        assert card(app, "length") == "32"
        assert (card(app, "per-step"), card(app, "total"), card(app, "wasted")) == (
            "32x",
            "528",
            "496",
        )
        await pilot.press("minus", "left")
        assert card(app, "total") == "465"  # 30 x 31 / 2
        await pilot.press(*["left"] * 40)
        assert card(app, "length") == "1"  # clamped at 1


async def test_screen2_cards_and_identical_mark():
    app = build(1, 24)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*["right"] * 8)  # 32, chosen on screen 1
        await pilot.press("2")
        assert isinstance(app.screen, CacheScreen)
        await settle(app, pilot)
        assert (card(app, "without"), card(app, "with"), card(app, "speedup")) == (
            "528",
            "32",
            "16.5x",
        )
        mark = app.screen.query_one("#same-mark", Static)
        assert "identical" in str(mark.render()) and mark.has_class("-identical")
        assert card(app, "measured").endswith("x")


async def test_screen2_shows_the_first_divergence():
    from conftest import SETTINGS
    from fakes import sim_events

    from kvtui.engine.protocol import StepSample

    events = sim_events(SETTINGS)
    tampered = [
        StepSample(**{**vars(e), "token_id": 999}) if _is(e, "cached", 5) else e for e in events
    ]
    app = build(2, 24, events=tampered)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        mark = app.screen.query_one("#same-mark", Static)
        assert "first divergence at step 6" in str(mark.render())
        assert mark.has_class("-diverged")


def _is(event, loop, step) -> bool:
    return getattr(event, "loop", None) == loop and getattr(event, "step", None) == step


async def test_c_turns_the_cache_on_and_off():
    app = build(1, 24)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("c")
        assert isinstance(app.screen, CacheScreen) and app.screen.cache_on
        await pilot.press("c")
        assert not app.screen.cache_on
        assert card(app, "with") == "off"
        assert app.screen.has_class("-cache-off")


async def test_screen3_turns_red_past_capacity_and_clears_below():
    app = build(3)
    async with app.run_test(size=SIZE) as pilot:
        assert isinstance(app.screen, MemoryScreen)
        assert (card(app, "kv"), card(app, "share"), card(app, "status")) == (
            "23.4 GiB",
            "29%",
            "FITS",
        )
        bar = app.screen.query_one(VramBar)
        assert not bar.has_class("-overflow")
        await pilot.press("plus", "plus")  # 96,000 tokens x 8 sequences
        assert card(app, "status") == "OVERFLOW"
        assert bar.has_class("-overflow")
        assert app.screen.query_one("#status", StatCard).has_class("-bad")
        await pilot.press("minus")
        assert card(app, "status") == "FITS"
        assert not bar.has_class("-overflow")


async def test_screen3_pickers_change_the_budget():
    app = build(3)
    async with app.run_test(size=SIZE) as pilot:
        before = card(app, "kv")
        await pilot.press("k")  # bf16 -> fp8
        assert card(app, "kv") == "11.7 GiB" != before
        await pilot.press("b")  # batch 8 -> 16
        assert app.screen.batch == 16
        await pilot.press("g")
        assert app.screen.gpu == "gh200"


async def test_quiz_gives_feedback():
    app = build(3)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("t")
        assert isinstance(app.screen, QuizScreen)
        await pilot.press("down", "enter")  # the second answer: memory
        feedback = app.screen.query_one("#feedback", Static)
        assert feedback.has_class("-right")
        await pilot.press("down", "enter")
        assert feedback.has_class("-wrong")
        await pilot.press("escape")
        assert isinstance(app.screen, MemoryScreen)


async def test_help_opens_and_closes():
    app = build(1)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert app.screen.__class__.__name__ == "HelpScreen"
        await pilot.press("escape")
        assert isinstance(app.screen, RecomputeScreen)


async def test_too_small_says_how_large():
    app = build(1)
    async with app.run_test(size=(70, 20)) as pilot:
        await pilot.pause()
        assert app.screen.has_class("-too-small")
        note = str(app.screen.query_one("TooSmall").render())
        assert "80x24" in note and "70x20" in note


async def test_screens_switch_with_number_keys():
    app = build(1)
    async with app.run_test(size=SIZE) as pilot:
        for key, kind in (("2", CacheScreen), ("3", MemoryScreen), ("1", RecomputeScreen)):
            await pilot.press(key)
            assert isinstance(app.screen, kind)


async def test_streams_show_the_run():
    app = build(1)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.live.state == "done"
        stream = app.screen.query_one("#stream")
        assert "wisdom" in stream.text
        assert "done" in str(app.screen.query_one("RunHeader").render())
