"""No traceback, hang or runaway memory on any input: one line on stderr and exit 2 instead.

Hand-picked hostile inputs first (replay records, config.json files, command-line numbers),
each refused in one line by `kvtui bench` and by the app's check before it opens; then a few
Hypothesis examples of each kind of input. `benchmarks/fuzz_inputs.py` runs the same strategies
with many more examples and prints the outcomes by category.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtui.engines.replay as replay_module
import kvtui.sim.hf_config as hf_config_module
from kvtui.cli import main
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunSettings, to_json
from kvtui.engines.replay import FORMAT, VERSION

SIM = RunSettings(engine="sim:gpt2@t4", tokens=3, replay_speed=0)


def refused(capsys, *argv: str) -> str:
    """The stderr of `kvtui ARGV`, asserting it was refused: exit 2, no output, one line, no
    traceback and no control character (the line may quote a hostile file)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    assert not any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in err[:-1]), err
    return err


def app_refuses(capsys, monkeypatch, *argv: str) -> str:
    """As `refused`, for the app: the check before it opens, with the app itself never run."""
    import kvtui.app

    opened = []
    monkeypatch.setattr(kvtui.app, "run_app", lambda *a, **k: opened.append(a) or 0)
    err = refused(capsys, *argv)
    assert not opened
    return err


# --- replay records ------------------------------------------------------------------------------


def record_lines(settings: RunSettings = SIM) -> list[dict]:
    """A good record, as the JSON objects of its lines: header, started, steps, finished."""
    header = {"kind": "header", "format": FORMAT, "version": VERSION}
    header["settings"] = settings.to_json()
    return [header] + [to_json(e) for e in run_events(open_engine(settings), settings)]


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def _set(index: int, **fields: Any):
    def change(lines: list[dict]) -> list[Any]:
        lines[index] = {**lines[index], **fields}
        return lines

    return change


def _drop(index: int, name: str):
    def change(lines: list[dict]) -> list[Any]:
        lines[index] = {k: v for k, v in lines[index].items() if k != name}
        return lines

    return change


def _swap_first_steps(lines: list[dict]) -> list[dict]:
    """The cached loop's steps 0 and 1 swapped."""
    i, j = [n for n, line in enumerate(lines) if line.get("loop") == "cached"][:2]
    lines[i], lines[j] = lines[j], lines[i]
    return lines


RECORDS = {
    "a list for a header": (lambda lines: [[1, 2]] + lines[1:], "not a kvtui record"),
    "null for an event": (lambda lines: lines[:1] + [None] + lines[1:], "not a kvtui event"),
    "a number for an event": (lambda lines: lines[:1] + [3] + lines[1:], "not a kvtui event"),
    "settings a list": (_set(0, settings=[1]), "expected a JSON object"),
    "settings of the wrong type": (_set(0, settings={"tokens": "many"}), "tokens is 'many'"),
    "a version of 5,000 digits": (_set(0, version=int("9" * 4000)), "version"),
    "layers a string": (_set(1, layers="32"), "layers is '32', not an integer"),
    "a start that does not say how it was timed": (
        _drop(1, "timing"),
        "malformed started event: RunStarted.__init__() missing 1 required positional argument: "
        "'timing'",
    ),
    "a token id past 64 bits": (_set(2, token_id=10**30), "token_id is"),
    "a negative step time": (_set(2, step_seconds=-1.0), "step_seconds is negative"),
    "a step of a day": (_set(2, step_seconds=86_400.0), "a step of 86,400 s"),
    "text a number": (_set(2, text=7), "text is 7, not a string"),
    "a loop kvtui does not know": (_set(2, loop="sideways"), "loop is 'sideways'"),
    "steps out of order": (lambda lines: _swap_first_steps(lines), "out of order"),
    "a position that does not follow": (_set(2, position=10**6), "at position 1,000,000"),
    "two runs": (lambda lines: lines[:2] + [lines[1]] + lines[2:], "a second 'started'"),
    "a step before the start": (lambda lines: [lines[0]] + lines[2:], "before the run's"),
    "a failed run": (
        lambda lines: lines[:2] + [{"kind": "failed", "message": "boom"}],
        "the recorded run failed: boom",
    ),
    "a loop that finished twice": (lambda lines: lines + [lines[-1]], "after the cached loop"),
    "a finish that miscounts": (_set(-1, steps=99), "finished after 99 steps, not"),
    "capabilities a string": (_set(1, can="yes"), "can is 'yes', not an object or null"),
    "a capability a number": (
        lambda lines: _set(1, can={**lines[1]["can"], "torch": 1})(lines),
        "started event: can: torch is 1, not true or false",
    ),
    "capabilities that leave one out": (
        _set(1, can={"torch": False}),
        "started event: can: own_cache is missing",
    ),
    "a sliding window of nothing": (_set(1, sliding_window=0), "a sliding window of 0 positions"),
    "a sliding layer past the model's": (_set(1, sliding_layers=[99]), "are not all among its"),
    "a batch of none": (_set(1, batch=0), "batch must be from 1 to 256, not 0"),
    "blocks of no tokens": (_set(1, kv_block_tokens=0), "kv_block_tokens is 0"),
    "more positions than exist": (_set(2, positions_computed=2**62), "more than its batch"),
    "an empty run": (lambda lines: lines[:2], "empty run"),
    "no run": (lambda lines: lines[:1], "no run"),
}


