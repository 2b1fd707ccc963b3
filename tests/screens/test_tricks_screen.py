"""Screen 4, driven as a user does: the tricks' table fills row by row from its own (here
in-process, `sim:`) measurement, the race's plain cache turns red and stops before the trick, the
keys pick the trick and its setting, and the essentials fit 80x24."""

from pathlib import Path

from kvtui.engines.protocol import RunFailed, RunSettings
from kvtui.screens.tricks import TricksScreen
from kvtui.testing import ScriptedEngine, headless
from kvtui.widgets.pool_line import PoolLine
from kvtui.widgets.stream import TokenStream

SIM = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=24, replay_speed=0)


def _screen(run) -> TricksScreen:
    screen = run.app.screen
    assert isinstance(screen, TricksScreen)
    return screen


async def _race_and_table_done(run) -> TricksScreen:
    screen = _screen(run)
    await run.wait_for(lambda: screen.race and not screen.racing)
    await run.wait_for(lambda: screen.table.done or screen.table.failed)
    await run.settle()
    return screen


async def test_the_table_and_the_race_fit_80x24_and_say_where_each_figure_came_from():
    async with headless(SIM, screen=4, size=(80, 24)) as run:
        screen = await _race_and_table_done(run)
        text = run.text()
        lines = text.splitlines()
        assert len(lines) <= 24 and max(len(line) for line in lines) <= 80
        assert not screen.table.failed and len(screen.table.rows) == 8
        for label in ("plain cache", "fp8", "int8", "window 124+4 sinks", "MHA (by formula)"):
            assert label in text, label
        assert "waiting" not in text and "measuring…" not in text
        assert "modelled (sim:)" in text  # every figure says how it was had
        assert "measur" not in text.lower(), text  # sim: runs no trick: nothing here is measured
        assert "RACE (modelled): plain vs fp8" in text
        assert "To continue the chat:" in text and "the tokens" in text
        plain, trick = screen.race["plain"], screen.race["trick"]
        assert plain.pool().full and trick.loop("cached").steps > plain.loop("cached").steps
        assert screen.query_one("#pool-plain", PoolLine).has_class("-full")
        assert "stopped at" in (
            screen.query_one("#stream-plain", TokenStream).border_subtitle or ""
        )
        for side in ("plain", "trick"):  # sim: decodes no text: its stand-in says so
            assert "placeholder text" in str(screen.query_one(f"#stream-{side}").border_title)
        fp8 = screen.table.rows["fp8"]
        assert fp8["tokens_before_full_predicted"] == fp8["steps"]  # the stop, as predicted
        assert "✓" in text


async def test_the_reach_and_the_published_ratio_say_what_the_plain_cache_here_is():
    """fp8's reach beside vLLM's "about 2x": the published figure is against a 16-bit cache,
    the ratio here against this plain cache (bf16 on sim:llama-3.1-8b: 2x by the format)."""
    async with headless(SIM, screen=4, size=(100, 30)) as run:
        await _race_and_table_done(run)
        text = " ".join(run.text().split())
        assert "reach: vs plain (bf16)" in text
        assert "speed: vs plain, each row's own run" in text  # sim: times no turns
        assert "about 2x the tokens of a 16-bit one" in text
        assert "the plain cache here is bf16, 2 bytes a value, so fp8's 1 byte is 2x" in text


async def test_keys_pick_the_trick_and_its_setting_and_race_again():
    async with headless(SIM, screen=4, size=(100, 30)) as run:
        screen = await _race_and_table_done(run)
        first = screen._race_id
        await run.press("k")
        await run.wait_for(lambda: screen.race["plain"].pool() and screen.race["plain"].pool().full)
        await run.settle()
        assert screen.race_variant.words.startswith("window") and screen._race_id == first + 1
        assert "plain vs window 124 + 4 sinks" in run.text()
        window = screen.race["trick"]
        assert window.settings.kv_window == 128 and window.settings.tokens == 6000
        await run.wait_for(lambda: window.loop("cached").steps > 400)
        assert not window.pool().full  # a window the pool holds never fills: it goes on
        await run.press("plus")
        assert screen.race["trick"].settings.kv_sinks == 0
        await run.press("k", "k")
        await run.wait_for(lambda: screen.race and not screen.racing)
        await run.settle()
        assert screen.race["trick"].settings.kv_heads == 1
        assert "Published, a reference (not measured here)" in run.text()  # 100x30: room
        before = screen._race_id
        await run.press("r")
        assert screen._race_id == before + 1


