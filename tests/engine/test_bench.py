"""`kvtui bench`: the headless measurement, its JSON, its record, and its bad inputs."""

import json
import subprocess
import sys

import pytest

from kvtui.cli import main

KEYS = {
    "engine",
    "device",
    "model",
    "tokens",
    "text",
    "token_ids",
    "identical",
    "first_divergence",
    "cached",
    "uncached",
    "speedup_wall",
    "work_ratio",
    "kv_bytes_measured",
    "kv_bytes_formula",
}
LOOP_KEYS = {"tokens_per_s", "step_ms_p50", "step_ms_first_quartile", "step_ms_last_quartile"}


def bench_json(capsys, *args):
    assert main(["bench", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_tiny_json(capsys):
    r = bench_json(capsys, "--engine", "tiny", "--device", "cpu", "--tokens", "32", "--greedy")
    assert (
        r.keys() >= KEYS and r["cached"].keys() >= LOOP_KEYS and r["uncached"].keys() >= LOOP_KEYS
    )
    assert r["identical"] is True and r["first_divergence"] is None
    assert len(r["token_ids"]) == 32 and r["text"]
    assert r["kv_bytes_measured"] == r["kv_bytes_formula"] == (r["prompt_tokens"] + 32) * 3072
    P = r["prompt_tokens"]
    # positions computed: uncached sum_{i<32} (P + i); cached P + 31
    assert r["work_ratio"] == pytest.approx((32 * P + 32 * 31 // 2) / (P + 31))
    assert r["cached"]["tokens_per_s"] > 0 and r["speedup_wall"] > 0


def test_bench_sim_reproduces_the_lesson_ratio_shape(capsys):
    r = bench_json(
        capsys, "--engine", "sim:llama-3.1-8b@h100", "--tokens", "64", "--replay-speed", "0"
    )
    assert r["identical"] and r["device"].startswith("sim:")
    assert r["kv_bytes_measured"] == r["kv_bytes_formula"]
    assert r["achieved_bandwidth_bytes_per_s"] == pytest.approx(r["peak_bandwidth_bytes_per_s"])


def test_bench_record_then_replay(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    first = bench_json(
        capsys, "--engine", "tiny", "--device", "cpu", "--tokens", "12", "--record", str(path)
    )
    assert path.read_text().count("\n") == 1 + 1 + 2 * 12 + 2  # header, started, steps, finished
    again = bench_json(capsys, "--engine", f"replay:{path}", "--replay-speed", "0")
    for key in ("token_ids", "text", "cached", "uncached", "kv_bytes_measured", "speedup_wall"):
        assert again[key] == first[key]


def test_bench_table(capsys):
    assert (
        main(["bench", "--engine", "sim:llama-3.2-1b@t4", "--tokens", "8", "--replay-speed", "0"])
        == 0
    )
    out = capsys.readouterr().out
    assert "tokens/s" in out and "identical" in out and "by the formula" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "nope"], "unknown engine 'nope'"),
        (["--engine", "sim:llama-3.1-8b@h10"], "did you mean h100"),
        (["--engine", "replay:/no/such/file.jsonl"], "no recorded run"),
        (["--tokens", "0"], "expected a positive integer"),
        (["--tokens", "many"], "expected a positive integer"),
        (["--engine", "sim:llama-3.1-70b@t4"], "do not fit"),
    ],
)
def test_bench_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bench_corrupt_replay_file_in_a_subprocess(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json")
    out = subprocess.run(
        [sys.executable, "-m", "kvtui", "bench", "--engine", f"replay:{bad}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        out.returncode == 2 and "not a kvtui record" in out.stderr and "Traceback" not in out.stderr
    )


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ("nope", "unknown engine 'nope'"),
        ("sim:llama-3.1-8b@h10", "did you mean h100"),
        ("shape:llama9", "unknown model 'llama9'"),
        ("replay:/no/such/run.jsonl", "no recorded run"),
        ("hf:/", "no config.json"),
    ],
)
def test_the_app_refuses_a_bad_engine_before_it_opens(capsys, monkeypatch, engine, message):
    import kvtui.app

    opened = []
    monkeypatch.setattr(kvtui.app, "run_app", lambda *a, **k: opened.append(a) or 0)
    assert main(["--engine", engine]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not opened


def test_the_app_opens_on_a_good_engine(monkeypatch):
    import kvtui.app

    opened = []
    monkeypatch.setattr(
        kvtui.app, "run_app", lambda settings, **k: opened.append((settings, k)) or 0
    )
    assert main(["--engine", "sim:llama-3.1-8b@h100", "--screen", "3", "--length", "32"]) == 0
    settings, options = opened[0]
    assert settings.engine == "sim:llama-3.1-8b@h100" and options == {"screen": 3, "length": 32}