@pytest.mark.parametrize("case", list(RECORDS))
def test_a_bad_record_is_one_line(tmp_path, capsys, monkeypatch, case):
    change, says = RECORDS[case]
    path = write_lines(tmp_path / "run.jsonl", change(record_lines()))
    assert says in refused(capsys, "bench", "--engine", f"replay:{path}", "--replay-speed", "0")
    assert says in app_refuses(capsys, monkeypatch, "--engine", f"replay:{path}")


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"kind": "step", "step_seconds": NaN}', "NaN is not a JSON number"),
        ('{"kind": "step", "step_seconds": 1e400}', "too large for a float"),
        ("[" * 100_000, "nested too deeply"),
        ('{"kind": "step", "token_id": ' + "9" * 5000 + "}", "corrupt record"),
    ],
    ids=["NaN", "1e400", "deep", "5000 digits"],
)
def test_json_python_takes_but_json_does_not(tmp_path, capsys, line, says):
    path = tmp_path / "run.jsonl"
    lines = record_lines()
    path.write_text(json.dumps(lines[0]) + "\n" + json.dumps(lines[1]) + "\n" + line + "\n")
    assert says in refused(capsys, "bench", "--engine", f"replay:{path}")


def test_records_that_are_not_regular_files_never_block(tmp_path, capsys):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # nothing ever writes it: reading would block for ever
    for path, says in [
        (fifo, "a FIFO, not a regular file"),
        (Path("/dev/zero"), "a device, not a regular file"),
        (Path("/dev/urandom"), "a device, not a regular file"),
        (tmp_path, "a directory, not a regular file"),
    ]:
        assert says in refused(capsys, "bench", "--engine", f"replay:{path}")


def test_records_past_the_caps(tmp_path, capsys, monkeypatch):
    path = write_lines(tmp_path / "run.jsonl", record_lines())
    monkeypatch.setattr(replay_module, "MAX_LINE_BYTES", 200)
    assert "longer than" in refused(capsys, "bench", "--engine", f"replay:{path}")
    monkeypatch.setattr(replay_module, "MAX_RECORD_BYTES", 1000)
    assert "larger than" in refused(capsys, "bench", "--engine", f"replay:{path}")
    path.write_bytes(b'{"kind": "header", "format": "kvtui-record", \xff\xfe}\n')
    assert "not UTF-8" in refused(capsys, "bench", "--engine", f"replay:{path}")


# --- config.json ---------------------------------------------------------------------------------

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
MOE = {**LLAMA, "num_local_experts": 8, "num_experts_per_tok": 2}
MLA = {**LLAMA, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}

