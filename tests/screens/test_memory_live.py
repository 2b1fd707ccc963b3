"""Screen 3's live pool: the running engine's KV cache fills a budget, the bar turns red, the
run stops where the pool predicts, and a larger budget runs again; the what-if beside it."""

from __future__ import annotations

from dataclasses import replace

from conftest import PROBE, screen_text, wait_for
from fakes import FakeEngine
from textual import events
from textual.widgets import Static

from kvtui.app import make_app
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunSettings
from kvtui.screens.memory import MemoryScreen
from kvtui.sim.budget import budget
from kvtui.sim.catalog import get_gpu, get_model, gpu_names, model_names
from kvtui.sim.memory import kv_bytes_per_token
from kvtui.sim.pool import KVPool
from kvtui.widgets.vram import VramBar

SIZE = (100, 30)
SIM = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=64, lesson=True, replay_speed=0)
PER_TOKEN = 131_072  # Llama 3.1 8B, bf16: 2 x 32 layers x 8 KV heads x 128 x 2 bytes


def sim_app(settings: RunSettings):
    """The app over the real roofline engine, its events computed in this process."""

    def engine(s: RunSettings) -> FakeEngine:
        return FakeEngine(s, events=list(run_events(open_engine(s), s)))

    return make_app(settings, 3, probe=PROBE, engine_factory=engine)


def words(app) -> str:
    """The screen's text with its line breaks and runs of spaces made single spaces."""
    return " ".join(screen_text(app).split())


def finished(app) -> bool:
    return app.live.state in ("done", "failed")


async def test_a_small_budget_stops_the_run_red_and_a_larger_one_runs_again():
    app = sim_app(replace(SIM, kv_budget_bytes=4 << 20))  # 32 tokens of 128 KiB
    async with app.run_test(size=SIZE) as pilot:
        # the stop's whole paragraph: its text is drawn a frame before it is laid out on 2 lines
        await wait_for(pilot, lambda: finished(app) and "predicted 32;" in words(app))
        assert isinstance(app.screen, MemoryScreen)
        predicted = KVPool(4 << 20, 16, PER_TOKEN).tokens_before_full(1)
        assert predicted == 32
        assert app.live.loop("cached").steps == predicted
        bar = app.screen.query_one("#live-bar", VramBar)
        assert bar.has_class("-overflow")
        assert "KV cache full" in screen_text(app).splitlines()[0]  # the header says it stopped
        text = words(app)
        assert "Stopped: the KV cache is full after token 32" in text
        assert "Modelled: 32 tokens = 32 rows - 1 prompt + 1, predicted 32" in text
        assert "4 MiB (--kv-budget)" in text
        await pilot.press("right_square_bracket")  # 8 MiB: the 64 tokens' 64 positions
        assert app.kv_budget == 8 << 20
        await wait_for(
            pilot, lambda: "Next run: 8 MiB holds 64 rows, 64 tokens fit: r." in words(app)
        )
        await pilot.press("r")
        await wait_for(pilot, lambda: finished(app) and app.live.started is not None)
        assert app.live.loop("cached").steps == 64
        assert app.live.loop("cached").finished.reason == "done"
        await wait_for(pilot, lambda: not bar.has_class("-overflow"))
        await wait_for(pilot, lambda: "KV cache full" not in screen_text(app))


async def test_the_budget_keys_step_by_powers_of_two_from_the_runs_own_size():
    app = sim_app(SIM)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: finished(app))
        default = app.live.started.kv_capacity_bytes
        assert default > 8 << 20  # the modelled H100's room: gigabytes
        await pilot.press("left_square_bracket")  # one press: the run's own size
        assert app.kv_budget == 8 << 20  # 1 + 63 positions x 128 KiB, a power of two
        await pilot.press("left_square_bracket")
        assert app.kv_budget == 4 << 20
        await pilot.press("r")
        await wait_for(pilot, lambda: finished(app) and app.live.settings.kv_budget_bytes)
        assert app.live.loop("cached").finished.reason == "out_of_memory"
        await pilot.press("backslash")  # the engine's default again
        assert app.kv_budget is None
        await pilot.press("r")
        await wait_for(pilot, lambda: finished(app) and app.live.started is not None)
        assert app.live.started.kv_capacity_bytes == default


