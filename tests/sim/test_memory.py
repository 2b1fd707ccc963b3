"""Exact KV-cache and weight bytes, budgets against GPUs, and the lesson's memory card."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtui.format import format_bytes, format_percent
from kvtui.sim.budget import LESSON_BUDGET, Budget, budget, max_context_tokens, vram_split
from kvtui.sim.catalog import GIB, ModelSpec, dtype_names, get_gpu, get_model, gpu_names
from kvtui.sim.catalog import model_names as catalog_model_names
from kvtui.sim.memory import (
    RUNTIME_RESERVE_BYTES,
    kv_bytes,
    kv_bytes_per_token,
    weights_bytes,
)

# --- the lesson's memory card: "23.4 GB of KV on an 80 GB GPU is 29% and fits" --------------------


def lesson_budget() -> Budget:
    s = LESSON_BUDGET
    spec, gpu = get_model(s.model), get_gpu(s.gpu)
    return budget(spec, gpu, s.context_tokens, s.batch, s.kv_dtype, s.weights_dtype)


def test_lesson_memory_card():
    b = lesson_budget()
    assert (b.model, b.gpu, b.context_tokens, b.batch, b.kv_dtype) == (
        "llama-3.1-8b",
        "h100",
        24_000,
        8,
        "bf16",
    )
    assert b.kv_bytes == 8 * 24_000 * 131_072 == 25_165_824_000
    assert b.vram_bytes == 80 * GIB
    assert format_bytes(b.kv_bytes) == "23.4 GiB"
    assert format_bytes(b.vram_bytes) == "80 GiB"
    assert format_percent(b.kv_fraction_of_vram) == "29%"
    assert b.status == "fits"
    assert b.advice == ()


def test_lesson_budget_constant_names_catalog_entries():
    assert get_model(LESSON_BUDGET.model).name == LESSON_BUDGET.model
    assert get_gpu(LESSON_BUDGET.gpu).name == LESSON_BUDGET.gpu


# --- KV bytes per token ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama-2-7b", 2 * 32 * 32 * 128 * 2),  # 512 KiB: full multi-head attention
        ("llama-2-13b", 2 * 40 * 40 * 128 * 2),  # 800 KiB
        ("llama-2-70b", 2 * 80 * 8 * 128 * 2),  # grouped-query attention, 8 kv heads
        ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),  # 128 KiB
        ("llama-3.2-1b", 2 * 16 * 8 * 64 * 2),  # head_dim 64
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),  # 4 kv heads
        ("gemma-2-9b", 2 * 42 * 8 * 256 * 2),  # head_dim 256, not 3584 / 16
        ("deepseek-v3", (512 + 64) * 61 * 2),  # MLA latent, no factor 2
        ("tiny-austen", 2 * 6 * 2 * 32 * 2),
    ],
)
def test_kv_bytes_per_token(name, expected):
    assert kv_bytes_per_token(get_model(name), "bf16") == expected


def test_dtypes_scale_exactly():
    spec = get_model("llama-3.1-8b")
    per_dtype = {d: kv_bytes(spec, 1000, 3, d) for d in dtype_names()}
    bf16 = 3 * 1000 * 131_072
    assert per_dtype == {
        "fp32": 2 * bf16,
        "fp16": bf16,
        "bf16": bf16,
        "fp8": bf16 // 2,
        "int8": bf16 // 2 + 3 * 1000 * 32 * 2 * 8 * 2,  # and an fp16 scale per token and head
        "int4": bf16 // 4,
    }
    assert kv_bytes(spec, 10, 1, "bfloat16") == kv_bytes(spec, 10, 1, "bf16")


def test_int4_rounds_up_once():
    # One latent element per layer per token: half a byte in int4.
    spec = ModelSpec(
        name="half",
        layers=1,
        heads=1,
        kv_heads=1,
        head_dim=1,
        hidden_size=1,
        intermediate_size=1,
        vocab_size=1,
        params=3,
        max_context=100,
        kv_lora_rank=1,
        qk_rope_head_dim=0,
    )
    assert kv_bytes_per_token(spec, "int4") == 1
    assert kv_bytes(spec, 3, 1, "int4") == 2  # 1.5 bytes, rounded up once
    assert kv_bytes(spec, 4, 1, "int4") == 2
    assert weights_bytes(spec, "int4") == 2


def test_sliding_windows_cap_their_layers():
    mistral = get_model("mistral-7b")
    assert kv_bytes(mistral, 100_000) == kv_bytes(mistral, 4096) == 4096 * 131_072
    gemma = get_model("gemma-2-9b")
    per_layer_token = 2 * 8 * 256 * 2
    assert kv_bytes(gemma, 8192) == per_layer_token * (21 * 8192 + 21 * 4096)
    assert kv_bytes(gemma, 1000) == per_layer_token * 42 * 1000


def test_weights_bytes():
    assert weights_bytes(get_model("llama-3.1-8b"), "bf16") == 16_060_522_496
    assert weights_bytes(get_model("llama-2-7b"), "int4") == 6_738_415_616 // 2
    assert weights_bytes(get_model("gpt2")) == 124_439_808 * 4  # its published dtype, fp32


@given(context=st.integers(0, 10**6), batch=st.integers(1, 64))
def test_kv_bytes_grow_linearly_without_windows(context, batch):
    spec = get_model("llama-3.1-70b")
    assert kv_bytes(spec, context, batch) == batch * context * kv_bytes_per_token(spec)


# --- budgets --------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(catalog_model_names()),
    gpu=st.sampled_from(gpu_names()),
    batch=st.integers(1, 64),
    kv_dtype=st.sampled_from(dtype_names()),
    weights_dtype=st.sampled_from(dtype_names()),
)
def test_budget_flips_exactly_at_max_context(name, gpu, batch, kv_dtype, weights_dtype):
    spec, g = get_model(name), get_gpu(gpu)
    b = budget(spec, g, 1, batch, kv_dtype, weights_dtype)
    longest = b.max_context_tokens
    if longest is None:  # every layer slides and the full windows fit: nothing more to hold
        assert budget(spec, g, 10**9, batch, kv_dtype, weights_dtype).status == "fits"
    elif longest == 0:
        assert b.status == "overflow"
    else:
        at = budget(spec, g, longest, batch, kv_dtype, weights_dtype)
        past = budget(spec, g, longest + 1, batch, kv_dtype, weights_dtype)
        assert at.status == "fits"
        assert past.status == "overflow"
        assert at.max_context_tokens == past.max_context_tokens == longest


@given(room=st.integers(0, 10**12), batch=st.integers(1, 16))
def test_max_context_is_the_largest_that_fits(room, batch):
    spec = get_model("gemma-2-9b")  # half its layers slide: the growth rate changes at 4096
    longest = max_context_tokens(spec, room, batch)
    assert longest is not None
    if longest:
        assert kv_bytes(spec, longest, batch) <= room
    assert kv_bytes(spec, longest + 1, batch) > room


def test_budget_fields_add_up():
    b = budget(get_model("llama-2-13b"), get_gpu("a100-80gb"), 4096, 4)
    assert isinstance(b, Budget)
    assert b.reserve_bytes == RUNTIME_RESERVE_BYTES == GIB
    assert b.used_bytes == b.weights_bytes + b.kv_bytes + b.reserve_bytes
    assert b.kv_fraction_of_vram == b.kv_bytes / b.vram_bytes
    assert b.free_bytes == b.vram_bytes - b.used_bytes
    assert b.kv_bytes_per_token == 819_200
    assert set(b.to_json()) >= {
        "model",
        "gpu",
        "context_tokens",
        "batch",
        "kv_bytes_per_token",
        "kv_bytes",
        "weights_bytes",
        "vram_bytes",
        "kv_fraction_of_vram",
        "status",
        "max_context_tokens",
        "advice",
        "reserve_bytes",
    }


def test_overflow_advice_names_every_way_out():
    # 8 x 32K tokens of Llama 3.1 8B: 32 GiB of KV + 15 GiB of weights > 40 GiB.
    b = budget(get_model("llama-3.1-8b"), get_gpu("a100-40gb"), 32_768, 8)
    assert b.status == "overflow"
    room = 40 * GIB - 16_060_522_496 - GIB  # VRAM - bf16 weights - reserve
    assert b.max_context_tokens == room // (8 * 131_072) == 24_619
    text = "\n".join(b.advice)
    assert "Shorten the context to 24,619 tokens" in text
    assert room // (32_768 * 131_072) == 6
    assert "batch of 6 instead of 8" in text
    assert "KV cache in fp8" in text
    assert "L40S" in text  # the smallest catalog GPU that holds it


def test_weights_that_do_not_fit_say_so():
    b = budget(get_model("llama-3.1-70b"), get_gpu("h100"), 8192)
    assert b.status == "overflow"
    assert b.max_context_tokens == 0
    assert "leave no room" in b.advice[0]
    assert any("Quantize the weights to fp8" in line for line in b.advice)
    assert any("H200" in line for line in b.advice)


def test_nothing_in_the_catalog_holds_deepseek_in_bf16():
    b = budget(get_model("deepseek-v3"), get_gpu("mi300x"), 4096)
    assert "No GPU in the catalog" in b.advice[-1]


def test_context_beyond_the_model_is_flagged_even_when_it_fits():
    b = budget(get_model("llama-2-7b"), get_gpu("h200"), 8192)
    assert b.status == "fits"
    assert "4,096 tokens" in b.advice[0]


def test_reserve_is_configurable():
    spec, gpu = get_model("llama-3.1-8b"), get_gpu("h100")
    assert budget(spec, gpu, 1000, reserve_bytes=0).used_bytes + GIB == (
        budget(spec, gpu, 1000).used_bytes
    )


@pytest.mark.parametrize(("context", "batch"), [(0, 1), (-5, 1), (10, 0)])
def test_budget_rejects_empty_work(context, batch):
    with pytest.raises(ValueError):
        budget(get_model("gpt2"), get_gpu("t4"), context, batch)


@pytest.mark.parametrize(
    ("model", "context", "batch"), [("llama-3.1-8b", 24_000, 8), ("llama-3.1-70b", 131_072, 4)]
)
def test_vram_split_draws_a_whole_bar(model, context, batch):
    b = budget(get_model(model), get_gpu("h100"), context, batch)
    split = vram_split(b)
    parts = (split.weights_bytes, split.kv_bytes, split.reserve_bytes, split.free_bytes)
    assert sum(parts) == b.vram_bytes
    assert all(part >= 0 for part in parts)
    assert split.overflow_bytes == max(0, b.used_bytes - b.vram_bytes)
    assert sum(split.fractions()) == pytest.approx(1.0)
    if b.fits:
        assert (split.kv_bytes, split.free_bytes) == (b.kv_bytes, b.free_bytes)


# --- the live engines' KV pool -------------------------------------------------------------------


def test_a_pool_is_whole_blocks_of_its_capacity():
    from kvtui.sim.pool import KVPool

    pool = KVPool(100 * 1024, 16, 3072)  # 48 KiB blocks: two fit in 100 KiB, 4 KiB left over
    assert (pool.block_bytes, pool.blocks, pool.tokens) == (49_152, 2, 32)
    assert pool.blocks_for(1) == 1 and pool.blocks_for(16) == 1 and pool.blocks_for(17) == 2
    assert pool.blocks_for(17, batch=3) == 6


@pytest.mark.parametrize(
    ("capacity_tokens", "block", "prompt", "batch", "expected"),
    [
        (32, 16, 1, 1, 32),  # C - P + 1
        (32, 16, 32, 1, 1),  # the prompt fills the pool: its one token, then full
        (32, 16, 33, 1, 0),  # the prompt does not fit
        (64, 16, 10, 2, 23),  # 4 blocks for 2 sequences: 32 slots each
        (64, 16, 10, 3, 7),  # 4 blocks for 3: one block each (16 slots)
        (48, 1, 5, 1, 44),
    ],
)
def test_the_cached_loop_stops_where_the_pool_says(capacity_tokens, block, prompt, batch, expected):
    from kvtui.sim.pool import KVPool

    pool = KVPool(capacity_tokens * 100, block, 100)
    assert pool.tokens_before_full(prompt, batch) == expected


def test_the_gpu_pool_is_vllms_share_less_what_is_in_use():
    from kvtui.sim.pool import gpu_pool_bytes

    gib = 2**30
    # 80 GiB device, 16 GiB in use (weights, context): 0.9 x 80 - 16 = 56 GiB
    assert gpu_pool_bytes(80 * gib, 64 * gib, 0.9) == 56 * gib
    assert gpu_pool_bytes(80 * gib, 4 * gib, 0.9) == 0  # nothing left of the share


def test_the_budget_keys_step_by_powers_of_two_from_the_runs_size():
    from kvtui.sim.pool import step_budget

    need, block = 300 * 3072, 16 * 3072  # 900 KiB for the run, 48 KiB blocks
    first = step_budget(256 << 20, need, -1, smallest=block)
    assert first == 1 << 20  # the smallest power of two that holds the run
    assert step_budget(first, need, -1, smallest=block) == 512 << 10
    assert step_budget(64 << 10, need, -1, smallest=block) == 64 << 10  # one block's floor
    assert step_budget(512 << 10, need, 1, smallest=block) == 1 << 20
    assert step_budget(1000, 5000, -1, smallest=100) == 512
    # a --kv-budget below one block stays put going down (1 << -1 would raise), rises going up
    assert step_budget(1, need, -1, smallest=block) == 1
    assert step_budget(0, need, -1, smallest=block) == 0
    assert step_budget(1, need, 1, smallest=block) == 64 << 10
