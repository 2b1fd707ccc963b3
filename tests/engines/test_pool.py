"""The KV pool: blocks of token slots taken on demand, a run that stops where the pool predicts,
and not one logit changed by paging."""

from dataclasses import replace

import pytest
import torch

from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunFinished, RunSettings, StepSample
from kvtui.gpu.cache import BlockPool, KVCacheFull, PagedKVCache
from kvtui.sim.memory import kv_bytes
from kvtui.sim.pool import KVPool

TINY_PER_TOKEN = 2 * 6 * 2 * 32 * 4
"""The shipped model's keys and values per position in fp32: 3,072 bytes."""


def test_blocks_are_taken_lowest_first_and_given_back_for_reuse():
    pool = BlockPool(4)
    assert pool.take(2) == [0, 1] and pool.free == 2
    assert pool.take(1) == [2]
    pool.give_back([0])
    assert pool.take(2) == [0, 3] and pool.free == 0
    with pytest.raises(KVCacheFull):
        pool.take(1)
    assert pool.taken == 4  # a refused take takes nothing
    pool.give_back([3, 0, 1, 2])
    assert pool.free == 4 and pool.take(4) == [0, 1, 2, 3]


def test_a_step_that_finds_too_few_blocks_changes_nothing():
    """Two sequences need a block each at position 4; with one left, neither gets it."""
    cache = PagedKVCache(1, 2, 1, 2, block_tokens=4, n_blocks=3, max_positions=8)
    cache.reserve(0, 4)
    assert cache.pool.taken == 2 and cache.length == 4
    with pytest.raises(KVCacheFull):
        cache.reserve(4, 1)
    assert cache.pool.taken == 2 and cache.length == 4 and [len(t) for t in cache.tables] == [1, 1]
    cache.free()
    assert cache.pool.free == 3 and cache.length == 0


def _prefill_then_decode(model, ids, prefix, **cache):
    """Logits of a prefill of `ids[:, :prefix]` then one token at a time, and every layer's keys
    and values of every position, through a cache set up with `cache`."""
    batch, n = ids.shape
    kv = model.setup_caches(batch, n, **cache)
    with torch.inference_mode():
        logits = [model(ids[:, :prefix], start=0, use_cache=True)[:, -1]]
        logits += [
            model(ids[:, p : p + 1], start=p, use_cache=True)[:, -1] for p in range(prefix, n)
        ]
        read = [layer.read() for layer in kv.layers]
    model.drop_caches()
    return torch.stack(logits), read


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("block_tokens", [16, 5, 1])
def test_paging_changes_not_one_logit_against_the_contiguous_cache(
    small_model, batch, block_tokens
):
    """One block of the whole run is the contiguous buffer: for one sequence, any block size
    (read as a view) gives its logits and keys bit for bit. A batch is gathered by slot either way,
    so there the test says that the block size changes nothing; the gather against a contiguous
    view is the next test's."""
    ids = torch.randint(0, 256, (batch, 70), generator=torch.Generator().manual_seed(5))
    whole, whole_kv = _prefill_then_decode(small_model, ids, 9)
    paged, paged_kv = _prefill_then_decode(small_model, ids, 9, block_tokens=block_tokens)
    assert torch.equal(whole, paged)
    for (k1, v1), (k2, v2) in zip(whole_kv, paged_kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_sequence_whose_blocks_are_not_consecutive_is_gathered_to_the_same_logits(small_model):
    """Blocks taken out of order (a pool another sequence used first) are read by slot."""
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(6))
    whole, _ = _prefill_then_decode(small_model, ids, 7)
    kv = small_model.setup_caches(1, 52, block_tokens=4)  # 13 blocks: room for 3 more
    held = kv.pool.take(3)  # blocks 0-2 held elsewhere: the sequence starts at block 3...
    with torch.inference_mode():
        logits = [small_model(ids[:, :7], start=0, use_cache=True)[:, -1]]
        kv.pool.give_back(held[1:2])  # ...and its third block is 1, out of order
        logits += [
            small_model(ids[:, p : p + 1], start=p, use_cache=True)[:, -1] for p in range(7, 40)
        ]
    assert kv.tables[0][:3] == [3, 4, 1] and kv.base is None
    small_model.drop_caches()
    assert torch.equal(torch.stack(logits), whole)


def tiny(**settings) -> RunSettings:
    return RunSettings(engine="tiny", device="cpu", loops=("cached",), greedy=True, **settings)


def cached_run(settings):
    engine = open_engine(settings)
    events = list(engine.steps("cached"))
    return engine, [e for e in events if isinstance(e, StepSample)], events[-1]


