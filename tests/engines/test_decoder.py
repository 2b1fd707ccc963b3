import pytest
import torch
import torch.nn.functional as F

from kvtui.gpu import kernels as model_module
from kvtui.gpu.cache import PagedKVCache
from kvtui.gpu.kernels import Linear, choose_matvec, row_sum
from kvtui.gpu.model import ModelArgs, Transformer
from kvtui.sim.memory import kv_bytes

from .conftest import SMALL


def test_kv_cache_bytes_equal_the_formula(small_model):
    """Filled: the formula for the positions written; allocated: whole blocks."""
    from kvtui.gpu.load import spec_from_args

    spec = spec_from_args("small", SMALL)
    kv = small_model.setup_caches(batch=1, max_len=300, block_tokens=16)
    assert kv.allocated_bytes == kv.filled_bytes == 0  # nothing taken before a position is written
    with torch.inference_mode():
        small_model(torch.zeros(1, 300, dtype=torch.long), use_cache=True)
    per_token = 2 * SMALL.n_layer * SMALL.n_kv_head * SMALL.head_dim * 4
    assert kv.filled_bytes == kv_bytes(spec, 300, 1, "fp32") == 300 * per_token
    assert kv.allocated_bytes == 19 * 16 * per_token  # ceil(300 / 16) blocks
    small_model.drop_caches()


def test_the_parameter_count_of_a_shape_is_the_count_of_its_tensors():
    """`ModelArgs.params` is kvtui.sim's counter; the model's own tensors must agree with it."""
    for args in (SMALL, ModelArgs(), ModelArgs(n_layer=3, dim=96, n_head=6, n_kv_head=3)):
        model = Transformer(args, device="meta")
        assert sum(p.numel() for p in model.parameters()) == args.params


def test_kv_cache_update_writes_at_positions_and_counts_length():
    cache = PagedKVCache(1, 1, 2, 4, block_tokens=2, n_blocks=4, max_positions=8)
    layer = cache.layers[0]
    k = torch.ones(1, 2, 3, 4)
    cache.reserve(0, 3)
    keys, values = layer.update(0, k, 2 * k)
    assert cache.length == 3 and keys.shape == (1, 2, 3, 4) and cache.pool.taken == 2
    cache.reserve(3, 1)
    keys, values = layer.update(3, 3 * k[:, :, :1], 4 * k[:, :, :1])
    assert cache.length == 4 and cache.pool.taken == 2  # position 3 is block 1's second slot
    assert keys[0, 0, :, 0].tolist() == [1, 1, 1, 3]
    assert values[0, 0, :, 0].tolist() == [2, 2, 2, 4]
    with pytest.raises(ValueError, match="past the cache"):
        cache.reserve(7, 2)


def test_decoding_with_the_cache_matches_the_full_forward_at_every_position(small_model):
    """The trap of SDPA's top-left causal mask: one query against many cached keys must see them
    all. Tokens fed one by one through the cache give the logits of one causal pass."""
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = small_model(ids)
        small_model.setup_caches(1, 40)
        head = small_model(ids[:, :10], start=0, use_cache=True)  # prefill
        steps = [small_model(ids[:, i : i + 1], start=i, use_cache=True) for i in range(10, 33)]
        chunk = small_model(ids[:, 33:], start=33, use_cache=True)  # several queries after a prefix
    incremental = torch.cat([head, *steps, chunk], dim=1)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-4)


def _decode_after_prefill(model: Transformer, ids: torch.Tensor, prefix: int, one_token_path):
    """Prefill `ids[:, :prefix]`, then feed the rest one token at a time through
    `one_token_path(model, token, position)`; the logits of each step and the caches' keys and
    values at the end."""
    with torch.inference_mode():
        model.setup_caches(ids.shape[0], ids.shape[1])
        model(ids[:, :prefix], start=0, use_cache=True)
        logits = [one_token_path(model, ids[:, i : i + 1], i) for i in range(prefix, ids.shape[1])]
    caches = [(c.k.clone(), c.v.clone()) for c in model.kv.layers]
    model.drop_caches()
    return torch.stack(logits), caches


def _step(model: Transformer, token: torch.Tensor, position: int) -> torch.Tensor:
    """The cached loop's step: the one forward on one token per row."""
    return model(token, start=position, use_cache=True)[:, -1]


