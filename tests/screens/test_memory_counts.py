"""Screen 3's pool in one vocabulary (issue 34): tokens generated, rows the cache holds (P + t - 1),
slots and blocks of the pool; where two counts sit side by side they agree or the words say how.
Its labels say how the figures were had (measured, modelled, replayed), it names the cache's dtype
and bytes a row, its bar shows the cache grow, and its budget keys say what they do."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import PROBE, notifications, wait_for
from fakes import measured_events
from test_memory_live import finished as done
from test_memory_live import sim_app, words

from kvtui.app import make_app
from kvtui.engines.protocol import RunSettings, RunStarted
from kvtui.paths import asset_path
from kvtui.testing import ScriptedEngine
from kvtui.widgets.vram import VramBar

SIZE = (100, 30)
SIM = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=64, replay_speed=0)
PER_TOKEN = 131_072  # Llama 3.1 8B, bf16
BLOCK = 16 * PER_TOKEN  # 2 MiB


def bar(app) -> VramBar:
    return app.screen.query_one("#live-bar", VramBar)


async def test_the_rows_the_bar_counts_are_the_rows_the_words_count_with_their_tokens():
    """Side by side, the bar's rows and the status's rows are one count, and the status says
    how it follows from the prompt and the tokens (it said "this run's 41 fit" beside "40 tok")."""
    app = sim_app(replace(SIM, tokens=40))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: done(app) and "rows fit" in words(app))
        P, live = app.live.prompt_tokens, app.live.pool()
        assert P > 1 and live.rows == P + 40 - 1
        text = words(app)
        assert f"Modelled: {live.rows} rows = {P} prompt + 40 tokens - 1," in text
        assert f"the run's {live.rows} rows fit" in text
        kv = next(p for p in bar(app).bar.parts if p.look == "kv")
        assert kv.detail == f"({live.rows} rows)"


async def test_a_full_pool_names_the_token_it_stopped_after_and_has_no_free_block_left():
    """17 MiB is 8 blocks of 2 MiB (128 slots) and 1 MiB too small for a block: the run stops
    after token 128 - P + 1, the message says that token (it said "full at token 128", a row),
    the words give the relation, and the bar shows no free pool (it showed the 1 MiB free)."""
    app = sim_app(replace(SIM, tokens=200, kv_budget_bytes=17 << 20))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: done(app) and "predicted" in words(app))
        P, live = app.live.prompt_tokens, app.live.pool()
        t = 128 - P + 1
        assert live.full and live.steps == t and live.rows == 128
        text = words(app)
        assert f"the KV cache is full after token {t}:" in text
        assert f"Modelled: {t} tokens = 128 rows - {P} prompt + 1, predicted {t}" in text
        assert "Measured" not in text.split("WHAT-IF")[0]  # a modelled run's figures say so
        parts = {p.name: p.bytes for p in bar(app).bar.parts}
        assert parts["free pool"] == 0 and bar(app).has_class("-overflow")


@pytest.mark.parametrize(("dtype", "per_row"), [("int8", 66_560), ("fp8", 65_536)])
async def test_screen_3_names_the_caches_dtype_and_its_bytes_a_row(dtype, per_row):
    """The engine's own bytes a row for its layout (int8: + its scales), as screen 2's picture
    gives each row; it named neither the dtype nor the bytes."""
    app = sim_app(replace(SIM, tokens=8, kv_cache_dtype=dtype))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: done(app) and app.live.started is not None)
        assert app.live.started.kv_bytes_per_token == per_row
        await wait_for(pilot, lambda: f"{dtype}, {per_row:,} B a row" in words(app))
        P = app.live.prompt_tokens  # a smaller element keeps a row per position all the same
        assert f"{P + 7} rows = {P} prompt + 8 tokens - 1" in words(app)


async def test_a_replay_says_replayed_and_its_cpu_bar_spans_the_runs_room():
    """The shipped record of a tiny run on the CPU (a 256 MiB pool, 44 + 64 tokens): its figures
    say replayed, the bar spans the 512 KiB the run's 7 blocks round up to (it was 256 MiB, the
    cache a sliver at 0.1%), and the budget keys say a replay plays what it recorded."""
    replay = RunSettings(engine=f"replay:{asset_path('tiny-cpu.jsonl')}", replay_speed=0)
    app = make_app(replay, 3, probe=PROBE, engine_factory=ScriptedEngine.from_settings)
    seen: list = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await wait_for(pilot, lambda: done(app) and "Replayed:" in words(app))
        live = app.live.pool()
        assert live.pool.capacity_bytes == 256 << 20 and live.blocks == 7 and live.rows == 107
        assert "Replayed: 107 rows = 44 prompt + 64 tokens - 1" in words(app)
        shown = bar(app)
        assert shown.bar.capacity_bytes == 512 << 10
        assert "first 512 KiB" in shown.border_title
        kv = sum(p.bytes for p in shown.bar.parts if p.look in ("kv", "tail"))
        assert kv / shown.bar.capacity_bytes > 0.5  # the run's cache fills most of the bar
        await pilot.press("left_square_bracket")
        await wait_for(pilot, lambda: any("A replay plays" in n for n in notifications(seen)))
        assert app.kv_budget is None


async def test_the_budget_keys_are_on_the_screen_and_say_what_they_do():
    """The live status names `[` `]` (not only the footer); the first `[` lands on the run's own
    size and says why, and what `r` then does on this engine (a modelled pool, at once)."""
    start = replace(measured_events(replace(SIM, tokens=40, lesson=True))[0])
    assert isinstance(start, RunStarted)
    app = sim_app(replace(SIM, tokens=40, lesson=True))
    seen: list = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await wait_for(pilot, lambda: done(app) and "[ ] a smaller or larger pool" in words(app))
        await pilot.press("left_square_bracket")
        assert app.kv_budget == 8 << 20  # 40 rows, 3 blocks of 2 MiB: 8 MiB
        said = notifications(seen)[-1]
        assert "the smallest power of two that holds this run's 40 rows" in said
        assert "a modelled pool of that size, at once" in said
        await wait_for(
            pilot, lambda: "Next run: 8 MiB holds 64 rows, 40 tokens fit: r." in words(app)
        )


async def test_at_80x24_the_bar_still_says_it_spans_part_of_the_pool():
    replay = RunSettings(engine=f"replay:{asset_path('tiny-cpu.jsonl')}", replay_speed=0)
    app = make_app(replay, 3, probe=PROBE, engine_factory=ScriptedEngine.from_settings)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: done(app) and "Replayed:" in words(app))
        await wait_for(pilot, lambda: "first 512 KiB" in bar(app).border_title)
        assert "…" not in bar(app).border_title
