"""Presenter mode as a room sees it (kvtui.testing's `slide()`): the nodes in order, one figure
at a time, each node's part of the run paced and then all shown, figures in large type that grow
with the terminal, node 3's pool filling to red at the predicted token, nothing cut."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import PROBE, SETTINGS, screen_text, wait_for
from fakes import FakeEngine

import kvtui.widgets.present_nodes as present_nodes
from kvtui.app import make_app
from kvtui.screens.present import PresentScreen
from kvtui.screens.recompute import RecomputeScreen
from kvtui.testing import headless
from kvtui.widgets.present_nodes import NODES
from kvtui.widgets.slides import Race, TallBar

LESSON = replace(SETTINGS, tokens=24, lesson=True)
SIZES = ((80, 24), (100, 30), (160, 48))
PRESSES = [1 + len(node.figures) for node in NODES[1:]]
"""Spaces that open each node after the title and reveal all its figures."""


@pytest.fixture
def quick_pace(monkeypatch):
    """A fast pace (the figures are the same; only how soon the node has shown them all)."""
    monkeypatch.setattr(present_nodes, "PACE_S", 0.3)
    monkeypatch.setattr(present_nodes, "RACE_S", 0.3)


def presenting(**engine_options):
    return make_app(
        LESSON,
        probe=PROBE,
        present=True,
        engine_factory=lambda s: FakeEngine(s, measured=True, **engine_options),
    )


def labels(slide):
    return [(f.label, f.value) for f in slide.figures]


async def test_space_reveals_each_figure_then_the_next_node_and_left_goes_back(quick_pace):
    async with headless(LESSON, present=True, engine=lambda s: FakeEngine(s, measured=True)) as run:
        await run.until_done()
        assert isinstance(run.app.screen, PresentScreen)
        assert run.slide().title == NODES[0].title
        await run.press("space")
        node1 = []
        for _ in range(len(NODES[1].figures) + 1):
            slide = await run.until_shown()
            assert slide.title == NODES[1].title
            node1.append(labels(slide))
            await run.press("space")
        assert node1 == [  # the lesson's figures, as the run measured them, one at a time
            [],
            [("PER STEP", "24")],
            [("PER STEP", "24"), ("TOTAL", "300")],
            [("PER STEP", "24"), ("TOTAL", "300"), ("WASTED", "276")],
        ]
        assert run.slide().title == NODES[2].title
        await run.press(*["space"] * 20)  # the last press stays on the last node
        slide = await run.until_shown()
        assert slide.title == NODES[-1].title and labels(slide) == [("ANSWER", "GPU memory")]
        assert "The KV cache grew with every token" in " ".join(run.text().split())
        await run.press("left", "left")  # the answer hidden, then node 3 with its figures
        assert [f.label for f in (await run.until_shown()).figures] == [
            "A TOKEN",
            "HELD NOW",
            "FULL AT TOKEN",
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


async def test_node_1_opens_not_done_and_is_done_after_its_pace():
    """The staircase is revealed a few steps a second (PACE_S), never ahead of the run: just
    opened it has shown part of the run; waited on, all of it, the figures the run's own."""
    async with headless(LESSON, present=True, engine=lambda s: FakeEngine(s, measured=True)) as run:
        await run.until_done()
        await run.press("space", "space")  # node 1, its first figure
        opened = run.slide()
        assert opened.title == NODES[1].title and not opened.done
        value = opened.figures[0].value  # the per-step positions count up to the last step's 24
        assert value is None or int(value) < 24
        slide = await run.until_shown(timeout=present_nodes.PACE_S + 20)
        assert slide.done and labels(slide) == [("PER STEP", "24")]
        assert slide.figures[0].caption == "measured: positions step 24 computed"


async def test_r_runs_the_node_again_and_plus_minus_change_the_length(quick_pace):
    async with headless(LESSON, present=True, engine=lambda s: FakeEngine(s, measured=True)) as run:
        await run.until_done()
        await run.press("space", "space", "space", "space")  # node 1, all three figures
        assert labels(await run.until_shown())[1] == ("TOTAL", "300")
        await run.press("r")
        await run.wait_for(lambda: len(FakeEngine.instances) == 2)
        assert labels(await run.until_shown())[1] == ("TOTAL", "300")  # the same run again
        await run.press("plus")
        await run.wait_for(lambda: run.app.live.settings.tokens == 48)
        await run.until_done()
        assert labels(await run.until_shown())[1] == ("TOTAL", "1,176")  # 48 x 49 / 2
        await run.press("minus", "minus")
        await run.wait_for(lambda: run.app.live.settings.tokens == 12)
        await run.until_done()
        assert labels(await run.until_shown())[1] == ("TOTAL", "78")  # 12 x 13 / 2


