"""The third sweep's inputs and how each one's outcome is judged, shared by
`benchmarks/fuzz_inputs.py` (many examples, every category) and the suite's seeded fuzz tests
(tests/test_hostile_inputs.py, a few examples of the cheap categories).

Categories added to the configs, records, command-line numbers and safetensors headers of
tests/test_hostile_inputs.py: numbers at the edges in every numeric field of a record; paths as
people type them; markup and control characters in a record's strings, through the app; model
folders (config, weights and tokenizer edits, loaded through transformers); environment variables
at start-up; standard streams closed or full; `kvtui serve` with malformed HTTP and websocket
traffic. Each `try_*` returns an outcome: "exit 0", "exit 2", "shown" (the app drew it) or what
went wrong ("traceback ...", "hang", "exit N", "N stderr lines", "security: ...").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from kvtui.cli import main
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunSettings, to_json
from kvtui.engines.replay import FORMAT, VERSION
from tests.ports import free_port
from tests.test_hostile_inputs import outcome

SIM = RunSettings(engine="sim:gpt2@t4", tokens=3, replay_speed=0)
OK = ("exit 0", "exit 2")


def record(settings: RunSettings = SIM) -> list[dict[str, Any]]:
    header = {"kind": "header", "format": FORMAT, "version": VERSION}
    header["settings"] = settings.to_json()
    return [header] + [to_json(e) for e in run_events(open_engine(settings), settings)]


RECORD = record()


def write_record(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


# --- numbers at the edges, in every numeric field of a record -----------------------------------

EDGE_NUMBERS = [
    0,
    -0.0,
    1,
    -1,
    2,
    255,
    256,
    257,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    0.5,
    1e-320,
    5e-324,
    1e-9,
    1e308,
    -1e308,
    3600.0,
    3600.0001,
]
NUMERIC_FIELDS = sorted(
    {
        (i, key)
        for i, line in enumerate(RECORD)
        for key, value in line.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    | {(i, key) for i, line in enumerate(RECORD) for key in ("batch", "kv_block_tokens")}
)


@st.composite
def record_numbers(draw: Any) -> bytes:
    """A good record with one numeric field of one line (every step's, for a step field) set to a
    number at an edge: 0, 1, 2^63, a subnormal, 1e308..."""
    lines = [dict(line) for line in RECORD]
    index, key = draw(st.sampled_from(NUMERIC_FIELDS))
    value = draw(st.sampled_from(EDGE_NUMBERS))
    kind = lines[index].get("kind")
    for line in lines:
        if line is lines[index] or kind == "step" and line.get("kind") == "step":
            line[key] = value
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def try_record_in_app(directory: Path, data: bytes, read_output: Any) -> str:
    """A record replayed in the app (headless, screen 3, then 1, 2 and help): "shown", or
    refused before the app opens ("exit 2"), or what went wrong."""
    from kvtui.errors import EngineError
    from kvtui.testing import ScriptedEngine, headless

    path = directory / "run.jsonl"
    path.write_bytes(data)
    try:
        engine = ScriptedEngine.from_record(path)
    except EngineError:
        return "exit 2"

    async def drive() -> int:
        async with headless(f"replay:{path}", 3, size=(100, 30), engine=lambda s: engine) as run:
            await run.wait_for(lambda: run.app.live.state in ("done", "failed"), 20)
            for key in ("1", "2", "question_mark", "escape", "3", "r"):
                await run.press(key)
            if not run.app.is_running:
                return 1
        return 0

    result = outcome(lambda: asyncio.run(drive()), read_output, seconds=40)
    return "shown" if result == "exit 0" else result


# --- strings with markup and control characters, in the app ---------------------------------------

MARKUP_PIECES = st.sampled_from(
    [
        "[/dim]",
        "[/]",
        "[b]",
        "[@click=app.quit]",
        "[@click=app.bell]",
        "[link='http://x']",
        "[$accent]",
        "[$nope]",
        "[B]",
        "[ b]",
        "\\",
        "[",
        "]",
        "$x",
        "\x1b]0;title\x07",
        "\x1b[2J",
        "\x9b31m",
        "\r",
        "\n",
        "\t",
        "\u202e",
        "\ud800",
        "\x00",
    ]
)
markup_text = st.lists(MARKUP_PIECES | st.text(max_size=4), min_size=1, max_size=6).map("".join)


@st.composite
def records_with_text(draw: Any) -> bytes:
    """A good record whose start names its model, device, timing, pool and prompt with markup,
    actions and control characters."""
    lines = [dict(line) for line in RECORD]
    started = next(line for line in lines if line.get("kind") == "started")
    for key in ("model", "device", "timing", "kv_pool_source", "prompt_text", "ridge_source"):
        if draw(st.booleans()):
            started[key] = draw(markup_text)
    for line in lines:
        if line.get("kind") == "step" and draw(st.integers(0, 3)) == 0:
            line["text"] = draw(markup_text)
    return (
        json.dumps(lines[0]).encode()
        + b"\n"
        + b"".join(json.dumps(line, ensure_ascii=True).encode() + b"\n" for line in lines[1:])
    )


# --- paths as people type them --------------------------------------------------------------------

path_texts = st.one_of(
    st.sampled_from(
        [
            "~nosuchuser/x.jsonl",
            "~",
            "~/",
            "x.jsonl/",
            ".",
            "..",
            "/",
            "/dev/null",
            "/dev/zero",
            "/dev/full",
            "/proc/self/mem",
            "/proc/self/fd/0",
            "/etc/shadow",
            "a" * 255,
            "a" * 256,
            "d/" * 2100 + "x",
            " ",
            "-",
            "--json",
            "\u202e.jsonl",
            "\udcff.jsonl",
        ]
    ),
    st.text(
        alphabet=st.sampled_from(list("ab./~-_ \\:*?$\u00e9\u202e\x01\x1b\udcff")), max_size=40
    ),
    st.integers(250, 300).map(lambda n: "p" * n),
)
PATH_COMMANDS = {
    "replay": lambda p: ["bench", "--engine", f"replay:{p}", "--replay-speed", "0"],
    "model": lambda p: ["bench", "--model", p, "--tokens", "2"],
    "record": lambda p: [*("bench", "--engine", "sim:gpt2@t4", "--tokens", "2"), "--record", p],
    "config": lambda p: ["budget", "--config", p, "--gpu", "h100", "--context", "9"],
    "app replay": lambda p: ["--engine", f"replay:{p}"],
}
paths = st.tuples(st.sampled_from(sorted(PATH_COMMANDS)), path_texts)


def try_path(directory: Path, command_path: tuple[str, str], read_output: Any) -> str:
    """A path given to a command, run from an empty folder: exit 0 or 2, and nothing written
    outside that folder (a record written is the only file allowed, and only inside)."""
    import kvtui.app

    command, path = command_path
    work = directory / "cwd"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    before = os.getcwd()
    real, kvtui.app.run_app = kvtui.app.run_app, lambda *a, **k: 0
    try:
        os.chdir(work)
        result = outcome(lambda: main(PATH_COMMANDS[command](path)), read_output)
    finally:
        os.chdir(before)
        kvtui.app.run_app = real
    written = [p for p in work.rglob("*") if p.is_file()]
    if command != "record" and written:
        return f"security: {command} wrote {written[0].name!r}"
    return result


# --- model folders -------------------------------------------------------------------------------

_FOLDER_CACHE: dict[str, Path] = {}


def base_model(scratch: Path) -> Path:
    """A small random Llama saved with its tokenizer (built once per process)."""
    if "llama" not in _FOLDER_CACHE:
        from tests.engines.test_hf import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        directory = scratch / "base-llama"
        with contextlib.redirect_stderr(open(os.devnull, "w")):  # noqa: SIM115
            build_model("llama", tokenizer).save_pretrained(directory, safe_serialization=True)
            tokenizer.save_pretrained(directory)
        _FOLDER_CACHE["llama"] = directory
    return _FOLDER_CACHE["llama"]


json_junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([0, -1, 2**31, 2**63, 1e308, 0.5, "32", "", [], {}, [1], {"type": None}]),
)
CONFIG_EDITS = st.one_of(
    st.tuples(
        st.just("model_type"),
        st.sampled_from(["gpt2", "qwen2", "mistral", "gemma", "phi3", "llama", "opt", "bert"]),
    ),
    st.tuples(st.just("sliding_window"), st.sampled_from([-1, 0, 1, 2, None, "x", 10**9])),
    st.tuples(st.just("vocab_size"), st.sampled_from([1, 10, 299, 301, 10**6])),
    st.tuples(st.just("num_key_value_heads"), st.sampled_from([1, 3, 4, 8, 0])),
    st.tuples(st.just("num_attention_heads"), st.sampled_from([1, 3, 8, 64])),
    st.tuples(st.just("hidden_size"), st.sampled_from([32, 63, 128])),
    st.tuples(st.just("num_hidden_layers"), st.sampled_from([1, 3, 100])),
    st.tuples(st.just("max_position_embeddings"), st.sampled_from([1, 8, 20, 10**7])),
    st.tuples(st.just("rope_scaling"), json_junk | st.just({"rope_type": "dynamic"})),
    st.tuples(st.just("rope_theta"), json_junk),
    st.tuples(st.just("torch_dtype"), st.sampled_from(["float8", "int4", "complex64", 7])),
    st.tuples(st.just("head_dim"), st.sampled_from([1, 15, 16, 17, 0])),
    st.tuples(st.just("tie_word_embeddings"), json_junk),
    st.tuples(st.just("bos_token_id"), st.sampled_from([-1, 10**6, None])),
    st.tuples(st.just("attn_implementation"), st.sampled_from(["flash_attention_2", "x"])),
    st.tuples(st.sampled_from(["hidden_act", "rms_norm_eps", "initializer_range"]), json_junk),
)
WEIGHT_EDITS = st.sampled_from(
    ["drop", "add", "reshape", "int8", "float16", "bool", "empty", "truncate", "none"]
)
TOKENIZER_EDITS = st.sampled_from(["none", "none", "none", "truncate", "junk", "remove", "empty"])
model_folders = st.tuples(st.lists(CONFIG_EDITS, max_size=2), WEIGHT_EDITS, TOKENIZER_EDITS)


def make_folder(base: Path, target: Path, edits: tuple[Any, str, str]) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    config_edits, weights, tokenizer = edits
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(base, target)
    config = json.loads((target / "config.json").read_text())
    for key, value in config_edits:
        config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    path = target / "model.safetensors"
    if weights in ("truncate", "empty"):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if weights == "truncate" else b"")
    elif weights != "none":
        tensors = load_file(path)
        name = sorted(tensors)[len(tensors) // 2]
        if weights == "drop":
            tensors.pop(name)
        elif weights == "add":
            tensors["model.extra.weight"] = torch.zeros(3)
        elif weights == "reshape":
            tensors[name] = torch.zeros(tensors[name].numel() + 1)
        else:
            dtype = {"int8": torch.int8, "float16": torch.float16, "bool": torch.bool}[weights]
            tensors[name] = tensors[name].to(dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    tok = target / "tokenizer.json"
    if tokenizer == "truncate":
        tok.write_bytes(tok.read_bytes()[:200])
    elif tokenizer == "junk":
        tok.write_text(json.dumps({"model": {"type": "BPE", "vocab": 7}}))
    elif tokenizer == "remove":
        tok.unlink()
    elif tokenizer == "empty":
        tok.write_text("")
    return target


def try_model_folder(scratch: Path, edits: tuple[Any, str, str], read_output: Any) -> str:
    """`kvtui bench --model DIR` on an edited copy of a good model folder: a run (exit 0) where
    the folder is still the model its config describes, else one line (exit 2)."""
    folder = make_folder(base_model(scratch), scratch / "model", edits)
    argv = ["bench", "--model", str(folder), "--tokens", "3", "--device", "cpu", "--json"]
    return outcome(lambda: main(argv), read_output, seconds=60)


# --- environment variables at start-up ------------------------------------------------------------

ENV_NAMES = [
    "TORCH_LOGS",
    "TORCH_SHOW_CPP_STACKTRACES",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_VISIBLE_DEVICES",
    "TEXTUAL_DRIVER",
    "TEXTUAL_FPS",
    "TEXTUAL_ANIMATIONS",
    "TEXTUAL_COLOR_SYSTEM",
    "TEXTUAL_THEME",
    "TERM",
    "COLUMNS",
    "LINES",
    "LANG",
    "LC_ALL",
    "PYTHONIOENCODING",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_VERBOSITY",
    "TOKENIZERS_PARALLELISM",
    "HOME",
    "TMPDIR",
    "NO_COLOR",
]
ENV_VALUES = st.one_of(
    st.sampled_from(
        [
            "",
            "evil",
            "-1",
            "0",
            "99999999999",
            "nosuch.module:X",
            "os:path",
            "/dev/null",
            "/nonexistent",
            "C",
            "ascii",
            "latin-1",
            "utf-8:strict",
            "nan",
            "+dynamo",
            "all",
            "xterm-256color",
            "dumb",
        ]
    ),
    st.text(alphabet=st.sampled_from(list("ab01-:,.=/ ")), max_size=12),
)
ENV_COMMANDS = {
    "bench sim": ["bench", "--engine", "sim:gpt2@t4", "--tokens", "2", "--json"],
    "bench tiny": ["bench", "--tokens", "2", "--device", "cpu", "--json"],
    "app": ["--engine", "sim:gpt2@t4"],
    "work": ["work", "--length", "4", "--json"],
}
environments = st.tuples(
    st.sampled_from(sorted(ENV_COMMANDS)), st.sampled_from(ENV_NAMES), ENV_VALUES
)


def run_outcome(done: subprocess.CompletedProcess[str] | None, seconds: float) -> str:
    if done is None:
        return "hang"
    code, err = done.returncode, done.stderr
    if code == 1 and "Fatal Python error: init_" in err:  # PYTHONIOENCODING=nosuchcodec, say
        return "python refused to start"  # before any of kvtui's code: `python -c pass` too
    if "Traceback" in err or "Traceback" in done.stdout:
        line = [ln for ln in err.splitlines() if ln.strip()][-1:] or ["?"]
        return f"traceback {line[0][:80]}"
    if code not in (0, 2):
        return f"exit {code}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if code == 2 and len(lines) != 1:
        return f"{len(lines)} stderr lines"
    return f"exit {code}"


def run_kvtui(argv: list[str], env: dict[str, str], seconds: float = 90) -> str:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvtui", *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=seconds,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "hang"
    return run_outcome(done, seconds)


def try_environment(value: tuple[str, str, str], read_output: Any = None) -> str:
    """A kvtui command in a process whose environment sets one variable to a hostile value:
    exit 0, or one line and exit 2 (library warnings on stderr are allowed on exit 0)."""
    command, name, text = value
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "HYPOTHESIS"))}
    env[name] = text
    return run_kvtui(ENV_COMMANDS[command], env)


# --- standard streams ---------------------------------------------------------------------------

STREAM_REDIRECTS = ["<&-", ">&-", "2>&-", "<&- >&- 2>&-", ">/dev/full", "2>/dev/full", "</dev/zero"]
STREAM_COMMANDS = {
    "bench": "bench --engine sim:gpt2@t4 --tokens 2 --json",
    "bad option": "bench --tokens nope",
    "help": "--help",
    "version": "--version",
    "app": "--engine sim:gpt2@t4",
    "models": "models --json",
    "record": "bench --engine sim:gpt2@t4 --tokens 2 --record {dir}/r.jsonl --force",
}
streams = st.tuples(st.sampled_from(sorted(STREAM_COMMANDS)), st.sampled_from(STREAM_REDIRECTS))


def try_streams(directory: Path, value: tuple[str, str], read_output: Any = None) -> str:
    command, redirects = value
    line = f"{sys.executable} -m kvtui {STREAM_COMMANDS[command].format(dir=directory)}"
    try:
        done = subprocess.run(
            ["bash", "-c", f"{line} {redirects}"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "hang"
    if done.returncode == 0 and ">" not in redirects.replace("2>", "") and command == "bench":
        try:
            json.loads(done.stdout)
        except ValueError:
            return "exit 0 without its output"
    result = run_outcome(done, 60)
    if result == "0 stderr lines" and "2>" in redirects:
        return "exit 2"  # the one line went where stderr was sent: nowhere
    return result


# --- kvtui serve: malformed HTTP and websocket traffic ------------------------------------------


class Served:
    """A `kvtui serve` on a free loopback port, its stderr kept (the presenter's terminal)."""

    def __init__(self, scratch: Path, *options: str) -> None:
        self.port = free_port()
        self.log = scratch / f"serve-{self.port}.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvtui", "serve", "--port", str(self.port), *options],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            time.sleep(0.1)
        raise RuntimeError("kvtui serve did not start")

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def raw_exchange(port: int, data: bytes, seconds: float = 10) -> bytes | None:
    """The server's answer to `data`: what it sent until it closed or fell quiet for half a
    second after answering; b"" if it closed without a word; None if it said nothing within
    `seconds` (a request it is still waiting the rest of: the caller decides)."""
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
        try:
            sock.sendall(data)
        except OSError:
            return b""
        answer = b""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if answer:
                    return answer
                continue
            except OSError:
                return answer
            if not chunk:
                return answer
            answer += chunk
        return answer or None


header_names = st.sampled_from(
    ["Host", "Origin", "Content-Length", "Transfer-Encoding", "Upgrade", "Connection", "X"]
)
header_values = st.one_of(
    st.sampled_from(
        [
            "",
            "127.0.0.1",
            "localhost:1",
            "evil.example",
            "chunked",
            "websocket",
            "-1",
            "99999999999999999999",
            "http://evil.example",
            "a" * 9000,
        ]
    ),
    st.binary(max_size=20).map(lambda b: b.decode("latin-1")),
)
http_requests = st.builds(
    lambda method, target, version, headers, body, raw: (
        raw
        if raw is not None
        else (
            f"{method} {target} {version}\r\n".encode("latin-1", "replace")
            + b"".join(f"{k}: {v}\r\n".encode("latin-1", "replace") for k, v in headers)
            + b"\r\n"
            + body
        )
    ),
    st.sampled_from(["GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "BREW", "", "G\x00T"]),
    st.sampled_from(
        [
            "/",
            "/ws",
            "/static/",
            "/static/js",
            "/static/../../etc/passwd",
            "/static/%2e%2e/x",
            "/download/x",
            "*",
            "http://evil/",
            "/" + "a" * 9000,
            "/?fontsize=9999999999999",
        ]
    ),
    st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/9", "", "HTTP/1.1 x"]),
    st.lists(st.tuples(header_names, header_values), max_size=6).map(
        lambda hs: [("Host", "127.0.0.1"), *hs] if len(hs) % 2 else hs
    ),
    st.binary(max_size=40),
    st.none() | st.none() | st.binary(min_size=1, max_size=200),
)


def try_http(served: Served, data: bytes, read_output: Any = None) -> str:
    """One raw request: answered (or closed) within 10 s, at most one line on the server's
    terminal, never a traceback, never a 200 with a directory listing or for a Host that is not
    the loopback's."""
    before = len(served.lines())
    answer = raw_exchange(served.port, data, seconds=3)
    if answer is None:  # it waits for the rest of the request: fine, if it still serves others
        index = raw_exchange(served.port, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        return "waits for the rest" if index else "hang"
    time.sleep(0.02)
    said = served.lines()[before:]
    if any("Traceback" in line for line in said):
        return "traceback in the server's log"
    if len(said) > 1:
        return f"{len(said)} log lines"
    if not served.alive():
        return "server died"
    status = answer.split(b"\r\n", 1)[0]
    if b" 200 " in status + b" ":
        head = data.split(b"\r\n\r\n", 1)[0].lower()
        hosts = [
            h.split(b":", 1)[1].strip() for h in head.split(b"\r\n")[1:] if h.startswith(b"host:")
        ]
        named = [h.split(b":")[0] for h in hosts]
        if not hosts or any(h not in (b"127.0.0.1", b"localhost") for h in named):
            return "security: answered a foreign or empty Host"
        if b"Index of" in answer:
            return "security: a directory listing"
    return "answered" if status else "closed"


websocket_messages = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "not json",
                '["stdin"]',
                '["stdin", 5]',
                '["stdin", "\\ud800"]',
                '["resize", {}]',
                '["resize", {"width": -1, "height": 10}]',
                '["resize", {"width": 100000, "height": 100000}]',
                '["ping"]',
                '["focus"]',
                "[]",
                "{}",
                "null",
                '["stdin", "q"]',
                '["stdin", "\\u001b[<0;1;1M"]',
            ]
        ),
        st.binary(max_size=30),
        st.text(max_size=30),
    ),
    min_size=1,
    max_size=4,
)