CONFIGS = {
    "layers a string": ({**LLAMA, "num_hidden_layers": "32"}, "must be a positive integer"),
    "layers a list": ({**LLAMA, "num_hidden_layers": [32]}, "num_hidden_layers"),
    "layers true": ({**LLAMA, "num_hidden_layers": True}, "num_hidden_layers"),
    "layers a float": ({**LLAMA, "num_hidden_layers": 32.0}, "num_hidden_layers"),
    "a billion layers": ({**LLAMA, "num_hidden_layers": 10**9}, "up to 1,024"),
    "a context of 10^30": ({**LLAMA, "max_position_embeddings": 10**30}, "up to 16,777,216"),
    "a width of 2^40": ({**LLAMA, "hidden_size": 2**40}, "hidden_size"),
    "heads null": ({**LLAMA, "num_attention_heads": None}, "missing num_attention_heads"),
    "negative experts": ({**LLAMA, "num_local_experts": -3}, "num_local_experts"),
    "experts per token a string": ({**MOE, "num_experts_per_tok": "2"}, "num_experts_per_tok"),
    "more experts per token than experts": ({**MOE, "num_experts_per_tok": 9}, "up to 8"),
    "expert size a list": ({**MOE, "moe_intermediate_size": [1]}, "moe_intermediate_size"),
    "dense layers past the last": ({**MOE, "first_k_dense_replace": 99}, "up to 32"),
    "MLA rank a string": ({**MLA, "kv_lora_rank": "512"}, "kv_lora_rank"),
    "MLA rope negative": ({**MLA, "qk_rope_head_dim": -1}, "qk_rope_head_dim"),
    "MLA q rank a float": ({**MLA, "q_lora_rank": 1.5}, "q_lora_rank"),
    "a window as text": ({**LLAMA, "sliding_window": "4096"}, "sliding_window"),
    "use_sliding_window as text": ({**LLAMA, "use_sliding_window": "yes"}, "true or false"),
    "layer types of numbers": ({**LLAMA, "layer_types": [1] * 32}, "layer_types"),
    "layer types too few": ({**LLAMA, "layer_types": ["full_attention"]}, "layer_types"),
    "max_window_layers past the last": (
        {**LLAMA, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 99},
        "max_window_layers",
    ),
    "text_config a string": ({**LLAMA, "text_config": "llama"}, "text_config must be an object"),
    "text_config a list": ({"text_config": [LLAMA]}, "text_config must be an object"),
    "tie_word_embeddings as text": ({**LLAMA, "tie_word_embeddings": "false"}, "true or false"),
    "parameters past 2^50": ({**LLAMA, "num_parameters": 10**30}, "num_parameters"),
    "parameters as text": ({**LLAMA, "num_parameters": "8B"}, "num_parameters"),
    "quantization as text": ({**LLAMA, "quantization_config": "fp8"}, "quantization_config"),
    "quantized bits as text": ({**LLAMA, "quantization_config": {"bits": "4"}}, "bits"),
    "a dtype that is an object": ({**LLAMA, "torch_dtype": {"a": 1}}, "not a dtype"),
    "a list": ([LLAMA], "not a model config"),
    "null": (None, "not a model config"),
    "a number": (3, "not a model config"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_bad_config_is_one_line(tmp_path, capsys, case):
    config, says = CONFIGS[case]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    err = refused(capsys, "budget", "--config", str(path), "--gpu", "h100", "--context", "1000")
    assert says in err


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"a": ' * 100_000, "nested too deeply"),
        ('{"num_hidden_layers": NaN}', "NaN is not a JSON number"),
        ('{"num_hidden_layers": Infinity}', "Infinity is not a JSON number"),
        ('{"hidden_size": 1e999}', "too large for a float"),
    ],
    ids=["deep", "NaN", "Infinity", "1e999"],
)
def test_config_text_python_takes_but_json_does_not(tmp_path, capsys, text, says):
    path = tmp_path / "config.json"
    path.write_text(text)
    err = refused(capsys, "budget", "--config", str(path), "--gpu", "h100", "--context", "10")
    assert says in err


def test_configs_that_are_not_regular_files_or_too_big(tmp_path, capsys, monkeypatch):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    args = ("--gpu", "h100", "--context", "10")
    assert "a FIFO" in refused(capsys, "budget", "--config", str(fifo), *args)
    assert "a device" in refused(capsys, "budget", "--config", "/dev/zero", *args)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({**LLAMA, "padding": "x" * 2000}))
    monkeypatch.setattr(hf_config_module, "CONFIG_LIMIT", 1000)
    assert "larger than" in refused(capsys, "budget", "--config", str(big), *args)