@pytest.mark.parametrize("batch", [1, 2])
def test_one_token_steps_through_the_cache_give_the_logits_of_one_causal_pass(either_layout, batch):
    """The one forward, run token by token against the cache (the cached loop's step), gives
    what it gives over the whole sequence at once, whatever the layout and the kernel."""
    ids = torch.randint(0, 256, (batch, 50), generator=torch.Generator().manual_seed(3))
    model = either_layout
    steps, _ = _decode_after_prefill(model, ids, 7, _step)
    with torch.inference_mode():
        full = model(ids)[:, 7:].transpose(0, 1)  # (positions, B, vocab)
    assert steps.shape == (43, batch, 256)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)


def test_the_cached_step_reads_the_weights_and_kernels_set_up_with_the_caches(small_model):
    """`setup_caches` gathers what the step multiplies by, each linear once, in order;
    `drop_caches` lets it go, and then a step needs caches again."""
    token = torch.zeros(1, 1, dtype=torch.long)
    seen = []

    def kernel(x, weight):
        seen.append(weight)
        return F.linear(x, weight)

    small_model.setup_caches(1, 4)  # gathers the kernels as they are now: F.linear
    for module in small_model.modules():
        if isinstance(module, Linear):
            module.matvec = kernel
    with torch.inference_mode():
        _step(small_model, token, 0)
    assert seen == []  # the step ran the kernels gathered with the caches
    small_model.setup_caches(1, 4)
    with torch.inference_mode():
        _step(small_model, token, 0)
    linears = [m for m in small_model.modules() if isinstance(m, Linear)]
    assert [id(w) for w in seen] == [id(m.weight) for m in linears]
    small_model.drop_caches()
    with pytest.raises(RuntimeError, match="setup_caches"):
        _step(small_model, token, 0)


def test_the_model_counts_the_key_rows_its_layers_produce(small_model):
    """`key_rows` grows by batch x positions per layer per call: the count the loops read."""
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        small_model(ids)
        assert small_model.key_rows == 2 * 9 * SMALL.n_layer
        small_model.setup_caches(2, 10)
        small_model(ids, use_cache=True)
        _step(small_model, ids[:, :1], 9)
    assert small_model.key_rows == (2 * 9 + 2 * 9 + 2 * 1) * SMALL.n_layer


@pytest.mark.parametrize("batch", [1, 2])
def test_weights_stored_transposed_keep_their_values_and_the_model_its_outputs(small_model, batch):
    import copy

    ids = torch.randint(0, 256, (batch, 60), generator=torch.Generator().manual_seed(4))
    moved = copy.deepcopy(small_model)
    timings = moved.store_weights_transposed()
    linears = [m for m in moved.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * SMALL.n_layer + 1
    for lin in linears:  # same shape and values, laid out (in, out) in memory
        assert lin.weight.t().is_contiguous() and not lin.weight.is_contiguous()
    # every weight was timed by shape and multiplies by the kernel measured fastest for it
    chosen = {t.shape: model_module.MATVEC_KERNELS[t.kernel] for t in timings}
    assert moved.matvec_timings == timings
    assert {tuple(lin.weight.shape) for lin in linears} == set(chosen)
    assert sum(t.weights for t in timings) == len(linears)
    assert all(lin.matvec is chosen[tuple(lin.weight.shape)] for lin in linears)
    before, after = small_model.state_dict(), moved.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.inference_mode():
        torch.testing.assert_close(moved(ids), small_model(ids), rtol=1e-5, atol=1e-5)
    fast, fast_caches = _decode_after_prefill(moved, ids, 10, _step)
    slow, slow_caches = _decode_after_prefill(small_model, ids, 10, _step)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    for (k1, v1), (k2, v2) in zip(fast_caches, slow_caches, strict=True):
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)


