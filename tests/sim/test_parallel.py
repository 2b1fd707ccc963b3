"""A model split over GPUs: each GPU's heads, weights and KV cache, and the KV cache a vLLM-style
server sizes at start-up (whole blocks, maximum concurrency). The figures are exact integers,
computed here from the stated rules, not by calling the code under test."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtui.sim.budget import budget
from kvtui.sim.catalog import GIB, get_gpu, get_model, gpu_names, model_names
from kvtui.sim.memory import RUNTIME_RESERVE_BYTES, kv_bytes_per_token, weights_bytes
from kvtui.sim.parallel import (
    fewest_gpus,
    kv_head_copies,
    kv_heads_per_gpu,
    params_per_gpu,
    shard,
    tensor_parallel_problem,
    tensor_parallel_sizes,
)
from kvtui.sim.pool import DEFAULT_BLOCK_SIZE, DEFAULT_GPU_MEMORY_UTILIZATION, kv_capacity


def rule_params_per_gpu(name: str, tp: int) -> int:
    """The stated rule, written out: split everything evenly (rounded up) but the norms, which
    every GPU keeps, and the K/V projections, of which each GPU keeps its own heads whole."""
    m = get_model(name)
    norms = (2 * m.layers + 1) * m.hidden_size
    kv_heads = max(1, m.kv_heads // tp)
    kv_full = m.layers * 2 * m.hidden_size * m.kv_heads * m.head_dim
    kv_own = m.layers * 2 * m.hidden_size * kv_heads * m.head_dim
    return math.ceil((m.params - norms - kv_full) / tp) + norms + kv_own


# --- heads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "tp", "heads", "copies"),
    [
        ("llama-3.1-70b", 1, 8, 1),
        ("llama-3.1-70b", 4, 2, 1),
        ("llama-3.1-70b", 8, 1, 1),
        ("llama-3.1-70b", 16, 1, 2),  # 8 KV heads on 16 GPUs: one whole head each, not half
        ("llama-3.1-70b", 64, 1, 8),
        ("qwen2.5-7b", 2, 2, 1),
        ("qwen2.5-7b", 28, 1, 7),
        ("tiny-austen", 4, 1, 2),
        ("gpt2", 12, 1, 1),  # multi-head: 12 KV heads split 12 ways
        ("gemma-2-9b", 16, 1, 2),
        ("deepseek-v3", 8, 1, 8),  # MLA: one latent, whole on every GPU
    ],
)
def test_kv_heads_per_gpu_replicate_when_fewer_than_gpus(name, tp, heads, copies):
    spec = get_model(name)
    assert kv_heads_per_gpu(spec, tp) == heads
    assert kv_head_copies(spec, tp) == copies
    if not spec.is_mla:
        assert heads * tp == max(spec.kv_heads, tp)  # every head held, some on several GPUs
        assert heads == max(1, math.ceil(spec.kv_heads / tp))  # the form, the same here


@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("llama-3.1-70b", [1, 2, 4, 8, 16, 32, 64]),
        ("qwen2.5-7b", [1, 2, 4, 28]),  # 28 heads, 4 KV heads: 7 and 14 split neither evenly
        ("gpt2", [1, 2, 3, 4, 6, 12]),
        ("tiny-austen", [1, 2, 4, 8]),
    ],
)
def test_the_splits_vllm_can_make(name, sizes):
    spec = get_model(name)
    assert tensor_parallel_sizes(spec) == sizes
    for tp in range(1, spec.heads + 2):
        assert (tensor_parallel_problem(spec, tp) is None) == (tp in sizes)


def test_a_split_that_cannot_be_made_says_why_in_one_line():
    problem = tensor_parallel_problem(get_model("llama-3.1-70b"), 3)
    assert problem == (
        "Llama 3.1 70B's 64 attention heads do not split evenly over 3 GPUs; "
        "use 1, 2, 4, 8, 16, 32 or 64"
    )
    odd = replace(get_model("gpt2"), kv_heads=3, display_name="odd")  # 12 heads, 3 KV heads
    assert "3 KV heads neither split evenly over 2 GPUs" in tensor_parallel_problem(odd, 2)
    with pytest.raises(ValueError, match="do not split"):
        shard(get_model("llama-3.1-70b"), 3)


# --- weights and KV per GPU ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "tp", "params"),
    [
        # 70B over 16: (70,553,706,496 - 1,318,912 norms - 1,342,177,280 K/V) / 16
        #   + 1,318,912 + 167,772,160 (one K/V head per layer, whole)
        ("llama-3.1-70b", 16, 4_494_729_216),
        ("llama-3.1-70b", 4, 17_639_415_808),
        # 8B over 2: (8,030,261,248 - 266,240 - 268,435,456) / 2 + 266,240 + 134,217,728
        ("llama-3.1-8b", 2, 4_015_263_744),
    ],
)
def test_params_per_gpu_exact(name, tp, params):
    assert params_per_gpu(get_model(name), tp) == params == rule_params_per_gpu(name, tp)


@pytest.mark.parametrize("name", [n for n in model_names() if not get_model(n).is_mla])
def test_every_split_follows_the_rule(name):
    spec = get_model(name)
    for tp in tensor_parallel_sizes(spec):
        share = shard(spec, tp)
        assert share.params == rule_params_per_gpu(name, tp)
        assert share.heads * tp == spec.heads
        kv_heads = max(1, spec.kv_heads // tp)
        per_token = 2 * spec.layers * kv_heads * spec.head_dim * 2  # bf16
        assert kv_bytes_per_token(share) == per_token
        # replicated K/V heads and norms make the shares add up to at least the whole
        assert tp * weights_bytes(share) >= weights_bytes(spec)


def test_one_gpu_is_the_model_itself():
    for name in model_names():
        spec = get_model(name)
        assert shard(spec, 1) is spec
        assert params_per_gpu(spec, 1) == spec.params


def test_kv_per_gpu_counts_replicated_heads_fully():
    spec = get_model("llama-3.1-70b")  # 327,680 bytes of bf16 KV per token
    assert kv_bytes_per_token(shard(spec, 4)) == 80 * 2 * 2 * 128 * 2 == 81_920
    assert kv_bytes_per_token(shard(spec, 16)) == 80 * 2 * 1 * 128 * 2 == 40_960
    assert 2 * kv_bytes_per_token(spec) == 16 * 40_960  # each head on two GPUs


def test_mla_keeps_its_whole_latent_on_every_gpu():
    spec = get_model("deepseek-v3")
    assert kv_bytes_per_token(shard(spec, 8)) == kv_bytes_per_token(spec) == 61 * 576 * 2
    latent_projection = 61 * 7168 * (512 + 64)
    norms = (2 * 61 + 1) * 7168
    assert shard(spec, 8).params == (
        math.ceil((spec.params - norms - latent_projection) / 8) + norms + latent_projection
    )


# --- budgets split over GPUs ---------------------------------------------------------------------


def test_a_split_budget_is_per_gpu():
    b = budget(get_model("llama-3.1-70b"), get_gpu("h100"), 8192, tp=4)
    assert (b.tp, b.kv_heads_per_gpu) == (4, 2)
    assert b.weights_bytes == 141_107_412_992  # the whole model's, as at tp 1
    assert b.weights_bytes_per_gpu == 2 * 17_639_415_808
    assert b.kv_bytes_per_token_per_gpu == 81_920
    assert b.kv_bytes_per_gpu == 8192 * 81_920
    assert b.used_bytes == b.weights_bytes_per_gpu + b.kv_bytes_per_gpu + GIB
    assert b.status == "fits" and b.advice == ()
    data = b.to_json()
    assert data["tp"] == 4 and data["weights_bytes_per_gpu"] == 35_278_831_616


def test_one_gpu_budget_has_the_per_gpu_figures_equal_to_the_whole():
    b = budget(get_model("llama-3.1-8b"), get_gpu("h100"), 24_000, 8)
    assert (b.tp, b.kv_heads_per_gpu) == (1, 8)
    assert b.weights_bytes_per_gpu == b.weights_bytes
    assert b.kv_bytes_per_gpu == b.kv_bytes == 25_165_824_000


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["llama-3.1-70b", "gemma-2-9b", "qwen2.5-7b", "mistral-7b"]),
    gpu=st.sampled_from(gpu_names()),
    batch=st.integers(1, 16),
    pick=st.integers(0, 10),
)
def test_a_split_budget_flips_exactly_at_its_max_context(name, gpu, batch, pick):
    spec, g = get_model(name), get_gpu(gpu)
    sizes = tensor_parallel_sizes(spec)
    tp = sizes[pick % len(sizes)]
    longest = budget(spec, g, 1, batch, tp=tp).max_context_tokens
    if longest:
        assert budget(spec, g, longest, batch, tp=tp).fits
        assert not budget(spec, g, longest + 1, batch, tp=tp).fits


def test_overflow_advice_names_the_fewest_gpus_that_hold_it():
    b = budget(get_model("llama-3.1-70b"), get_gpu("l4"), 8192, tp=2)
    assert not b.fits
    # 24 GiB L4s: 4 of them would hold 32.9 GiB each; 8 hold 16.4 GiB each
    assert weights_bytes(shard(get_model("llama-3.1-70b"), 4)) + GIB > 24 * GIB
    assert weights_bytes(shard(get_model("llama-3.1-70b"), 8)) + GIB < 24 * GIB
    assert any("--tp 8 on the NVIDIA L4 holds it" in line for line in b.advice)
    alone = budget(get_model("deepseek-v3"), get_gpu("mi300x"), 4096)
    assert "--tp 8 on the AMD Instinct MI300X holds it" in alone.advice[-1]


def test_fewest_gpus_is_the_smallest_split_that_fits():
    spec = get_model("llama-3.1-70b")

    def fits_h100(share):
        return weights_bytes(share) + RUNTIME_RESERVE_BYTES <= 80 * GIB

    assert fewest_gpus(spec, fits_h100) == 2
    assert fewest_gpus(spec, lambda share: False) is None


# --- the KV cache a server sizes: whole blocks, and concurrency ----------------------------------


def test_vllm_style_capacity_of_llama_70b_on_4_h100s():
    c = kv_capacity(get_model("llama-3.1-70b"), get_gpu("h100"), 8192, tp=4)
    assert (DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_BLOCK_SIZE) == (0.9, 16)
    usable = 80 * GIB * 9 // 10
    available = usable - 35_278_831_616 - GIB  # its weights per GPU, the reserve
    block = 16 * 81_920  # 16 tokens of its 2 KV heads in 80 layers
    assert (c.usable_bytes_per_gpu, c.kv_bytes_available_per_gpu) == (usable, available)
    assert c.block_bytes_per_gpu == block == 1_310_720
    assert c.kv_blocks == available // block == 31_247
    assert c.kv_capacity_tokens == 31_247 * 16 == 499_952
    assert c.blocks_per_request == 8192 // 16 == 512
    assert c.max_concurrency == 31_247 / 512
    assert f"{c.max_concurrency:.2f}x" == "61.03x"


def test_vllm_style_capacity_of_the_lesson():
    c = kv_capacity(get_model("llama-3.1-8b"), get_gpu("h100"), 24_000)
    available = 80 * GIB * 9 // 10 - 16_060_522_496 - GIB
    assert c.kv_blocks == available // (16 * 131_072) == 28_693
    assert c.kv_capacity_tokens == 459_088
    assert c.blocks_per_request == 1500
    assert c.max_concurrency == 28_693 / 1500


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(model_names()),
    gpu=st.sampled_from(gpu_names()),
    context=st.integers(1, 300_000),
    block=st.sampled_from([1, 8, 16, 32, 64, 128, 1000]),
    utilization=st.sampled_from([0.05, 0.5, 0.9, 0.92, 1.0]),
    pick=st.integers(0, 10),
)
def test_capacity_is_whole_blocks_and_concurrency_follows(
    name, gpu, context, block, utilization, pick
):
    spec, g = get_model(name), get_gpu(gpu)
    sizes = tensor_parallel_sizes(spec)
    tp = sizes[pick % len(sizes)]
    c = kv_capacity(spec, g, context, tp, utilization, block)
    assert c.kv_capacity_tokens % block == 0
    assert c.kv_blocks * c.block_bytes_per_gpu <= max(0, c.kv_bytes_available_per_gpu)
    assert (c.kv_blocks + 1) * c.block_bytes_per_gpu > c.kv_bytes_available_per_gpu
    assert c.blocks_per_request == -(-context // block)
    assert c.max_concurrency * c.blocks_per_request == pytest.approx(c.kv_blocks)
    # a request takes whole blocks, so at most tokens / context of them fit at once
    assert c.max_concurrency <= c.kv_capacity_tokens / context + 1e-9
    if context % block == 0:
        assert c.max_concurrency == pytest.approx(c.kv_capacity_tokens / context)


def test_nothing_left_for_the_cache_is_zero_tokens():
    c = kv_capacity(get_model("llama-3.1-70b"), get_gpu("h100"), 8192)  # 131 GiB > 72 GiB
    assert c.kv_bytes_available_per_gpu < 0
    assert (c.kv_blocks, c.kv_capacity_tokens, c.max_concurrency) == (0, 0, 0.0)


@pytest.mark.parametrize("utilization", [0, -0.5, 1.5, math.nan, math.inf])
def test_capacity_refuses_a_utilization_outside_0_to_1(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_capacity(get_model("gpt2"), get_gpu("h100"), 1024, gpu_memory_utilization=utilization)


def test_every_catalog_gpu_states_its_link():
    for name in gpu_names():
        gpu = get_gpu(name)
        assert gpu.interconnect and gpu.interconnect_bytes_per_s
        # a link between GPUs is slower than the GPU's own memory
        assert 1e10 <= gpu.interconnect_bytes_per_s < gpu.bandwidth_bytes_per_s
    assert get_gpu("h100").interconnect_bytes_per_s == 900e9 / 2  # NVLink 4, one way
