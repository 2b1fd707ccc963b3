"""kvtui.run.summary: one fold of a run's events, over synthetic runs with exact figures.

The toy run: a 3-token prompt, 2 layers of 1 KV head of head_dim 4 in fp32, so a position's keys
and values are 2 x 2 x 1 x 4 x 4 = 64 bytes. Step times are powers of two, so that every sum and
rate below is exact in floating point.
"""

import copy
import dataclasses
import json
from dataclasses import replace

import pytest

from kvtui.engines.capabilities import KVTUI_TORCH, NOTHING, ROOFLINE, TRANSFORMERS
from kvtui.engines.factory import recorded_start
from kvtui.engines.protocol import (
    RunFailed,
    RunFinished,
    RunSettings,
    RunStarted,
    ServerMetrics,
    StepSample,
)
from kvtui.engines.replay import RecordWriter
from kvtui.reports.bench import loop_stats, run_bench
from kvtui.reports.bench_text import format_table
from kvtui.run.columns import MAX_POINTS, Column
from kvtui.run.live import LiveRun
from kvtui.run.summary import RunSummary, summarize_events, windowed_spec
from kvtui.sim.catalog import ModelSpec
from kvtui.sim.memory import kv_bytes

P = 3
PER_TOKEN = 64
WEIGHTS = 1000

SLIDING = ModelSpec(
    name="toy-sliding",
    layers=2,
    heads=1,
    kv_heads=1,
    head_dim=4,
    hidden_size=4,
    intermediate_size=8,
    vocab_size=16,
    params=WEIGHTS // 4,
    max_context=64,
    sliding_window=4,
    sliding_layers=(0,),
)
"""Layer 0 keeps the last 4 positions, layer 1 all of them: 32 bytes per position per layer."""


def started(tokens: int = 6, batch: int = 1, engine: str = "tiny") -> RunStarted:
    return RunStarted(
        engine=engine,
        model="toy",
        device="cpu",
        dtype="fp32",
        layers=2,
        kv_heads=1,
        head_dim=4,
        kv_bytes_per_token=PER_TOKEN,
        weights_bytes=WEIGHTS,
        prompt_tokens=P,
        tokens=tokens,
        timing="measured",
        batch=batch,
        kv_capacity_bytes=64 * PER_TOKEN,
        kv_block_tokens=4,
    )


