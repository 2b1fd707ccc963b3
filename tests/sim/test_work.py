"""Exact decode-work counts: the lesson's figures, closed forms against brute force, step costs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtui.format import format_int, format_ratio
from kvtui.sim.catalog import get_gpu, get_model, model_names
from kvtui.sim.memory import kv_bytes, weights_bytes
from kvtui.sim.work import (
    WorkSummary,
    attention_flops,
    cached_cumulative,
    cached_step_positions,
    decode_step_bytes,
    decode_step_flops,
    head_params,
    naive_cumulative,
    naive_step_positions,
    roofline_seconds,
    uncached_step_bytes,
    uncached_step_flops,
    work_summary,
)

# --- the lesson -----------------------------------------------------------------------------------


def test_lesson_n24():
    s = work_summary(24)
    assert s.naive_last_step == 24
    assert s.naive_total == 300
    assert s.wasted == 276


def test_lesson_n32():
    s = work_summary(32)
    assert (s.naive_total, s.cached_total) == (528, 32)
    assert s.speedup == 16.5
    assert format_ratio(s.speedup) == "16.5x"


def test_lesson_n4096():
    s = work_summary(4096)
    assert (s.naive_total, s.cached_total) == (8_390_656, 4_096)
    assert format_int(s.naive_total) == "8,390,656"
    assert format_int(s.cached_total) == "4,096"


def test_summary_json_keys():
    assert set(work_summary(3, 2).to_json()) == {
        "length",
        "prompt",
        "naive_last_step",
        "naive_total",
        "cached_total",
        "wasted",
        "speedup",
    }


def test_summary_is_frozen():
    s = work_summary(5)
    assert isinstance(s, WorkSummary)
    with pytest.raises(AttributeError):
        s.length = 6  # type: ignore[misc]


# --- closed forms against brute force -------------------------------------------------------------


def brute_force(n: int, p: int) -> tuple[int, int]:
    """The counting rule, step by step, as the engines apply it: the step emitting token t
    feeds the whole sequence so far (p + t - 1 positions) without a cache; with one, the prompt
    on the first step and the newest token after."""
    sequence_before = [p + t - 1 for t in range(1, n + 1)]
    return sum(sequence_before), p + (n - 1)


@given(n=st.integers(1, 400), p=st.integers(1, 400))
def test_totals_match_brute_force(n, p):
    naive = sum(naive_step_positions(t, p) for t in range(1, n + 1))
    cached = sum(cached_step_positions(t, p) for t in range(1, n + 1))
    s = work_summary(n, p)
    assert (naive, cached) == brute_force(n, p)
    assert naive == naive_cumulative(n, p) == s.naive_total == n * p + n * (n - 1) // 2
    assert cached == cached_cumulative(n, p) == s.cached_total == p + n - 1
    assert s.wasted == naive - cached
    assert s.naive_last_step == p + n - 1
    assert s.speedup == naive / cached


def test_a_one_token_prompt_is_the_lesson():
    for n in (1, 24, 32, 4096):
        assert work_summary(n, prompt=1) == work_summary(n)
        assert work_summary(n).naive_total == n * (n + 1) // 2
        assert work_summary(n).cached_total == n


def test_the_issue_s_example_44_token_prompt():
    """24 tokens after the default 44-byte prompt: what the tiny engine computes."""
    s = work_summary(24, prompt=44)
    assert (s.naive_total, s.cached_total) == (1_332, 67)


@given(t=st.integers(1, 10_000), p=st.integers(1, 10_000))
def test_cumulative_is_a_running_sum(t, p):
    assert naive_cumulative(t, p) - naive_cumulative(t - 1, p) == naive_step_positions(t, p)
    assert cached_cumulative(t, p) - cached_cumulative(t - 1, p) == cached_step_positions(t, p)


def test_the_prefill_is_the_first_cached_step():
    assert cached_step_positions(1, prompt=10) == 10
    assert cached_step_positions(2, prompt=10) == 1
    assert naive_step_positions(1, prompt=10) == 10
    assert naive_step_positions(5, prompt=10) == 14
    assert cached_cumulative(0, 10) == naive_cumulative(0, 10) == 0


@pytest.mark.parametrize("n", [10**7, 10**12])
def test_huge_lengths_stay_exact(n):
    s = work_summary(n, prompt=7)
    assert s.naive_total == n * 7 + n * (n - 1) // 2
    assert isinstance(s.naive_total, int)
    assert s.cached_total == n + 6


@pytest.mark.parametrize(
    "call",
    [
        lambda: work_summary(0),
        lambda: work_summary(-3),
        lambda: work_summary(5, -1),
        lambda: work_summary(5, 0),
        lambda: naive_step_positions(0),
        lambda: cached_step_positions(0),
    ],
)
def test_bad_counts_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_non_integers_raise_type_error():
    with pytest.raises(TypeError):
        work_summary(2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        work_summary(True)  # type: ignore[arg-type]


# --- FLOPs and bytes of a step ------------------------------------------------------------------


def test_decode_flops_formula_llama_2_7b():
    spec = get_model("llama-2-7b")
    # 2 x params + 4 x layers x heads x head_dim x context
    assert decode_step_flops(spec, 1000) == 2 * 6_738_415_616 + 4 * 32 * 32 * 128 * 1000
    assert attention_flops(spec, 1000) == 4 * 32 * 32 * 128 * 1000
    assert decode_step_flops(spec, 1000, batch=3) == 3 * decode_step_flops(spec, 1000)


def test_moe_multiplies_only_active_parameters():
    spec = get_model("deepseek-v3")
    assert decode_step_flops(spec, 1) == 2 * 37_000_000_000 + attention_flops(spec, 1)
    assert decode_step_bytes(spec, 1, "fp8", "bf16") == 37_000_000_000 + kv_bytes(spec, 1)


def test_sliding_layers_attend_to_their_window_only():
    spec = get_model("mistral-7b")
    assert attention_flops(spec, 10_000) == attention_flops(spec, 4096)
    gemma = get_model("gemma-2-9b")
    assert attention_flops(gemma, 8192) == 4 * 16 * 256 * (21 * 8192 + 21 * 4096)


@pytest.mark.parametrize("name", model_names())
@given(positions=st.integers(1, 120))
def test_uncached_step_is_every_position_again(name, positions):
    """Recomputing P positions costs what cached steps at contexts 1..P cost, exactly, less the
    output head of all but the newest (only its logits are needed)."""
    spec = get_model(name)
    brute = sum(decode_step_flops(spec, i) for i in range(1, positions + 1))
    heads = 2 * (positions - 1) * head_params(spec)
    assert uncached_step_flops(spec, positions) == brute - heads


def test_uncached_flops_closed_form_matches_sum_with_windows():
    spec = get_model("gemma-2-9b")
    for positions in (1, 4095, 4096, 4097, 9000):
        brute = sum(decode_step_flops(spec, i) for i in range(1, positions + 1))
        heads = 2 * (positions - 1) * head_params(spec)
        assert uncached_step_flops(spec, positions) == brute - heads


def test_decode_bytes_are_weights_plus_cache():
    spec = get_model("llama-3.1-8b")
    assert decode_step_bytes(spec, 2048) == 16_060_522_496 + 2048 * 131_072
    assert decode_step_bytes(spec, 2048, batch=4) == weights_bytes(spec, "bf16") + kv_bytes(
        spec, 2048, 4
    )
    assert uncached_step_bytes(spec, 100) == weights_bytes(spec, "bf16") + kv_bytes(spec, 100)


def test_a_batch_reads_the_weights_once_and_every_sequences_cache():
    """B sequences together: B times the FLOPs, the weights once, B caches (exact integers)."""
    spec = get_model("llama-3.1-8b")
    weights, per_token = 16_060_522_496, 131_072
    for batch in (1, 2, 16):
        assert decode_step_bytes(spec, 300, batch=batch) == weights + batch * 300 * per_token
        assert uncached_step_bytes(spec, 300, batch=batch) == weights + batch * 300 * per_token
        assert uncached_step_flops(spec, 300, batch) == batch * uncached_step_flops(spec, 300)
    with pytest.raises(ValueError, match="batch must be at least 1"):
        uncached_step_bytes(spec, 300, batch=0)


def test_decode_is_memory_bound_at_batch_1():
    spec, gpu = get_model("llama-3.1-8b"), get_gpu("h100")

    def intensity(batch: int) -> float:
        return decode_step_flops(spec, 1024, batch) / decode_step_bytes(spec, 1024, batch=batch)

    assert 0.9 < intensity(1) < 1.1  # one multiply-add per 2-byte weight
    assert intensity(1) < gpu.ridge_flops_per_byte
    assert intensity(64) > 30 * intensity(1) / 2


def test_roofline_takes_the_slower_of_compute_and_memory():
    gpu = get_gpu("h100")
    spec = get_model("llama-3.1-8b")
    flops, read = decode_step_flops(spec, 1024), decode_step_bytes(spec, 1024)
    assert roofline_seconds(flops, read, gpu) == read / 3.35e12
    assert roofline_seconds(1e18, 1, gpu) == 1e18 / gpu.peak_bf16_flops


def test_an_uncached_step_turns_compute_bound_near_the_ridge_point():
    from kvtui.sim.work import compute_bound_positions

    spec, gpu = get_model("llama-3.1-8b"), get_gpu("h100")
    t = compute_bound_positions(spec, gpu)
    assert t is not None and 0.5 * gpu.ridge_flops_per_byte < t < 1.5 * gpu.ridge_flops_per_byte

    def bound(positions: int) -> bool:
        return (
            roofline_seconds(
                uncached_step_flops(spec, positions), uncached_step_bytes(spec, positions), gpu
            )
            > uncached_step_bytes(spec, positions) / gpu.bandwidth_bytes_per_s
        )

    assert bound(t + 1) and not bound(t - 1)


# --- tensor parallelism: the all-reduces ---------------------------------------------------------


def test_two_all_reduces_per_layer_and_one_for_the_embedding():
    from kvtui.sim.work import tensor_parallel_all_reduces

    assert tensor_parallel_all_reduces(get_model("llama-3.1-70b")) == 2 * 80 + 1


def test_link_bytes_of_a_ring_all_reduce_exact():
    from kvtui.sim.work import tensor_parallel_step_link_bytes

    spec = get_model("llama-3.1-70b")  # hidden 8192, vocab 128,256
    message = 8192 * 2  # one position's bf16 hidden state
    all_reduces = 161 * 2 * 3 * message  # 2(N-1)/N of it per all-reduce, times N = 4
    logits = 3 * 128_256 * 2  # (N-1)/N of the logits gathered on one GPU, times N
    assert tensor_parallel_step_link_bytes(spec, 1, 4) == (all_reduces + logits) // 4 == 4_149_120
    assert tensor_parallel_step_link_bytes(spec, 1, 1) == 0
    assert tensor_parallel_step_link_bytes(spec, 44, 4) > 44 * 3_900_000  # grows with positions


def test_a_split_step_is_its_gpus_roofline_plus_the_link():
    from kvtui.sim.parallel import shard
    from kvtui.sim.work import tensor_parallel_step_link_bytes, tensor_parallel_step_seconds

    spec, gpu = get_model("llama-3.1-70b"), get_gpu("h100")
    share = shard(spec, 4)
    flops, read = decode_step_flops(share, 1024), decode_step_bytes(share, 1024)
    seconds = tensor_parallel_step_seconds(spec, flops, read, 1, 4, gpu)
    link = tensor_parallel_step_link_bytes(spec, 1, 4) / 450e9  # NVLink 4, one way
    assert seconds == roofline_seconds(flops, read, gpu) + link
    assert read == weights_bytes(share) + kv_bytes(share, 1024)  # its share only
    one = get_model("llama-3.1-8b")
    f1, r1 = decode_step_flops(one, 99), decode_step_bytes(one, 99)
    assert tensor_parallel_step_seconds(one, f1, r1, 1, 1, gpu) == roofline_seconds(f1, r1, gpu)
