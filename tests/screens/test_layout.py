"""The layout holds from 80x24 up: every line whole, the live lines on screen 3 in view."""

from __future__ import annotations

import re

import pytest
from conftest import PROBE, build, screen_text
from test_screens import settle

from kvtui.engines.protocol import RunSettings
from kvtui.engines.roofline import MODELLED
from kvtui.screens.quiz import QuizScreen
from kvtui.testing import headless
from kvtui.widgets.chart import rolling_median
from kvtui.widgets.vram import VramBar

SMALL, MEDIUM, LARGE = (80, 24), (100, 30), (160, 48)


@pytest.mark.parametrize("size", [SMALL, MEDIUM, LARGE])
async def test_screen3_shows_the_live_lines(size):
    """The fake's run is a `sim:` device's, timed by arithmetic: the lines say modelled."""
    app = build(3)
    async with app.run_test(size=size) as pilot:
        await settle(app, pilot)
        assert app.live.timing == MODELLED
        text = screen_text(app)
        assert "measured" not in text.lower()
        for words in (
            "LIVE (modelled): llama-3.1-8b on sim: h100",
            "Live (modelled: roofline):",
            "KV held",
            "= formula",
            "pos/s: prefill",
            "batch 1 (n):",
            "Formula bytes, FLOPs / modelled time:",
            "read, ",
            "of peak",
            "FLOPs/byte, ridge 295: memory-bound",
            "24,000 tok",
        ):
            assert words in text, f"{words!r} not on screen at {size}"
        assert app.screen.query_one(".side").max_scroll_y == 0  # all of it, without scrolling


ESSENTIALS = {
    1: (
        "1 · Without a cache",
        "PER STEP",
        "TOTAL",
        "WASTED",
        "ANSWER",
        "Without a cache",
        "placeholder · 32 tokens",  # the sim: engine's text is not a model's
        "positions per step, modelled",
        "modelled time per step (right axis)",
        "9 prompt tokens (l: lesson mode)",
        "with the square of the length.",
    ),
    2: (
        "2 · With the cache",
        "WITHOUT",
        "BY COUNT",
        "MODELLED",
        "identical: 32 tokens",
        "without a cache",
        "with a cache",
        "Modelled (roofline), not measured",
    ),
    3: (
        "3 · The cache grows",
        "LIVE (modelled): llama-3.1-8b on sim: h100",
        "459,088 slots",
        "WHAT-IF (modelled): Llama 3.1 8B (bf16) on",
        "KV CACHE",
        "MAX CONTEXT",
        "24,000 tok",
        "KV held",
        "FLOPs/byte, ridge 295: memory-bound",
        "runs out.",
    ),
}


@pytest.mark.parametrize("screen", [1, 2, 3])
async def test_80x24_every_screen_shows_its_essentials_whole(screen):
    """At 80x24 each screen shows its figures, legends and lines without scrolling, and no
    header, title, card or bar is cut (nothing ends in an ellipsis)."""
    app = build(screen)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        text = screen_text(app)
        joined = " ".join(text.split())
        for words in ESSENTIALS[screen]:
            assert words in joined, f"{words!r} not whole on screen {screen} at 80x24"
        assert "…" not in text, text
        assert text.splitlines()[0].rstrip().endswith("CPU, no GPU")  # the header, whole
        for scrolled in app.screen.query(".side"):
            assert scrolled.max_scroll_y == 0


async def test_80x24_screen3_keeps_its_lines_with_a_next_run_pending():
    """The budget keys add a line ("Next run: ..."): the live lines still fit."""
    app = build(3)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        await pilot.press("left_square_bracket", "n")
        await settle(app, pilot)
        text = " ".join(screen_text(app).split())
        assert "Next run:" in text and "FLOPs/byte, ridge 295: memory-bound" in text
        assert app.screen.query_one(".side").max_scroll_y == 0


async def test_80x24_screen1_keeps_its_narrative_and_legend():
    app = build(1, 24, measured=True)  # a measured run's legend: its times are wall time
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        assert app.screen.has_class("-narrow") and app.screen.has_class("-short")
        text = screen_text(app)
        assert "grows\n with the square of the length." in text
        assert "measured time per step (right axis)" in text
        assert "9 prompt tokens (l: lesson mode)" in text