async def test_the_live_bar_counts_weights_blocks_slots_and_the_free_pool():
    """Filled + the last block's tail + free = the pool; the parts are the engine's own."""
    app = sim_app(replace(SIM, tokens=40))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: finished(app) and "blocks" in words(app))
        live = app.live.pool()
        assert live.filled_bytes == 40 * PER_TOKEN  # positions 0..39 cached after 40 steps
        assert live.allocated_bytes == 3 * 16 * PER_TOKEN and live.blocks == 3
        assert live.tail_bytes == 8 * PER_TOKEN
        whole = live.filled_bytes + live.tail_bytes + live.free_bytes + live.spare_bytes
        assert whole == live.pool.capacity_bytes
        parts = {p.name: p.bytes for p in app.screen.query_one("#live-bar", VramBar).bar.parts}
        assert parts["KV filled"] == live.filled_bytes and parts["block tail"] == live.tail_bytes
        assert parts["weights"] == app.live.started.weights_bytes
        text = words(app)
        assert "40 rows = 1 prompt + 40 tokens - 1, in 3 of" in text
        assert "the run's 40 rows fit" in text


async def test_the_what_if_starts_from_the_running_model_and_is_labelled():
    app = sim_app(replace(SIM, engine="sim:llama-3.2-1b@l4"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: finished(app) and app.screen.model == "llama-3.2-1b")
        assert (app.screen.model, app.screen.gpu) == ("llama-3.2-1b", "l4")
        title = str(app.screen.query_one("#whatif-title", Static).render())
        assert title.startswith("WHAT-IF (modelled") and "the sim engine's GPU" in title


def test_the_share_card_never_contradicts_the_status():
    """ALL IN USE counts weights + KV + runtime: at or under 100% exactly when it fits."""
    for model in model_names():
        for gpu in gpu_names():
            spec, card = get_model(model), get_gpu(gpu)
            for context in (1_000, 32_000, 128_000):
                b = budget(spec, card, min(context, spec.max_context), 8)
                assert (b.used_bytes / b.vram_bytes <= 1) == b.fits, (model, gpu, context)


async def test_at_80x24_the_live_pool_and_what_if_are_both_on_screen():
    app = sim_app(replace(SIM, kv_budget_bytes=4 << 20))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: finished(app) and "Stopped:" in words(app))
        text = words(app)
        assert "LIVE (modelled)" in text and "WHAT-IF" in text and "Stopped:" in text
        assert kv_bytes_per_token(get_model("llama-3.1-8b")) == PER_TOKEN


async def test_keys_held_down_each_count_and_the_budget_stops_at_the_engines_own_pool():
    """Screen 3's keys set the App's next run at once, so a key held down (auto-repeat: keys
    with no frame between) counts every press; up, the budget stops at the pool the engine took
    by itself."""
    app = sim_app(SIM)
    seen = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await wait_for(pilot, lambda: finished(app))
        default = app.live.started.kv_capacity_bytes
        keys = ["left_square_bracket"] * 3 + ["n"] * 3  # 8 MiB, 4, 2; batch 2, 4, 8
        for key in keys:  # as a terminal delivers them: all at once
            app.post_message(events.Key(key, None))
        await wait_for(pilot, lambda: sum(isinstance(m, events.Key) for m in seen) >= len(keys))
        await pilot.pause()
        assert (app.kv_budget, app.batch) == (2 << 20, 8)
        for _ in range(20):
            app.post_message(events.Key("right_square_bracket", None))
        await wait_for(pilot, lambda: sum(isinstance(m, events.Key) for m in seen) >= 26)
        await pilot.pause()
        assert app.kv_budget == default  # not the power of two above it


