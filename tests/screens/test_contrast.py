"""Everything on screen reads in a room, on the dark and the light theme: measured on what is
rendered (the app's own screenshot, `kvtui.testing.screen_cells`), not on the stylesheet's
constants. WCAG 2: text at 4.5:1 against what is under it (1.4.3), graphics (borders, chart
lines, swatches, marks, big digits) at 3:1 (1.4.11)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from textual.color import Color
from textual.geometry import Region
from textual.widgets import OptionList

from kvtui.screens.quiz import QuizScreen
from kvtui.testing import Cells, HeadlessRun, RunSettings, headless, screen_cells
from kvtui.widgets.chart import contrast_ratio

TEXT, GRAPHICS = 4.5, 3.0
_WORDS = re.compile(r"[^\W_]")  # a letter or a digit: text, read as words


def needed(cells: Cells) -> float:
    """Text (anything with a letter or digit) needs 4.5:1; marks, lines and glyphs 3:1."""
    return TEXT if _WORDS.search(cells.text) else GRAPHICS


def too_faint(run: HeadlessRun, where: str, region: Region | None = None) -> list[str]:
    """Every run of cells (inside `region`, if given) below its contrast, described."""
    faint = []
    for cells in screen_cells(run.app):
        if region is not None and not region.contains(cells.column, cells.row):
            continue
        ratio = contrast_ratio(cells.foreground, cells.background)
        if ratio < needed(cells):
            faint.append(
                f"{where} row {cells.row}, column {cells.column}: {cells.text.strip()[:24]!r} "
                f"{cells.foreground.hex} on {cells.background.hex} = {ratio:.2f}:1"
            )
    return faint


SETTINGS = RunSettings("sim:llama-3.1-8b@h100", tokens=24, kv_budget_bytes=2 << 20)
"""A run whose pool fills (16 tokens of 128 KiB): screen 3 shows the red, stopped pool."""


async def test_every_screen_reads_on_both_themes():
    """One run, each screen in each state drawn under textual-dark, then textual-light."""
    faint: list[str] = []
    async with headless(SETTINGS, 1, size=(100, 30)) as run:
        await run.until_done()
        # The pool filled, by design: the header says so, and no notification covers a panel.
        assert "KV cache full" in run.text().splitlines()[0] and not run.notifications
        await run.press("right")  # the run note turns to what r would run
        for theme in ("textual-dark", "textual-light"):
            run.app.theme = theme
            for where, keys in (
                ("screen 1", ()),
                ("screen 2", ("2",)),
                ("screen 2, cache off", ("c",)),
                ("screen 3", ("3", *["plus"] * 3)),  # the what-if past capacity: red
            ):
                await run.press(*keys)
                await run.settle()
                faint += too_faint(run, f"{theme}, {where}")
            assert run.card("status").value == "OVERFLOW"
            await run.press("question_mark")
            await run.settle()
            help_box = run.app.screen.query_one("#help").region  # the rest: a dimmed backdrop
            faint += too_faint(run, f"{theme}, help", help_box)
            await run.press("escape", "t")
            await run.press(*_answer(run, right=False), "enter")
            await run.settle()
            assert isinstance(run.app.screen, QuizScreen)
            faint += too_faint(run, f"{theme}, quiz, a wrong answer")
            await run.press(*_answer(run, right=True), "enter")
            await run.settle()
            faint += too_faint(run, f"{theme}, quiz, the right answer")
            await run.press("escape", "1", "c", "minus", "minus", "minus")  # back as it was
    assert not faint, "\n".join(faint)


def _answer(run: HeadlessRun, *, right: bool) -> list[str]:
    """Keys from the highlighted answer to the first right (or wrong) one."""
    quiz = run.app.screen
    assert isinstance(quiz, QuizScreen)
    target = [is_right for _, is_right, _ in quiz.answers()].index(right)
    here = quiz.query_one(OptionList).highlighted
    here = -1 if here is None else here  # none highlighted: the first ↓ goes to the first
    return ["down"] * (target - here) if target >= here else ["up"] * (here - target)


async def test_a_faint_colour_is_caught():
    """The measure can fail: a border at a fifth of the primary colour is too faint."""
    async with headless(replace(SETTINGS, tokens=4), 1, size=(100, 30)) as run:
        await run.until_done()
        run.app.stylesheet.add_source("StatCard { border: round $primary 20%; }")
        run.app.stylesheet.reparse()
        run.app.refresh_css()
        await run.settle()
        assert any("'╭'" in line for line in too_faint(run, "screen 1"))


def test_the_contrast_ratio_is_wcag_s():
    assert contrast_ratio(Color(0, 0, 0), Color(255, 255, 255)) == pytest.approx(21)
    assert contrast_ratio(Color(119, 119, 119), Color(255, 255, 255)) == pytest.approx(4.48, 0.01)


async def test_a_chart_takes_the_new_theme_s_colours_when_the_run_has_ended():
    """Switching theme after a run has ended (nothing left to redraw it) recolours the charts
    too, not only their legends: the dark theme's series colours fall below 3:1 on the light
    theme's canvas."""
    async with headless(SETTINGS, 3, size=(100, 30)) as run:
        await run.until_done()
        await run.settle()
        run.app.theme = "textual-light"
        for _ in range(3):
            await run.pilot.pause()  # no redraw_now: what a person sees once the theme is set
        chart = run.app.screen.query_one("Chart").region
        assert not too_faint(run, "screen 3's chart, textual-light", chart)
