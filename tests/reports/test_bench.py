"""`kvtui bench`: the headless measurement, its JSON, its record, and its bad inputs."""

import json
import subprocess
import sys

import pytest

from kvtui.cli import main
from kvtui.engines.replay import read_record
from kvtui.format import safe_text

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
    "kv_capacity_bytes",
    "kv_block_tokens",
    "kv_blocks_allocated",
    "kv_bytes_allocated",
    "kv_bytes_filled",
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
    P = r["prompt_tokens"]
    assert r["kv_bytes_filled"] == r["kv_bytes_formula"] == (P + 31) * 3072
    assert r["kv_blocks_allocated"] == -(-(P + 31) // 16)
    assert r["kv_bytes_allocated"] == r["kv_blocks_allocated"] * 16 * 3072
    assert r["cached"]["finished"] == {"reason": "done", "steps": 32, "message": ""}
    # positions computed: uncached sum_{i<32} (P + i); cached P + 31
    assert r["work_ratio"] == pytest.approx((32 * P + 32 * 31 // 2) / (P + 31))
    assert r["cached"]["tokens_per_s"] > 0 and r["speedup_wall"] > 0


def test_bench_sim_reproduces_the_lesson_ratio_shape(capsys):
    r = bench_json(
        capsys, "--engine", "sim:llama-3.1-8b@h100", "--tokens", "64", "--replay-speed", "0"
    )
    assert r["identical"] and r["device"].startswith("sim:")
    assert r["kv_bytes_filled"] == r["kv_bytes_formula"]
    assert r["achieved_bandwidth_bytes_per_s"] == pytest.approx(r["peak_bandwidth_bytes_per_s"])


def test_bench_record_then_replay(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    first = bench_json(
        capsys, "--engine", "tiny", "--device", "cpu", "--tokens", "12", "--record", str(path)
    )
    assert path.read_text().count("\n") == 1 + 1 + 2 * 12 + 2  # header, started, steps, finished
    again = bench_json(capsys, "--engine", f"replay:{path}", "--replay-speed", "0")
    for key in ("token_ids", "text", "cached", "uncached", "kv_bytes_allocated", "speedup_wall"):
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
    import kvtui.cli

    monkeypatch.setattr(kvtui.cli, "has_terminal", lambda: True)
    opened = []
    monkeypatch.setattr(
        kvtui.app, "run_app", lambda settings, **k: opened.append((settings, k)) or 0
    )
    assert main(["--engine", "sim:llama-3.1-8b@h100", "--screen", "3", "--length", "32"]) == 0
    settings, options = opened[0]
    assert settings.engine == "sim:llama-3.1-8b@h100"
    assert options == {"screen": 3, "present": False, "theme": "dark", "kv_events": None}
    assert settings.tokens == 32


# --- what a record or a model says reaches the terminal escaped, and JSON stays JSON ------------


def strict_json(text: str):
    """JSON as RFC 8259 has it: NaN and Infinity refused."""

    def refuse(name):
        raise ValueError(f"{name} in the output")

    return json.loads(text, parse_constant=refuse)


def sim_record(tmp_path, tokens=4):
    path = tmp_path / "run.jsonl"
    args = ["bench", "--engine", "sim:gpt2@t4", "--tokens", str(tokens), "--replay-speed", "0"]
    assert main([*args, "--record", str(path)]) == 0
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def rewrite(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


ESCAPES = "\x1b]0;PWNED\x07\x1b[2J\x9b31m\x7f"


def test_control_characters_from_a_record_never_reach_the_terminal(tmp_path, capsys):
    path, lines = sim_record(tmp_path)
    capsys.readouterr()
    lines[1]["model"] = f"evil{ESCAPES}"  # the started event
    lines[1]["device"] = f"gpu{ESCAPES}"
    lines[2]["text"] = ESCAPES
    lines[-1]["message"] = f"done{ESCAPES}"
    rewrite(path, lines)
    assert main(["bench", "--engine", f"replay:{path}", "--replay-speed", "0"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\x9b\x7f")
    assert "evil\\x1b]0;PWNED\\x07" in out and "done\\x1b]0;PWNED" in out
    assert main(["bench", "--engine", f"replay:{path}", "--replay-speed", "0", "--json"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\x9b\x7f")
    # Made safe where the record was read, as every screen and the table show it.
    assert strict_json(out)["model"] == safe_text(f"evil{ESCAPES}", one_line=True)


def test_json_output_is_json_for_a_step_that_took_no_time(tmp_path, capsys):
    path, lines = sim_record(tmp_path)
    for line in lines:
        if line.get("kind") == "step":
            line["step_seconds"] = 5e-324  # the smallest float: rates overflow to infinity
    rewrite(path, lines)
    capsys.readouterr()
    assert main(["bench", "--engine", f"replay:{path}", "--replay-speed", "0", "--json"]) == 0
    r = strict_json(capsys.readouterr().out)
    assert r["cached"]["tokens_per_s"] is None and r["achieved_bandwidth_bytes_per_s"] is None
    assert main(["bench", "--engine", f"replay:{path}", "--replay-speed", "0"]) == 0
    assert "tokens/s" in capsys.readouterr().out


# --- --record: whole or not at all, never over a file or through a link --------------------------

SIM_RUN = ["bench", "--engine", "sim:gpt2@t4", "--tokens", "3", "--replay-speed", "0"]


def refused(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_record_refuses_to_overwrite_without_force(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    path.write_text("precious\n")
    assert "already exists (--force replaces it)" in refused(
        capsys, *SIM_RUN, "--record", str(path)
    )
    assert path.read_text() == "precious\n" and list(tmp_path.iterdir()) == [path]
    assert main([*SIM_RUN, "--record", str(path), "--force", "--json"]) == 0
    assert read_record(path)[1]  # replaced by a whole record


def test_record_refuses_links_and_devices(tmp_path, capsys):
    target = tmp_path / "elsewhere.jsonl"
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert "symbolic link" in refused(capsys, *SIM_RUN, "--record", str(link), "--force")
    assert not target.exists()
    assert "not a regular file" in refused(capsys, *SIM_RUN, "--record", "/dev/null", "--force")
    assert "not a regular file" in refused(capsys, *SIM_RUN, "--record", str(tmp_path))


def test_record_makes_its_folder_and_stamps_the_run_with_its_date(tmp_path, capsys):
    """`--record runs/h100.jsonl` on a fresh checkout: the folder is made; the record's start
    says when it was recorded (a replay then says so), the header too."""
    path = tmp_path / "runs" / "deeper" / "run.jsonl"
    assert main([*SIM_RUN, "--record", str(path), "--json"]) == 0
    header, events = read_record(path)
    started = events[0]
    assert started.recorded_at and started.recorded_at == header["recorded_at"]
    assert started.recorded_at[:4].isdigit() and started.recorded_at[4] == "-"


def test_a_run_that_cannot_start_makes_no_folder(tmp_path, capsys):
    """A bad engine, or CUDA on a machine without it, is said before anything is written."""
    path = tmp_path / "runs" / "h100.jsonl"
    bad = ["bench", "--engine", "sim:gpt2@t9", "--record", str(path)]
    assert "unknown GPU" in refused(capsys, *bad)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_leaves_no_record_and_one_line(tmp_path, capsys, monkeypatch):
    import errno

    import kvtui.engines.replay

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kvtui.engines.replay.RecordWriter, "_write", full)
    path = tmp_path / "run.jsonl"
    err = refused(capsys, *SIM_RUN, "--record", str(path))
    assert f"cannot write {path}: No space left on device" in err
    assert list(tmp_path.iterdir()) == []  # neither the record nor its temporary file


def test_ctrl_c_leaves_a_whole_replayable_record(tmp_path, capsys, monkeypatch):
    import kvtui.reports.bench

    real = kvtui.reports.bench.run_events

    def interrupted(*args, **kwargs):
        for n, event in enumerate(real(*args, **kwargs)):
            if n == 4:  # started, then three cached steps
                raise KeyboardInterrupt
            yield event

    monkeypatch.setattr(kvtui.reports.bench, "run_events", interrupted)
    path = tmp_path / "run.jsonl"
    code = main([*SIM_RUN[:3], "--tokens", "8", "--replay-speed", "0", "--record", str(path)])
    err = capsys.readouterr().err
    assert code == 130 and err == f"kvtui: interrupted after 3 steps; recorded to {path}\n"
    header, events = read_record(path)
    assert [e.kind for e in events] == ["started", "step", "step", "step", "finished", "finished"]
    assert {e.loop: e.reason for e in events if e.kind == "finished"} == {
        "cached": "cancelled",
        "uncached": "cancelled",
    }
    assert [p.name for p in tmp_path.iterdir()] == ["run.jsonl"]


def test_a_prompt_with_bytes_that_are_not_utf8(tmp_path, capsys):
    """A prompt from a command line holding bytes that are not UTF-8 (Python keeps them as lone
    surrogates) is echoed, run and recorded; the bytes read back as U+FFFD."""
    path = tmp_path / "run.jsonl"
    prompt = "caf\udcc3\udca9 \udcff"  # b"caf\xc3\xa9 \xff" as os.fsdecode gives it
    assert main([*SIM_RUN, "--prompt", prompt, "--record", str(path)]) == 0
    capsys.readouterr()
    header, _ = read_record(path)
    assert header["settings"]["prompt"] == "café \ufffd"


def test_bench_times_the_first_token_apart_from_the_later_ones(capsys):
    """Prefill is not decode: time to first token and time per later token, per loop."""
    code = main(
        [
            "bench",
            "--engine",
            "sim:llama-3.1-8b@h100",
            "--tokens",
            "16",
            "--json",
            "--replay-speed",
            "0",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    for loop in ("cached", "uncached"):
        assert out[loop]["ttft_s"] > 0 and out[loop]["tpot_s"] > 0
    cached = out["cached"]
    # the prefill computes the whole prompt in its one step; each later step one position
    prefill_rate = out["prompt_tokens"] / cached["ttft_s"]
    assert cached["first_step_positions_per_s"] == pytest.approx(prefill_rate)
    assert cached["later_step_positions_per_s"] == pytest.approx(1 / cached["tpot_s"])


def test_bench_reports_the_pool_and_where_the_cached_loop_stopped(capsys):
    """96 KiB is 2 blocks of 16 tokens of the shipped model's 3,072 bytes: 32 positions."""
    r = bench_json(
        capsys, "--device", "cpu", "--lesson", "--tokens", "40", "--greedy", "--kv-budget", "96KiB"
    )
    assert r["kv_capacity_bytes"] == 96 * 1024 and r["kv_block_tokens"] == 16
    assert r["cached"]["finished"]["reason"] == "out_of_memory"
    assert r["cached"]["finished"]["steps"] == 32 and r["cached"]["tokens"] == 32
    assert "full after token 32" in r["cached"]["finished"]["message"]
    assert r["uncached"]["finished"] == {"reason": "done", "steps": 40, "message": ""}
    assert r["kv_blocks_allocated"] == 2 and r["kv_bytes_allocated"] == 96 * 1024
    assert r["kv_bytes_filled"] == r["kv_bytes_formula"] == 32 * 3072
    assert r["identical"] is True and r["compared_tokens"] == 32  # as far as both got
    assert (
        main(["bench", "--device", "cpu", "--lesson", "--tokens", "40", "--kv-budget", "96KiB"])
        == 0
    )
    table = capsys.readouterr().out
    assert "KV pool: 96 KiB (--kv-budget), blocks of 16 tokens" in table
    assert "96 KiB allocated (2 blocks)" in table and "full after token 32" in table


def test_a_run_the_pool_stopped_prints_every_count_over_the_same_tokens(capsys):
    """The cached loop stops at 32 (96 KiB), the uncached goes on to 40: the positions beside
    16.5x are both loops' over the 32 tokens both made (32 and 528), where the table printed
    "positions computed 32 / 820" (the uncached loop's 40 tokens) beside the 32 tokens' 16.5x."""
    args = ["--device", "cpu", "--lesson", "--tokens", "40", "--greedy", "--kv-budget", "96KiB"]
    r = bench_json(capsys, *args)
    assert (r["work_cached"], r["work_uncached"]) == (32, 528)  # the lesson's 528 / 32
    assert r["work_ratio"] == r["work_uncached"] / r["work_cached"] == 16.5
    assert r["cached"]["positions_computed"] == 32 and r["uncached"]["positions_computed"] == 820
    assert main(["bench", *args]) == 0
    table = capsys.readouterr().out
    head, positions = table.splitlines()[0], _row(table, "positions computed")
    assert head.endswith(
        "1 prompt + 40 tokens asked: the cached loop made 32 (its KV pool full), "
        "the uncached loop made 40"
    )
    assert positions == ["positions computed, first 32 tokens", "32", "528"]
    assert "speedup over the 32 tokens both made:" in table and "16.5x in positions" in table
    assert (
        "the cached loop stopped at 32 tokens (measured; predicted 32): its KV pool was full; "
        "the uncached loop keeps no cache and went on to 40 (820 positions computed)"
    ) in table


def _row(table: str, label: str) -> list[str]:
    """A row of bench's table: its label, then its cells."""
    line = next(line.strip() for line in table.splitlines() if line.strip().startswith(label))
    name, *cells = [c for c in line.split("  ") if c]
    return [name.strip(), *(c.strip() for c in cells)]


def test_the_budget_is_refused_where_kvtui_keeps_no_pool(capsys, tmp_path):
    assert main(["bench", "--model", str(tmp_path), "--kv-budget", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not to hf:" in err