@pytest.mark.parametrize(
    ("budget", "block", "prompt"),
    [
        (96 * 1024, 16, "a"),  # 2 blocks: 32 slots
        (100 * 1024, 16, "It is a truth"),  # 100 KiB holds 2 whole blocks of 48 KiB
        (150 * 1024, 7, "Emma"),  # 7 blocks of 7: 49 slots
        (60 * TINY_PER_TOKEN, 1, "It is a truth universally acknowledged"),
        (64 * TINY_PER_TOKEN, 64, "x" * 64),  # the prompt fills the one block: 1 token
    ],
)
def test_the_cached_loop_stops_at_the_token_the_pool_predicts(budget, block, prompt):
    settings = tiny(tokens=200, kv_budget_bytes=budget, kv_block_tokens=block, prompt=prompt)
    engine, steps, finished = cached_run(settings)
    P = len(prompt.encode())
    pool = KVPool(budget, block, TINY_PER_TOKEN)
    expected = pool.tokens_before_full(P)
    assert isinstance(finished, RunFinished) and finished.reason == "out_of_memory"
    assert finished.steps == len(steps) == expected
    assert f"full after token {expected:,}" in finished.message
    assert f"holds {pool.tokens:,} rows" in finished.message
    assert engine.model.kv is None  # the cache was freed
    last = steps[-1]
    assert last.kv_bytes == kv_bytes(engine.spec, pool.tokens, 1, "fp32")  # every slot filled
    assert last.kv_bytes_allocated == pool.blocks * pool.block_bytes
    assert finished.kv_bytes_allocated == last.kv_bytes_allocated


def test_a_prompt_the_pool_cannot_hold_generates_nothing():
    settings = tiny(tokens=10, kv_budget_bytes=16 * TINY_PER_TOKEN, prompt="x" * 17)
    _, steps, finished = cached_run(settings)
    assert steps == [] and finished.reason == "out_of_memory"
    assert "cannot hold the prompt's 17 tokens" in finished.message


def test_a_run_that_fits_finishes_and_the_same_engine_runs_again_after_a_stop():
    """Reuse after a stop: the pool of a run that ran out is free for the next."""
    settings = tiny(tokens=40, kv_budget_bytes=32 * TINY_PER_TOKEN, prompt="a")
    engine = open_engine(settings)
    first = list(engine.steps("cached"))
    assert first[-1].reason == "out_of_memory" and first[-1].steps == 32
    again = list(engine.steps("cached"))
    assert again[-1].reason == "out_of_memory" and again[-1].steps == 32
    assert [e.token_id for e in again[:-1]] == [e.token_id for e in first[:-1]]
    roomy = open_engine(replace(settings, kv_budget_bytes=64 * TINY_PER_TOKEN))
    whole = list(roomy.steps("cached"))
    assert whole[-1].reason == "done" and whole[-1].steps == 40
    # the stopped run's tokens are the first 32 of the one that had room
    assert [e.token_id for e in whole[:32]] == [e.token_id for e in first[:-1]]


def test_the_uncached_loop_keeps_no_cache_whatever_the_budget():
    settings = replace(tiny(tokens=40, kv_budget_bytes=1024, prompt="a"), loops=("uncached",))
    engine = open_engine(settings)
    events = list(engine.steps("uncached"))
    assert events[-1].reason == "done" and events[-1].steps == 40
    assert all(e.kv_bytes == e.kv_bytes_allocated == 0 for e in events[:-1])


def test_the_pool_is_stated_in_what_the_run_reports():
    started = open_engine(tiny(tokens=8, kv_budget_bytes=5 << 20, kv_block_tokens=32)).started()
    assert started.kv_capacity_bytes == 5 << 20 and started.kv_block_tokens == 32
    assert started.kv_pool_source == "--kv-budget"
    default = open_engine(tiny(tokens=8)).started()
    assert default.kv_capacity_bytes == 256 << 20 and default.kv_pool_source == "the CPU default"


def test_on_a_gpu_the_pool_is_vllms_share_of_the_device_measured_after_the_weights(monkeypatch):
    """No GPU here: torch's free/total reading is stood in for; the rule is what is tested."""
    from kvtui.engines.torch_engine import open_pool

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 * gib, 80 * gib))
    pool, source = open_pool(RunSettings(), torch.device("cuda"), 131_072)
    assert pool.capacity_bytes == 56 * gib  # 0.9 x 80 GiB - the 16 GiB in use
    assert "0.9 of the GPU's 80 GiB" in source and "16 GiB in use" in source
    pool, source = open_pool(RunSettings(kv_budget_bytes=1 << 30), torch.device("cuda"), 131_072)
    assert (pool.capacity_bytes, source) == (1 << 30, "--kv-budget")