def test_a_huge_but_allowed_config_is_answered_at_once(tmp_path, capsys):
    """The bounds themselves: 1,024 layers, every size 2^24, a 2^24 context at batch 65,536."""
    path = tmp_path / "config.json"
    biggest = {
        **LLAMA,
        "num_hidden_layers": 1024,
        "hidden_size": 2**24,
        "num_attention_heads": 2**24,
        "num_key_value_heads": 2**24,
        "intermediate_size": 2**24,
        "vocab_size": 2**24,
        "max_position_embeddings": 2**24,
        "sliding_window": 2**23,
    }
    path.write_text(json.dumps(biggest))
    code = main(
        ["budget", "--config", str(path), "--gpu", "b200", "--context", str(2**24)]
        + ["--batch", "65536", "--json"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["status"] == "overflow"


# --- command-line numbers ------------------------------------------------------------------------

RUN = ("bench", "--engine", "sim:gpt2@t4", "--replay-speed", "0")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ((*RUN, "--tokens", "9" * 5000), "expected a positive integer up to 262,144"),
        ((*RUN, "--tokens", "1e3"), "--tokens"),
        ((*RUN, "--tokens", "262145"), "--tokens"),
        ((*RUN, "--seed", "-1"), "--seed"),
        ((*RUN, "--seed", str(2**64)), "--seed"),
        ((*RUN, "--temperature", "inf"), "--temperature"),
        ((*RUN, "--temperature", "nan"), "--temperature"),
        ((*RUN, "--temperature", "1e-300"), "--temperature"),
        ((*RUN, "--top-k", "0"), "--top-k"),
        ((*RUN, "--top-k", str(2**40)), "--top-k"),
        ((*RUN, "--threads", "100000"), "--threads"),
        ((*RUN, "--replay-speed", "-1"), "--replay-speed"),
        ((*RUN, "--replay-speed", "nan"), "--replay-speed"),
        ((*RUN, "--replay-speed", "1e-300"), "--replay-speed"),
        ((*RUN, "--tokens", "5000"), "past gpt2's 1,024; ask for at most 980 tokens"),
        ((*RUN, "--kv-budget", "1GB"), "units B, KiB, MiB, GiB"),
        ((*RUN, "--kv-budget", "-1MiB"), "--kv-budget"),
        ((*RUN, "--kv-budget", "2048TiB"), "from 1 B to 1 PiB"),
        ((*RUN, "--kv-budget", "9" * 5000), "--kv-budget"),
        ((*RUN, "--kv-budget", "100GiB"), "is more than the"),
        ((*RUN, "--kv-block", "0"), "--kv-block"),
        ((*RUN, "--kv-block", "65537"), "--kv-block"),
        ((*RUN, "--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization"),
        ((*RUN, "--gpu-memory-utilization", "nan"), "--gpu-memory-utilization"),
        (("bench", "--engine", "replay:x.jsonl", "--kv-budget", "1MiB"), "not to replay:"),
        (("work", "--length", str(10**30)), "--length"),
        (("work", "--length", "4", "--prompt", "nan"), "--prompt"),
        (("budget", "--model", "gpt2", "--gpu", "h100", "--context", "1e400"), "--context"),
        (("budget", "--model", "gpt2", "--gpu", "h100", "--context", "9", "--batch", "1e6"), ""),
        (("--tokens", str(2**70)), "--tokens"),
        (("--engine", "sim:llama-3.1-8b@h100", "--tokens", "200000"), "past llama-3.1-8b's"),
    ],
)
def test_numbers_at_the_edges(capsys, monkeypatch, argv, says):
    if argv[0] == "bench" or argv[0] in ("work", "budget"):
        assert says in refused(capsys, *argv)
    else:
        assert says in app_refuses(capsys, monkeypatch, *argv)


def test_too_many_tokens_for_the_tiny_model_is_refused_before_it_loads(capsys, monkeypatch):
    pytest.importorskip("torch")
    import kvtui.engines.torch_engine

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    from kvtui.engines import factory as spec
    from kvtui.gpu.model import ModelArgs

    # The torch-free check falls back on the engine's default where the file is missing.
    assert ModelArgs().max_positions == spec.TINY_POSITIONS
    monkeypatch.setattr(kvtui.engines.torch_engine, "open_torch_engine", load)
    err = refused(capsys, "bench", "--tokens", "5000")
    assert "5,044 positions, past tiny-austen's 4,096; ask for at most 4,052 tokens" in err
    assert "past tiny-austen's" in app_refuses(capsys, monkeypatch, "--tokens", "5000")


def test_cuda_where_there_is_none_is_refused_before_the_app_opens(capsys, monkeypatch):
    import kvtui.gpu.probe

    cuda_visible = kvtui.gpu.probe.cuda_visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hides every GPU, from torch too
    assert cuda_visible() is False
    monkeypatch.setattr(kvtui.gpu.probe, "cuda_visible", lambda: False)
    assert "shows no CUDA device" in app_refuses(capsys, monkeypatch, "--device", "cuda")
    assert "shows no CUDA device" in refused(capsys, "bench", "--device", "cuda")


# --- fuzzing: a few examples of each kind of input (benchmarks/fuzz_inputs.py runs many) ---------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children)
    ),
    max_leaves=6,
)
CONFIG_KEYS = sorted(
    {*LLAMA, *MOE, *MLA}
    | {"sliding_window", "use_sliding_window", "layer_types", "text_config", "head_dim"}
    | {"tie_word_embeddings", "num_parameters", "quantization_config", "n_layer", "n_embd"}
    | {"max_window_layers", "n_shared_experts", "first_k_dense_replace", "v_head_dim"}
)
configs = (
    st.fixed_dictionaries(
        {}, optional={key: json_values | st.integers(-5, 2**26) for key in CONFIG_KEYS}
    ).map(lambda extra: {**LLAMA, **extra})
    | json_values
)


