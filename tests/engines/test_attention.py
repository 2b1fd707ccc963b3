"""The newest query's attention as the engine sends it: of a model whose attention is known, the
same with and without a cache, bounded in size and rate, checked where it crosses into kvtui."""

import json
import math

import pytest
import torch

from kvtui.engines.attention import (
    ATTENTION_SCALE,
    EXACT_FIRST,
    EXACT_LAST,
    MAX_SPANS,
    Attention,
    spans_for,
)
from kvtui.engines.drive import run_events
from kvtui.engines.protocol import (
    LOOPS,
    MAX_PROGRESS_CHARS,
    RunProgress,
    RunSettings,
    StepSample,
    event_from_json,
    to_json,
)
from kvtui.engines.torch_engine import DecoderEngine
from kvtui.gpu.load import spec_from_args
from kvtui.gpu.model import ModelArgs, Transformer

PROMPT = "xyAbcd"
"""A prompt with one 'A', at position 2: the key every query of `looks_at_a` reads."""

KNOWN = ModelArgs(
    n_layer=1,
    n_head=2,
    n_kv_head=1,
    dim=16,
    intermediate_size=16,
    max_positions=512,
    rope_base=1e30,  # only the first pair of each head turns with position: the rest stay put
)


def known_model(*, looks_at_a: bool) -> Transformer:
    """A one-layer decoder whose attention is known exactly. Every token but 'A' embeds as one
    unit vector, 'A' as another; the MLP, the output projection and the head are zero, so the
    logits are zero and greedy decoding emits byte 0 forever. `looks_at_a`: every query and the
    key of 'A' share a direction (dims 2-3, which RoPE leaves alone at this base), scoring 51
    against 0 for every other key: the attention is one-hot on the 'A'. Otherwise the queries
    are zero, every score is 0, and the attention is uniform over the keys read."""
    model = Transformer(KNOWN)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.norm, model.layers[0].attention_norm, model.layers[0].ffn_norm):
            norm.weight.fill_(1.0)
        model.tok_embeddings.weight[:, 1] = 1.0
        model.tok_embeddings.weight[ord("A")] = torch.nn.functional.one_hot(
            torch.tensor(0), KNOWN.dim
        ).float()
        wqkv = model.layers[0].attention.wqkv.weight  # (q heads, then k, then v) x dim
        hd = KNOWN.head_dim
        wqkv[2 * hd + 2, 0] = 3.0  # the key of 'A' (embedding dim 0) along head dim 2
        if looks_at_a:
            for head in range(KNOWN.n_head):
                wqkv[head * hd + 2, :2] = 3.0  # every token's query along head dim 2
    return model.eval()


def run(
    model: Transformer,
    tokens: int,
    per_second: float = math.inf,
    clock=None,
    loops=LOOPS,
    kv_budget_bytes: int | None = None,
) -> list[StepSample]:
    settings = RunSettings(
        engine="tiny",
        device="cpu",
        prompt=PROMPT,
        tokens=tokens,
        greedy=True,
        loops=loops,
        kv_budget_bytes=kv_budget_bytes,
    )
    spec = spec_from_args("known", KNOWN)
    engine = DecoderEngine(
        settings, model, spec, torch.device("cpu"), "known", byte_level=True, trained_positions=None
    )
    engine.attention_per_second = per_second
    if clock is not None:
        engine.clock = clock
    try:
        events = list(run_events(engine, settings))
    finally:
        engine.close()
    started = events[0]
    assert started.attention_layer == 0 and started.attention_heads == KNOWN.n_head
    assert "".join(started.prompt_pieces) == PROMPT
    return [e for e in events if isinstance(e, StepSample)]


def read(sample: StepSample) -> Attention:
    """A step's attention as the app reads it, after the trip through JSON."""
    sample = event_from_json(json.loads(json.dumps(to_json(sample))))
    return Attention(sample.step, sample.position - 1, sample.attention_spans, sample.attention)


def test_one_hot_attention_is_sent_as_the_model_computed_it():
    samples = run(known_model(looks_at_a=True), tokens=40)
    assert len(samples) == 80  # both loops, every step (no rate limit here)
    for sample in samples:
        attention = read(sample)
        assert attention.keys == sample.position  # every position before the output token
        assert attention.at(2) == pytest.approx(1.0, abs=2e-6)
        assert attention.share(0, 2) + attention.share(3, sample.position) < 2e-6


def test_uniform_attention_and_its_buckets():
    samples = run(known_model(looks_at_a=False), tokens=256, loops=("cached",))
    assert len(samples[-1].attention) <= MAX_SPANS < samples[-1].position  # bucketed past 256
    for sample in samples:
        attention, keys = read(sample), sample.position
        spans = [*sample.attention_spans, keys]
        for i, share in enumerate(sample.attention):
            assert share == pytest.approx(ATTENTION_SCALE * (spans[i + 1] - spans[i]) / keys, abs=2)
        rounding = len(sample.attention) / 2 / ATTENTION_SCALE  # half a millionth a span
        assert attention.share(0, keys) == pytest.approx(1.0, abs=rounding)