def test_choose_matvec_gives_each_weight_the_kernel_it_times_fastest(small_model, monkeypatch):
    """Timed on a clock that each kernel advances by its own cost (no sleeping, no real timing):
    every weight gets the cheaper kernel, each kernel keeps its best round."""
    clock = [0.0]

    def kernel(cost):
        def multiply(x, weight):
            clock[0] += cost
            return F.linear(x, weight)

        return multiply

    slow, fast = kernel(1.0), kernel(0.25)
    monkeypatch.setattr(model_module.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(model_module, "MATVEC_KERNELS", {"slow": slow, "fast": fast})
    timings = choose_matvec(small_model, rounds=2)
    linears = [m for m in small_model.modules() if isinstance(m, Linear)]
    assert all(lin.matvec is fast for lin in linears)
    assert all(t.kernel == "fast" and t.timed == t.weights for t in timings)
    assert all(t.seconds == {"slow": t.timed * 1.0, "fast": t.timed * 0.25} for t in timings)
    # w13 and the output are both (256, 64) here: three weights of one shape, timed together
    assert sorted(t.shape for t in timings) == [(64, 64), (64, 128), (128, 64), (256, 64)]
    assert {t.shape: t.weights for t in timings}[(256, 64)] == 2 * SMALL.n_layer - 1


def test_choose_matvec_times_as_many_weights_as_fit_in_a_pass(small_model):
    """Some weights of a shape, at least one: enough to stream from memory, bounded in time."""
    timings = choose_matvec(small_model, rounds=1, bytes_per_pass=1)
    assert all(t.timed == 1 for t in timings)
    timings = choose_matvec(small_model, rounds=1, bytes_per_pass=2 * 256 * 64 * 4)
    assert {t.shape: t.timed for t in timings}[(256, 64)] == 2


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 1, 96), (2, 1, 64)], ids=str)
def test_row_sum_is_linear_for_either_layout(shape, monkeypatch):
    """Only one vector against a weight stored transposed takes the row sum; the answer is
    `F.linear`'s either way (to rounding)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen)
    rows = torch.randn(40, shape[-1], generator=gen)  # (out, in), as nn.Linear stores it
    transposed = rows.t().contiguous().t()  # the same matrix, stored (in, out)
    expected = F.linear(x, rows)
    row_sums = []
    real = F.embedding_bag
    monkeypatch.setattr(F, "embedding_bag", lambda *a, **k: row_sums.append(1) or real(*a, **k))
    assert torch.equal(row_sum(x, rows), expected)  # as trained: F.linear itself
    assert row_sums == []
    torch.testing.assert_close(row_sum(x, transposed), expected, rtol=1e-5, atol=1e-5)
    assert row_sum(x, transposed).shape == expected.shape
    assert bool(row_sums) == (shape[0] == 1)


def test_row_sum_works_with_gradients_after_an_inference_call():
    """The cached indices are made outside inference mode: a later call that records
    gradients may use them."""
    x = torch.randn(1, 1, 48)
    weight = torch.randn(48, 24).t().requires_grad_()  # stored (in, out)
    with torch.inference_mode():
        row_sum(x, weight.detach())
    row_sum(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, x.view(1, 48).expand(24, 48))


def test_a_cached_step_needs_caches_and_a_position_inside_the_rope_table(small_model):
    token = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="setup_caches"):
        _step(small_model, token, 0)
    small_model.setup_caches(1, 8)
    with pytest.raises(ValueError, match="past the model"):
        _step(small_model, token, SMALL.max_positions)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_a_gpu_one_token_steps_through_the_cache_match_one_causal_pass(small_model, dtype):
    model = small_model.to(device="cuda", dtype=dtype)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(6)).cuda()
    steps, _ = _decode_after_prefill(model, ids, 8, _step)
    with torch.inference_mode():
        full = model(ids)[:, 8:].transpose(0, 1)  # (positions, B, vocab)
    torch.testing.assert_close(steps.float(), full.float(), rtol=2e-2, atol=2e-2)


def test_positions_past_the_rope_tables_are_refused(small_model):
    with pytest.raises(ValueError, match="past the model"):
        small_model(torch.zeros(1, SMALL.max_positions + 1, dtype=torch.long))


def test_head_dim_can_differ_from_dim_over_heads():
    args = ModelArgs(
        n_layer=1, n_head=4, n_kv_head=2, dim=64, intermediate_size=64, head_dim_override=32
    )
    model = Transformer(args)
    assert model.layers[0].attention.wqkv.out_features == 4 * 32 + 2 * 2 * 32
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 256)


def test_moving_the_model_keeps_its_rotary_table(small_model):
    """`Module.to(dtype)` casts buffers: the RoPE table must survive it (a complex buffer would
    lose its sines and silently break positions)."""
    import copy

    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    moved = copy.deepcopy(small_model).to(device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        torch.testing.assert_close(moved(ids), small_model(ids))
        as_bf16 = copy.deepcopy(small_model).to(torch.bfloat16)(ids).float()
    torch.testing.assert_close(as_bf16, small_model(ids), atol=0.1, rtol=0.1)
