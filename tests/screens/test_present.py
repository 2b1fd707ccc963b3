"""Presenter mode: the nodes in order, one figure at a time, space and the decode's pause both
reachable, the device out of the header."""

from __future__ import annotations

import re
from dataclasses import replace

from conftest import PROBE, SETTINGS, screen_text, wait_for
from fakes import FakeEngine
from test_screens import settle
from textual.widgets import Digits

from kvtui.app import make_app
from kvtui.screens.present import NODES, BigFigure, PresentScreen
from kvtui.screens.recompute import RecomputeScreen

LESSON = replace(SETTINGS, tokens=24, lesson=True)


def presenting(**engine_options):
    return make_app(
        LESSON,
        probe=PROBE,
        present=True,
        engine_factory=lambda s: FakeEngine(s, measured=True, **engine_options),
    )


def shown(app) -> tuple[str, list[tuple[str, str | None]]]:
    """The node's title and each figure shown: its label and its large digits."""
    screen = app.screen
    title = screen.query_one(".lesson-title").render().plain
    figures = [
        (f.query_one(".big--label").render().plain, f.query_one(Digits).value)
        for f in screen.query(BigFigure)
        if f.display
    ]
    return title, figures


async def test_space_reveals_each_figure_then_the_next_node_and_left_goes_back():
    app = presenting()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        assert isinstance(app.screen, PresentScreen)
        steps = []
        for _ in range(1 + sum(len(node.figures) + 1 for node in NODES[1:])):
            steps.append(shown(app))
            await pilot.press("space")
        titles = [title for title, _ in steps]
        assert titles == [n.title for n in NODES for _ in range(len(n.figures) + 1)]
        node1 = [figures for title, figures in steps if title == NODES[1].title]
        assert node1 == [  # the lesson's figures, as the run measured them, one at a time
            [],
            [("PER STEP", "24")],
            [("PER STEP", "24"), ("TOTAL", "300")],
            [("PER STEP", "24"), ("TOTAL", "300"), ("WASTED", "276")],
        ]
        assert shown(app)[0] == NODES[-1].title  # the last press stays on the last node
        assert "GPU memory: the KV cache grew" in screen_text(app)
        await pilot.press("left", "left")  # the answer hidden, then node 3 with its figures
        title, figures = shown(app)
        assert title == NODES[3].title and [label for label, _ in figures] == [
            "A TOKEN",
            "HELD NOW",
            "FULL AT",
        ]


async def test_s_pauses_the_decode_p_leaves_and_the_device_is_in_help_not_the_header():
    app = presenting(hold_at=30)  # the run stays mid-way, running
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.live.state == "running")
        await wait_for(pilot, lambda: "s Pause" in screen_text(app))  # the footer's keys
        assert "space Next" in screen_text(app) and "CPU, no GPU" not in screen_text(app)
        await pilot.press("s")
        assert app.live.state == "paused" and FakeEngine.instances[-1].paused_calls == 1
        await pilot.press("question_mark")
        await pilot.pause()
        assert PROBE["description"] in screen_text(app)
        await pilot.press("escape", "p")
        await pilot.pause()
        assert isinstance(app.screen, RecomputeScreen)  # back where presenting began
        await pilot.press("p")
        await pilot.pause()
        assert isinstance(app.screen, PresentScreen)


async def test_at_80x24_every_figure_says_how_it_was_had_and_the_answer_is_whole():
    """A figure's line is cut to one row on a short terminal: its first words say how the
    figure was had (measured, or the formula), so the cut never takes that, and the closing
    answer, with no figures beside it, wraps rather than ending in an ellipsis."""
    app = presenting()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        for node in NODES[1:-1]:
            await pilot.press(*["space"] * (len(node.figures) + 1))
            assert shown(app)[0] == node.title
            lines = [f.query_one(".big--line").render().plain for f in app.screen.query(BigFigure)]
            text = screen_text(app)
            for label, line in zip([f.label for f in node.figures], lines, strict=False):
                assert re.match(r"(\w+, )?(measured|formula):", line), (label, line)
                assert line[:17] in text, (label, line)
        await pilot.press("space", "space")
        assert shown(app)[0] == NODES[-1].title
        assert "are the ways out." in " ".join(screen_text(app).split())


async def test_at_100x30_a_figures_line_wraps_whole_when_revealed():
    """On a taller terminal a figure's line wraps: revealed, it gets every line it needs, where
    it kept the one line it was laid out with (the rest cut)."""
    app = presenting()
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        presses = sum(len(node.figures) + 1 for node in NODES[:3]) + len(NODES[3].figures)
        await pilot.press(*["space"] * presses)
        assert shown(app)[0] == NODES[3].title and len(shown(app)[1]) == 3
        await pilot.pause()
        heights = []
        for line in app.screen.query(".big--line"):
            width = line.content_size.width
            needed = line.get_content_height(line.container_size, app.size, width)
            assert line.content_size.height == needed, line.render().plain
            heights.append(needed)
        assert max(heights) > 1  # one of them wraps, at least