async def test_node_3_sizes_a_pool_the_run_fills_and_the_bar_turns_red_at_the_predicted_token(
    quick_pace,
):
    """The lesson run on `sim:` (its own pool, a KV budget honoured): node 3 asks for a pool that
    fills within the node; the cached loop stops at the predicted token, the bar is full and
    red, and FULL AT says so beside the lesson's own figure (29% of an H100: it fits)."""
    async with headless(LESSON, present=True, size=(100, 30)) as run:
        await run.until_done()
        await run.press(*["space"] * sum(PRESSES[:3]))  # node 3, all shown
        await run.wait_for(lambda: run.app.live.settings.kv_budget_bytes is not None)
        await run.until_done()
        slide = await run.until_shown()
        pool = run.app.live.pool()
        assert pool is not None and pool.full and pool.tokens_before_full == 16
        assert pool.steps == 16  # measured: the cached loop stopped at the predicted token
        assert labels(slide)[2] == ("FULL AT TOKEN", "16")
        assert slide.figures[2].caption.endswith("the formula said 16")
        bar = run.app.screen.query_one("#present-pool", TallBar)
        assert bar.red and bar.has_class("-overflow")
        assert bar.bar is not None
        free = [p.bytes for p in bar.bar.parts if p.look == "free"]
        assert free == [0]  # full: nothing of the pool is free
        text = run.text()
        assert "FULL at token 16" in text and "= 29%: FITS" in text
        await run.press("minus")  # a shorter context: it fits the same pool, the bar not red
        await run.wait_for(lambda: run.app.live.settings.tokens == 12)
        await run.until_done()
        assert labels(await run.until_shown())[2] == ("FULL AT TOKEN", "FITS") and not bar.red
        await run.press("left", "left", "left", "left")  # node 2: the lesson's pool again
        await run.wait_for(lambda: run.app.live.settings.kv_budget_bytes is None)
        await run.press("plus")  # 24 tokens again (12 fit any pool of whole 16-token blocks)
        await run.wait_for(lambda: run.app.live.settings.tokens == 24)
        await run.until_done()
        await run.press("right", "right", "right", "right")  # node 3 again, then leave
        await run.wait_for(lambda: run.app.kv_budget is not None)
        await run.press("p")
        assert run.app.kv_budget is None  # r elsewhere: the engine's own pool


async def test_node_2_races_the_loops_on_their_measured_seconds_and_says_why_time_saves_less():
    async with headless(LESSON, present=True) as run:  # sim: modelled, memory-bound
        await run.until_done()
        await run.press(*["space"] * sum(PRESSES[:2]))  # node 2, all shown
        slide = await run.until_shown(timeout=present_nodes.RACE_S + 20)
        assert labels(slide) == [("WITH THE CACHE", "24"), ("BY COUNT", "12.5x"), ("TIME", "1x")]
        lanes = run.app.screen.query_one(Race).lanes
        assert [(lane.steps, lane.finished) for lane in lanes] == [(24, True), (24, True)]
        words = " ".join(run.text().split())
        assert "memory-bound" in words and "Why only 1x" in words


@pytest.mark.parametrize("size", SIZES)
async def test_no_line_is_cut_on_any_node(size, quick_pace):
    """Every node, each of its figures shown, at 80x24, 100x30 and 160x48: no line ends cut
    ("…"), and each figure's caption says first how it was had."""
    events = lambda s: FakeEngine(s, measured=True)  # noqa: E731
    async with headless(LESSON, present=True, size=size, engine=events) as run:
        await run.until_done()
        cut = [f"title: {line}" for line in run.text().splitlines() if line.endswith("…")]
        await run.press("space")
        for node, presses in zip(NODES[1:], PRESSES, strict=True):
            await run.press(*["space"] * (presses - 1))
            slide = await run.until_shown()
            assert slide.title == node.title
            cut += [f"{node.title}: {ln}" for ln in run.text().splitlines() if ln.endswith("…")]
            for figure in slide.figures if node.part != "question" else ():
                assert figure.caption.split(":")[0] in ("measured", "formula"), figure
            await run.press("space")
    assert not cut, "\n".join(cut)