async def _websocket(port: int, messages: list[Any]) -> str:
    import aiohttp

    url = f"http://127.0.0.1:{port}/ws"
    async with aiohttp.ClientSession() as session, session.ws_connect(url, timeout=10) as ws:
        for message in messages:
            if ws.closed:
                break
            if isinstance(message, bytes):
                await ws.send_bytes(message)
            else:
                await ws.send_str(message)
        with contextlib.suppress(asyncio.TimeoutError):
            await ws.receive(timeout=1.0)
        return "closed by the server" if ws.closed else "open"


def try_websocket(served: Served, messages: list[Any], read_output: Any = None) -> str:
    """A session sent these messages: at most one log line, never a traceback, and the server
    still serving (its page answers) once the session has ended."""
    before = len(served.lines())
    try:
        asyncio.run(asyncio.wait_for(_websocket(served.port, messages), 30))
    except (asyncio.TimeoutError, TimeoutError):
        return "hang"
    except Exception as exc:  # noqa: BLE001 - a refused handshake is an outcome, not a failure
        return f"refused ({type(exc).__name__})"
    said = served.lines()[before:]
    if any("Traceback" in line for line in said):
        return "traceback in the server's log"
    if len(said) > 1:
        return f"{len(said)} log lines"
    answer = raw_exchange(served.port, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    if not answer or not served.alive():
        return "server stopped serving"
    return "session ended" if said else "session ran"