def step(
    loop: str,
    i: int,
    seconds: float,
    *,
    batch: int = 1,
    token: int | None = None,
    windows: ModelSpec | None = None,
    counted: int | None = None,
) -> StepSample:
    """Step `i` by the counting rule: cached P then 1 position, uncached P + i; 10 FLOPs a
    position; the weights read once plus the cache; KV bytes for the P + i positions cached."""
    computed = batch * ((P if i == 0 else 1) if loop == "cached" else P + i)
    cached = P + i if loop == "cached" else 0
    held = kv_bytes(windows, cached, batch, "fp32") if windows else batch * PER_TOKEN * cached
    return StepSample(
        loop=loop,
        step=i,
        position=P + i,
        token_id=100 + i if token is None else token,
        text="ab"[i % 2],
        positions_computed=computed,
        flops=10 * computed,
        bytes_read=WEIGHTS + held,
        step_seconds=seconds,
        kv_bytes=held,
        kv_bytes_allocated=batch * -(-cached // 4) * 4 * PER_TOKEN,
        flops_counted=counted,
    )


def run(tokens: int = 6, batch: int = 1, **kw) -> list:
    """Both loops, cached steps of 1/4 s after a 1/2 s prefill, uncached steps of 1/2 s."""
    events: list = [started(tokens, batch)]
    for loop, first, later in (("cached", 0.5, 0.25), ("uncached", 0.5, 0.5)):
        events += [
            step(loop, i, first if i == 0 else later, batch=batch, **kw) for i in range(tokens)
        ]
        events.append(RunFinished(loop, "done", tokens))
    return events


def test_positions_and_steps_per_loop():
    s = summarize_events(run(tokens=6, batch=2))
    cached, uncached = s.loop("cached"), s.loop("uncached")
    assert cached.steps == uncached.steps == s.compared_steps == 6
    # cached: P + 5 per sequence, 2 sequences; uncached: sum of P + i for i < 6 = 33, twice
    assert cached.positions_computed == 2 * 8 and uncached.positions_computed == 2 * 33
    assert cached.first_positions == 2 * P and uncached.first_positions == 2 * P
    assert list(cached.positions_cumulative) == [3, 4, 5, 6, 7, 8]  # per sequence
    assert list(uncached.positions_cumulative) == [3, 7, 12, 18, 25, 33]
    assert cached.last_positions == 1 and uncached.last_positions == 8
    assert s.work_over(6) == (33, 8) and s.work_over(2) == (7, 4) and s.work_over(0) == (0, 0)
    assert s.positions_speedup() == 33 / 8


def test_first_and_later_step_times_and_rates():
    s = summarize_events(run(tokens=5, batch=2))
    cached = s.loop("cached")
    assert cached.seconds_total == 0.5 + 4 * 0.25 == list(cached.seconds_cumulative)[-1]
    assert cached.ttft_s == 0.5 and cached.tpot_s == 0.25
    assert cached.tokens_per_s_per_sequence == 5 / 1.5
    assert cached.tokens_per_s_total == 2 * 5 / 1.5
    assert cached.first_step_positions_per_s == 2 * P / 0.5  # the prefill, both sequences
    assert cached.later_step_positions_per_s == 2 / 0.25  # one position a step, each
    assert cached.step_seconds_p50 == 0.25 and cached.step_seconds_quantile(0.99) == 0.5
    assert cached.step_seconds_first_quartile == 0.5 and cached.step_seconds_last_quartile == 0.25
    assert cached.seconds_per_position == 0.25 / 2  # one position of each sequence a step
    assert cached.step_seconds_growth_per_position is None  # flat after the prefill
    assert s.wall_speedup() == (5 * 0.5) / 1.5


def timed(times: list[float]) -> list:
    """A cached loop whose steps took `times`, the first a prefill."""
    return [started(len(times)), *(step("cached", i, t) for i, t in enumerate(times))]


def test_a_time_per_position_is_never_negative_and_a_slope_only_where_resolved():
    # later steps that get quicker by noise: the old least-squares "seconds per position" was
    # a slope, -1/64 s here, printed as a time
    noisy = summarize_events(timed([0.5, 0.5, 0.25, 0.5, 0.25, 0.25, 0.25])).loop("cached")
    assert noisy.seconds_per_position == 2 / 6 > 0  # 2 s over 6 positions, measured
    assert noisy.step_seconds_growth_per_position is None  # not a time, and not resolved
    steady = summarize_events(timed([1.0, 0.25, 0.5, 0.75, 1.0, 1.25])).loop("cached")
    assert steady.step_seconds_growth_per_position == 0.25  # exact: no noise at all
    assert steady.seconds_per_position == 3.75 / 5
    stats = loop_stats(noisy)
    assert stats["ms_per_position"] > 0 and stats["step_ms_growth_per_position"] is None
    assert "noise" in stats["step_ms_growth_note"]


def test_no_steps_means_no_figures():
    s = RunSummary()
    s.apply(started())
    cached = s.loop("cached")
    assert cached.steps == 0 and cached.ttft_s is None and cached.tpot_s is None
    assert cached.tokens_per_s_per_sequence is None and cached.bandwidth_bytes_per_s is None
    assert cached.flops_counted is None and cached.flops_ratio is None
    assert s.kv_bytes_formula() is None and s.kv_matches_formula() is None
    assert s.wall_speedup() is None and s.positions_speedup() is None and not s.identical


def test_bandwidth_is_formula_bytes_over_measured_time_after_the_first_step():
    s = summarize_events(run(tokens=4))
    cached = s.loop("cached")
    # steps 1..3 read the weights and P + i positions' keys and values, in 1/4 s each
    rates = [(WEIGHTS + PER_TOKEN * (P + i)) / 0.25 for i in (1, 2, 3)]
    assert list(cached.bandwidth) == rates and cached.bandwidth_bytes_per_s == rates[1]
    assert cached.recent_bandwidth_bytes_per_s(2) == (rates[1] + rates[2]) / 2
    intensity = [10 / (WEIGHTS + PER_TOKEN * (P + i)) for i in (1, 2, 3)]
    assert cached.flops_per_byte == pytest.approx(sum(intensity) / 3)


def test_flops_counted_against_the_formula_on_the_sampled_steps_only():
    events = [started(5)]
    counted = {0: 10 * P, 1: 10, 2: 10, 4: 12}  # step 4 counted 2 FLOPs more than the formula
    for i in range(5):
        events.append(step("cached", i, 0.25, counted=counted.get(i)))
    s = summarize_events(events)
    cached = s.loop("cached")
    assert cached.flops_sampled_steps == 4
    assert cached.flops_counted == 30 + 10 + 10 + 12
    assert cached.flops_formula == 30 + 10 + 10 + 10  # step 3 was not sampled
    assert cached.flops_ratio == 62 / 60
    assert s.loop("uncached").flops_counted is None  # no step, none counted


def test_first_divergence_whichever_loop_comes_first():
    tokens = [1, 2, 3, 4, 5, 6]
    other = [1, 2, 3, 9, 5, 7]
    cached = [step("cached", i, 0.25, token=t) for i, t in enumerate(tokens)]
    uncached = [step("uncached", i, 0.5, token=t) for i, t in enumerate(other)]
    sequential = summarize_events([started(), *cached, *uncached])
    interleaved = summarize_events(
        [started(), *(e for pair in zip(uncached, cached, strict=True) for e in pair)]
    )
    for s in (sequential, interleaved):
        assert s.first_divergence == 3 and not s.identical and s.compared_steps == 6
    same = summarize_events([started(), *cached[:3], *uncached[:2]])
    assert same.first_divergence is None and same.identical and same.compared_steps == 2


def test_wall_speedup_over_the_steps_both_loops_made():
    """A cached loop that stopped early (its pool ran out) is compared over its own steps."""
    events = [started(6)]
    events += [step("cached", i, 0.25) for i in range(2)]
    events.append(RunFinished("cached", "out_of_memory", 2, "the KV cache is full"))
    events += [step("uncached", i, 0.5) for i in range(6)]
    s = summarize_events(events)
    assert s.compared_steps == 2
    assert s.wall_speedup() == 1.0 / 0.5
    assert s.positions_speedup() == (3 + 4) / (3 + 1)


def test_kv_bytes_against_the_formula_without_windows():
    s = summarize_events(run(tokens=5, batch=2))
    assert s.loop("cached").kv_bytes_filled == 2 * PER_TOKEN * (P + 4)
    assert s.loop("cached").kv_bytes_allocated == 2 * 2 * 4 * PER_TOKEN  # 7 positions: 2 blocks
    assert s.kv_bytes_formula() == 2 * PER_TOKEN * (P + 4) and s.kv_matches_formula() is True
    assert s.kv_bytes_formula("uncached") is None  # it keeps no cache
    assert s.loop("uncached").kv_bytes_filled == 0


def test_the_pool_blocks_stop_and_messages_are_the_folds():
    """The figures `kvtui bench` once worked out beside the fold: the pool of the run's start,
    where it stops the cached loop, the blocks held, the loops' messages and step-time ratio."""
    events = run(tokens=5, batch=2)
    events[6] = RunFinished("cached", "out_of_memory", 5, "the KV cache is full")
    events[-1] = RunFinished("uncached", "done", 5, "the KV cache is full")
    s = summarize_events(events)
    assert s.pool is not None and (s.pool.blocks, s.pool.block_tokens) == (16, 4)
    # 16 blocks of 4 slots, 8 blocks a sequence: 32 positions, the prompt's 3, then 30 tokens
    assert s.tokens_before_full == 30
    assert s.kv_blocks_allocated() == 4  # 7 positions of each sequence: 2 blocks each
    assert s.kv_blocks_allocated("uncached") == 0
    assert s.messages == ["the KV cache is full"]  # said by both loops, listed once
    assert s.last_quartile_ratio == 0.5 / 0.25
    assert s.loop("cached").kv_bytes_per_position is None  # its end measured no tensors
    empty = RunSummary()
    assert empty.pool is None and empty.tokens_before_full is None
    assert empty.kv_blocks_allocated() is None and empty.messages == []
    assert empty.last_quartile_ratio is None


def test_the_end_of_a_loop_measures_the_cache():
    events = run(tokens=3)
    events[4] = RunFinished("cached", "done", 3, kv_bytes_allocated=512, kv_bytes_filled=320)
    s = summarize_events(events)
    assert s.loop("cached").kv_bytes_filled == 320 and s.loop("cached").kv_bytes_allocated == 512
    assert s.kv_bytes_formula() == PER_TOKEN * (P + 2) == 320 and s.kv_matches_formula()


def test_a_sliding_window_caps_the_formula():
    """After step 4 the cache holds 7 positions: layer 0 keeps 4 of them, layer 1 all 7."""
    events = run(tokens=5, batch=2, windows=SLIDING)
    s = summarize_events(events, spec=SLIDING)
    held = 2 * (4 + 7) * 2 * 1 * 4 * 4  # 2 sequences x 11 layer-positions x 32 bytes
    assert held == 704 < 2 * PER_TOKEN * 7
    assert s.loop("cached").kv_bytes_filled == held == s.kv_bytes_formula()
    assert s.kv_matches_formula() is True
    windowless = summarize_events(events)  # the same run counted without its window
    assert (
        windowless.kv_bytes_formula() == 2 * PER_TOKEN * 7 and not windowless.kv_matches_formula()
    )


def test_a_spec_of_another_cache_is_not_used():
    """A shape whose bytes per token are not the run's would report a mismatch the engine did
    not make: the formula falls back to the run's own bytes per token."""
    other = ModelSpec("other", 2, 1, 2, 4, 4, 8, 16, 250, 64, sliding_window=4, sliding_layers=(0,))
    s = summarize_events(run(tokens=5), spec=other)
    assert s.kv_bytes_formula() == PER_TOKEN * 7 and s.kv_matches_formula()


def begun(engine: str = "tiny", **kw) -> RunStarted:
    """The toy run's start from `engine`, with `kw` for its fields."""
    return replace(started(engine=engine), **kw)


MISTRAL_ON_ONE = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"}
"""mistral-7b's start on one GPU: 2 x 32 layers x 8 heads x 128 x 2 bytes a position."""


def test_windows_are_what_the_start_states():
    """The fold reads a run's windows from its start (the engine read its config), no file."""
    hf = windowed_spec(begun(sliding_window=4, sliding_layers=(0, 1)))
    assert hf is not None and hf.layer_windows() == (4, 4)
    assert kv_bytes(hf, 7, 1, "fp32") == 2 * 4 * 32  # the run's own shape, capped
    assert windowed_spec(started()) is None
    # the hf engine's cache keeps 4 positions in each layer: 2 x 4 x 32 bytes after 7
    s = RunSummary()
    s.apply(begun("hf:/moved/away", sliding_window=4, sliding_layers=(0, 1)))
    s.apply(step("cached", 0, 0.5))
    s.apply(step("cached", 4, 0.25, windows=hf))
    assert s.kv_bytes_formula() == 2 * 4 * 32 == s.loop("cached").kv_bytes_filled


def test_an_older_record_finds_its_windows_from_the_engine_name(tmp_path):
    """A record written before starts stated windows gets them as it replays
    (kvtui.engines.factory.recorded_start), where the fold once looked them up."""
    config = {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size": 8,
        "intermediate_size": 16,
        "vocab_size": 32,
        "max_position_embeddings": 64,
        "sliding_window": 4,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = recorded_start(begun(f"hf:{tmp_path}"))
    assert hf.can == TRANSFORMERS and windowed_spec(hf).layer_windows() == (4, 4)
    one = {**MISTRAL_ON_ONE, "kv_bytes_per_token": 2 * 32 * 8 * 128 * 2}
    sim = recorded_start(begun("sim:mistral-7b@h100", **one))
    assert sim.can == ROOFLINE and sim.sliding_window == 4096
    assert len(sim.sliding_layers) == 32
    two = {**one, "kv_heads": 4, "kv_bytes_per_token": 2 * 32 * 4 * 128 * 2}  # one GPU's share
    assert recorded_start(begun("sim:mistral-7b@2xh100", **two)).sliding_window == 4096
    assert recorded_start(begun("sim:mistral-7b@2xh100", **one)).sliding_window is None
    for engine in ("tiny", "shape:mistral-7b", "sim:llama-3.1-8b@h100", "hf:/no/such", "nope"):
        for shape in ({}, one):
            assert recorded_start(begun(engine, **shape)).sliding_window is None
    assert recorded_start(begun("tiny")).can == KVTUI_TORCH
    assert recorded_start(begun("nope")).can == NOTHING
    said = begun("sim:mistral-7b@h100", can=ROOFLINE, **one)  # a start that says
    assert recorded_start(said) is said


def test_a_failed_run_says_why():
    s = summarize_events([started(), step("cached", 0, 0.5), RunFailed("engine died")])
    assert s.failure == "engine died" and s.loop("cached").steps == 1


def test_live_run_reads_the_same_figures():
    """The screens' LiveRun folds through the summary: its figures are the summary's."""
    events = run(tokens=5, batch=2, windows=SLIDING)
    live = LiveRun(RunSettings(batch=2))
    for event in events:
        live.apply(event)
    s = summarize_events(events)
    assert live.summary.loop("cached").steps == 5 and live.state == "done"
    assert live.compared_steps() == s.compared_steps and live.work_over(5) == s.work_over(5)
    assert live.wall_speedup() == s.wall_speedup()
    assert live.achieved_bandwidth() == s.loop("cached").recent_bandwidth_bytes_per_s()
    assert live.kv_bytes_measured() == (704, s.kv_bytes_formula())
    trace = live.loop("uncached")
    assert list(trace.positions_cumulative) == [3, 7, 12, 18, 25] and trace.last_positions == 7
    assert trace.text == "ababa" and trace.positions.values == [3, 4, 5, 6, 7]


def _shown(live: LiveRun) -> dict:
    """Everything a screen can read of a live run, field by field (LiveRun compares by identity)."""
    return {f.name: getattr(live, f.name) for f in dataclasses.fields(live) if f.compare}


def test_a_snapshot_is_the_run_as_it_was_whatever_is_folded_after():
    """The screens' copy shares what the fold never changes and views its columns, where it was
    a deep copy: the events folded after it leave it as a deep copy taken at the same moment,
    past a series' downsampling (MAX_POINTS) and with a server's polls."""
    tokens = MAX_POINTS + 100
    events = run(tokens=tokens, batch=2)
    events.insert(1, ServerMetrics(0.5, kv_usage=0.25))
    half = 2 + tokens + 1 + tokens // 2  # the cached loop ended, the uncached one halfway
    live = LiveRun(RunSettings(batch=2))
    for event in events[:half]:
        live.apply(event)
    snapshot, deep = live.snapshot(), copy.deepcopy(live)
    for event in events[half:]:
        live.apply(event)
    live.apply(ServerMetrics(1.0, kv_usage=0.5))
    assert _shown(snapshot) == _shown(deep) != _shown(live)
    uncached = snapshot.loop("uncached")
    assert uncached.steps == tokens // 2 < live.loop("uncached").steps
    assert len(uncached.positions.steps) <= MAX_POINTS + 1
    assert list(uncached.positions_cumulative) == list(deep.loop("uncached").positions_cumulative)
    assert snapshot.state == "running" and live.state == "done"
    assert list(snapshot.summary.server.usage) == [(0.5, 0.25)]
    with pytest.raises(RuntimeError):
        snapshot.apply(events[-1])
    with pytest.raises(RuntimeError):
        snapshot.summary.loop("uncached").step_seconds.append(1.0)


def test_a_column_view_shows_its_items_as_they_were():
    column: Column[int] = Column("q", [1, 2, 3])
    view = column.snapshot()
    for i in range(4, 100):
        column.append(i)  # the array outgrows its buffer: the view's items move with it
    assert len(view) == 3 and list(view) == [1, 2, 3] == view.tolist()
    assert view[-1] == 3 and view[0] == 1 and view[-3] == 1
    assert list(view[1:]) == [2, 3] and list(view[-2:]) == [2, 3] and list(view[::-1]) == [3, 2, 1]
    assert list(view[5:]) == [] and list(view[2:1]) == []
    for outside in (3, -4):
        with pytest.raises(IndexError):
            view[outside]
    assert view == Column("q", [1, 2, 3]) != column and column[-1] == 99 and len(column) == 99
    own = copy.deepcopy(view)  # a column of its own: appending to it changes neither
    own.append(4)
    assert list(own) == [1, 2, 3, 4] and len(view) == 3 and len(column) == 99


def test_bench_reports_counted_flops_beside_the_formula(tmp_path):
    """A record of a run whose sampled steps counted their FLOPs, replayed through `kvtui
    bench`: its JSON and its table say counted against formula, over the sampled steps."""
    path = tmp_path / "run.jsonl"
    counted = {0: 10 * P, 1: 10, 2: 10}
    events = [started(3)]
    for loop in ("cached", "uncached"):
        for i in range(3):
            positions = (P if i == 0 else 1) if loop == "cached" else P + i
            events.append(
                step(loop, i, 0.25, counted=counted[i] if loop == "cached" else 10 * positions)
            )
        events.append(RunFinished(loop, "done", 3))
    with path.open("w") as out:
        writer = RecordWriter(out, RunSettings(tokens=3))
        for event in events:
            writer.write(event)
    r = run_bench(RunSettings(engine=f"replay:{path}", replay_speed=0))
    assert r["cached"]["flops_counted"] == r["cached"]["flops_formula"] == 50
    assert r["uncached"]["flops_counted"] == r["uncached"]["flops_formula"] == 10 * (3 + 4 + 5)
    assert r["cached"]["flops_sampled_steps"] == 3 and r["cached"]["flops_ratio"] == 1
    assert r["kv_bytes_formula"] == r["kv_bytes_filled"] == PER_TOKEN * (P + 2)
    assert r["work_ratio"] == 12 / 5 and r["speedup_wall"] == 1
    table = format_table(r)
    assert "cached: FLOPs counted (FlopCounterMode, 3 sampled steps) 50 vs formula 50" in table