async def test_an_engine_that_keeps_its_own_cache_has_no_tricks_and_says_so():
    async with headless(SIM, screen=4, size=(80, 24)) as run:
        screen = _screen(run)
        await run.wait_for(lambda: screen.table.started)
        run.app.restart_with("hf:/nowhere")  # an engine that keeps its own cache
        await run.wait_for(lambda: screen.table.engine == "hf:/nowhere")
        await run.settle()
        assert "kvtui's own engines" in run.text()


async def test_screen_3s_what_if_follows_the_runs_kv_cache_dtype():
    settings = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=8, kv_cache_dtype="fp8")
    async with headless(settings, screen=3, size=(100, 30)) as run:
        await run.until_done()
        assert "KV fp8 (k)" in run.text()
        assert run.card("kv").note == "64 KiB/token"  # llama-3.1-8b: 128 KiB in bf16
        await run.press("k")  # a dtype chosen by hand stays chosen
        await run.settle()
        assert "KV int8 (k)" in run.text()


async def test_screen_4_reads_on_both_themes():
    """The table (a formula's row dimmed), the race's pool lines and streams, red when full, the
    published line: text at 4.5:1 and marks at 3:1, as tests/screens/test_contrast.py holds the
    other screens."""
    from test_contrast import too_faint

    async with headless(SIM, screen=4, size=(100, 30)) as run:
        await _race_and_table_done(run)
        faint = []
        for theme in ("textual-dark", "textual-light"):
            run.app.theme = theme
            await run.settle()
            faint += too_faint(run, f"{theme}, screen 4")
        assert faint == []


async def test_a_replay_has_no_tricks_and_nothing_on_screen_4_says_it_is_waiting():
    """A replay has no table and no race to wait for: the rows and the race's panes say so,
    where they said "waiting" (and "waiting for the first token...") for ever."""
    asset = Path(__file__).parents[2] / "assets" / "tiny-cpu.jsonl"
    settings = RunSettings(engine=f"replay:{asset}", replay_speed=0)
    async with headless(settings, screen=4, size=(80, 24)) as run:
        screen = _screen(run)
        await run.wait_for(lambda: screen.table.failed)
        await run.settle()
        text = run.text()
        assert "kvtui's own engines" in text
        assert "waiting" not in text, text
        assert "No race on this engine" in text


async def test_another_engine_races_again_on_screen_4():
    """Another engine picked on screen 4 (ctrl+p) races on that engine: the race of the engine
    before stayed on screen beside the new engine's table."""
    async with headless(SIM, screen=4, size=(80, 24)) as run:
        screen = await _race_and_table_done(run)
        other = "sim:llama-3.2-1b@h100"
        run.app.restart_with(other)
        await run.wait_for(lambda: screen.race and screen.race["plain"].settings.engine == other)
        await run.wait_for(lambda: not screen.racing)
        await run.settle()
        assert all(side.settings.engine == other for side in screen.race.values())


async def test_a_race_engines_message_shows_as_written():
    """A race engine's failure is shown on its pane's border as text: a `[/dim]` in it crashed
    the app (MarkupError), as the border read it as markup."""
    message = "broke [/dim] here"

    def engines(settings: RunSettings) -> ScriptedEngine:
        if settings.loops == ("cached",):  # a race's engine
            return ScriptedEngine([RunFailed(message)], settings=settings)
        return ScriptedEngine.from_settings(settings)

    async with headless(SIM, screen=4, size=(100, 30), engine=engines) as run:
        screen = _screen(run)
        await run.wait_for(lambda: screen.race and not screen.racing)
        await run.settle()
        assert message in run.text()


async def test_the_race_runs_on_the_apps_engines_and_closing_them_ends_the_race_too():
    """The race is another run of the App's engines (its one owner makes them), read as the run
    is; closing the App's engines (as `q` and the end of `kvtui` do) ends every one it made, the
    race's too, at once (not when their readers next look)."""

    def engines(settings: RunSettings) -> ScriptedEngine:
        if settings.loops == ("cached",):  # a race's engine: it stalls mid-run, a long step
            return ScriptedEngine.from_settings(settings, hold_at=6)
        return ScriptedEngine.from_settings(settings)

    async with headless(SIM, screen=4, size=(100, 30), engine=engines) as run:
        screen = _screen(run)
        await run.wait_for(lambda: screen.race and screen.race["plain"].loop("cached").steps)
        await run.wait_for(lambda: screen.race["trick"].loop("cached").steps)
        race = [e for e in run.engines if e.settings.loops == ("cached",)]
        assert len(race) == 2 and all(e.alive for e in race)
        assert all(len(e.sent) == 6 for e in race)
        run.app.close_engine()
        assert not any(e.alive for e in run.engines)