@st.composite
def records(draw) -> bytes:
    """A good record, then one or two edits: a field set to any JSON value, a line dropped,
    repeated or swapped, or the bytes cut short."""
    lines: list[Any] = [dict(line) for line in RECORD_TEMPLATE]
    for _ in range(draw(st.integers(1, 2))):
        where = draw(st.integers(0, len(lines) - 1))
        edit = draw(st.sampled_from(["field", "drop", "repeat", "swap", "replace"]))
        if edit == "field" and isinstance(lines[where], dict):
            key = draw(st.sampled_from(sorted(lines[where]) + ["kind", "steps", "step_seconds"]))
            lines[where] = {**lines[where], key: draw(json_values)}
        elif edit == "drop":
            del lines[where]
        elif edit == "repeat":
            lines.insert(where, lines[where])
        elif edit == "swap":
            other = draw(st.integers(0, len(lines) - 1))
            lines[where], lines[other] = lines[other], lines[where]
        else:
            lines[where] = draw(json_values)
        if not lines:
            break
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    cut = draw(st.none() | st.integers(0, len(data)))
    return data if cut is None else data[:cut]


RECORD_TEMPLATE = record_lines(replace(SIM, tokens=2))

NUMBER_OPTIONS = {
    "--tokens": RUN,
    "--seed": RUN,
    "--temperature": RUN,
    "--top-k": RUN,
    "--threads": RUN,
    "--replay-speed": (*RUN[:3], "--tokens", "2"),
    "--length": ("work",),
    "--prompt": ("work", "--length", "4"),
    "--context": ("budget", "--model", "gpt2", "--gpu", "h100"),
    "--batch": ("budget", "--model", "gpt2", "--gpu", "h100", "--context", "9"),
    "--kv-budget": (*RUN[:3], "--tokens", "2"),
    "--kv-block": (*RUN[:3], "--tokens", "2"),
    "--gpu-memory-utilization": (*RUN[:3], "--tokens", "2"),
}
number_texts = st.one_of(
    st.integers(-(2**80), 2**80).map(str),
    st.floats().map(str),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "0", "-0", "1_000", "1,000", "0x10", " 7 "]),
    st.text(max_size=12),
)
cli_values = st.tuples(st.sampled_from(sorted(NUMBER_OPTIONS)), number_texts)


