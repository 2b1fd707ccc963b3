"""The tricks through the engines and headless: each layout's cached loop stops where its own
C - P + 1 says under the same --kv-budget, its bytes per token measured equal the formula's, the
run says what it kept (RunStarted), `kvtui bench` reports it per loop with its quality, and the
`sim:` engine models the same tricks on catalog models."""

import json
from dataclasses import replace

import pytest

from kvtui.cli import main
from kvtui.engines.drive import run_events
from kvtui.engines.factory import check_run, open_engine
from kvtui.engines.protocol import (
    RunFinished,
    RunSettings,
    RunStarted,
    StepSample,
    event_from_json,
    to_json,
)
from kvtui.errors import EngineError
from kvtui.reports.table import TABLE_ROWS, TableProcess
from kvtui.run.summary import summarize_events
from kvtui.sim.pool import KVPool
from kvtui.sim.tricks import KVLayout, tokens_before_full

TINY_PER_TOKEN = 3072
PROMPT = "It is a truth universally acknowledged, that"  # 44 bytes


def tiny(**settings) -> RunSettings:
    return RunSettings(engine="tiny", device="cpu", loops=("cached",), greedy=True, **settings)


@pytest.mark.parametrize(
    ("tricks", "budget", "block", "prompt", "batch", "per_token"),
    [
        ({"kv_cache_dtype": "fp8"}, 48 * 1024, 16, "a", 1, 768),  # 4 blocks: 64 tokens
        ({"kv_cache_dtype": "int8"}, 48 * 1024, 16, "a", 1, 816),  # 3 blocks: 48
        ({"kv_heads": 1}, 48 * 1024, 16, "a", 1, 1536),  # 2 blocks: 32
        ({"kv_window": 20, "kv_sinks": 4}, 48 * 1024, 4, "a", 1, 3072),  # the window outgrows 4
        ({"enable_prefix_caching": True}, 12 * 16 * 3072, 16, PROMPT, 4, 3072),  # 2 shared
        ({}, 12 * 16 * 3072, 16, PROMPT, 4, 3072),  # the same batch without: 3 blocks each
    ],
    ids=["fp8", "int8", "mqa", "window", "prefix", "plain-batch"],
)
def test_each_trick_stops_where_its_pool_predicts(tricks, budget, block, prompt, batch, per_token):
    settings = tiny(
        tokens=80,
        kv_budget_bytes=budget,
        kv_block_tokens=block,
        prompt=prompt,
        batch=batch,
        **tricks,
    )
    engine = open_engine(settings)
    started = engine.started()
    assert started.kv_bytes_per_token == per_token  # the formula, codes and scales
    events = list(engine.steps("cached"))
    steps = [e for e in events if isinstance(e, StepSample)]
    finished = events[-1]
    P = len(prompt.encode())
    pool = KVPool(budget, block, per_token)
    predicted = tokens_before_full(pool, settings.layout, P, batch)
    assert isinstance(finished, RunFinished) and finished.reason == "out_of_memory"
    assert finished.steps == len(steps) == predicted
    assert finished.kv_bytes_per_position == per_token  # measured from the tensors
    if tricks.get("enable_prefix_caching"):
        assert started.kv_shared_tokens == 32 and predicted == 21  # against 5 without sharing
        assert steps[0].positions_computed == 44 + 3 * 12  # the partial block, computed by each
    if not tricks:
        assert predicted == 5


