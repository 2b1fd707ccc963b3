"""The KV cache picture (screens 1 and 2): a row per cached position, one more a cached step,
every row again without a cache, and the attention the engine sent, shown as it sent it."""

from __future__ import annotations

from dataclasses import replace

from conftest import SETTINGS, build
from fakes import measured_events, sim_events
from test_screens import settle

from kvtui.engines.attention import ATTENTION_SCALE
from kvtui.engines.protocol import RunStarted, StepSample
from kvtui.run.live import SERVED_CACHE, LiveRun
from kvtui.widgets.cache_grid import CacheGrid

LESSON = replace(SETTINGS, tokens=16, lesson=True)
"""A one-token prompt and 16 tokens: 16 rows at the end, all of them listed at 160x48."""


def with_attention(events, sink: float = 0.6):
    """The run as an engine that sees its model's attention sends it: every step's newest query
    gives `sink` of its attention to position 0 and the rest to its own key (in layer 2)."""
    out = []
    for e in events:
        if isinstance(e, RunStarted):
            e = replace(e, attention_layer=1, attention_heads=8)
        elif isinstance(e, StepSample):
            keys = e.position
            shares = [0] * keys
            shares[0] += round(sink * ATTENTION_SCALE)
            shares[-1] += ATTENTION_SCALE - round(sink * ATTENTION_SCALE)
            e = replace(e, attention_spans=tuple(range(keys)), attention=tuple(shares))
        out.append(e)
    return out


def test_the_cached_grid_gains_one_row_a_step_and_the_uncached_one_recomputes_all():
    events = measured_events(replace(SETTINGS, tokens=40))
    run = LiveRun(SETTINGS)
    rows: dict[str, list[int]] = {"cached": [], "uncached": []}
    for event in events:
        run.apply(event)
        if isinstance(event, StepSample):
            picture = run.picture(event.loop)
            rows[event.loop].append(picture.rows)
            assert picture.step == event.step
            if event.loop == "uncached":
                assert picture.new_rows == picture.rows  # every row computed again
            else:
                assert picture.new_rows == (run.prompt_tokens if event.step == 0 else 1)
                assert picture.row_bytes * picture.rows == event.kv_bytes  # bytes held / rows
    P = run.prompt_tokens
    assert rows["cached"] == rows["uncached"] == list(range(P, P + 40))


def _row_looks(grid: CacheGrid) -> list[tuple[str, str]]:
    """Each listed row's position and the look of its K cell ("kept", "new", "recomputed")."""
    looks = {
        str(grid.get_component_rich_style(f"grid--{name}")): name
        for name in ("kept", "new", "recomputed")
    }
    width, height = grid.content_size.width, grid.content_size.height
    out = []
    for line in grid.lines(width, height):
        text = line.plain
        if " K V" not in text:
            continue
        k = text.index(" K V") + 1
        style = next(str(s.style) for s in line.spans if s.start <= k < s.end)
        out.append((text[1:].split()[0], looks[style]))
    return out


async def test_every_row_is_listed_kept_new_or_recomputed_as_the_run_did_it():
    app = build(2, 16, lesson=True, events=measured_events(LESSON))
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        grid = app.screen.query_one(CacheGrid)
        assert grid.border_title == "KV cache: 16 rows × 128 KiB"
        looks = _row_looks(grid)
        assert [position for position, _ in looks] == [str(i) for i in range(16)]
        assert [look for _, look in looks] == ["kept"] * 15 + ["new"]  # one row written
        await pilot.press("c")  # the cache off: the picture is the uncached loop's
        await pilot.pause()
        assert grid.border_title == "No cache: all 16 rows again"
        assert [look for _, look in _row_looks(grid)] == ["recomputed"] * 16


async def test_the_attention_shown_is_the_engines():
    app = build(2, 16, lesson=True, events=with_attention(measured_events(LESSON)))
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        grid = app.screen.query_one(CacheGrid)
        lines = [line.plain for line in grid.lines(*grid.content_size)]
        shares = {line[1:].split()[0]: line.split()[-1] for line in lines if " K V" in line}
        assert shares["0"] == "60%" and shares["15"] == "40%"
        assert all(shares[str(i)] == "0%" for i in range(1, 15))
        assert "first 4: 60% · newest 8: 40% · layer 2/32, 8 heads" in lines


