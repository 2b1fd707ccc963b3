"""The fourth sweep's inputs, what a server says (kvtui.engines.vllm: `vllm:URL`, `kvtui load`),
and how each one's outcome is judged, for `benchmarks/fuzz_inputs.py`:

- server lies: a stand-in server (tests/vllm/fake.py, on 127.0.0.1) that lies in every field it
  answers (the model list, the version, the tokenized prompt, /metrics, the stream's chunks)
  and in how it sends them (a byte at a time, forever, keep-alives only, dying mid-stream), put
  to `kvtui bench --engine vllm:URL` (with `--json`, with `--record` and the record replayed) or
  `kvtui load URL` in a process of their own, timed and measured;
- server URLs: the URLs people and scripts give (`vllm:URL`, `kvtui load URL`): any scheme, host
  (IDNA that is not, labels past 63, IPv6, bytes that were not UTF-8), port, path and credentials,
  through `kvtui.cli.main` in this process. Hosts are loopback or invalid, never looked up.

An outcome is "exit 0", "exit 1" (load: a request failed), "exit 2" (one line), or what went wrong:
"traceback ...", "hang" (past the case's limit), "exit N", "N stderr lines", "memory N MiB"
(past MEMORY_MIB of peak RSS), "litter NAME" (a `.part` or scratch file left), "security: ..."
(an escape code or a line of the server's own reached the output).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
MEMORY_MIB = 400
"""Peak RSS past which a run against a lying server counts as a memory failure."""
SLOW_S = 45.0
"""A run longer than this against a lying server is "slow" (the third sweep's hangs passed 40 s;
a stream that sends nothing may rightly be waited for, STREAM_IDLE_S, 120 s)."""
LIMIT_S = 170.0
"""A run still going after this is a hang."""

FAILED_REQUESTS = "exit 1 (load: requests failed)"
"""kvtui load's outcome when the server failed some of its requests: as it should be."""
MARK = "FAKE LINE"
CONTROL = f"\x1b]52;c;aGFja2Vk\x07\x1b]0;PWNED\x07\x9b31m\r\n{MARK}: speedup 999x"
NESTED = b"[" * 100_000 + b"]" * 100_000
METRICS = (ROOT / "tests" / "engines" / "data" / "vllm-0.32-busy.txt").read_text()

STRINGS = [
    CONTROL,
    "[/]",
    "[@click=app.quit]x",
    "x" * 5000,
    "",
    "\udcff",
    "\u202e",
    "/" + "a" * 100_000,
    "~root",
    "../../etc/passwd",
    "\x00",
]
NUMBERS = [10**30, 2**63, 2**64, -1, 0, 1.5, 1e308, True, "512", None]

MODEL_LIES = (
    [{"data": [{"id": s, "root": s, "max_model_len": 512}]} for s in STRINGS if s]
    + [{"data": [{"id": "m", "root": "m", "max_model_len": n}]} for n in NUMBERS]
    + [
        {"data": []},
        {"data": {}},
        {"data": "x"},
        {"data": [5]},
        {"data": [{"id": 5}]},
        {"data": [{"id": "m", "root": 5, "max_model_len": 512}]},
    ]
)
RAW_LIES = [
    NESTED,
    b"",
    b"null",
    b"{",
    b"\xff\xfe\x00",
    b"NaN",
    b"1e999",
    b'{"data": [{"id": "m", "max_model_len": 1e999}]}',
    b'{"version": "' + b"9" * 5000 + b'"}',
    b'{"tokens": [' + b"9" * 5000 + b"]}",
    b'{"tokens": [' + b",".join([b"1"] * 300_000) + b"]}",
    json.dumps({"version": CONTROL, "tokens": [2**70, -1]}).encode(),
    json.dumps({"detail": CONTROL}).encode(),
    b"x" * (5 * 2**20),
]