def test_cached_and_uncached_steps_send_the_same_attention(small_model):
    settings = RunSettings(engine="tiny", device="cpu", tokens=40, greedy=True)
    spec = spec_from_args("small", small_model.args)
    engine = DecoderEngine(
        settings,
        small_model,
        spec,
        torch.device("cpu"),
        "small",
        byte_level=True,
        trained_positions=None,
    )
    engine.attention_per_second = math.inf
    try:
        steps = [e for e in run_events(engine, settings) if isinstance(e, StepSample)]
    finally:
        engine.close()
    by_loop = {loop: [s for s in steps if s.loop == loop] for loop in ("cached", "uncached")}
    assert [s.token_id for s in by_loop["cached"]] == [s.token_id for s in by_loop["uncached"]]
    for cached, uncached in zip(by_loop["cached"], by_loop["uncached"], strict=True):
        assert cached.attention_spans == uncached.attention_spans
        differences = zip(cached.attention, uncached.attention, strict=True)
        assert max(abs(a - b) for a, b in differences) <= 2
        assert cached.attention != (0,) * len(cached.attention)


def test_attention_is_sent_at_most_so_often_first_and_last_always():
    for loop in LOOPS:
        ticks = iter(range(10**6))  # the clock moves 10 ms a step
        clock = lambda: next(ticks) / 100  # noqa: B023, E731
        samples = run(known_model(looks_at_a=True), 60, 15.0, clock, loops=(loop,))
        sent = [s.step for s in samples if s.attention is not None]
        assert sent[0] == 0 and sent[-1] == 59
        assert [b - a for a, b in zip(sent, sent[1:-1], strict=False)] == [7] * 8  # 1/15 s


def test_a_loop_stopped_by_a_full_pool_sends_the_attention_of_its_last_step():
    ticks = iter(range(10**6))  # the clock moves 10 ms a step
    clock = lambda: next(ticks) / 100  # noqa: E731
    model = known_model(looks_at_a=True)
    per_token = 2 * KNOWN.n_layer * KNOWN.n_kv_head * KNOWN.head_dim * 4  # fp32
    budget = 4 * 16 * per_token  # 4 blocks of 16 positions: 64 positions, the prompt's 6 too
    samples = run(model, 80, 15.0, clock, loops=("cached",), kv_budget_bytes=budget)
    assert len(samples) == 64 - len(PROMPT) + 1  # the step after the last one found no block
    assert samples[-1].step % 7  # not a step the rate (every 7th) would have read anyway
    sent = [s.step for s in samples if s.attention is not None]
    assert sent[0] == 0 and sent[-1] == samples[-1].step
    assert read(samples[-1]).keys == samples[-1].position  # it read every key the pool held


def test_without_a_rate_the_model_keeps_nothing_and_no_step_carries_attention():
    model = known_model(looks_at_a=True)
    samples = run(model, tokens=8, per_second=0)
    assert all(s.attention is None for s in samples)
    assert model.watch_layer is None and model.watched is None


def test_spans_stay_bounded_and_on_block_boundaries():
    for end in (1, 255, 256, 257, 300, 4_096, 131_072, 262_144):
        for block in (1, 7, 16, 1024):
            spans = spans_for(0, end, block)
            assert len(spans) <= MAX_SPANS and spans[0] == 0 and spans == sorted(set(spans))
            if end > MAX_SPANS:
                assert spans[:EXACT_FIRST] == list(range(EXACT_FIRST))
                assert spans[-EXACT_LAST:] == list(range(end - EXACT_LAST, end))
                middle = spans[EXACT_FIRST + 1 : -EXACT_LAST]
                assert all(first % block == 0 for first in middle)
            else:
                assert spans == list(range(end))


def _step(**fields):
    data = to_json(StepSample("cached", 3, 10, 65, "A", 1, 100, 100, 0.001, 640)) | fields
    return data


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"attention": [1], "attention_spans": None}, "go together"),
        ({"attention": [1, 2], "attention_spans": [0]}, "2 shares for 1 spans"),
        ({"attention": [1, 2], "attention_spans": [0, 0]}, "do not rise"),
        ({"attention": [1], "attention_spans": [10]}, "not in 0..9"),
        ({"attention": [-1], "attention_spans": [0]}, "not 0 to"),
        ({"attention": [ATTENTION_SCALE + 1], "attention_spans": [0]}, "not 0 to"),
        ({"attention": [1] * 300, "attention_spans": list(range(300))}, "1 to 256"),
        ({"attention": ["x"], "attention_spans": [0]}, "not a list of an integer"),
    ],
)
def test_a_step_with_malformed_attention_is_one_clear_error(fields, why):
    with pytest.raises(ValueError, match=why):
        event_from_json(_step(**fields))


def test_progress_and_prompt_pieces_are_checked_where_they_enter():
    assert event_from_json({"kind": "progress", "phrase": "importing torch"}) == RunProgress(
        "importing torch"
    )
    with pytest.raises(ValueError, match="progress event"):
        event_from_json({"kind": "progress", "phrase": "x" * (MAX_PROGRESS_CHARS + 1)})
    with pytest.raises(ValueError, match="phrase is 3"):
        event_from_json({"kind": "progress", "phrase": 3})
    started = {"kind": "started", "engine": "tiny", "model": "m", "device": "cpu", "dtype": "fp32"}
    started |= dict(layers=1, kv_heads=1, head_dim=8, kv_bytes_per_token=64, weights_bytes=1)
    started |= dict(prompt_tokens=3, tokens=4, timing="measured")
    assert event_from_json(started | {"prompt_pieces": ["a", "", "é"]}).prompt_pieces == (
        "a",
        "",
        "é",
    )
    with pytest.raises(ValueError, match="2 prompt pieces for 3 prompt tokens"):
        event_from_json(started | {"prompt_pieces": ["a", "b"]})