def test_a_window_the_pool_holds_never_stops_and_its_memory_is_flat():
    settings = tiny(tokens=60, kv_budget_bytes=96 * 1024, kv_block_tokens=4, prompt="a")
    settings = RunSettings(**{**settings.__dict__, "kv_window": 20, "kv_sinks": 4})
    events = list(run_events(open_engine(settings), settings))
    summary = summarize_events(events)
    steps = [e for e in events if isinstance(e, StepSample)]
    assert events[-1].reason == "done" and len(steps) == 60
    assert {s.kv_bytes for s in steps[25:]} == {20 * TINY_PER_TOKEN}  # flat: 4 sinks + 16
    assert max(s.kv_bytes_allocated for s in steps) <= 6 * 4 * TINY_PER_TOKEN
    assert summary.kv_matches_formula() is True
    started = events[0]
    assert (started.kv_window, started.kv_sinks) == (20, 4)
    last = steps[-1]  # its attention: the sinks first, as one span from 0, then the last 16
    assert last.attention_spans[0] == 0 and last.attention_spans[1] == last.position - 16
    assert len(last.attention_spans) == 17 and abs(sum(last.attention) - 1_000_000) <= 17
    assert event_from_json(json.loads(json.dumps(to_json(last)))) == last


def test_run_settings_and_events_carry_the_layout_and_refuse_nonsense():
    settings = tiny(kv_cache_dtype="int8", kv_window=64, kv_sinks=4, kv_heads=1)
    again = RunSettings.from_json(json.loads(json.dumps(settings.to_json())))
    assert again == settings and again.layout == KVLayout("int8", 64, 4, False, 1)
    for bad, words in [
        ({"kv_sinks": 4}, "give --kv-window"),
        ({"kv_window": 4, "kv_sinks": 4}, "no room"),
        ({"kv_cache_dtype": "int4"}, "kv-cache-dtype"),
        ({"kv_window": 64, "enable_prefix_caching": True}, "not modelled"),
        ({"kv_heads": 0}, "at least 1"),
    ]:
        with pytest.raises(ValueError, match=words):
            RunSettings.from_json({**RunSettings().to_json(), **bad})
    started = open_engine(settings).started()
    assert event_from_json(json.loads(json.dumps(to_json(started)))) == started
    with pytest.raises(ValueError, match="batch must be from 1 to"):  # a fuzzed record's
        event_from_json({**to_json(started), "batch": 0})
    assert started.kv_heads == 1 and started.kv_heads_model == 2
    assert started.layout == settings.layout


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        (RunSettings(engine="tiny", kv_window=20000), "past tiny-austen's 4,096 positions"),
        (RunSettings(engine="tiny", kv_window=8, prompt="x" * 20), "do not fit in --kv-window 8"),
        (RunSettings(engine="tiny", kv_window=512, tokens=5000), "keeps no window"),
        (RunSettings(engine="tiny", kv_heads=4), "divides them"),
        (RunSettings(engine="sim:deepseek-v3@8xh200", kv_heads=1), "MLA"),
    ],
)
def test_a_layout_the_run_cannot_keep_is_refused_before_it_starts(settings, words):
    with pytest.raises(EngineError, match=words):
        check_run(settings)


@pytest.mark.parametrize("command", ["bench", "tricks"])
def test_one_byte_of_quality_text_is_refused_in_one_line(capsys, command):
    """One byte of text has no next byte to predict: refused as the flag is read, where it
    ended `kvtui bench` in a traceback (a mean over no positions)."""
    assert main([command, "--quality-bytes", "1"]) == 2
    err = capsys.readouterr().err
    assert "--quality-bytes" in err and "'1'" in err and "Traceback" not in err


def test_a_window_goes_past_the_models_positions_in_the_cached_loop_only():
    long = RunSettings(engine="tiny", kv_window=512, tokens=5000, loops=("cached",))
    assert check_run(long).kind == "tiny"


def test_bench_json_reports_each_loops_bytes_stop_and_quality(capsys):
    code = main(
        [
            "bench",
            "--kv-cache-dtype",
            "int8",
            "--tokens",
            "60",
            "--kv-budget",
            "48KiB",
            "--prompt",
            "a",
            "--greedy",
            "--loops",
            "cached",
            "--quality-bytes",
            "64",
            "--json",
        ]
    )
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    cached = r["cached"]
    assert cached["kv_bytes_per_token"] == cached["kv_bytes_per_token_formula"] == 816
    assert cached["finished"]["reason"] == "out_of_memory"
    assert cached["finished"]["steps"] == cached["tokens_before_full_predicted"] == 48
    q = cached["quality"]
    assert set(q) >= {"nats_per_byte", "nats_per_byte_baseline", "kl", "top1_agreement"}
    assert "first_divergence" in q and q["positions"] == 63 and q["greedy_tokens"] == 64
    assert 0 <= q["kl"] < 0.05 and q["top1_agreement"] > 0.9  # int8: a little, measured
    assert r["uncached"]["tokens"] == 0 and r["uncached"]["quality"] is None
    assert r["kv_layout"]["words"] == "int8 cache"


