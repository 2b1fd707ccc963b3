"""A live batch: B sequences of one prompt decoded together, cached and uncached, through the same
model code and the same KV pool; what each step counts; `kvtui bench --batch` and its sweep."""

import json

import pytest

from kvtui.cli import main
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.generate import encode_text, generate
from kvtui.engines.loops import Sampling
from kvtui.engines.protocol import RunFinished, RunSettings, RunStarted, StepSample
from kvtui.sim.catalog import get_gpu, get_model
from kvtui.sim.memory import kv_bytes, weights_bytes
from kvtui.sim.pool import KVPool
from kvtui.sim.work import (
    decode_step_bytes,
    decode_step_flops,
    roofline_seconds,
    tensor_parallel_step_seconds,
    uncached_step_bytes,
    uncached_step_flops,
)

PROMPT = "It is a truth universally acknowledged, that"
TINY_PER_TOKEN = 2 * 6 * 2 * 32 * 4
"""The shipped model's keys and values per position in fp32: 3,072 bytes."""


def steps_of(events, loop):
    return [e for e in events if isinstance(e, StepSample) and e.loop == loop]


def finished_of(events, loop):
    return next(e for e in events if isinstance(e, RunFinished) and e.loop == loop)


# --- the loops ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [Sampling(greedy=True), Sampling(temperature=0.8, top_k=40, seed=5)],
    ids=["greedy", "seeded"],
)
def test_a_batch_decodes_the_same_tokens_cached_and_uncached_row_by_row(small_model, sampling):
    prompt = encode_text(PROMPT).expand(3, -1)
    cached = list(generate(small_model, prompt, 48, sampling, cache=True))
    uncached = list(generate(small_model, prompt, 48, sampling, cache=False))
    rows = list(zip(*(s.token_ids for s in cached), strict=True))
    assert [s.token_ids for s in cached] == [s.token_ids for s in uncached]
    assert len(rows) == 3 and all(len(set(row)) > 5 for row in rows)  # real streams
    if sampling.greedy:
        assert len(set(rows)) == 1  # the same prompt, no randomness: B equal rows
        return
    assert len(set(rows)) == 3  # each row its own seed: the rows differ
    for r, row in enumerate(rows):  # row r is the one-sequence run seeded seed + r
        alone = generate(small_model, prompt[:1], 48, Sampling(seed=5 + r), cache=True)
        assert [s.token_id for s in alone] == list(row)


def test_a_batch_step_counts_every_sequence(small_model):
    prompt = encode_text("abc").expand(4, -1)
    cached = list(generate(small_model, prompt, 6, Sampling(greedy=True), cache=True))
    uncached = list(generate(small_model, prompt, 6, Sampling(greedy=True), cache=False))
    assert [s.positions_computed for s in cached] == [12, 4, 4, 4, 4, 4]
    assert [s.positions_computed for s in uncached] == [4 * p for p in (3, 4, 5, 6, 7, 8)]
    per_position = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head_dim x fp32
    assert [s.kv_bytes for s in cached] == [4 * per_position * p for p in (3, 4, 5, 6, 7, 8)]
    assert all(len(s.token_ids) == 4 and s.token_id == s.token_ids[0] for s in cached)


# --- the tiny engine ------------------------------------------------------------------------------

BATCH = RunSettings(engine="tiny", device="cpu", tokens=12, seed=3, batch=4)


@pytest.fixture(scope="module")
def batch_run():
    engine = open_engine(BATCH)
    return engine, list(run_events(engine, BATCH))


def test_the_tiny_engine_runs_a_batch_and_says_so(batch_run):
    _, events = batch_run
    started = events[0]
    assert isinstance(started, RunStarted) and started.batch == 4
    assert started.ridge_flops_per_byte is None and "CPU" in started.ridge_source
    assert {(f.loop, f.reason, f.steps) for f in events if isinstance(f, RunFinished)} == {
        ("cached", "done", 12),
        ("uncached", "done", 12),
    }
    cached, uncached = steps_of(events, "cached"), steps_of(events, "uncached")
    assert [s.token_id for s in cached] == [s.token_id for s in uncached]
    assert "".join(s.text for s in cached) == "".join(s.text for s in uncached)
    # row 0 samples with the seed itself: the one-sequence run's tokens
    alone = RunSettings(engine="tiny", device="cpu", tokens=12, seed=3, loops=("cached",))
    single = steps_of(run_events(open_engine(alone), alone), "cached")
    assert [s.token_id for s in cached] == [s.token_id for s in single]


