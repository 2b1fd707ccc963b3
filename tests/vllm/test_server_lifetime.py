"""The tests' vLLM server (tests/vllm/server.py) ends with the test process, however that ends:
a run killed at its time limit (SIGKILL: no atexit, no pytest_unconfigure) left its server
running with parent 1, holding a core and 2-3 GB. Tried with a stand-in for vLLM's Python (a
script that sleeps), started the way the run starts the real one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_the_server_ends_when_the_test_process_is_killed(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexec sleep 120\n")  # as vLLM, it runs until stopped
    fake_python.chmod(0o755)
    runner = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
from tests.vllm.server import VLLMServer
server = VLLMServer({str(fake_python)!r})
server.start()
print(server.proc.pid, server.folder, server.model.parent, flush=True)
time.sleep(120)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVTUI_VLLM_URL", None)  # a server of its own, not the run's
    test_process = subprocess.Popen(
        [sys.executable, "-c", runner], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert test_process.stdout is not None
        pid, folder, export = test_process.stdout.readline().split()
        server = int(pid)
        assert _alive(server)
    finally:
        test_process.kill()  # as a CI limit kills a run: nothing of it runs after
        test_process.wait()
    for left in (folder, export):  # its log and export, which its stop and exit would remove
        shutil.rmtree(left, ignore_errors=True)
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(server):
        os.killpg(server, 9)  # not left behind by this test, whatever it finds
        raise AssertionError("the server outlived the test process that started it")