@pytest.mark.parametrize(
    ("flags", "per_token"),
    [
        ([], 327_680),
        (["--kv-cache-dtype", "fp8"], 163_840),
        (["--kv-cache-dtype", "int8"], 163_840 + 80 * 2 * 8 * 2),
        (["--kv-heads", "1"], 40_960),
    ],
)
def test_sim_models_the_tricks_on_a_catalog_model(capsys, flags, per_token):
    """fp8 KV on Llama 3.1 70B (modelled): half the bytes a token, twice the tokens a pool
    holds."""
    args = ["bench", "--engine", "sim:llama-3.1-70b@4xh100", "--replay-speed", "0"]
    args += ["--tokens", "64", "--kv-budget", "1GiB", "--loops", "cached", "--json", *flags]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    per_gpu = per_token // 4 if "--kv-heads" not in flags else per_token  # 1 head: on every GPU
    assert r["cached"]["kv_bytes_per_token_formula"] == per_gpu
    assert r["timing"].startswith("modelled")
    pool = KVPool(2**30, 16, per_gpu)
    assert r["cached"]["tokens_before_full_predicted"] == pool.tokens_before_full(44)


def test_sim_models_a_window_and_shared_prefixes():
    window = RunSettings(
        engine="sim:llama-3.1-8b@h100",
        tokens=300,
        kv_window=128,
        kv_sinks=4,
        replay_speed=0,
        loops=("cached",),
    )
    events = list(run_events(open_engine(window), window))
    steps = [e for e in events if isinstance(e, StepSample)]
    assert {s.kv_bytes for s in steps[100:]} == {128 * 131_072}
    assert summarize_events(events).kv_matches_formula() is True
    shared = RunSettings(
        engine="sim:llama-3.1-8b@h100",
        tokens=300,
        batch=4,
        enable_prefix_caching=True,
        kv_budget_bytes=12 * 16 * 131_072,
        replay_speed=0,
        loops=("cached",),
    )
    events = list(run_events(open_engine(shared), shared))
    assert isinstance(events[0], RunStarted) and events[0].kv_shared_tokens == 32
    assert events[-1].reason == "out_of_memory" and events[-1].steps == 21


@pytest.mark.parametrize("changes", [{"kv_window": 4096}, {"enable_prefix_caching": True}])
def test_a_layout_on_sim_reads_the_cache_in_the_dtype_the_server_keeps(changes):
    """DeepSeek-V3's weights are fp8 and its cache bf16 (as vLLM serves it): a window that has
    not filled, or shared prefixes after the prefill, read the same bytes a step as the plain
    cache, where they were priced reading the cache in the weights' fp8."""
    plain = RunSettings(
        engine="sim:deepseek-v3@8xh200", tokens=4, batch=2, replay_speed=0, loops=("cached",)
    )

    def read(settings: RunSettings) -> list[int]:
        events = run_events(open_engine(settings), settings)
        return [e.bytes_read for e in events if isinstance(e, StepSample)]

    assert read(replace(plain, **changes))[1:] == read(plain)[1:]


def test_a_layouts_uncached_loop_is_priced_as_the_plain_runs():
    """The uncached loop keeps no cache, so a trick does not change what its steps read: on the
    shipped model (fp32 on a CPU) its keys and values are fp32, where a layout's run priced them
    in bf16."""
    plain = RunSettings(engine="tiny", tokens=3, device="cpu", loops=("uncached",))

    def read(settings: RunSettings) -> list[int]:
        events = run_events(open_engine(settings), settings)
        return [e.bytes_read for e in events if isinstance(e, StepSample)]

    assert read(replace(plain, kv_cache_dtype="int8")) == read(plain)