async def test_80x24_screen2_keeps_its_explanation_and_legend():
    """The measured explanation, the longer one (a CPU run's), fits at 80x24."""
    app = build(2, 24, measured=True)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        assert app.live.timing == "measured"
        text = " ".join(screen_text(app).split())  # lines re-joined: the wrap does not matter
        assert "it still reads every cached key and value (screen 3)." in text
        assert "with a cache x: tokens" in text
        assert "identical: 24 tokens" in text  # both loops done: not "so far"
        assert "Positions computed per step" in text and "Total:" not in text
        await pilot.press("v")  # one chart at a time on a short terminal: the totals
        text = " ".join(screen_text(app).split())
        assert "Total: 460 positions saved so far" in text


async def test_header_says_plain_words_and_help_gives_the_reason():
    """Without a GPU NVML can read, the header says so in plain words at every width (never
    "NVML library not found (libnvidia-ml.so.1)"); help gives the reason in full."""
    for size in (SMALL, LARGE):
        app = build(1)
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            header = screen_text(app).splitlines()[0]
            assert header.rstrip().endswith("CPU, no GPU") and "NVML" not in header
            await pilot.press("question_mark")
            await pilot.pause()
            assert PROBE["description"] in screen_text(app)


async def test_80x24_help_fits_without_scrolling():
    app = build(1)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        text = screen_text(app)
        assert "kvtui: why LLM decoding" in text and "quit" in text
        help_text = app.screen.query_one("#help Static").render().plain
        for line in help_text.splitlines():  # each line whole, on a row of its own
            assert line.rstrip() in text, line


async def test_80x24_quiz_shows_the_feedback_whole():
    app = build(3)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("t", "n", "n", "n")  # the closing question
        quiz = app.screen
        assert isinstance(quiz, QuizScreen)
        right = [is_right for _, is_right, _ in quiz.answers()].index(True)
        await pilot.press(*["down"] * (right + 1), "enter")
        await pilot.pause()
        text = " ".join(screen_text(app).replace("│", " ").split())
        assert "bigger GPU are the ways out." in text


def test_rolling_median_drops_a_spike_and_keeps_a_ramp():
    jittery = [1.0, 1.1, 0.9, 1.0, 9.0, 1.0, 1.1, 0.9, 1.0]
    assert max(rolling_median(jittery, 5)) < 1.2
    ramp = [float(i) for i in range(20)]
    assert rolling_median(ramp, 9)[4:16] == ramp[4:16]
    assert rolling_median(ramp, 9, at=[0, 10, 19]) == [2.0, 10.0, 17.0]


async def test_a_memory_bar_names_a_part_whole_or_not_at_all():
    """A part too narrow for its name leaves it to the legend: at 160 columns the what-if's
    1 GiB runtime part (2 cells) showed an "r" beside the free part's name."""
    async with headless(RunSettings("sim:llama-3.1-8b@h100", tokens=24), 3, size=(160, 48)) as run:
        await run.until_done()
        await run.settle()
        for bar in run.app.screen.query(VramBar):
            assert bar.bar is not None
            line, start = bar.render().plain.splitlines()[0], 0
            for cells, part in zip(bar.widths(bar.bar, len(line)), bar.bar.parts, strict=True):
                shown = line[start : start + cells].strip(" ▒")
                start += cells
                assert shown in ("", part.name), (line, part.name)


async def test_80x24_memory_legend_names_every_part_with_its_whole_size():
    """Five parts on a GPU's bar (weights, KV, the last block's tail, free pool, other) at 80
    columns: every size whole ("other 9GiB"), where the legend was cut at "other 9"."""
    settings = RunSettings("sim:llama-3.1-70b@4xh100", tokens=256, replay_speed=0)
    async with headless(settings, 3, size=SMALL) as run:
        await run.until_done()
        legend = next(line for line in run.text().splitlines() if "■ weights" in line)
    for part in ("weights", "KV", "tail", "free", "other"):
        assert re.search(rf"{part} [\d.]+ ?[KMG]iB", legend), (part, legend)
