"""Pilot tests: press the keys a user presses, then read what the screens show."""

from __future__ import annotations

from dataclasses import replace

from conftest import PROBE, SETTINGS, build, notifications, screen_text, wait_for
from fakes import FakeEngine, sim_events
from textual.widgets import OptionList, Static

from kvtui.app import make_app
from kvtui.engines.protocol import RunSettings
from kvtui.engines.roofline import MODELLED
from kvtui.format import format_ratio
from kvtui.screens.cache import CacheScreen
from kvtui.screens.memory import MemoryScreen
from kvtui.screens.quiz import QUESTIONS, QuizScreen
from kvtui.screens.recompute import RecomputeScreen
from kvtui.testing import headless
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


async def test_screen1_cards_are_the_positions_the_run_reported():
    """The cards add up the positions the run's steps reported, not a formula of their own:
    the fake reports the counting rule's P + t - 1 at step t (P = 9 here), and a run that
    reports one more position on its last step moves every card by it."""
    P, n = 9, 24
    total = sum(P + t - 1 for t in range(1, n + 1))
    honest = sim_events(replace(SETTINGS, tokens=n))
    last = max(i for i, e in enumerate(honest) if _is(e, "uncached", n - 1))
    one_more = [*honest]
    one_more[last] = replace(honest[last], positions_computed=P + n)
    for events, extra in ((honest, 0), (one_more, 1)):
        app = build(1, n, events=events)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert isinstance(app.screen, RecomputeScreen)
            assert app.live.prompt_tokens == P
            assert (card(app, "per-step"), card(app, "total"), card(app, "wasted")) == (
                f"{P + n - 1 + extra}",
                f"{total + extra:,}",
                f"{total - (P + n - 1):,}",
            )


async def test_lesson_mode_runs_the_lessons_prompt_and_length():
    """l restarts with a one-token prompt and 24 tokens; the positions that run reports (the
    fake's are the counting rule's) are then the lesson's 24 (the last step's positions), 300,
    276, and screen 2's."""
    app = build(1, 32)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        await settle(app, pilot)
        assert app.live.settings.lesson and app.live.prompt_tokens == 1
        assert FakeEngine.instances[-1].settings.tokens == 24
        assert (card(app, "per-step"), card(app, "total"), card(app, "wasted")) == (
            "24",
            "300",
            "276",
        )
        await pilot.press("2")
        await settle(app, pilot)
        assert (card(app, "without"), card(app, "with"), card(app, "speedup")) == (
            "300",
            "24",
            "12.5x",
        )
        assert "lesson mode" in screen_text(app)