def _metrics_lies() -> list[str | None]:  # built once: cases share its strings
    label = CONTROL.replace("\\", "\\\\").replace('"', '\\"')
    return [
        None,
        METRICS.replace('reason="capacity"', f'reason="{label}"'),
        METRICS.replace('cache_dtype="auto"', f'cache_dtype="{label}"'),
        METRICS.replace('model_name="/tmp/kvtui-vllm/tiny-austen-hf"', f'model_name="{label}"'),
        METRICS.replace('block_size="32"', 'block_size="999999999999999999"'),
        METRICS.replace('num_gpu_blocks="40"', 'num_gpu_blocks="99999999999999999999"'),
        METRICS + "vllm:num_requests_running +Inf\nvllm:num_preemptions_total 1e999\n",
        METRICS + "vllm:num_preemptions_total 1.7e308\nvllm:num_preemptions_total 1.7e308\n",
        METRICS + "vllm:num_requests_waiting NaN\n",
        'vllm:num_requests_running{model_name="' + "a" * (7 * 2**20) + '"} 1\n',
        "\n" * (8 * 2**20 - 1),
        "x" * (9 * 2**20),
        "vllm:num_requests_running{" + ",".join(f'l{i}="v"' for i in range(20_000)) + "} 1\n",
        'vllm:num_requests_running{a="' + "\\" * 60_000 + '"} 1\n',
        "\x00\x01\x02 garbage \xff",
    ]


METRICS_LIES = _metrics_lies()


def _chunk(choices: Any) -> bytes:
    return f"data: {json.dumps({'choices': choices})}\n\n".encode()


CHUNK_LIES: list[bytes] = [
    _chunk(5),
    _chunk({"text": "x"}),
    _chunk([5]),
    _chunk("x"),
    _chunk(None),
    _chunk([{"text": "x", "token_ids": [2**64]}]),
    _chunk([{"text": "x", "token_ids": [-1]}]),
    _chunk([{"text": "x", "token_ids": ["a"]}]),
    _chunk([{"text": "x", "token_ids": [1.5]}]),
    _chunk([{"text": CONTROL, "token_ids": [7]}]),
    _chunk([{"text": "y" * 10_000, "token_ids": [7]}]),
    b"data: "
    + json.dumps({"choices": [{"text": "x", "token_ids": [0] * 400_000}]}).replace(" ", "").encode()
    + b"\n\n",
    b"data: " + NESTED + b"\n\n",
    b"data: not json\n\n",
    b"data: NaN\n\n",
    b"data: [DONE]\n\n",
    b"event: nothing\n\n",
    b"data: " + b"x" * (2 * 2**20) + b"\n\n",
    b'data: {"choices": [{"text": "a", "token_ids": [97]}]}\r\r',
    b'data: {"usage": {"completion_tokens": 99999999999}}\n\n',
]
HOW = ["plain"] * 4 + ["drip"] * 3 + ["forever"] * 3 + ["die"] * 3 + ["keep-alive"]
"""How it sends: keep-alives without a token are rare here, as each may rightly be waited for
(STREAM_IDLE_S) and so costs two minutes."""
ROUTES = ["/v1/models", "/version", "/tokenize", "/metrics", "/v1/completions"]


@st.composite
def server_lies(draw: Any) -> dict[str, Any]:
    """A stand-in server lying in one to three ways, and a command put to it."""
    lies: dict[str, Any] = {}
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["models", "raw", "metrics", "chunk", "how"]))
        if kind == "models":
            lies["models"] = draw(st.sampled_from(MODEL_LIES))
        elif kind == "raw":
            route = draw(st.sampled_from(ROUTES[:3]))
            lies.setdefault("replies", {})[route] = draw(st.sampled_from(RAW_LIES))
        elif kind == "metrics":
            lies["metrics"] = draw(st.sampled_from(METRICS_LIES))
        elif kind == "chunk":
            lies["chunk"] = draw(st.sampled_from(CHUNK_LIES))
        else:
            how = draw(st.sampled_from(HOW))
            if how == "drip":
                lies["drip_s"] = draw(st.sampled_from([0.002, 0.02, 0.3]))
                lies["drip_paths"] = (draw(st.sampled_from(ROUTES)),)
            elif how == "forever":
                lies["forever"] = True
                lies["token_delay_s"] = 0.0
            elif how == "keep-alive":
                lies["chunk"] = b": keep-alive\n\n"
                lies["forever"] = True
                lies["token_delay_s"] = 0.5
            elif how == "die":
                lies["die_after"] = draw(st.integers(0, 4))
    command = draw(st.sampled_from(["bench", "bench json", "record", "load"]))
    return {"lies": lies, "command": command}