def test_a_batch_step_counts_b_sequences_by_kvtui_sim(batch_run):
    """FLOPs for B sequences; the weights read once and every sequence's keys and values."""
    engine, events = batch_run
    spec, P = engine.spec, events[0].prompt_tokens
    cached, uncached = steps_of(events, "cached"), steps_of(events, "uncached")
    weights = weights_bytes(spec, "fp32")
    assert [s.positions_computed for s in cached] == [4 * P] + [4] * 11
    assert [s.positions_computed for s in uncached] == [4 * (P + i) for i in range(12)]
    for i, s in enumerate(cached[1:], start=1):
        assert s.flops == decode_step_flops(spec, P + i, 4) == 4 * decode_step_flops(spec, P + i)
        assert s.bytes_read == decode_step_bytes(spec, P + i, "fp32", "fp32", 4)
        assert s.bytes_read == weights + 4 * (P + i) * TINY_PER_TOKEN
    for i, s in enumerate(uncached):
        assert s.flops == uncached_step_flops(spec, P + i, 4)
        assert s.bytes_read == uncached_step_bytes(spec, P + i, "fp32", "fp32", 4)
    assert cached[0].flops == uncached_step_flops(spec, P, 4)


def test_a_batch_holds_b_times_one_sequences_kv_bytes(batch_run):
    engine, events = batch_run
    spec, P = engine.spec, events[0].prompt_tokens
    cached = steps_of(events, "cached")
    pool = engine.pool
    for i, s in enumerate(cached):
        one = kv_bytes(spec, P + i, 1, "fp32")
        assert s.kv_bytes == 4 * one == kv_bytes(spec, P + i, 4, "fp32")
        assert s.kv_bytes_allocated == pool.blocks_for(P + i, 4) * pool.block_bytes
    finished = finished_of(events, "cached")
    assert finished.kv_bytes_filled == 4 * (P + 11) * TINY_PER_TOKEN
    assert all(s.kv_bytes == s.kv_bytes_allocated == 0 for s in steps_of(events, "uncached"))


@pytest.mark.parametrize(
    ("budget_blocks", "block", "prompt", "batch"),
    [
        (2, 16, "a", 2),  # one block each: 16 slots
        (10, 7, "Emma", 3),  # 3 blocks each (one left over): 21 slots
        (9, 4, "It is", 4),  # 2 blocks each: 8 slots
        (3, 16, "a", 4),  # fewer blocks than sequences: not even the prompt
    ],
)
def test_the_pool_stops_a_batch_where_kvpool_says(budget_blocks, block, prompt, batch):
    budget = budget_blocks * block * TINY_PER_TOKEN
    settings = RunSettings(
        engine="tiny",
        device="cpu",
        tokens=100,
        greedy=True,
        loops=("cached",),
        prompt=prompt,
        kv_budget_bytes=budget,
        kv_block_tokens=block,
        batch=batch,
    )
    engine = open_engine(settings)
    events = list(engine.steps("cached"))
    steps, finished = events[:-1], events[-1]
    P, pool = len(prompt.encode()), KVPool(budget, block, TINY_PER_TOKEN)
    assert isinstance(finished, RunFinished) and finished.reason == "out_of_memory"
    assert finished.steps == len(steps) == pool.tokens_before_full(P, batch)
    assert finished.message == pool.full_message(P, batch)
    assert engine.model.kv is None  # the cache was freed
    if steps:  # every slot of every sequence filled; every sequence's blocks taken
        per_sequence = pool.tokens_per_sequence(batch)
        assert steps[-1].kv_bytes == batch * per_sequence * TINY_PER_TOKEN
        assert finished.kv_bytes_allocated == batch * (pool.blocks // batch) * pool.block_bytes


def test_a_cuda_devices_ridge_is_the_catalog_gpu_it_matches(monkeypatch):
    """The lookup only (the name as the driver gives it); a run on CUDA is gpu_checks.sh's."""
    torch = pytest.importorskip("torch")
    from kvtui.gpu import device as torch_engine

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda:0")
    ridge, source = torch_engine.device_ridge(cuda, 85_520_809_984)
    assert ridge == get_gpu("h100").ridge_flops_per_byte
    assert source == "the catalog's NVIDIA H100 (SXM, 80GB)"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA GeForce GT 710")
    assert torch_engine.device_ridge(cuda, 2 << 30) == (
        None,
        "none: NVIDIA GeForce GT 710 is not in the GPU catalog",
    )
    assert torch_engine.device_ridge(torch.device("cpu"), None)[0] is None


# --- the sim engine -------------------------------------------------------------------------------


def test_sim_batch_figures_are_kvtui_sims_exactly():
    """Roofline of a batch: FLOPs x B, bytes = the weights once + B x the KV cache."""
    settings = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=20, replay_speed=0, batch=8)
    events = list(run_events(open_engine(settings), settings))
    spec, gpu = get_model("llama-3.1-8b"), get_gpu("h100")
    started = events[0]
    P = started.prompt_tokens
    assert started.batch == 8 and started.ridge_flops_per_byte == gpu.ridge_flops_per_byte
    cached, uncached = steps_of(events, "cached"), steps_of(events, "uncached")
    assert cached[0].flops == uncached_step_flops(spec, P, 8)
    assert cached[0].positions_computed == 8 * P
    for i, s in enumerate(cached[1:], start=1):
        assert s.positions_computed == 8
        assert s.flops == 8 * decode_step_flops(spec, P + i)
        assert s.bytes_read == weights_bytes(spec, "bf16") + 8 * kv_bytes(spec, P + i)
        assert s.bytes_read == decode_step_bytes(spec, P + i, batch=8)
        assert s.step_seconds == roofline_seconds(s.flops, s.bytes_read, gpu)
        assert s.kv_bytes == kv_bytes(spec, P + i, 8)
    for i, s in enumerate(uncached):
        assert s.positions_computed == 8 * (P + i)
        assert s.flops == uncached_step_flops(spec, P + i, 8)
        assert s.bytes_read == uncached_step_bytes(spec, P + i, batch=8)
        assert s.step_seconds == roofline_seconds(s.flops, s.bytes_read, gpu)
    assert finished_of(events, "cached").kv_bytes_filled == kv_bytes(spec, P + 19, 8)