async def test_a_modelled_run_says_it_has_no_weights_at_80x24():
    app = build(1, 24, events=sim_events(replace(SETTINGS, tokens=24)))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        grid = app.screen.query_one(CacheGrid)
        lines = [line.plain for line in grid.lines(*grid.content_size)]
        assert lines[-1] == "sim: no attention (modelled)"
        assert lines[-2].startswith("q 31 reads 32 keys")  # a 9-token prompt, 24 tokens
        assert any(line.startswith("⋮") for line in lines)  # more rows than lines: a gap
        assert grid.border_subtitle.endswith("modelled")


async def test_a_cached_picture_without_a_pool_is_drawn():
    """A run whose engine keeps its own cache and no pool of blocks (a Hugging Face folder, `hf:`):
    the picture's subtitle says the rows and how they were had, where building it indexed the
    first of no block lines (IndexError: pressing 2 after such a run ended the app)."""
    events = [
        replace(e, kv_block_tokens=None, kv_capacity_bytes=None)
        if isinstance(e, RunStarted)
        else replace(e, kv_bytes_allocated=0)
        if isinstance(e, StepSample)
        else e
        for e in measured_events(replace(SETTINGS, tokens=8))
    ]
    app = build(2, 8, events=events)
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        grid = app.screen.query_one(CacheGrid)
        assert grid.picture.step is not None and grid.picture.blocks is None
        assert "block" not in grid.border_subtitle and grid.border_subtitle.endswith("measured")
        assert app.is_running


def test_a_served_run_says_its_cache_is_the_servers():
    """A `vllm:` run's keys and values are the server's: the picture does not draw a cache
    kvtui cannot see."""
    events = measured_events(replace(SETTINGS, tokens=4))
    run = LiveRun(SETTINGS)
    for event in events:
        run.apply(
            replace(event, served_by="vLLM 0.32 at http://127.0.0.1:8001")
            if isinstance(event, RunStarted)
            else event
        )
    for loop in ("cached", "uncached"):
        assert run.picture(loop).unseen == SERVED_CACHE
        assert run.picture(loop).rows == 0


async def test_the_picture_and_presenter_mode_read_on_both_themes():
    """Text 4.5:1 and graphics 3:1 (tests/screens/test_contrast.py's measure) for the picture
    with its attention bars, kept, new and recomputed rows, and presenter mode's title and a
    node with its figures (large digits, their lines)."""
    from test_contrast import too_faint

    from kvtui.testing import headless

    events = with_attention(measured_events(LESSON))
    faint: list[str] = []
    async with headless(LESSON, 2, size=(100, 30), engine=events) as run:
        await run.until_done()
        for theme in ("textual-dark", "textual-light"):
            run.app.theme = theme
            for where, keys in (
                ("screen 2", ()),
                ("cache off", ("c",)),
                ("presenter mode's title", ("c", "p")),
                ("presenter mode's node 2", ["space"] * 8),
            ):
                await run.press(*keys)
                await run.settle()
                faint += too_faint(run, f"{theme}, {where}")
            await run.press("p", "2")
    assert not faint, "\n".join(faint)


async def test_the_picture_shows_the_step_the_cards_count_with_older_weights_said_so():
    """An engine sends attention with some steps only (at most 15 a second): the picture's rows,
    query and counts are still the newest step's, the one PER STEP and the stream count, and its
    weights say how many steps ago they were (before, the whole picture was a step or more
    behind the cards: "PER STEP 76" beside "No cache: 75 rows again")."""
    events = [
        replace(e, attention=None, attention_spans=None)
        if isinstance(e, StepSample) and e.step != 11
        else e
        for e in with_attention(measured_events(LESSON))
    ]
    app = build(1, 16, lesson=True, events=events)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        grid = app.screen.query_one(CacheGrid)
        per_step = app.screen.query_one("#per-step").value
        assert per_step == "16"  # the 16th step: 1 prompt position + 15 tokens, again
        assert grid.border_title == "No cache: all 16 rows again"
        lines = [line.plain for line in grid.lines(*grid.content_size)]
        assert "16 rows = 1 prompt + 15 of 16 tokens" in lines
        assert any(line.startswith("q 15 reads 16 keys") for line in lines)
        shares = {line[1:].split()[0]: line.split()[-1] for line in lines if " K V" in line}
        assert shares["0"] == "60%" and shares["11"] == "40%"  # step 12's query read 12 keys
        assert "12" not in shares or not shares["12"].endswith("%")  # rows it never read
        assert lines[-1].endswith("· weights 4 steps ago")
