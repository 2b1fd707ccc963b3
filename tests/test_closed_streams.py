"""Standard streams the shell closed (`<&-`, `>&-`, `2>&-`) or that are full (`/dev/full`): the
command works, or says so in one line and exits 2; never a traceback, never exit 1 or 120, and
never a JSON result lost because stderr is gone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BENCH = ["bench", "--engine", "sim:gpt2@t4", "--tokens", "2", "--replay-speed", "0", "--json"]


def kvtui(argv: list[str], shell_redirects: str) -> subprocess.CompletedProcess[str]:
    """`python -m kvtui ARGV REDIRECTS`, as a shell runs it (stdout and stderr captured unless
    the redirects close or replace them)."""
    command = " ".join([sys.executable, "-m", "kvtui", *argv, shell_redirects])
    return subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("redirects", ["<&- 2>&-"])
def test_bench_still_prints_its_result(redirects):
    done = kvtui(BENCH, redirects)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokens"] == 2
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "redirects"),
    [(BENCH, ">&-"), (["--help"], ">/dev/full")],
)
def test_output_that_cannot_be_written_is_exit_2(argv, redirects):
    done = kvtui(argv, redirects)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.count("\n") <= 1, done.stderr


@pytest.mark.parametrize("redirects", ["2>&-"])
def test_the_app_without_a_terminal_is_exit_2(redirects):
    done = kvtui(["--engine", "sim:gpt2@t4"], redirects)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == "" and "Traceback" not in done.stderr


def test_a_bad_option_with_stderr_full_is_exit_2():
    assert kvtui(["bench", "--tokens", "nope"], "2>/dev/full").returncode == 2
