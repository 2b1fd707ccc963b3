"""The headless commands: tables, JSON, and one clear line (exit 2) for every kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtui.cli import build_parser, main
from kvtui.sim.catalog import gpu_names, model_names

BUDGET_KEYS = {
    "model",
    "gpu",
    "context_tokens",
    "batch",
    "kv_bytes_per_token",
    "kv_bytes",
    "weights_bytes",
    "vram_bytes",
    "kv_fraction_of_vram",
    "status",
    "max_context_tokens",
    "advice",
    "reserve_bytes",
}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    return json.loads(out)


def assert_usage_error(capsys, *argv, says):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1, err  # one line
    assert "Traceback" not in err
    assert says in err
    return err


# --- work ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (24, {"naive_last_step": 24, "naive_total": 300, "wasted": 276}),
        (32, {"naive_total": 528, "cached_total": 32, "speedup": 16.5}),
        (4096, {"naive_total": 8_390_656, "cached_total": 4096}),
    ],
)
def test_work_json_lesson_figures(capsys, length, expected):
    data = run_json(capsys, "work", "--length", str(length))
    assert set(data) == {
        "length",
        "prompt",
        "naive_last_step",
        "naive_total",
        "cached_total",
        "wasted",
        "speedup",
    }
    assert data["length"] == length and data["prompt"] == 1
    assert {key: data[key] for key in expected} == expected


def test_work_with_prompt(capsys):
    data = run_json(capsys, "work", "--length", "10", "--prompt", "5")
    assert (data["naive_total"], data["cached_total"]) == (10 * 5 + 45, 14)


@pytest.mark.parametrize(("prompt", "length"), [("x", 24), ("It is a truth", 7), ("ab" * 22, 24)])
def test_work_counts_what_bench_measures_on_a_prompt_of_that_length(capsys, prompt, length):
    """One counting rule: `kvtui work --prompt P` is what an engine computes after P tokens."""
    bench = run_json(
        capsys,
        "bench",
        "--engine",
        "sim:llama-3.2-1b@h100",
        "--replay-speed",
        "0",
        "--prompt",
        prompt,
        "--tokens",
        str(length),
    )
    P = bench["prompt_tokens"]
    assert len(prompt.encode()) == P
    work = run_json(capsys, "work", "--length", str(length), "--prompt", str(P))
    assert (work["naive_total"], work["cached_total"]) == (
        bench["work_uncached"],
        bench["work_cached"],
    )


def test_work_table(capsys):
    code, out, err = run(capsys, "work", "--length", "4096")
    assert (code, err) == (0, "")
    assert "8,390,656" in out and "4,096" in out and "2,048.5x" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["work", "--length", "0"], "--length"),
        (["work", "--length", "-4"], "positive integer"),
        (["work", "--length", "many"], "'many'"),
        (["work", "--length", "2.5"], "positive integer"),
        (["work"], "required: --length"),
        (["work", "--length", "5", "--prompt", "-1"], "--prompt"),
        (["work", "--length", "5", "--prompt", "0"], "--prompt"),
    ],
)
def test_work_bad_input(capsys, argv, says):
    assert_usage_error(capsys, *argv, says=says)


# --- budget --------------------------------------------------------------------------------------


def test_budget_json_lesson(capsys):
    data = run_json(
        capsys,
        "budget",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "h100",
        "--context",
        "24000",
        "--batch",
        "8",
    )
    assert set(data) >= BUDGET_KEYS
    assert data["kv_bytes"] == 25_165_824_000
    assert data["vram_bytes"] == 80 * 2**30
    assert data["kv_fraction_of_vram"] == pytest.approx(0.29296875)
    assert data["status"] == "fits"
    assert data["reserve_bytes"] == 2**30
    assert data["advice"] == []


def test_budget_table_reads_like_the_memory_card(capsys):
    code, out, _ = run(
        capsys,
        "budget",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "h100",
        "--context",
        "24000",
        "--batch",
        "8",
    )
    assert code == 0
    assert "23.4 GiB of KV on an 80 GiB GPU is 29%; the whole budget fits." in out
    assert "runtime reserve" in out and "1 GiB" in out


def test_budget_overflow_gives_advice(capsys):
    data = run_json(
        capsys,
        "budget",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "a100-40gb",
        "--context",
        "32768",
        "--batch",
        "8",
        "--kv-dtype",
        "bf16",
        "--weights-dtype",
        "bf16",
    )
    assert data["status"] == "overflow"
    assert data["max_context_tokens"] == 24_619
    assert any("fp8" in line for line in data["advice"])
    code, out, _ = run(
        capsys,
        "budget",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "a100-40gb",
        "--context",
        "32768",
        "--batch",
        "8",
    )
    assert code == 0
    assert "overflow" in out and "- Shorten the context to 24,619 tokens" in out


def test_budget_dtypes(capsys):
    data = run_json(
        capsys,
        "budget",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "h100",
        "--context",
        "1000",
        "--kv-dtype",
        "int4",
        "--weights-dtype",
        "float8",
    )
    assert (data["kv_dtype"], data["weights_dtype"]) == ("int4", "fp8")
    assert data["kv_bytes"] == 1000 * 131_072 // 4
    assert data["weights_bytes"] == 8_030_261_248


def test_budget_from_config(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "max_position_embeddings": 131072,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "vocab_size": 128256,
            }
        )
    )
    argv = [
        "budget",
        "--config",
        str(config),
        *["--gpu", "h100", "--context", "24000", "--batch", "8"],
    ]
    data = run_json(capsys, *argv)
    assert data["kv_bytes"] == 25_165_824_000
    assert data["weights_bytes"] == 16_060_522_496


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--model", "llama-3-8b", "--gpu", "h100", "--context", "10"],
            "did you mean llama-3.1-8b",
        ),
        (["--model", "gpt2", "--gpu", "h10", "--context", "10"], "did you mean h100"),
        (["--model", "gpt2", "--gpu", "h100", "--context", "0"], "--context"),
        (["--model", "gpt2", "--gpu", "h100", "--context", "lots"], "'lots'"),
        (["--model", "gpt2", "--gpu", "h100", "--context", "9", "--batch", "0"], "--batch"),
        (["--model", "gpt2", "--gpu", "h100", "--context", "9", "--kv-dtype", "fp7"], "fp8"),
        (["--gpu", "h100", "--context", "10"], "one of the arguments --model --config"),
        (
            ["--model", "gpt2", "--config", "c.json", "--gpu", "h100", "--context", "1"],
            "not allowed",
        ),
        (["--model", "gpt2", "--context", "10"], "--gpu"),
    ],
)
def test_budget_bad_input(capsys, argv, says):
    assert_usage_error(capsys, "budget", *argv, says=says)


@pytest.mark.parametrize(
    ("content", "says"),
    [(None, "cannot read"), ("{oops", "not valid JSON"), ('{"n_layer": 2}', "missing")],
)
def test_budget_bad_config(capsys, tmp_path, content, says):
    config = tmp_path / "config.json"
    if content is not None:
        config.write_text(content)
    assert_usage_error(
        capsys, "budget", "--config", str(config), "--gpu", "h100", "--context", "10", says=says
    )


# --- catalogs ------------------------------------------------------------------------------------


def test_models(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    for name in model_names():
        assert name in out
    data = run_json(capsys, "models")
    assert [entry["name"] for entry in data] == model_names()
    llama = next(entry for entry in data if entry["name"] == "llama-3.1-8b")
    assert llama["kv_bytes_per_token_bf16"] == 131_072 and llama["source"].startswith("https://")


def test_gpus(capsys):
    code, out, _ = run(capsys, "gpus")
    assert code == 0
    assert "3.35 TB/s" in out and "141 GiB" in out
    data = run_json(capsys, "gpus")
    assert [entry["name"] for entry in data] == gpu_names()
    h200 = next(entry for entry in data if entry["name"] == "h200")
    assert h200["memory_bytes"] == 141 * 2**30 and h200["bandwidth_bytes_per_s"] == 4.8e12


# --- the top level -------------------------------------------------------------------------------


def test_unknown_subcommand(capsys):
    assert_usage_error(capsys, "frobnicate", says="invalid choice")


def test_an_unknown_theme_is_refused_before_the_app_opens(capsys):
    assert_usage_error(capsys, "--theme", "solarized", says="choose from 'dark', 'light'")


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    assert "budget" in capsys.readouterr().out


def test_app_options_parse_without_a_subcommand():
    args = build_parser().parse_args(
        [
            "--engine",
            "sim:llama-3.1-8b@h100",
            "--device",
            "cpu",
            "--screen",
            "2",
            "--tokens",
            "64",
            "--lesson",
            "--prompt",
            "It is a truth",
            "--seed",
            "3",
            "--greedy",
        ]
    )
    assert args.command is None
    assert (args.engine, args.device, args.screen, args.tokens, args.lesson) == (
        "sim:llama-3.1-8b@h100",
        "cpu",
        2,
        64,
        True,
    )
    assert build_parser().parse_args(["--length", "32"]).tokens == 32  # --length is --tokens
    assert (args.prompt, args.seed, args.greedy) == ("It is a truth", 3, True)


def test_no_subcommand_runs_the_app(monkeypatch):
    import kvtui.cli

    seen = []
    monkeypatch.setattr(kvtui.cli, "cmd_app", lambda args: seen.append(args) or 0)
    assert main(["--screen", "3"]) == 0
    assert seen[0].screen == 3


def test_python_dash_m_kvtui():
    done = subprocess.run(
        [sys.executable, "-m", "kvtui", "work", "--length", "32", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["naive_total"] == 528


def test_python_dash_m_kvtui_bad_input_has_no_traceback():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtui",
            "budget",
            "--model",
            "nope",
            "--gpu",
            "h100",
            "--context",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("kvtui: error: unknown model 'nope'")
    assert done.stderr.count("\n") == 1


# --- format: the one place numbers become text ---------------------------------------------------


def test_format_helpers():
    from kvtui.format import (
        format_bandwidth,
        format_bytes,
        format_count,
        format_flops_rate,
        format_int,
        format_params,
        format_percent,
        format_ratio,
        format_seconds,
        format_tick,
    )
    from kvtui.reports.sim import _article

    assert format_bytes(25_165_824_000) == "23.4 GiB"
    assert format_bytes(80 * 2**30) == "80 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(2**40 - 1) == "1 TiB"
    assert format_bytes(-(2**30)) == "-1 GiB"
    assert format_int(8_390_656) == "8,390,656"
    assert format_ratio(16.5) == "16.5x"
    assert format_ratio(2048.5) == "2,048.5x"
    assert format_ratio(24.0) == "24x"
    assert format_ratio(16.96) == "17x"
    assert (format_count(1, "thread"), format_count(2, "thread")) == ("1 thread", "2 threads")
    assert [format_tick(v) for v in (1200, 3_000_000, 0.5, 40, 2e9)] == [
        "1.2k",
        "3M",
        "0.5",
        "40",
        "2G",
    ]
    assert format_percent(0.29296875) == "29%"
    assert format_percent(0.29296875, 1) == "29.3%"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(4.2e-5) == "42.0 µs"
    assert format_seconds(1.5) == "1.50 s"
    assert format_bandwidth(3.35e12) == "3.35 TB/s"
    assert format_bandwidth(320e9) == "320 GB/s"
    assert format_flops_rate(989.4e12) == "989 TFLOP/s"
    assert format_params(8_030_261_248) == "8.03B"
    assert format_params(124_439_808) == "124M"
    assert [_article(t) for t in ("80 GiB", "24 GiB", "11 GiB", "180 GiB", "8.5 GiB")] == [
        "an",
        "a",
        "an",
        "a",
        "an",
    ]


LLAMA_8B_CONFIG = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


def test_budget_refuses_a_config_with_an_unknown_dtype(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA_8B_CONFIG, "torch_dtype": "float7"}))
    code = main(["budget", "--config", str(config), "--gpu", "h100", "--context", "10"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{config}: torch_dtype 'float7' is not a dtype kvtui knows" in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["gpus"], ["models", "--json"]])
def test_a_full_stdout_is_one_line_not_a_traceback(argv):
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "kvtui", *argv],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr == "kvtui: error: cannot write the output: No space left on device\n"


def test_a_closed_stdout_is_not_a_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "kvtui", "gpus"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert done.returncode == 0 and done.stderr == ""
    done = subprocess.run(
        f"{sys.executable} -m kvtui gpus >&-", shell=True, stderr=subprocess.PIPE, text=True
    )
    assert done.returncode in (0, 2) and "Traceback" not in done.stderr


def test_a_shape_this_machine_cannot_hold_is_refused_before_the_app_opens(capsys, monkeypatch):
    """`kvtui --engine shape:llama-3.1-8b` on a laptop: one line, exit 2, naming the shapes
    that fit in its free memory, before any app (or torch) starts; one that fits passes on (to
    the terminal check, here)."""
    import kvtui.engines.factory

    monkeypatch.setattr(
        kvtui.engines.factory, "free_memory", lambda s: (2 << 30, "free host RAM", False)
    )
    code = main(["--engine", "shape:llama-3.1-8b"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert "shape:llama-3.1-8b needs 31.9 GiB" in err and "2 GiB of free host RAM" in err
    assert "fit here: shape:tiny-austen, shape:gpt2" in err and "llama-3.2-3b" not in err
    assert main(["--engine", "shape:gpt2"]) == 2
    assert "needs a terminal" in capsys.readouterr().err  # it fits: on to the next check


def test_the_app_without_a_terminal_says_so_in_one_line(capsys):
    """`kvtui </dev/null >out`: one line and exit 2, never escape codes written forever."""
    code = main(["--engine", "sim:llama-3.1-8b@h100"])  # pytest's stdin is not a terminal
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "needs a terminal" in err


# --- budget over several GPUs, and the KV cache a server sizes -----------------------------------

BUDGET_70B_4 = ("budget", "--model", "llama-3.1-70b", "--gpu", "h100", "--context", "8192")


@pytest.mark.parametrize(
    ("model", "tp", "kv_heads", "weights", "kv_per_token"),
    [
        # weights per GPU: (params - norms - K/V projections) / tp + norms + own K/V heads, bf16
        ("llama-3.1-70b", 4, 2, 2 * 17_639_415_808, 80 * 2 * 2 * 128 * 2),
        ("llama-3.1-70b", 16, 1, 2 * 4_494_729_216, 80 * 2 * 1 * 128 * 2),  # heads kept whole
        ("llama-3.1-8b", 2, 4, 2 * 4_015_263_744, 32 * 2 * 4 * 128 * 2),
        ("qwen2.5-7b", 28, 1, None, 28 * 2 * 1 * 128 * 2),
    ],
)
def test_budget_tp_per_gpu_figures(capsys, model, tp, kv_heads, weights, kv_per_token):
    data = run_json(
        capsys, "budget", "--model", model, "--gpu", "h100", "--context", "8192", "--tp", str(tp)
    )
    assert set(data) >= BUDGET_KEYS | {
        "tp",
        "gpu_memory_utilization",
        "block_size",
        "kv_capacity_tokens",
        "max_concurrency",
        "weights_bytes_per_gpu",
        "kv_bytes_per_token_per_gpu",
        "kv_heads_per_gpu",
    }
    assert (data["tp"], data["kv_heads_per_gpu"]) == (tp, kv_heads)
    assert data["kv_bytes_per_token_per_gpu"] == kv_per_token
    if weights is not None:
        assert data["weights_bytes_per_gpu"] == weights
    assert data["used_bytes"] == data["weights_bytes_per_gpu"] + 8192 * kv_per_token + 2**30
    block = 16 * kv_per_token
    available = 80 * 2**30 * 9 // 10 - data["weights_bytes_per_gpu"] - 2**30
    assert data["kv_capacity_tokens"] == available // block * 16
    assert data["max_concurrency"] == (available // block) / (8192 // 16)


def test_budget_capacity_is_whole_blocks_and_concurrency_follows(capsys):
    argv = [*BUDGET_70B_4, "--tp", "4", "--gpu-memory-utilization", "0.92", "--block-size", "32"]
    data = run_json(capsys, *argv)
    assert (data["gpu_memory_utilization"], data["block_size"]) == (0.92, 32)
    blocks = (80 * 2**30 * 92 // 100 - 35_278_831_616 - 2**30) // (32 * 81_920)
    assert data["kv_capacity_tokens"] == 32 * blocks
    assert data["kv_capacity_tokens"] % 32 == 0
    assert data["max_concurrency"] == blocks / 256 == data["kv_capacity_tokens"] / 8192


def test_budget_tp_1_keeps_the_one_gpu_figures(capsys):
    args = ("budget", "--model", "llama-3.1-8b", "--gpu", "h100", "--context", "24000")
    plain = run_json(capsys, *args, "--batch", "8")
    same = run_json(capsys, *args, "--batch", "8", "--tp", "1", "--gpu-memory-utilization", "0.9")
    assert plain == same
    assert plain["kv_bytes"] == plain["kv_bytes_per_gpu"] == 25_165_824_000
    assert plain["weights_bytes"] == plain["weights_bytes_per_gpu"] == 16_060_522_496
    assert plain["kv_capacity_tokens"] == 459_088  # 28,693 blocks of 16 tokens


def test_budget_tp_table_says_how_it_splits_and_what_a_server_reports(capsys):
    code, out, err = run(capsys, *BUDGET_70B_4, "--tp", "16")
    assert (code, err) == (0, "")
    assert "on 16x the NVIDIA H100 (SXM, 80GB) (tensor parallel)" in out
    assert "1 of the 8 KV heads, each kept on 2 GPUs (fewer KV heads than GPUs)" in out
    assert "GPU KV cache size: " in out and " tokens per request: " in out
    assert "activation peak" in out and "CUDA graphs" in out and "other processes" in out
    code, out, _ = run(capsys, *BUDGET_70B_4, "--tp", "4")
    assert "GPU KV cache size: 499,952 tokens" in out
    assert "Maximum concurrency for 8,192 tokens per request: 61.03x" in out


def test_budget_refuses_a_split_too_small_with_the_fewest_that_holds_it(capsys):
    argv = ("budget", "--model", "llama-3.1-70b", "--gpu", "l4", "--context", "8192")
    data = run_json(capsys, *argv, "--tp", "2")
    assert data["status"] == "overflow" and data["kv_capacity_tokens"] == 0
    assert any("--tp 8 on the NVIDIA L4 holds it" in line for line in data["advice"])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tp", "0"], "argument --tp: expected a positive integer up to 1,024, not '0'"),
        (["--tp", "-1"], "argument --tp"),
        (["--tp", "99999999999999999999999"], "argument --tp"),
        (["--tp", "1025"], "argument --tp"),
        (["--tp", "3"], "64 attention heads do not split evenly over 3 GPUs"),
        (["--tp", "128"], "do not split evenly over 128 GPUs"),
        (["--gpu-memory-utilization", "0"], "above 0 and at most 1, not '0'"),
        (["--gpu-memory-utilization", "1.5"], "above 0 and at most 1, not '1.5'"),
        (["--gpu-memory-utilization", "nan"], "above 0 and at most 1, not 'nan'"),
        (["--gpu-memory-utilization", "-inf"], "--gpu-memory-utilization"),
        (["--block-size", "0"], "argument --block-size"),
    ],
)
def test_budget_bad_split_options(capsys, argv, says):
    assert_usage_error(capsys, *BUDGET_70B_4, *argv, says=says)


def test_bench_runs_a_model_split_over_4_gpus(capsys):
    def bench(engine, *more):
        argv = ("bench", "--engine", engine, "--tokens", "8", "--replay-speed", "0", *more)
        return run_json(capsys, *argv)

    # one H200 holds the weights only if the engine may fill all of it (131 GiB of 141)
    split = bench("sim:llama-3.1-70b@4xh100")
    alone = bench("sim:llama-3.1-70b@h200", "--gpu-memory-utilization", "1")
    assert split["device"] == "sim: 4x NVIDIA H100 (SXM, 80GB), per GPU"
    assert split["text"] == alone["text"]  # a split changes the time, never the answer
    # each H100 reads a quarter of the weights at 3.35 TB/s; one H200 reads them all at 4.8
    assert split["cached"]["total_s"] < alone["cached"]["total_s"] / 2
    code, out, err = run(capsys, "bench", "--engine", "sim:llama-3.1-70b@2xl4", "--tokens", "8")
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert "does not fit 2x NVIDIA L4" in err and "it needs at least 8" in err


MOUSE_ON = b"\x1b[?1000h"
"""Textual's first act on a terminal: from here on, what the pty shows is the app's."""


class KvtuiInAPty:
    """`kvtui ARGS --engine sim:...` on a pty of `rows` x `cols` (0x0: one that says no size),
    its bytes read as they come; q and the process's end are the test's to check."""

    def __init__(self, args: list[str], rows: int, cols: int) -> None:
        import fcntl
        import os
        import pty
        import struct
        import termios

        self.main_fd, child_fd = pty.openpty()
        fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = {k: v for k, v in os.environ.items() if k != "TEXTUAL_DRIVER"} | {"TERM": "xterm"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvtui", *args, "--engine", "sim:llama-3.1-8b@h100"],
            stdin=child_fd,
            stdout=child_fd,
            stderr=child_fd,
            env=env,
            cwd=Path(__file__).parent.parent,
        )
        os.close(child_fd)
        self.seen = b""

    def read_until(self, condition: Callable[[], bool], timeout: float) -> None:
        """Read what the app writes until `condition` holds, `timeout` passes or the terminal
        closes (the app has ended)."""
        import os
        import select
        import time

        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            if select.select([self.main_fd], [], [], 0.1)[0]:
                try:
                    self.seen += os.read(self.main_fd, 65536)
                except OSError:  # the child closed the terminal
                    return

    def press(self, key: bytes) -> None:
        import os

        os.write(self.main_fd, key)

    def __enter__(self) -> KvtuiInAPty:
        return self

    def __exit__(self, *exc: object) -> None:
        import os

        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        os.close(self.main_fd)


@pytest.mark.parametrize("present", [["--present"], []], ids=["presenter", "lesson screens"])
def test_the_app_draws_its_title_card_before_the_app_and_leaves_the_terminal_as_it_was(present):
    """`kvtui` (presenter mode or not) in a terminal (a pty of 80x24): the title card, its
    waiting line turning, is on the terminal before the app starts drawing (Textual's first act
    is to turn the mouse on); q quits, exit 0, the terminal's own screen back."""
    with KvtuiInAPty([*present, "--lesson"], 24, 80) as term:
        term.read_until(lambda: MOUSE_ON in term.seen, 60)  # the app has started drawing
        assert MOUSE_ON in term.seen, term.seen[-2000:]
        before_app = term.seen.split(MOUSE_ON)[0].decode(errors="replace")
        assert before_app.startswith("\x1b[?1049h")  # the app's own screen, at once
        assert "A model decodes beside this screen" in before_app
        assert "starting kvtui..." in before_app and "██" in before_app
        term.read_until(lambda: b"space" in term.seen.split(MOUSE_ON)[-1], 60)  # its first frame
        term.press(b"q")
        term.read_until(lambda: term.process.poll() is not None, 30)  # as it ends, read on
        assert term.process.wait(5) == 0
        term.read_until(lambda: False, 0.5)
        assert term.seen.rstrip(b"\r\n").endswith(b"\x1b[?1049l")  # the terminal's own screen