@st.composite
def safetensors_files(draw) -> bytes:
    """A safetensors file with a header of any length claim, any JSON, any offsets."""
    header = draw(
        st.dictionaries(
            st.text(max_size=4),
            st.fixed_dictionaries(
                {
                    "dtype": st.sampled_from(["F32", "F16", "BF16", "I8", "F4", "X"]) | json_values,
                    "shape": st.lists(st.integers(-2, 2**40), max_size=3) | json_values,
                    "data_offsets": st.lists(st.integers(-2, 2**40), max_size=3) | json_values,
                }
            )
            | json_values,
            max_size=3,
        )
        | json_values
    )
    raw = json.dumps(header).encode()
    claim = draw(st.none() | st.integers(0, 2**64 - 1))
    length = len(raw) if claim is None else claim
    data = bytes(draw(st.integers(0, 64)))
    return length.to_bytes(8, "little") + raw + data


class Hang(BaseException):
    """Raised by the alarm when one input takes longer than its bound."""


@contextlib.contextmanager
def time_bound(seconds: float):
    def ring(signum, frame):
        raise Hang

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def outcome(run: Any, read_output: Any, seconds: float = 10.0) -> str:
    """What one input did: "exit 0", "exit 2", or what went wrong ("traceback ...", "hang",
    "exit N", "N stderr lines")."""
    try:
        with time_bound(seconds):
            code = run()
    except Hang:
        read_output()
        return "hang"
    except BaseException as exc:  # noqa: BLE001 - the point is to see everything
        read_output()
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return f"traceback {type(exc).__name__} at {Path(where.filename).name}:{where.lineno}"
    out, err = read_output()
    if code not in (0, 2):
        return f"exit {code}"
    if code == 2 and err.count("\n") != 1:
        return f"{err.count(chr(10))} stderr lines"
    if "Traceback" in err:
        return "traceback in stderr"
    return f"exit {code}"


def try_config(directory: Path, config: Any, read_output: Any) -> str:
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    argv = ["budget", "--config", str(path), "--gpu", "h100", "--context", "1000", "--json"]
    return outcome(lambda: main(argv), read_output)


def try_record(directory: Path, data: bytes, read_output: Any) -> str:
    path = directory / "run.jsonl"
    path.write_bytes(data)
    argv = ["bench", "--engine", f"replay:{path}", "--replay-speed", "0", "--json"]
    return outcome(lambda: main(argv), read_output)


def try_cli(option: str, value: str, read_output: Any) -> str:
    argv = [*NUMBER_OPTIONS[option], f"{option}={value}"]
    return outcome(lambda: main(argv), read_output)


