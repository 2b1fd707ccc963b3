"""The KV cache's tricks against the plain cache (kvtui.gpu.tricks): bytes measured from the
tensors equal to the formula's, codes within their format's error, a window that keeps exactly
its positions and gives the rest back, shared prefixes held once, copy-on-write, and the FLOPs and
positions the model computed still equal to the (adjusted) formula."""

import pytest
import torch

from kvtui.engines.generate import generate
from kvtui.engines.loops import Sampling, counts_flops
from kvtui.engines.quality import measure_quality
from kvtui.gpu.counting import PositionCounter
from kvtui.gpu.load import spec_from_args
from kvtui.gpu.model import ModelArgs, Transformer
from kvtui.gpu.tricks import (
    FP8_MAX,
    Codec,
    LayoutKVCache,
    average_kv_heads,
    prefill_shared,
    setup_layout_caches,
)
from kvtui.sim.tricks import (
    KVLayout,
    kv_bytes_held,
    layout_bytes_per_token,
    layout_step_cost,
    window_blocks,
    window_blocks_most,
)

from .conftest import SMALL

GREEDY = Sampling(greedy=True)
SPEC = spec_from_args("small", SMALL)


def _ids(batch: int, n: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def _teacher_forced(model: Transformer, ids: torch.Tensor, layout: KVLayout | None, prefix: int):
    """Logits of a prefill of `ids[:, :prefix]`, then of one token at a time; and the cache."""
    batch, n = ids.shape
    if layout is None:
        kv = model.setup_caches(batch, n, block_tokens=16)
    else:
        kv = setup_layout_caches(model, batch, n, layout, block_tokens=16)
    with torch.inference_mode():
        logits = [model(ids[:, :prefix], 0, use_cache=True)[:, -1]]
        logits += [model(ids[:, p : p + 1], p, use_cache=True)[:, -1] for p in range(prefix, n)]
    return torch.stack(logits), kv


# --- a smaller element ---------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "int8"])
def test_bytes_per_token_measured_from_the_tensors_equal_the_formula(small_model, cache_dtype):
    """Codes and scales, every layer: fp32 512 bytes a position here, fp8 128 (a scale per
    tensor), int8 128 + 16 (an fp16 scale per token, head, K and V)."""
    layout = KVLayout(cache_dtype=cache_dtype)
    _, kv = _teacher_forced(small_model, _ids(2, 50), layout, 9)
    per_token = layout_bytes_per_token(SPEC, layout, "fp32")
    assert per_token == {"auto": 512, "fp8": 128, "int8": 144}[cache_dtype]
    assert kv.bytes_per_position == per_token
    assert kv.filled_bytes == kv_bytes_held(SPEC, layout, "fp32", 50, 2) == 2 * 50 * per_token
    assert kv.allocated_bytes == 2 * 4 * 16 * per_token  # ceil(50 / 16) blocks each
    small_model.drop_caches()


def test_the_model_dtype_layout_is_the_plain_cache_bit_for_bit(small_model):
    plain, _ = _teacher_forced(small_model, _ids(2, 40), None, 7)
    small_model.drop_caches()
    auto, _ = _teacher_forced(small_model, _ids(2, 40), KVLayout(window=64), 7)  # never slides
    small_model.drop_caches()
    assert torch.equal(plain, auto)


def test_fp8_codes_are_within_half_a_step_of_e4m3_and_saturate_at_448():
    x = torch.cat((torch.randn(4096) * torch.logspace(-4, 2, 4096), torch.tensor([1e4, -600.0])))
    codec = Codec("fp8", torch.float32)
    codes, scales = codec.encode(x.view(1, 1, -1, 2))
    back = codec.decode(codes, scales).flatten()
    assert scales is None and codes.dtype == torch.uint8 and codes.element_size() == 1
    inside = x.abs() <= FP8_MAX
    # 3 mantissa bits: a normal number within 2^-4 of itself; below 2^-6, within 2^-10.
    bound = torch.maximum(x.abs() * 2**-4, torch.tensor(2**-10))
    assert ((back - x).abs() <= bound)[inside].all()
    assert back[~inside].tolist() == [FP8_MAX, -FP8_MAX]


def test_int8_codes_are_within_half_a_scale_and_never_clip():
    x = torch.randn(64, 2, 16, 32) * torch.logspace(-3, 3, 16).view(1, 1, 16, 1)
    codec = Codec("int8", torch.float32)
    codes, scales = codec.encode(x)
    assert codes.dtype == torch.int8 and scales is not None and scales.dtype == torch.float16
    assert scales.shape == (64, 2, 16, 1)  # one per token and head
    scale = scales.float()
    assert (scale * 127 >= x.abs().amax(-1, keepdim=True)).all()  # rounded up: no code clips
    error = (codec.decode(codes, scales) - x).abs()
    assert (error <= scale / 2 * (1 + 1e-6)).all()


def test_quantized_caches_change_the_logits_a_little_and_int8_less_than_fp8(small_model):
    """The uncached loop keeps no cache, so a quantized cached loop may choose other tokens: a
    quality figure, not a bug. Here the logits move, int8 (a scale per vector) less than fp8
    (vLLM's scale of 1.0 per tensor), and the likeliest token mostly stays."""
    ids = _ids(1, 120)
    plain, _ = _teacher_forced(small_model, ids, None, 20)
    errors = {}
    for cache_dtype in ("fp8", "int8"):
        small_model.drop_caches()
        logits, _ = _teacher_forced(small_model, ids, KVLayout(cache_dtype=cache_dtype), 20)
        errors[cache_dtype] = (logits - plain).abs().max().item()
        agree = (logits.argmax(-1) == plain.argmax(-1)).float().mean().item()
        assert agree > 0.9, cache_dtype
    small_model.drop_caches()
    assert 0 < errors["int8"] < errors["fp8"]


# --- a window with sinks -------------------------------------------------------------------------


@pytest.mark.parametrize("sinks", [4, 0])
def test_a_window_keeps_exactly_its_positions_and_gives_the_rest_back(small_model, sinks):
    """Sinks plus the last W - S positions are read; a block none of whose positions is kept is
    back in the pool, so the blocks and bytes held stay flat while the run goes past the
    model's 1,024 positions (S = 0 runs too: that it reads worse is a quality figure)."""
    W, bt, B = 40, 16, 2
    layout = KVLayout(window=W, sinks=sinks)
    kv = setup_layout_caches(small_model, B, 2000, layout, block_tokens=bt)
    assert kv.pool.blocks == B * window_blocks_most(W, sinks, bt)
    token = _ids(B, 1)
    held = set()
    with torch.inference_mode():
        small_model(_ids(B, 10), 0, use_cache=True)
        for p in range(10, 1100):
            small_model(token, p, use_cache=True)
            n = p + 1
            keys, values = kv.layers[0].read()
            assert keys.shape[2] == values.shape[2] == min(n, W)  # S + (W - S)
            assert kv.pool.taken == B * window_blocks(n, W, sinks, bt)
            assert kv.filled_bytes == B * min(n, W) * kv.bytes_per_position
            if n > W + 2 * bt:
                held.add(kv.allocated_bytes)
    kept = kv.kept(1100).tolist()
    assert kept == list(range(sinks)) + list(range(1100 - (W - sinks), 1100))
    assert held == {
        B * b * kv.block_bytes
        for b in {window_blocks(n, W, sinks, bt) for n in range(W + 2 * bt + 1, 1101)}
    }
    assert max(held) <= B * window_blocks_most(W, sinks, bt) * kv.block_bytes  # flat
    assert kv.rope_start(1099, 1) == W - 1  # the query's index within the cache, not 1,099
    small_model.drop_caches()


def test_a_window_counts_positions_within_the_cache():
    """Keys are stored as projected and rotated by their index in the cache as they are read:
    after the window slides, attention sees the same rotations as a fresh sequence of the kept
    tokens would (StreamingLLM's re-indexing)."""
    model = Transformer(SMALL)
    model.init_weights(seed=3)
    model.eval()
    W, S = 24, 4
    ids = _ids(1, 60)
    kv = setup_layout_caches(model, 1, 60, KVLayout(window=W, sinks=S), block_tokens=8)
    with torch.inference_mode():
        model(ids[:, :10], 0, use_cache=True)
        for p in range(10, 59):
            model(ids[:, p : p + 1], p, use_cache=True)
        last = model(ids[:, 59:60], 59, use_cache=True)[:, -1]
        kept = kv.kept(60)
        # The kept tokens alone, as one sequence: keys at 0..W-1, the query at W-1. Their keys'
        # inputs differ (each was computed with its own context), so compare layer 0's keys,
        # whose inputs are the embeddings alone.
        fresh = model.setup_caches(1, W, block_tokens=8)
        model(ids[:, kept], 0, use_cache=True)
        k_fresh, _ = fresh.layers[0].read()
    model.drop_caches()
    kv_again = setup_layout_caches(model, 1, 60, KVLayout(window=W, sinks=S), block_tokens=8)
    with torch.inference_mode():
        model(ids[:, :10], 0, use_cache=True)
        for p in range(10, 60):
            model(ids[:, p : p + 1], p, use_cache=True)
        k_window, _ = kv_again.layers[0].read()
    model.drop_caches()
    torch.testing.assert_close(k_window, k_fresh, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(last).all()


def test_a_windows_quality_is_measured_when_the_window_is_shorter_than_the_greedy_prompt(
    small_model,
):
    """The free-running half of the quality starts from a prompt the window holds whole (a
    window's steps after its prefill are one position each): a window of 32 against a greedy
    prompt of 64 bytes is measured, not refused mid-way by the cache."""
    ids = _ids(1, 200)
    layout = KVLayout(window=32, sinks=4)
    q = measure_quality(small_model, small_model, layout, ids, greedy_prompt=64, greedy_tokens=40)
    assert q.positions == 199 and q.greedy_tokens == 40
    assert q.kl > 0  # the window forgets: the measurement is of a windowed run


# --- shared prefixes -----------------------------------------------------------------------------


def test_shared_prefix_blocks_are_held_once_and_the_partial_block_is_computed(small_model):
    """4 sequences of a 45-token prompt, blocks of 16: (45 - 1) // 16 = 2 full blocks are shared,
    the third (13 tokens, the last among them) each computes itself. The model's own count of
    positions says so: 45 + 3 x 13 = 84, against 180."""
    B, P, bt = 4, 45, 16
    prompt = _ids(1, P).expand(B, -1)
    kv = setup_layout_caches(small_model, B, P + 8, KVLayout(prefix_caching=True), block_tokens=bt)
    counted = PositionCounter(small_model)
    with torch.inference_mode():
        prefill_shared(small_model, prompt)
    assert counted() == 84 == kv.prefill_positions
    assert kv.prefix_plan == [([0], 0), ([1, 2, 3], 32)]
    assert kv.pool.taken == 2 + B * 1  # two shared blocks once, a private third each
    assert [t[:2] for t in kv.tables] == [kv.tables[0][:2]] * B
    assert len({t[2] for t in kv.tables}) == B
    assert kv.positions_held == 32 + B * 13
    assert kv.filled_bytes == kv_bytes_held(SPEC, KVLayout(), "fp32", 45 - 32, B) + 32 * 512
    small_model.drop_caches()


def test_prompts_sharing_a_beginning_share_only_their_common_full_blocks(small_model):
    common = _ids(1, 40, seed=1)
    prompts = torch.cat((common, common.clone(), common.clone()))
    prompts[1, 20:] = _ids(1, 20, seed=2)  # shares block 0 only (positions 0-15)
    prompts[2, 34:] = _ids(1, 6, seed=3)  # shares blocks 0 and 1 with row 0
    kv = setup_layout_caches(small_model, 3, 48, KVLayout(prefix_caching=True), block_tokens=16)
    with torch.inference_mode():
        prefill_shared(small_model, prompts)
    assert kv.prefix_plan == [([0], 0), ([1], 16), ([2], 32)]
    assert kv.tables[1][0] == kv.tables[0][0] != kv.tables[1][1]
    assert kv.tables[2][:2] == kv.tables[0][:2]
    small_model.drop_caches()


def test_sharing_changes_no_value_and_no_token(small_model):
    """A shared block holds exactly what the sequence would have computed itself: its keys are
    bit for bit those of the sequence prefilled alone. Greedy tokens of the batch with and without
    sharing are the same; the logits differ only as far as torch's kernels round a batch of 4
    and a batch of 1 differently (about 1e-7 here), sharing or not."""
    B, P = 4, 45
    prompt = _ids(1, P)
    kv = setup_layout_caches(small_model, B, P, KVLayout(prefix_caching=True), block_tokens=16)
    with torch.inference_mode():
        prefill_shared(small_model, prompt.expand(B, -1))
        kv.rows = [3]
        kv.reserve(0, P)  # address row 3's reads (nothing is written or taken again)
        shared_keys = [layer.read() for layer in kv.layers]
    small_model.drop_caches()
    alone = small_model.setup_caches(1, P, block_tokens=16)
    with torch.inference_mode():
        small_model(prompt, 0, use_cache=True)
    for (k1, v1), layer in zip(shared_keys, alone.layers, strict=True):
        k2, v2 = layer.read()
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    small_model.drop_caches()
    runs = {}
    for sharing in (False, True):
        layout = KVLayout(prefix_caching=sharing)
        steps = list(
            generate(small_model, prompt.expand(B, -1), 30, GREEDY, cache=True, layout=layout)
        )
        runs[sharing] = [s.token_ids for s in steps]
    assert runs[True] == runs[False]


def test_copy_on_write_when_a_sequence_appends_to_a_shared_partial_block(small_model):
    """A forked sequence shares every block, the partial last one too (parallel sampling). The
    first write into it copies it for the writer: one more block, and neither sequence sees the
    other's new keys."""
    P, bt = 20, 16  # the second block holds 4 positions
    kv = setup_layout_caches(small_model, 2, 24, KVLayout(prefix_caching=True), block_tokens=bt)
    prompt = _ids(1, P)
    with torch.inference_mode():
        kv.rows = [0]
        small_model(prompt, 0, use_cache=True)
        kv.fork(0, 1)
        assert kv.pool.taken == 2 and kv.tables[0] == kv.tables[1]
        kv.rows = [0, 1]
        kv.length = P
        step = small_model(torch.tensor([[7], [9]]), P, use_cache=True)[:, -1]
    assert kv.pool.taken == 3  # one copy: the last holder keeps the original
    assert kv.tables[0][0] == kv.tables[1][0] and kv.tables[0][1] != kv.tables[1][1]
    small_model.drop_caches()
    for row, token in enumerate((7, 9)):  # each as if it had never shared
        small_model.setup_caches(1, 24, block_tokens=bt)
        with torch.inference_mode():
            small_model(prompt, 0, use_cache=True)
            alone = small_model(torch.tensor([[token]]), P, use_cache=True)[:, -1]
        small_model.drop_caches()
        torch.testing.assert_close(step[row : row + 1], alone, rtol=1e-5, atol=1e-5)


# --- the work still observed, and the formula that prices it -----------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        KVLayout(cache_dtype="int8"),
        KVLayout(cache_dtype="fp8"),
        KVLayout(window=24, sinks=4),
        KVLayout(prefix_caching=True),
    ],
    ids=["int8", "fp8", "window", "prefix"],
)
def test_counted_flops_and_positions_equal_the_layouts_formula(small_model, layout):
    """FlopCounterMode over the model's calls equals kvtui.sim.tricks' price of each sampled
    step: a window bounds the keys attended, sharing removes the later sequences' shared
    prefill; codes change no FLOP. The positions are the layers' own count."""
    B, n = 3, 40
    prompt = _ids(1, 21).expand(B, -1)
    steps = list(generate(small_model, prompt, n, GREEDY, cache=True, layout=layout))
    for s in steps:
        cost = layout_step_cost(SPEC, layout, True, s.index, 21, B, "fp32", 16)
        assert s.positions_computed == cost.positions, s.index
        if counts_flops(s.index):
            assert s.flops_counted == cost.flops, s.index
    if layout.prefix_caching:
        assert steps[0].positions_computed == 21 + 2 * 5 < 3 * 21  # 16 shared, 5 computed