def shown(lies: dict[str, Any]) -> str:
    """A case in a line: what it lies about, not the megabytes it lies with."""
    parts = []
    for key, value in lies["lies"].items():
        if key == "replies":
            value = {k: repr(v[:60]) + f"...({len(v):,} B)" for k, v in value.items()}
        elif isinstance(value, bytes | str):
            value = repr(value[:80]) + f"...({len(value):,})"
        else:
            value = repr(value)[:100]
        parts.append(f"{key}={value}")
    return f"{lies['command']}: " + ", ".join(parts)


def run_measured(argv: list[str], cwd: Path, limit: float = LIMIT_S) -> dict[str, Any]:
    """`python -m kvtui argv` in `cwd`: its exit status (None: killed at `limit`), output,
    seconds and peak RSS in MiB (its own, `_peak_kib`, read every 20 ms)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "HYPOTHESIS"))}
    env["PYTHONPATH"] = str(ROOT)
    out, err = cwd / ".stdout", cwd / ".stderr"
    started = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtui", *argv],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
    code: int | None = None
    peak_kib = 0
    while True:
        peak_kib = max(peak_kib, _peak_kib(proc.pid))
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(status)
            proc.returncode = code
            break
        if time.monotonic() - started > limit:
            os.killpg(proc.pid, 9)
            os.waitpid(proc.pid, 0)
            proc.returncode = -9
            break
        time.sleep(0.02)
    result = {
        "code": code,
        "seconds": time.monotonic() - started,
        "rss_mib": peak_kib // 1024,
        "out": out.read_text(errors="replace"),
        "err": err.read_text(errors="replace"),
    }
    out.unlink()
    err.unlink()
    return result


def _peak_kib(pid: int) -> int:
    """The peak RSS of `pid` since its exec (VmHWM), read while it runs: its rusage would count
    the parent's pages between fork and exec (this sweep's process, holding the lies)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def judge(run: dict[str, Any], allowed: tuple[int, ...]) -> str:
    """One run's outcome (see the module's docstring)."""
    if run["code"] is None:
        return "hang"
    out, err, code = run["out"], run["err"], run["code"]
    text = out + err
    if any(c in text for c in "\x1b\x9b\x07\r") or any(
        line.lstrip().startswith(MARK) for line in text.splitlines()
    ):
        return "security: the server's escape code or line reached the output"
    if "Traceback" in text:
        last = [line for line in err.splitlines() if line.strip()][-1:] or ["?"]
        return f"traceback {last[0][:80]}"
    if run["rss_mib"] > MEMORY_MIB:
        return f"memory {run['rss_mib']:,} MiB"
    if code not in allowed:
        return f"exit {code}"
    lines = [line for line in err.splitlines() if line.strip()]
    if code == 2 and len(lines) != 1:
        return f"{len(lines)} stderr lines"
    return FAILED_REQUESTS if code == 1 else f"exit {code}"


