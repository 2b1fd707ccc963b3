"""What a key and a redraw cost: a length key repaints its line alone, a note lays the screen out
again only when it needs another height, and a chart is plotext's own figure without the ANSI
round trip. (How long that takes is a benchmark: `benchmarks/key_latency.py`.)"""

from __future__ import annotations

import pytest
from conftest import build
from rich.text import Text
from test_screens import SIZE, settle
from textual import messages
from textual.app import App, ComposeResult
from textual.containers import Vertical
from textual.widgets import Static
from textual_plotext.plot import Plot

from kvtui.widgets.chart import Chart, plot_text
from kvtui.widgets.note import Note


@pytest.mark.parametrize("screen", [1, 2])
async def test_a_length_key_repaints_the_run_note_alone(screen):
    app = build(screen)
    seen: list = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await settle(app, pilot)
        await pilot.press("right")  # 33: the note appears (on screen 2 it was hidden)
        await pilot.pause()
        whole: list = []
        refresh = app.screen.refresh
        app.screen.refresh = lambda *a, **k: whole.append(k) or refresh(*a, **k)
        seen.clear()
        await pilot.press("right")
        await pilot.pause()
        note = app.screen.query_one("#run-note")
        assert "r runs 34 tokens" in str(note.render())
        repainted = {m.widget for m in seen if isinstance(m, messages.Update)}
        assert repainted == {note}, "a length key repaints only the line that shows it"
        assert not [m for m in seen if isinstance(m, messages.Layout)]
        assert not whole, "nor the whole screen"


class _Notes(App):
    CSS = "Vertical { width: 24; height: auto; }"

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Note("one line", id="note")
            yield Static("below", id="below")


async def test_a_note_is_laid_out_again_only_for_another_height():
    app = _Notes()
    seen: list = []
    async with app.run_test(size=(40, 10), message_hook=seen.append) as pilot:
        note, below = app.query_one(Note), app.query_one("#below")
        assert note.size.height == 1 and below.region.y == 1

        seen.clear()
        note.show("another line")
        await pilot.pause()
        assert [m.widget for m in seen if isinstance(m, messages.Update)] == [note]
        assert not [m for m in seen if isinstance(m, messages.Layout)]

        note.show("one two three four five six seven eight nine ten eleven twelve")
        await pilot.pause()
        assert note.size.height == 3 and below.region.y == 3

        note.show("short again")
        await pilot.pause()
        assert note.size.height == 1 and below.region.y == 1

        seen.clear()
        note.show("short again")  # unchanged: nothing at all
        await pilot.pause()
        assert not [m for m in seen if isinstance(m, (messages.Update, messages.Layout))]


def _same_text(mine: Text, reference: Text) -> None:
    assert mine.plain == reference.plain
    assert mine.spans == reference.spans
    assert len(reference.spans) > 10  # a figure with colours, not an empty canvas


def test_plot_text_is_plotexts_figure_in_named_colours():
    plt = Plot()
    plt.theme("dark")  # colours as plotext names and 256-colour codes
    plt.plot([1, 2, 3, 4, 5], [1, 4, 9, 16, 25], color="red", marker="braille")
    plt.plot([1, 3, 5], [2, 2, 2], color=(10, 200, 30), marker="dot")
    plt.title("Squares")
    plt.xticks([1, 3, 5], ["one", "three", "five"])
    plt.plotsize(60, 20)
    _same_text(plot_text(plt), Text.from_ansi(plt.build()))


@pytest.mark.parametrize("theme", ["textual-dark", "textual-light"])
@pytest.mark.parametrize("screen", [1, 2, 3])
async def test_the_screens_charts_are_plotexts_figures(screen, theme):
    app = build(screen, 300)
    async with app.run_test(size=(160, 48)) as pilot:
        app.theme = theme
        await settle(app, pilot)
        charts = list(app.screen.query(Chart))
        assert charts
        for chart in charts:
            mine = chart.render()  # sizes the figure, sets its theme, then plot_text
            _same_text(mine, Text.from_ansi(chart.plt.build()))
