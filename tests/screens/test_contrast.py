"""Every chart series is readable on the dark and the light theme: 3:1 or better (WCAG 2,
non-text contrast), computed from the theme's own colours."""

from __future__ import annotations

import pytest
from textual.app import App
from textual.color import Color

from kvtui.widgets.chart import MIN_CONTRAST, SERIES, contrast_ratio, series_colour


@pytest.fixture(scope="module")
async def theme_variables():
    app = App()
    variables = {}
    async with app.run_test() as pilot:
        for theme in ("textual-dark", "textual-light"):
            app.theme = theme
            await pilot.pause()
            variables[theme] = dict(app.theme_variables)
    return variables


@pytest.mark.parametrize("theme", ["textual-dark", "textual-light"])
async def test_every_series_has_3_to_1_contrast(theme_variables, theme):
    variables = theme_variables[theme]
    background = Color.parse(variables["background"])
    for series in SERIES:
        r, g, b = series_colour(variables, series)
        ratio = contrast_ratio(Color(r, g, b), background)
        assert ratio >= MIN_CONTRAST, f"{series} on {theme}: {ratio:.2f}:1"


def test_the_contrast_ratio_is_wcag_s():
    assert contrast_ratio(Color(0, 0, 0), Color(255, 255, 255)) == pytest.approx(21)
    assert contrast_ratio(Color(119, 119, 119), Color(255, 255, 255)) == pytest.approx(4.48, 0.01)