def try_weights(directory: Path, data: bytes, read_output: Any) -> str:
    """A model folder with this model.safetensors: refused in one line or passed, nothing
    else (through the app's torch-free check of the folder)."""
    (directory / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": 4096}))
    (directory / "model.safetensors").write_bytes(data)
    argv = ["--model", str(directory), "--device", "cpu", "--tokens", "4"]
    import kvtui.app

    real, kvtui.app.run_app = kvtui.app.run_app, lambda *a, **k: 0
    try:
        return outcome(lambda: main(argv), read_output)
    finally:
        kvtui.app.run_app = real


FUZZ = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(config=configs)
def test_fuzz_configs(tmp_path, capsys, config):
    assert try_config(tmp_path, config, capsys.readouterr) in ("exit 0", "exit 2")


@FUZZ
@given(data=records())
def test_fuzz_records(tmp_path, capsys, data):
    assert try_record(tmp_path, data, capsys.readouterr) in ("exit 0", "exit 2")


@FUZZ
@given(option_value=cli_values)
def test_fuzz_command_line_numbers(capsys, option_value):
    assert try_cli(*option_value, capsys.readouterr) in ("exit 0", "exit 2")


@FUZZ
@given(data=safetensors_files())
def test_fuzz_safetensors_headers(tmp_path, capsys, data):
    assert try_weights(tmp_path, data, capsys.readouterr) in ("exit 0", "exit 2")


# --- the readers themselves ----------------------------------------------------------------------


def test_safe_text_escapes_what_a_terminal_would_obey():
    from kvtui.format import safe_text

    assert (
        safe_text("a\x1b]0;t\x07b\x9b1m\x7f\udcff\tc\nd")
        == "a\\x1b]0;t\\x07b\\x9b1m\\x7f\\udcff\tc\nd"
    )
    assert safe_text("tab\there\nnext", one_line=True) == "tab\\x09here\\x0anext"
    assert safe_text("Café — 日本") == "Café — 日本"


def test_argv_text_turns_undecodable_bytes_into_replacement_characters():
    from kvtui.inputs import argv_text

    assert argv_text(os.fsdecode(b"caf\xc3\xa9 \xff")) == "café \ufffd"
    assert argv_text("lone \ud800 surrogate") == "lone \ufffd surrogate"


def _safetensors() -> bytes:
    raw = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    return len(raw).to_bytes(8, "little") + raw + bytes(8)


def test_a_hub_cache_snapshot_may_link_into_its_own_blobs_only(tmp_path):
    from kvtui.inputs import InputError, model_weights

    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "9f8e").write_bytes(_safetensors())
    (snapshot / "model.safetensors").symlink_to("../../blobs/9f8e")  # as huggingface_hub links
    assert model_weights(snapshot) == [snapshot.resolve() / "model.safetensors"]
    (tmp_path / "other.safetensors").write_bytes(_safetensors())
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(tmp_path / "other.safetensors")
    with pytest.raises(InputError, match="outside the model folder"):
        model_weights(snapshot)


# --- numbers JSON does not have: never written ---------------------------------------------------


def test_a_record_never_holds_a_number_json_does_not(tmp_path, capsys, monkeypatch):
    """An engine that measured NaN: the record is refused in one line, never written with NaN
    (which kvtui itself, and every strict JSON reader, would then refuse to read)."""
    import math

    import kvtui.reports.bench as bench

    def nan_steps(settings):
        engine = open_engine(settings)
        steps = engine.steps

        def patched(loop):
            for event in steps(loop):
                yield replace(event, step_seconds=math.nan) if event.kind == "step" else event

        engine.steps = patched
        return engine

    monkeypatch.setattr(bench, "open_engine", nan_steps)
    path = tmp_path / "nan.jsonl"
    err = refused(capsys, *RUN, "--tokens", "2", "--json", "--record", str(path))
    assert "not a finite number" in err
    assert not path.exists() and list(tmp_path.iterdir()) == []


# --- paths ---------------------------------------------------------------------------------------

LONG_NAME = "r" * 300 + ".jsonl"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ((*RUN, "--tokens", "2", "--record", LONG_NAME), "at most 255"),
        ((*RUN, "--tokens", "2", "--record", "x" * 5000), "at most 255"),
        ((*RUN, "--tokens", "2", "--record", "run.jsonl/"), "a directory"),
        ((*RUN, "--tokens", "2", "--record", "."), "a directory"),
        (("bench", "--engine", "replay:~nosuchuser/x.jsonl"), "no user 'nosuchuser'"),
        (("bench", "--model", "~nosuchuser/model"), "no user 'nosuchuser'"),
        (("bench", "--engine", f"replay:{LONG_NAME}"), "at most 255"),
        (("bench", "--model", "m" * 300), "at most 255"),
        (("bench", "--engine", "replay:" + "d/" * 3000 + "x"), "at most 4,095"),
    ],
    ids=[
        "record 300",
        "record 5000",
        "record slash",
        "record dot",
        "replay nosuchuser",
        "model nosuchuser",
        "replay 300",
        "model 300",
        "replay path 6000",
    ],
)
def test_a_path_kvtui_cannot_use_is_one_line(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)
    assert says in refused(capsys, *argv)
    assert list(tmp_path.iterdir()) == []  # nothing written, under any name
    if argv[0] == "bench" and "--record" not in argv:
        assert says in app_refuses(capsys, monkeypatch, *argv[1:])