async def test_screen2_compares_the_same_span_of_both_loops():
    app = build(2, 32, lesson=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert (card(app, "without"), card(app, "with"), card(app, "speedup")) == (
            "528",
            "32",
            "16.5x",
        )
        mark = app.screen.query_one("#same-mark", Static)
        assert "identical" in str(mark.render()) and mark.has_class("-identical")
        uncached = app.live.loop("uncached").seconds_cumulative[-1]
        cached = app.live.loop("cached").seconds_cumulative[-1]
        assert card(app, "measured") == format_ratio(uncached / cached)


async def test_the_cached_stream_races_ahead_mid_run():
    """Mid-run (the engine held after 40 events), the cached loop is further on, and the cards
    compare only the steps both loops have made."""
    app = build(2, 32, lesson=True, hold_at=40)
    async with app.run_test(size=SIZE) as pilot:
        engine = FakeEngine.instances[-1]
        await wait_for(pilot, lambda: len(engine.sent) >= 40)
        # sent is not yet shown: wait until the app has taken all 40 (the start and 39 steps)
        loop = app.live.loop
        await wait_for(pilot, lambda: loop("cached").steps + loop("uncached").steps == 39)
        app.screen.redraw_now()
        cached, uncached = app.live.loop("cached").steps, app.live.loop("uncached").steps
        assert cached > uncached > 0
        n = uncached
        assert card(app, "without") == f"{n * (n + 1) // 2:,}"
        assert card(app, "with") == f"{n:,}"
        stream = app.screen.query_one("#stream-cached")
        assert f"{cached} tokens" in stream.border_subtitle


async def test_screen2_shows_the_first_divergence():
    from conftest import SETTINGS
    from fakes import sim_events

    from kvtui.engines.protocol import StepSample

    events = sim_events(SETTINGS)
    tampered = [
        StepSample(**{**vars(e), "token_id": 999}) if _is(e, "cached", 5) else e for e in events
    ]
    app = build(2, 32, events=tampered)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        mark = app.screen.query_one("#same-mark", Static)
        assert "first divergence at step 6" in str(mark.render())
        assert mark.has_class("-diverged")


def _is(event, loop, step) -> bool:
    return getattr(event, "loop", None) == loop and getattr(event, "step", None) == step


async def test_c_off_leaves_no_cache_figure_on_screen():
    app = build(1, 24)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("c")
        assert isinstance(app.screen, CacheScreen) and app.screen.cache_on
        await pilot.press("c")
        await pilot.pause()
        assert not app.screen.cache_on and app.screen.has_class("-cache-off")
        assert (card(app, "with"), card(app, "speedup"), card(app, "measured")) == (
            "off",
            "—",
            "—",
        )
        text = screen_text(app)
        assert "With a cache" not in text and "identical" not in text
        assert "saved" not in text


async def test_the_chosen_length_is_what_r_runs():
    app = build(1, 24)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press(*["right"] * 8)
        assert app.length == 32 and card(app, "length") == "24"  # still the run's
        assert "r runs 32 tokens" in screen_text(app)
        await pilot.press("r")
        await settle(app, pilot)
        assert FakeEngine.instances[-1].settings.tokens == 32 == app.live.run_tokens
        assert card(app, "length") == "32"
        await pilot.press(*["left"] * 20, "r")  # shorter runs shorter
        await settle(app, pilot)
        assert FakeEngine.instances[-1].settings.tokens == 12
        await pilot.press(*["left"] * 40)
        assert app.length == 1  # clamped at 1


async def test_the_sim_engine_says_modelled_and_why():
    """Times from the roofline are labelled modelled, and the screen says why its speedup is
    what it is (llama-3.1-8b on an H100 turns compute-bound at about 316 positions)."""
    events = sim_events(SETTINGS)
    assert events[0].timing == MODELLED  # the fake says what the sim: engine says
    app = build(2, 32, events=events)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        text = screen_text(app)
        assert "MODELLED" in text and "MEASURED" not in text
        assert "about 316 positions" in text
        assert app.screen.query_one("#measured", StatCard).note == "roofline"


async def test_a_measured_run_says_measured_and_wall_time():
    """The same run, reported as measured (a CPU engine's): the time card is MEASURED, wall
    time, and the explanation is the measured one, not the roofline's."""
    app = build(2, 32, measured=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.live.timing == "measured"
        text = screen_text(app)
        assert "MEASURED" in text and "MODELLED" not in text
        assert "Measured is below the count" in " ".join(text.split())
        assert "roofline" not in text
        timed = app.screen.query_one("#measured", StatCard)
        assert timed.border_title == "MEASURED" and timed.note == "wall time"


async def test_screen3_turns_red_past_capacity_and_clears_below():
    app = build(3)
    async with app.run_test(size=SIZE) as pilot:
        assert isinstance(app.screen, MemoryScreen)
        assert (card(app, "kv"), card(app, "share"), card(app, "status")) == (
            "23.4 GiB",
            "49%",  # weights 15 + KV 23.4 + runtime 1 of 80 GiB
            "FITS",
        )
        bar = app.screen.query_one("#whatif-bar", VramBar)
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


async def test_explain_it_back_asks_each_node_then_the_closing_question():
    app = build(3)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("t")
        assert isinstance(app.screen, QuizScreen)
        text = screen_text(app)
        assert "1 of 4" in text and "token 24" in text
        assert "memory, not compute" not in text and "KV CACHE" not in text  # opaque
        await pilot.press(*_to_answer(app.screen, right=True), "enter")  # 24: every position
        feedback = app.screen.query_one("#feedback", Static)
        assert feedback.has_class("-right") and "300" in str(feedback.render())
        await pilot.press("n", "n", "n")
        text = screen_text(app)
        assert "4 of 4" in text and "plenty of compute left" in text
        assert "ran out of room" in text  # the choice, but no feedback yet
        assert not feedback.has_class("-right") and not feedback.has_class("-wrong")
        await pilot.press(*_to_answer(app.screen, right=True), "enter")  # memory
        assert feedback.has_class("-right")
        await pilot.press(*_to_answer(app.screen, right=False), "enter")
        assert feedback.has_class("-wrong")
        await pilot.press("escape")
        assert isinstance(app.screen, MemoryScreen)


def _to_answer(quiz: QuizScreen, *, right: bool) -> list[str]:
    """The keys from the highlighted answer to the first right (or wrong) one, as shown."""
    shown = [is_right for _, is_right, _ in quiz.answers()]
    target = shown.index(right)
    here = quiz.query_one(OptionList).highlighted
    here = -1 if here is None else here  # none highlighted: the first ↓ goes to the first
    return ["down"] * (target - here) if target >= here else ["up"] * (here - target)


async def test_the_quiz_shuffles_and_balances_its_answers_and_hides_them_while_asking():
    """The right answer is not always first nor the longest (a guess by place or by length
    would pass), the order is the seed's, and while a question is asked nothing on screen
    says which answer is right: no feedback, nothing of the lesson's screens behind."""
    quiz = QuizScreen(seed=0)
    places = set()
    for index, question in enumerate(QUESTIONS):
        shown = quiz.answers(index)
        assert sorted(shown) == sorted(question.answers)  # the same answers, reordered
        assert shown == QuizScreen(seed=0).answers(index)  # seeded: the same order again
        right = next(len(text) for text, is_right, _ in shown if is_right)
        longest_wrong = max(len(text) for text, is_right, _ in shown if not is_right)
        assert right <= 1.1 * longest_wrong, question.text  # balanced: no tell in its length
        places.add([is_right for _, is_right, _ in shown].index(True))
    assert len(places) > 1  # not always in the same place
    app = build(3)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("t")
        for index in range(len(QUESTIONS)):
            assert app.screen.index == index
            text = " ".join(screen_text(app).split())
            for _, _, feedback in app.screen.answers():
                assert feedback[:40] not in text
            assert "memory, not compute" not in text and "P + t - 1" not in text
            await pilot.press("n")


async def test_enter_alone_answers_nothing_and_each_session_orders_the_answers_its_own_way():
    """The right answer of questions 1 and 3 was the first, highlighted when the question
    opened: enter alone scored. Nothing is highlighted now, and the order is the session's
    seed's (a test reproduces one by passing it)."""
    app = build(3)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("t")
        quiz = app.screen
        assert isinstance(quiz, QuizScreen)
        feedback = quiz.query_one("#feedback", Static)
        for _ in QUESTIONS:
            assert quiz.query_one(OptionList).highlighted is None
            await pilot.press("enter")
            assert not feedback.has_class("-right") and not feedback.has_class("-wrong")
            await pilot.press("n")
        assert quiz.right == set()
    orders = {
        tuple(tuple(text for text, _, _ in QuizScreen(seed=seed).answers(i)) for i in range(4))
        for seed in range(8)
    }
    assert len(orders) > 1  # each session its own order
    assert QuizScreen().seed == QuizScreen().seed  # one seed a session
    for index in range(len(QUESTIONS)):  # over sessions, the right answer takes every place
        places = {
            [right for _, right, _ in QuizScreen(seed=seed).answers(index)].index(True)
            for seed in range(32)
        }
        assert places == set(range(len(QUESTIONS[index].answers)))


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
        first = app.screen
        for key, kind in (("2", CacheScreen), ("3", MemoryScreen), ("1", RecomputeScreen)):
            await pilot.press(key)
            assert isinstance(app.screen, kind)
        assert app.screen is first  # screen 1 is the one the app opened on, not a second
        seen = {}
        for key in "23412341":  # each screen is built once, and kept
            await pilot.press(key)
            assert seen.setdefault(key, app.screen) is app.screen


async def test_streams_show_the_run():
    app = build(1)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.live.state == "done"
        stream = app.screen.query_one("#stream")
        assert "wisdom" in stream.text
        assert "done" in str(app.screen.query_one("RunHeader").render())


async def test_a_run_past_the_trained_context_says_so_where_it_happens():
    events = sim_events(SETTINGS)
    trained = events[0].prompt_tokens + 20  # trained on 29 positions: tokens 21-32 go past
    events = [replace(events[0], trained_positions=trained), *events[1:]]
    app = build(1, 32, events=events)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        text = " ".join(screen_text(app).split())  # the note wraps beside the stream's border
        assert "from token 21 past the" in text and "context the model was trained on" in text


async def test_the_palettes_screenshot_is_saved(tmp_path, monkeypatch):
    """The palette's Screenshot on a machine without ~/Downloads (a server, a container):
    saved in the current folder and said so, not "Failed to save screenshot"."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no Downloads folder there
    monkeypatch.chdir(tmp_path)
    app = build(1)
    seen = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await settle(app, pilot)
        app.action_screenshot()
        await wait_for(pilot, lambda: any("screenshot" in n for n in notifications(seen)))
        assert any(n.startswith("Saved screenshot") for n in notifications(seen))
        (saved,) = tmp_path.glob("*.svg")
        assert "PER&#160;STEP" in saved.read_text(encoding="utf-8")  # spaces are &#160; in SVG


async def test_the_app_opens_in_the_theme_asked_for_and_the_palette_still_changes_it():
    """`--theme light`, for a projector in a bright room: textual-light from the first frame."""
    app = make_app(SETTINGS, probe=PROBE, theme="light", engine_factory=FakeEngine)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.theme == "textual-light"
        assert app.current_theme.dark is False
        app.theme = "textual-dark"  # what the palette's Theme command sets
        await pilot.pause()
        assert app.current_theme.dark is True


async def test_a_one_token_run_says_one_step():
    """A card counts in the singular too: "1 step", not "1 steps"."""
    async with headless(RunSettings("sim:llama-3.1-8b@h100", tokens=1), 1) as run:
        await run.until_done()
        assert run.card("total").note == "1 step"