def test_averaging_kv_heads_makes_multi_query_attention(small_model):
    """2 key/value heads averaged into 1: half the cache's bytes; the keys are the mean of the
    two heads' (RoPE is linear), so the layer-0 keys of one prompt are the heads' mean."""
    mqa = average_kv_heads(small_model, 1)
    assert mqa.args.n_kv_head == 1 and mqa.args.n_head == SMALL.n_head
    ids = _ids(1, 12)
    kv_gqa = small_model.setup_caches(1, 12)
    kv_mqa = mqa.setup_caches(1, 12)
    with torch.inference_mode():
        small_model(ids, 0, use_cache=True)
        mqa(ids, 0, use_cache=True)
    assert kv_mqa.bytes_per_position * 2 == kv_gqa.bytes_per_position
    k2, v2 = kv_gqa.layers[0].read()
    k1, v1 = kv_mqa.layers[0].read()
    torch.testing.assert_close(k1[:, 0], k2.mean(dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v1[:, 0], v2.mean(dim=1), rtol=1e-5, atol=1e-5)
    assert layout_bytes_per_token(SPEC, KVLayout(kv_heads=1), "fp32") == kv_mqa.bytes_per_position
    small_model.drop_caches()
    mqa.drop_caches()
    with pytest.raises(ValueError, match="divide"):
        average_kv_heads(small_model, 3)


def test_a_layout_that_cannot_run_is_refused_in_words():
    model = Transformer(ModelArgs(n_layer=1, n_head=2, n_kv_head=1, dim=16, max_positions=64))
    with pytest.raises(ValueError, match="no room"):
        setup_layout_caches(model, 1, 10, KVLayout(window=4, sinks=4), block_tokens=4)
    with pytest.raises(ValueError, match="rotary positions"):
        setup_layout_caches(model, 1, 10, KVLayout(window=100), block_tokens=4)
    assert isinstance(
        setup_layout_caches(model, 1, 1000, KVLayout(window=32), block_tokens=4), LayoutKVCache
    )