@pytest.mark.parametrize(
    ("weights", "per_token"),
    [("int4", 131_072), ("fp8", 131_072), ("bf16", 131_072), ("fp16", 131_072), ("fp32", 262_144)],
)
def test_budgets_auto_cache_is_the_activations_dtype(capsys, weights, per_token):
    """vLLM's --kv-cache-dtype auto keeps keys and values in the dtype the model computes in:
    the weights' own for fp32, fp16 and bf16, bf16 beside 4-bit and 8-bit weights (which are
    dequantised to compute), as `sim:` prices them; the budget kept them in int4 or fp8."""
    args = ["budget", "--model", "llama-3.1-8b", "--gpu", "h100", "--context", "8192", "--json"]
    assert main([*args, "--weights-dtype", weights, "--kv-cache-dtype", "auto"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == per_token


def test_budget_takes_vllms_kv_cache_dtype(capsys):
    base = ["budget", "--model", "llama-3.1-8b", "--gpu", "h100", "--context", "8192", "--json"]
    assert main(base) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert main([*base, "--kv-cache-dtype", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert main([*base, "--kv-cache-dtype", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert main([*base, "--kv-cache-dtype", "auto"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"] == auto["kv_bytes_per_token"]
    assert int8["kv_bytes_per_token"] == fp8["kv_bytes_per_token"] + 32 * 2 * 8 * 2
    assert fp8["kv_capacity_tokens"] > 1.9 * bf16["kv_capacity_tokens"]
    assert main([*base, "--kv-cache-dtype", "fp8", "--kv-dtype", "bf16"]) == 2


def test_kvtui_tricks_models_every_row_on_sim_and_refuses_what_keeps_its_own_cache(capsys):
    args = ["tricks", "--engine", "sim:llama-3.1-8b@h100", "--tokens", "600", "--json"]
    assert main(args) == 0
    table = json.loads(capsys.readouterr().out)
    rows = {row["key"]: row for row in table["rows"]}
    assert list(rows) == [r.key for r in TABLE_ROWS]
    assert table["kv_budget_bytes"] == 32 * 2**20  # 160 tokens of 128 KiB, a power of two
    for key in ("plain", "fp8", "int8", "prefix"):
        assert rows[key]["steps"] == rows[key]["tokens_before_full_predicted"], key
    assert rows["fp8"]["kv_bytes_per_token_formula"] * 2 == 131_072
    assert rows["window"]["tokens_before_full_predicted"] is None and not rows["window"]["stopped"]
    assert rows["mha"]["how"] == "formula" and rows["mha"]["kv_bytes_per_token_formula"] == 524_288
    assert all(row["how"] in ("modelled", "formula") for row in rows.values())
    assert main(["tricks", "--engine", "hf:/nowhere"]) == 2
    assert "kvtui's own engines" in capsys.readouterr().err


def test_the_multi_head_row_names_the_models_own_heads(capsys):
    """Multi-head attention is a key/value head per query head: 32 for Llama 3.1 8B (the
    shipped model's 8 were the row's name whatever the model)."""
    args = ["tricks", "--engine", "sim:llama-3.1-8b@h100", "--tokens", "200"]
    assert main([*args, "--json"]) == 0
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["mha"]["label"] == "32 KV heads (MHA)" == f"{rows['mha']['words']} (MHA)"
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "32 KV heads (MHA)" in out and "8 KV heads" not in out


def test_a_modelled_table_calls_no_figure_measured(capsys):
    """On sim: every row is modelled: the prefix row's prefill and the stops say so, where the
    lines under the table called them measured."""
    assert main(["tricks", "--engine", "sim:llama-3.1-8b@h100", "--tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert "MODELLED" in out and "(modelled)" in out
    assert "measured" not in out.replace("not measured", "")


def test_the_shared_prefills_positions_are_its_own_steps_count(monkeypatch):
    """The prefix row's prefill positions are the first step's own count, not the run's total
    less what the later steps should have computed: a model whose later steps compute one
    position too many on purpose leaves the prefill's 80 (44 + 3 x 12) as it was."""
    import kvtui.engines.roofline as roofline
    from kvtui.reports.table import run_row, table_base
    from kvtui.sim.work import StepCost

    priced = roofline.layout_step_cost

    def one_too_many(*args, **kwargs):
        cost = priced(*args, **kwargs)
        step = args[3]
        return cost if step == 0 else StepCost(cost.positions + 1, cost.flops, cost.bytes_read)

    monkeypatch.setattr(roofline, "layout_step_cost", one_too_many)
    base = table_base(RunSettings(engine="sim:llama-3.1-8b@h100", tokens=20, replay_speed=0))
    prefix = next(row for row in TABLE_ROWS if row.key == "prefix")
    row = run_row(prefix, base, quality_bytes=0)
    assert row["steps"] == 20 and row["first_step_positions"] == 44 + 3 * (44 - 32)


@pytest.mark.parametrize(
    ("engine", "says"),
    [("sim:llama-3.1-8b@nogpu", "unknown GPU 'nogpu'"), ("sim:llama-3.1-70b@t4", "do not fit")],
)
def test_a_sim_table_that_cannot_open_is_refused_not_shown_as_rows_that_stopped(
    capsys, engine, says
):
    """An engine that cannot open is one line and exit 2, where every row became a run that
    'stopped' at 0 tokens, predicted 0, and the table exited 0."""
    assert main(["tricks", "--engine", engine]) == 2
    captured = capsys.readouterr()
    assert says in captured.err and captured.out == ""


def test_a_row_whose_prompt_the_pool_cannot_hold_keeps_its_formula_and_prediction(capsys):
    """A pool too small for the prompt stops every row before its first step: the rows still
    give the formula's bytes per token and the prediction (0 here) from the formula, and on
    sim: say they are modelled, where they said 0 bytes, a prediction of 0 whatever the pool,
    and measured."""
    args = ["tricks", "--engine", "sim:llama-3.1-8b@h100", "--kv-budget", "1MiB", "--json"]
    assert main(args) == 0
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["plain"]["steps"] == 0 and rows["plain"]["how"] == "modelled"
    assert rows["plain"]["kv_bytes_per_token_formula"] == 131_072
    assert rows["fp8"]["kv_bytes_per_token_formula"] == 65_536
    assert rows["plain"]["tokens_before_full_predicted"] == 0  # 8 tokens of room, 44 asked
    assert rows["window"]["tokens_before_full_predicted"] == 0


def test_the_tables_formula_prices_the_dtype_the_engine_computes_in():
    """On a GPU kvtui's engine computes GPT-2 (published in fp32) in fp32 (catalog.compute_dtype):
    the multi-head row's formula and the table's budget price that, where they took every model
    on a GPU to be bf16 (half the bytes the measured rows would hold). No GPU is needed: the
    formula row runs no engine."""
    from kvtui.reports.table import run_row, table_base

    base = table_base(RunSettings(engine="shape:gpt2", device="cuda"))
    mha = next(row for row in TABLE_ROWS if row.key == "mha")
    row = run_row(mha, base, quality_bytes=0)
    assert row["kv_bytes_per_token_formula"] == 12 * 2 * 12 * 64 * 4  # fp32
    assert base.kv_budget_bytes == 16 * 2**20  # 160 tokens of 73,728 bytes, a power of two


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"kv_window": 0}, "--kv-window must be at least 1"),
        ({"kv_window": 128, "kv_sinks": 200}, "leaves no room"),
        ({"kv_cache_dtype": "bogus"}, "--kv-cache-dtype must be one of"),
        ({"kv_shared_tokens": 45}, "45 shared of 44 prompt tokens"),
    ],
)
def test_a_record_whose_cache_layout_no_run_can_have_is_corrupt(tmp_path, capsys, changes, says):
    """A replayed run's layout is checked as a live run's is: a window of 0, more sinks than
    window, a cache dtype that is none, more shared positions than the prompt has, where the
    replay showed them (a window of 0 held 11.6 MiB, 'formula 0 B')."""
    record = tmp_path / "run.jsonl"
    args = ["bench", "--engine", "sim:llama-3.1-8b@h100", "--tokens", "5", "--replay-speed", "0"]
    assert main([*args, "--loops", "cached", "--record", str(record)]) == 0
    lines = record.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), **changes})
    record.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["bench", "--engine", f"replay:{record}", "--replay-speed", "0"]) == 2
    err = capsys.readouterr().err
    assert "corrupt record" in err and says in err


def test_the_tables_step_note_names_the_steps_bench_takes_it_over(monkeypatch, capsys):
    """A modelled table's step column is bench's `tpot_first_steps_s`, over bench.SPEED_STEPS
    steps: the note under the table reads that number, where it wrote 256 beside it."""
    import kvtui.reports.bench as bench

    monkeypatch.setattr(bench, "SPEED_STEPS", 64)
    assert main(["tricks", "--engine", "sim:llama-3.1-8b@h100", "--tokens", "100"]) == 0
    assert "the mean of the first 64 steps after the first" in capsys.readouterr().out


def test_a_layout_whose_pool_cannot_hold_the_prompt_says_so():
    """A window's or shared prefixes' pool too small for the prompts: the message says so, as
    the plain pool's does, where it said the cache was full 'at token 43' of a 44-token prompt."""
    from kvtui.sim.tricks import full_message

    pool = KVPool(160 * 1024, 16, 3072)  # 3 blocks of 16
    for layout in (KVLayout(window=100, sinks=4), KVLayout(prefix_caching=True)):
        assert tokens_before_full(pool, layout, 44, 3) == 0
        said = full_message(pool, layout, 44, 3)
        assert said.startswith("the KV cache cannot hold the prompt's 44 tokens per sequence")
        assert "at token" not in said


def test_the_uncached_loops_quality_is_measured_only_where_its_model_changed(capsys):
    """The uncached loop keeps no cache, so an int8 cache costs it nothing: no quality figure
    (it was the model scored against itself, KL 0 by construction), nor for the plain cache;
    averaged key/value heads change its model, and its quality is measured."""
    args = ["bench", "--tokens", "3", "--greedy", "--quality-bytes", "64", "--json"]
    assert main([*args, "--kv-cache-dtype", "int8"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["cached"]["quality"] is not None and r["uncached"]["quality"] is None
    assert main([*args, "--kv-heads", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["uncached"]["quality"]["kl"] > 0
    assert main(args) == 0  # the plain cache, asked for its quality: nothing to cost
    r = json.loads(capsys.readouterr().out)
    assert r["cached"]["quality"] is None and r["uncached"]["quality"] is None


@pytest.mark.parametrize(
    ("argv", "row"),
    [
        (["--engine", "sim:deepseek-v3@8xh200"], "the 1 KV head (MQA, averaged) row: --kv-heads"),
        (["--engine", "sim:llama-3.1-8b@h100", "--prompt", "x" * 200], "the window 124 + 4 sinks"),
    ],
)
def test_a_table_a_row_refuses_names_the_row(capsys, argv, row):
    """`kvtui tricks` takes no --kv-heads or --kv-window: a refusal that names one says which
    row it is the setting of."""
    assert main(["tricks", *argv]) == 2
    assert row in capsys.readouterr().err


def test_the_tables_process_says_why_it_cannot_run_in_one_line():
    table = TableProcess(RunSettings(engine="replay:/nowhere.jsonl"))
    table.start()
    try:
        lines = list(table.lines())
    finally:
        table.close()
    assert [line["kind"] for line in lines] == ["failed"]
    assert "replay:" in lines[0]["message"]