def try_server(scratch: Path, case: dict[str, Any], read_output: Any = None) -> str:
    """A stand-in server lying as `case` says, and its command (see `server_lies`)."""
    sys.path.insert(0, str(ROOT))
    from tests.vllm.fake import FakeVLLM

    work = Path(tempfile.mkdtemp(dir=scratch, prefix="server-case-"))  # one a case: in parallel
    lies = dict(case["lies"])
    if "chunk" in lies:
        data = lies["chunk"]
        lies["chunk"] = lambda i, data=data: data
    server = FakeVLLM(**lies).start()
    try:
        url, command = server.url, case["command"]
        bench = ["bench", "--engine", f"vllm:{url}", "--tokens", "6", "--greedy"]
        if command == "load":
            argv = ["load", url, "--concurrency", "2", "--prompt-tokens", "4", "--max-tokens"]
            runs = [
                (run_measured([*argv, "6", "--requests", "3", "--seconds", "8"], work), (0, 1, 2))
            ]
        elif command == "record":
            record = ["--record", "r.jsonl", "--json"]
            runs = [(run_measured([*bench, *record], work), (0, 2))]
            if (work / "r.jsonl").exists():
                replay = ["bench", "--engine", "replay:r.jsonl", "--replay-speed", "0", "--json"]
                runs.append((run_measured(replay, work), (0, 2)))
        else:
            runs = [
                (
                    run_measured(bench + (["--json"] if command == "bench json" else []), work),
                    (0, 2),
                )
            ]
    finally:
        server.close()
    results = [judge(run, allowed) for run, allowed in runs]
    bad = [r for r in results if not r.startswith("exit") or r.split()[1] not in ("0", "1", "2")]
    if bad:
        return bad[0]
    litter = [p.name for p in work.iterdir() if p.name.endswith(".part") or ".kvtui" in p.name]
    shutil.rmtree(work, ignore_errors=True)
    if litter:
        return f"litter {litter[0][:40]}"
    slowest = max(run["seconds"] for run, _ in runs)
    if slowest > SLOW_S:
        return f"slow, {results[0]}"
    return results[0]


# --- server URLs ----------------------------------------------------------------------------------

HOSTS = [
    "127.0.0.1",
    "localhost",
    "[::1]",
    "[::1",
    "ü..invalid",
    "ü" * 70 + ".invalid",
    "a" * 64 + ".invalid",
    "\udcff.invalid",
    "..",
    "",
    "127.0.0.1:99999",
    "127.0.0.1:-1",
    "127.0.0.1:0",
    "127.0.0.1:1:2",
    "user:pass@127.0.0.1",
    "@127.0.0.1",
    "127.0.0.1%00",
    "[fe80::1%25eth0]",
]
PATHS = [
    "",
    "/",
    "/v1",
    "/v1/",
    "/\udcff",
    "/é",
    "/a b",
    "/%",
    "/%zz",
    "/" + "p" * 70_000,
    "/?",
    "/#x",
    "/..",
    "/x?q=1",
]
SCHEMES = ["http://", "https://", "HTTP://", "ftp://", "", "http:/", "http:///", "file://"]


@st.composite
def server_urls(draw: Any) -> tuple[str, str]:
    """A URL as given, and the command it is given to (never a name that would be looked up)."""
    host = draw(st.sampled_from(HOSTS))
    port = draw(st.sampled_from(["", ":1", ":65535", ":65536", ":x", ":"]))
    if ":" in host.strip("[]") and not host.startswith("["):
        port = ""
    url = draw(st.sampled_from(SCHEMES)) + host + port + draw(st.sampled_from(PATHS))
    if draw(st.integers(0, 4)) == 0:
        url = draw(st.text(alphabet=st.sampled_from(list("h:/.[]@%?#1 \x1b\udcffü")), max_size=30))
    return draw(st.sampled_from(["bench", "load", "app"])), url


def try_url(value: tuple[str, str], read_output: Any) -> str:
    """A URL given to a command in this process: refused in one line (exit 2), or the server is
    not there (one line: connection refused, exit 2)."""
    import kvtui.app
    from kvtui.cli import main
    from tests.test_hostile_inputs import outcome

    command, url = value
    argv = {
        "bench": ["bench", "--engine", f"vllm:{url}", "--tokens", "2"],
        "load": ["load", url, "--concurrency", "1", "--prompt-tokens", "1", "--max-tokens", "1"],
        "app": ["--engine", f"vllm:{url}"],
    }[command]
    real, kvtui.app.run_app = kvtui.app.run_app, lambda *a, **k: 0
    try:
        return outcome(lambda: main(argv), read_output, seconds=30)
    finally:
        kvtui.app.run_app = real