def test_sim_batch_split_over_gpus_adds_the_batchs_exchanges():
    settings = RunSettings(
        engine="sim:llama-3.1-70b@4xh100", tokens=4, replay_speed=0, batch=4, loops=("cached",)
    )
    engine = open_engine(settings)
    steps = steps_of(run_events(engine, settings), "cached")
    model, gpu, P = get_model("llama-3.1-70b"), get_gpu("h100"), engine.prompt_tokens
    for i, s in enumerate(steps):
        per_sequence = P if i == 0 else 1
        assert s.step_seconds == tensor_parallel_step_seconds(
            model, s.flops, s.bytes_read, per_sequence, 4, gpu, 4
        )


def test_sim_pool_stops_a_batch_where_kvpool_says():
    budget = 1 << 30
    settings = RunSettings(
        engine="sim:llama-3.1-8b@h100",
        tokens=5000,
        replay_speed=0,
        loops=("cached",),
        kv_budget_bytes=budget,
        batch=16,
    )
    engine = open_engine(settings)
    events = list(engine.steps("cached"))
    pool, P = engine.pool, engine.prompt_tokens
    assert events[-1].reason == "out_of_memory"
    assert events[-1].steps == len(events) - 1 == pool.tokens_before_full(P, 16)
    assert events[-1].message == pool.full_message(P, 16)
    assert events[-2].kv_bytes_allocated == 16 * (pool.blocks // 16) * pool.block_bytes


# --- settings and the command line ----------------------------------------------------------------


@pytest.mark.parametrize("batch", [0, 257, "2", True, 2.0])
def test_run_settings_refuse_a_batch_out_of_range_or_not_an_integer(batch):
    with pytest.raises(ValueError, match="batch"):
        RunSettings.from_json({**RunSettings().to_json(), "batch": batch})
    assert RunSettings.from_json(RunSettings(batch=256).to_json()).batch == 256


def bench_json(capsys, *args):
    assert main(["bench", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


SWEEP_KEYS = {"batch", "kv_bytes_filled", "flops_per_byte", "ridge_flops_per_byte", "ridge_source"}
SWEEP_LOOP_KEYS = {"tokens_per_s_per_sequence", "tokens_per_s_total", "ttft_s", "tpot_s"}


def test_bench_sweep_json_is_one_summary_per_batch_size(capsys):
    r = bench_json(capsys, "--engine", "tiny", "--device", "cpu", "--tokens", "6", "--batch", "1,3")
    assert list(r) == ["sweep"] and [s["batch"] for s in r["sweep"]] == [1, 3]
    one = r["sweep"][0]
    for s in r["sweep"]:
        B = s["batch"]
        assert s.keys() >= SWEEP_KEYS and s["identical"] is True
        for loop in ("cached", "uncached"):
            stats = s[loop]
            assert stats.keys() >= SWEEP_LOOP_KEYS
            assert stats["ttft_s"] > 0 and stats["tpot_s"] > 0  # measured, per loop
            assert stats["tokens_per_s_total"] == pytest.approx(
                B * stats["tokens_per_s_per_sequence"]
            )
        assert s["kv_bytes_filled"] == B * one["kv_bytes_filled"] == s["kv_bytes_formula"]
        assert s["kv_bytes_filled"] == B * (s["prompt_tokens"] + 5) * TINY_PER_TOKEN
        assert s["flops_per_byte"] > 0
        assert s["ridge_flops_per_byte"] is None and "CPU" in s["ridge_source"]
    single = bench_json(
        capsys, "--engine", "tiny", "--device", "cpu", "--tokens", "3", "--batch", "2"
    )
    assert "sweep" not in single and single["batch"] == 2


def test_bench_sweep_on_sim_reaches_toward_the_ridge(capsys):
    sim = ("--engine", "sim:llama-3.1-8b@h100", "--tokens", "8", "--replay-speed", "0")
    r = bench_json(capsys, *sim, "--batch", "1,4,16")
    ridge = get_gpu("h100").ridge_flops_per_byte
    intensity = [s["flops_per_byte"] for s in r["sweep"]]
    assert all(s["ridge_flops_per_byte"] == ridge for s in r["sweep"])
    assert intensity == sorted(intensity) and intensity[-1] > 10 * intensity[0]
    totals = [s["cached"]["tokens_per_s_total"] for s in r["sweep"]]
    assert totals == sorted(totals)  # memory-bound: a bigger batch, more tokens per second
    assert main(["bench", *sim, "--batch", "1,4,16"]) == 0
    table = capsys.readouterr().out
    lines = [line.split() for line in table.splitlines()]
    assert [row[0] for row in lines if row and row[0] in {"1", "4", "16"}] == ["1", "4", "16"]
    assert f"ridge point: {ridge:.0f} FLOPs per byte" in table


def test_a_recorded_batch_replays_as_a_batch(tmp_path, capsys):
    path = tmp_path / "batch.jsonl"
    sim = ("--engine", "sim:llama-3.1-8b@h100", "--tokens", "6", "--replay-speed", "0")
    first = bench_json(capsys, *sim, "--batch", "4", "--record", str(path))
    capsys.readouterr()
    again = bench_json(capsys, "--engine", f"replay:{path}", "--replay-speed", "0")
    assert again["batch"] == first["batch"] == 4
    for key in ("kv_bytes_filled", "cached", "uncached", "ridge_flops_per_byte"):
        assert again[key] == first[key]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "--batch", "0"], "batch sizes from 1 to 256"),
        (["bench", "--batch", "257"], "batch sizes from 1 to 256"),
        (["bench", "--batch", "1,,2"], "batch sizes from 1 to 256"),
        (["bench", "--batch", "1,2,"], "batch sizes from 1 to 256"),
        (["bench", "--batch", "two"], "batch sizes from 1 to 256"),
        (["bench", "--batch", ""], "batch sizes from 1 to 256"),
        (["bench", "--batch", "-1"], "batch sizes from 1 to 256"),
        (["bench", "--batch", "9" * 5000], "batch sizes from 1 to 256"),
        (["bench", "--batch", "2,4,2"], "given twice"),
        (["bench", "--batch", ",".join(map(str, range(1, 18)))], "at most 16 batch sizes"),
        (["bench", "--batch", "1,2", "--record", "run.jsonl"], "--record records one run"),
        (["bench", "--engine", "replay:x.jsonl", "--batch", "2"], "not to replay:"),
        (["bench", "--model", "/no/such/model", "--batch", "2"], "not to hf:"),
        (["--batch", "2,4"], "the app runs one batch size"),
        (["--batch", "300"], "batch sizes from 1 to 256"),
    ],
)
def test_a_bad_batch_is_one_line_and_exit_2(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_app_takes_one_batch_size(monkeypatch):
    import kvtui.app
    import kvtui.cli

    monkeypatch.setattr(kvtui.cli, "has_terminal", lambda: True)
    opened = []
    monkeypatch.setattr(kvtui.app, "run_app", lambda settings, **k: opened.append(settings) or 0)
    assert main(["--engine", "sim:llama-3.1-8b@h100", "--batch", "8"]) == 0
    assert opened[0].batch == 8