async def test_n_runs_a_batch_whose_counts_stay_per_sequence_and_whose_pool_holds_all():
    app = sim_app(replace(SIM, tokens=24))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: finished(app))
        await pilot.press("n", "n")  # batch 1 -> 2 -> 4
        assert app.batch == 4
        await wait_for(
            pilot, lambda: "Next run: " in words(app) and ", batch 4 holds" in words(app)
        )
        await pilot.press("r")
        await wait_for(pilot, lambda: finished(app) and "batch 4 (n):" in words(app))
        assert app.live.started.batch == 4
        uncached = app.live.loop("uncached").positions_cumulative
        assert uncached[-1] == 300  # per sequence: the lesson's 24 tokens, 300 positions
        live = app.live.pool()
        assert live.filled_bytes == 4 * 24 * PER_TOKEN and live.filled_tokens == 24
        assert "batch 4 (n):" in words(app) and "per sequence" in words(app)


async def test_at_80x24_every_remedy_of_an_overflow_is_readable():
    from conftest import build
    from test_screens import settle

    app = build(3)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("plus", "plus")  # 96,000 tokens x 8: past the H100
        advice = app.screen.budget().advice
        assert len(advice) == 4 and not app.screen.budget().fits
        await wait_for(pilot, lambda: all(remedy in words(app) for remedy in advice))


async def test_on_a_gpu_the_live_bar_gives_torchs_capacity_and_nvmls():
    from fakes import sim_events

    from kvtui.engines.protocol import RunStarted

    settings = replace(SIM, lesson=False)
    events = [
        replace(e, device="cuda:0 (NVIDIA H100 80GB HBM3)") if isinstance(e, RunStarted) else e
        for e in sim_events(settings)
    ]
    probe = {**PROBE, "name": "NVIDIA H100 80GB HBM3", "total_bytes": 81_559 * 2**20}
    app = make_app(settings, 3, probe=probe, engine_factory=lambda s: FakeEngine(s, events=events))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: finished(app) and "NVML" in words(app))
        title = app.screen.query_one("#live-bar", VramBar).border_title
        assert "80 GiB of device memory (torch; NVML 79.6 GiB)" in title


async def test_a_batch_that_runs_out_is_predicted_for_the_batch_and_tiny_budgets_step_safely():
    # 16 MiB = 8 blocks of 16 x 128 KiB; 4 sequences take 2 each: 32 slots, 32 tokens
    app = sim_app(replace(SIM, kv_budget_bytes=16 << 20, batch=4))
    async with app.run_test(size=SIZE) as pilot:
        # the status is laid out again for its new height a frame after it changes: wait for it
        await wait_for(pilot, lambda: finished(app) and "predicted 32" in words(app))
        assert app.live.loop("cached").steps == 32
        assert "Modelled: 32 tokens = 32 rows - 1 prompt + 1, predicted 32" in words(app)
    app = sim_app(replace(SIM, kv_budget_bytes=1))  # below one block: nothing fits
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: finished(app))
        await pilot.press("left_square_bracket")  # stays at 1 byte, no crash
        assert app.kv_budget == 1 and app.is_running
        await pilot.press("right_square_bracket")
        assert app.kv_budget == 2 << 20  # up: at least one block (16 x 128 KiB)


async def test_at_80x24_a_stopped_pool_leaves_the_live_lines_whole():
    """The pool full, its status says so in two lines at 80x24, so the side panel's live lines
    (down to the FLOPs a byte) still show without scrolling, and after ] too (the next run)."""
    app = sim_app(replace(SIM, kv_budget_bytes=4 << 20))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: finished(app) and "Stopped:" in words(app))
        side = app.screen.query_one(".side")
        await wait_for(pilot, lambda: side.max_scroll_y == 0 and "FLOPs/byte" in words(app))
        await pilot.press("right_square_bracket")
        await wait_for(pilot, lambda: "Next run:" in words(app))
        await wait_for(pilot, lambda: side.max_scroll_y == 0 and "FLOPs/byte" in words(app))