async def test_the_figures_grow_with_the_terminal(quick_pace):
    """Node 1's figures in large type: taller on a larger terminal, at 160x48 at least twice
    as tall as at 80x24; the headline large above 80x24."""
    rows, headlines = {}, {}
    for size in SIZES:
        events = lambda s: FakeEngine(s, measured=True)  # noqa: E731
        async with headless(LESSON, present=True, size=size, engine=events) as run:
            await run.until_done()
            await run.press("space", "space", "space", "space")
            slide = await run.until_shown()
            rows[size] = {f.rows for f in slide.figures}
            headlines[size] = slide.headline_rows
    assert all(len(r) == 1 for r in rows.values()), rows  # a node's figures share one size
    small, medium, large = (rows[size].pop() for size in SIZES)
    assert 3 <= small < medium < large and large >= 2 * small, (small, medium, large)
    assert headlines[(80, 24)] == 0 < headlines[(100, 30)] < headlines[(160, 48)]


async def test_the_title_is_up_and_moving_while_the_engine_starts():
    """Before the engine's first word: the title card (the name large, the subtitle, the
    sentence) and a waiting line whose spinner moves."""
    started = []

    def held(settings):
        engine = FakeEngine(settings, hold_at=0)  # it never sends an event
        started.append(engine)
        return engine

    async with headless(LESSON, present=True, engine=held) as run:
        await run.pilot.pause()
        text = run.text()
        assert "A model decodes beside this screen" in " ".join(text.split())
        assert "██" in text  # the name, large
        line = run.app.screen.query_one("#present-status").render()
        await run.wait_for(lambda: run.app.screen.query_one("#present-status").render() != line)
        assert "starting" in str(run.app.screen.query_one("#present-status").render())


@pytest.mark.parametrize("theme", ["dark", "light"])
async def test_every_node_reads_on_both_themes(theme, quick_pace):
    """Text 4.5:1 and graphics 3:1 (tests/screens/test_contrast.py's measure) on every node, all
    of it shown: the title card, the staircase, the race (both lanes done), node 3's pool full
    and red beside the lesson's bar, the closing answer; --theme light as --theme dark."""
    from test_contrast import too_faint

    faint: list[str] = []
    async with headless(LESSON, present=True, size=(100, 30), theme=theme) as run:
        await run.until_done()
        faint += too_faint(run, f"{theme}, the title")
        await run.press("space")
        for node, presses in zip(NODES[1:], PRESSES, strict=True):
            await run.press(*["space"] * (presses - 1))
            await run.until_done()
            await run.until_shown()
            faint += too_faint(run, f"{theme}, {node.title}")
            await run.press("space")
    assert not faint, "\n".join(faint)


@pytest.mark.parametrize(
    ("engine", "how", "held"),
    [("replay", "replayed", "107 rows = 44 prompt + 63 tokens"), ("sim", "modelled", None)],
)
async def test_node_3s_figures_say_what_they_are_and_count_rows_as_rows(
    engine, how, held, quick_pace
):
    """A TOKEN is the engine's bytes held per row (measured, recorded or modelled, as the run
    says), beside the formula that agrees with it, not "measured" over the formula's caption;
    HELD NOW counts the rows it holds as rows, prompt and tokens named (it said "107 tokens"
    for a 64-token run after a 44-token prompt)."""
    from kvtui.paths import asset_path

    settings = (
        replace(SETTINGS, engine=f"replay:{asset_path('tiny-cpu.jsonl')}")
        if engine == "replay"
        else LESSON
    )
    async with headless(settings, present=True, size=(100, 30)) as run:
        await run.until_done()
        await run.press(*["space"] * sum(PRESSES[:3]))  # node 3, all shown
        await run.until_done()
        slide = await run.until_shown()
        token, held_now = slide.figures[0], slide.figures[1]
        assert token.label == "A TOKEN"
        assert token.caption.startswith(f"{how}: bytes held per row (K + V); the formula ")
        assert token.caption.endswith(" agrees")
        assert held_now.caption == f"{how}: {held or '16 rows = 1 prompt + 15 tokens'}"
        text = run.text()
        assert "tokens)" not in text  # the bar's rows are rows too
        if engine == "replay":  # a recording's pool is its own, not one sized for the room
            assert "this run's pool" in text and "sized for this room" not in text