def test_a_terminal_that_says_it_is_0x0_gets_the_app_without_the_title_card():
    """A pty that reports no size (as `script` gives one): the title card is not drawn (it ended
    the launch with a ValueError from textwrap at a width of -4), the app opens and q quits it."""
    with KvtuiInAPty(["--lesson"], 0, 0) as term:
        term.read_until(lambda: MOUSE_ON in term.seen, 60)  # the app draws
        assert MOUSE_ON in term.seen, term.seen[-2000:]
        assert b"Traceback" not in term.seen and b"starting kvtui" not in term.seen
        term.read_until(lambda: b"space" in term.seen.split(MOUSE_ON)[-1], 60)  # its first frame
        term.press(b"q")
        # read on while it ends: an app whose frame fills the pty's buffer waits for a reader
        term.read_until(lambda: term.process.poll() is not None, 30)
        assert term.process.wait(5) == 0


def test_budget_caps_the_longest_context_at_the_models_positions_and_says_which_binds(capsys):
    """Memory would hold 604,819 tokens of llama-3.1-70b on four H100s, but the model runs
    131,072 positions: the longest context printed is the model's, named as such, and the JSON
    says both and which binds; where memory binds, it says so."""
    assert (
        main(
            [
                "budget",
                "--model",
                "llama-3.1-70b",
                "--gpu",
                "h100",
                "--context",
                "8192",
                "--tp",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "Longest context that fits: 131,072 tokens, the model's own positions "
        "(memory would hold 604,819 tokens)." in out
    )
    assert (
        main(["budget", "--model", "llama-2-7b", "--gpu", "h100", "--context", "4096", "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["longest_context_tokens"] == 4_096 and data["longest_context_limit"] == "positions"
    assert data["max_context_tokens"] == 136_086  # what memory alone would hold
    assert (
        main(
            [
                "budget",
                "--model",
                "llama-3.1-8b",
                "--gpu",
                "h100",
                "--context",
                "24000",
                "--batch",
                "8",
            ]
        )
        == 0
    )
    assert "Longest context that fits: 65,579 tokens (memory binds)." in capsys.readouterr().out
