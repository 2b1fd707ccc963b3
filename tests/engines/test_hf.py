"""`--model DIR`: a local Hugging Face model through the engine protocol (needs the hf extra).

Small Llama and GPT-2 models are built from configs with random weights, beside a byte-level BPE
tokenizer trained on a few sentences, and saved (safetensors) to a temporary directory; nothing is
downloaded. Then `kvtui bench --model DIR` must agree with transformers' own greedy `generate`.
"""

from __future__ import annotations

import json
import sys

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")

from kvtui.cli import main  # noqa: E402
from kvtui.engines.hf import NO_EXTRA, TextStream  # noqa: E402

SENTENCES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "must be in want of a wife.",
    "However little known the feelings or views of such a man may be on his first entering a",
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families.",
    "Caf\u00e9 na\u00efve \u2014 \u00e9t\u00e9 \u2603 \u65e5\u672c",
]
PROMPT = "It is a truth universally"
TOKENS = 16


def build_tokenizer():
    """A byte-level BPE of about 300 ids with <s> prepended, as Llama's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def build_model(kind: str, tokenizer):
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.2,
            **ids,
        )
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2, **ids
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def saved(request, tmp_path_factory):
    """(directory, model, tokenizer) of a small random model saved as safetensors."""
    tokenizer = build_tokenizer()
    model = build_model(request.param, tokenizer)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory, model, tokenizer


def bench(capsys, directory, *args):
    code = main(
        ["bench", "--model", str(directory), "--device", "cpu", "--tokens", str(TOKENS), "--json"]
        + list(args)
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def reference_greedy(model, tokenizer) -> list[int]:
    """transformers' own greedy decode of PROMPT, never stopping early at an end-of-text id."""
    inputs = tokenizer(PROMPT, return_tensors="pt")
    config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=TOKENS,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=config)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_bench_matches_transformers_generate(saved, capsys):
    directory, model, tokenizer = saved
    r = bench(capsys, directory, "--greedy", "--prompt", PROMPT)
    expected = reference_greedy(model, tokenizer)
    assert len(expected) == TOKENS
    assert r["identical"] is True and r["first_divergence"] is None
    assert r["token_ids"] == expected
    assert len(set(expected)) > 1  # a model stuck on one id would prove little
    assert r["prompt_tokens"] == len(tokenizer(PROMPT)["input_ids"])
    assert r["model"] == directory.name and r["device"] == "cpu" and r["dtype"] == "fp32"
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    full, shown = tokenizer.decode(prompt_ids + expected), tokenizer.decode(prompt_ids)
    held_back = full.removeprefix(shown + r["text"])  # only an incomplete last character
    assert r["text"] and full.startswith(shown + r["text"]) and set(held_back) <= {"\ufffd"}


def test_kv_bytes_measured_equal_the_formula(saved, capsys):
    directory, model, _ = saved
    r = bench(capsys, directory, "--greedy")
    assert r["kv_bytes_filled"] == r["kv_bytes_formula"]
    # 2 (K and V) x 2 layers x kv heads x head_dim 16 x 4 bytes (fp32)
    kv_heads = 2 if model.config.model_type == "llama" else 4
    assert r["kv_bytes_per_token"] == 2 * 2 * kv_heads * 16 * 4
    # transformers' StaticCache, sized for the whole run; no pool, so no budget
    assert r["kv_bytes_allocated"] == r["kv_bytes_per_token"] * (r["prompt_tokens"] + TOKENS)
    assert r["kv_capacity_bytes"] is None and r["kv_blocks_allocated"] is None
    assert r["weights_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    P = r["prompt_tokens"]
    assert r["work_ratio"] == pytest.approx(
        (TOKENS * P + TOKENS * (TOKENS - 1) // 2) / (P + TOKENS - 1)
    )


def test_seeded_sampling_is_the_same_cached_and_uncached(saved, capsys):
    directory, _, _ = saved
    first = bench(capsys, directory, "--seed", "3", "--temperature", "1.5")
    other = bench(capsys, directory, "--seed", "4", "--temperature", "1.5")
    assert first["identical"] is True and other["identical"] is True
    assert first["token_ids"] != other["token_ids"]  # really sampled: the seed matters


def test_budget_reads_the_same_config_as_the_engine(saved, capsys):
    directory, _, _ = saved
    measured = bench(capsys, directory, "--greedy")
    code = main(
        [
            "budget",
            "--config",
            str(directory / "config.json"),
            "--gpu",
            "h100",
            "--context",
            "1000",
            "--kv-dtype",
            "fp32",
            "--json",
        ]
    )
    budget = json.loads(capsys.readouterr().out)
    assert code == 0
    per_token = measured["kv_bytes_allocated"] // (measured["prompt_tokens"] + TOKENS)
    assert budget["kv_bytes_per_token"] == per_token


def test_steps_carry_the_engine_protocol_fields(saved):
    from kvtui.engines.drive import run_events
    from kvtui.engines.factory import open_engine
    from kvtui.engines.protocol import RunFinished, RunSettings, RunStarted, StepSample

    directory, _, _ = saved
    settings = RunSettings(engine=f"hf:{directory}", device="cpu", tokens=4, greedy=True)
    engine = open_engine(settings)
    try:
        events = list(run_events(engine, settings, schedule="sequential"))
    finally:
        engine.close()
    started = events[0]
    assert isinstance(started, RunStarted)
    # The saved model's config says float32: on the CPU it runs in it, and says why.
    assert (started.dtype, started.dtype_source) == ("fp32", "the weights' own")
    P = started.prompt_tokens
    steps = {
        loop: [e for e in events if isinstance(e, StepSample) and e.loop == loop]
        for loop in settings.loops
    }
    assert [s.positions_computed for s in steps["cached"]] == [P, 1, 1, 1]
    assert [s.positions_computed for s in steps["uncached"]] == [P, P + 1, P + 2, P + 3]
    assert [s.kv_bytes for s in steps["cached"]] == [
        started.kv_bytes_per_token * (P + i) for i in range(4)
    ]
    assert all(s.kv_bytes == 0 for s in steps["uncached"])
    assert all(s.step_seconds > 0 and s.flops > 0 and s.bytes_read > 0 for s in steps["cached"])
    finished = [e for e in events if isinstance(e, RunFinished)]
    assert {f.loop: f.reason for f in finished} == {"cached": "done", "uncached": "done"}


# --- text streaming ------------------------------------------------------------------------------


def test_text_stream_holds_back_half_a_character():
    tokenizer = build_tokenizer()
    # The byte-level symbols of U+2603's three UTF-8 bytes, each a token of its own.
    [(symbols, _)] = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("\u2603")
    byte_ids = tokenizer.convert_tokens_to_ids(list(symbols))
    assert len(byte_ids) == 3 and tokenizer.unk_token_id not in byte_ids
    stream = TextStream(tokenizer, tokenizer("It is")["input_ids"])
    assert [stream.push(i) for i in byte_ids] == ["", "", "\u2603"]
    assert stream.push(tokenizer.convert_tokens_to_ids("a")) == "a"


# --- bad input: one line, exit 2 -----------------------------------------------------------------


def bad(capsys, *argv) -> str:
    code = main(["bench", "--device", "cpu", "--tokens", "2", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    return err


def write_config(directory, **config):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def test_missing_directory(tmp_path, capsys):
    assert "does not exist" in bad(capsys, "--model", str(tmp_path / "nowhere"))


def test_directory_without_config(tmp_path, capsys):
    assert "no config.json" in bad(capsys, "--model", str(tmp_path))


@pytest.mark.parametrize(
    ("model_type", "words"),
    [("bert", "not a decoder-only causal language model"), ("no-such-model", "does not know it")],
)
def test_unsupported_architecture(tmp_path, capsys, model_type, words):
    directory = write_config(
        tmp_path / model_type,
        model_type=model_type,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=64,
        vocab_size=300,
        max_position_embeddings=128,
    )
    err = bad(capsys, "--model", str(directory))
    assert "unsupported architecture" in err and words in err


def test_remote_code_is_never_run(tmp_path, capsys):
    directory = write_config(
        tmp_path / "remote", model_type="my-own", auto_map={"AutoModelForCausalLM": "x.Y"}
    )
    assert "remote code" in bad(capsys, "--model", str(directory))


def test_directory_without_safetensors(saved, tmp_path, capsys):
    source, _, _ = saved
    directory = tmp_path / "no-weights"
    directory.mkdir()
    for f in source.iterdir():
        if not f.name.endswith(".safetensors"):
            (directory / f.name).write_bytes(f.read_bytes())
    assert "no safetensors weights" in bad(capsys, "--model", str(directory))


def test_weights_that_do_not_fit(saved, tmp_path, capsys):
    source, _, _ = saved
    config = json.loads((source / "config.json").read_text())
    config.update(num_parameters=10**15)  # a petaparameter model, as the config states it
    directory = tmp_path / "huge"
    directory.mkdir()
    for f in source.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    (directory / "config.json").write_text(json.dumps(config))
    err = bad(capsys, "--model", str(directory))
    assert "needs" in err and "available" in err


def test_without_transformers_says_how_to_install(saved, monkeypatch, capsys):
    directory, _, _ = saved
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    assert NO_EXTRA in bad(capsys, "--model", str(directory))


def test_a_cancelled_run_lets_go_of_its_cache(saved):
    import gc
    import weakref

    from kvtui.engines.factory import open_engine
    from kvtui.engines.protocol import RunSettings

    directory, _, _ = saved
    engine = open_engine(RunSettings(engine=f"hf:{directory}", device="cpu", tokens=8))
    steps = engine.steps("cached")
    next(steps), next(steps)
    cache = weakref.ref(engine._cache)
    steps.close()  # what run_events does when a run is stopped
    gc.collect()
    assert cache() is None
    engine.close()


# --- weights: exactly the folder's safetensors, checked, never a pickle --------------------------

TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 300,
    "max_position_embeddings": 256,
}


def safetensors_bytes(header: dict | None = None, data: bytes = bytes(8)) -> bytes:
    """A safetensors file: one F32 tensor of 2 elements unless `header` says otherwise."""
    import struct

    header = header or {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


class Touch:
    """Unpickling this creates a file: what a malicious pytorch_model.bin can do."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def armed_pickle(marker) -> bytes:
    import pickle

    data = pickle.dumps(Touch(marker))
    control = marker.with_name("control")
    pickle.loads(pickle.dumps(Touch(control)))  # the payload works: loading it creates a file
    assert control.exists()
    return data


def index(*files: str) -> str:
    return json.dumps({"metadata": {}, "weight_map": {f"t{i}": f for i, f in enumerate(files)}})


def _only_a_pickle(d, out, marker):
    (d / "pytorch_model.bin").write_bytes(armed_pickle(marker))
    return "no safetensors weights (found pytorch_model.bin)"


def _index_names_a_pickle(d, out, marker):
    (d / "pytorch_model.bin").write_bytes(armed_pickle(marker))
    (d / "stray.safetensors").write_bytes(b"")  # enough for the old glob check
    (d / "model.safetensors.index.json").write_text(index("pytorch_model.bin"))
    return "'pytorch_model.bin', not a .safetensors file"


def _index_climbs_out(d, out, marker):
    (out / "x.safetensors").write_bytes(safetensors_bytes())
    (d / "model.safetensors.index.json").write_text(index("../outside/x.safetensors"))
    return "outside the model folder"


def _index_absolute(d, out, marker):
    (out / "x.safetensors").write_bytes(safetensors_bytes())
    (d / "model.safetensors.index.json").write_text(index(str(out / "x.safetensors")))
    return "outside the model folder"


def _link_out_of_the_folder(d, out, marker):
    (out / "x.safetensors").write_bytes(safetensors_bytes())
    (d / "model.safetensors").symlink_to(out / "x.safetensors")
    return "a link to"


def _empty_safetensors(d, out, marker):
    (d / "model.safetensors").write_bytes(b"")
    return "not a safetensors file (0 bytes)"


def _header_longer_than_the_file(d, out, marker):
    (d / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    return "corrupt safetensors header (it claims 1,000,000,000,000 bytes"


def _offsets_past_the_end(d, out, marker):
    header = {"w": {"dtype": "F32", "shape": [2**20], "data_offsets": [0, 2**22]}}
    (d / "model.safetensors").write_bytes(safetensors_bytes(header))
    return "outside the file's 8 bytes of data"


def _header_not_json(d, out, marker):
    (d / "model.safetensors").write_bytes((4).to_bytes(8, "little") + b"{{{{" + bytes(8))
    return "corrupt safetensors header (line 1"


def _config_names_a_pickle(d, out, marker):
    (d / "adapter_model.bin").write_bytes(armed_pickle(marker))
    (d / "model.safetensors").write_bytes(safetensors_bytes())
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(
        json.dumps({**config, "transformers_weights": "adapter_model.bin"})
    )
    return "transformers_weights 'adapter_model.bin' is not a safetensors file"


def _peft_adapter(d, out, marker):
    (d / "model.safetensors").write_bytes(safetensors_bytes())
    (d / "adapter_config.json").write_text("{}")
    return "PEFT adapter"


def _tokenizer_is_a_fifo(d, out, marker):
    import os

    (d / "model.safetensors").write_bytes(safetensors_bytes())
    os.mkfifo(d / "tokenizer.json")  # transformers would block on it for ever
    return "tokenizer.json is a FIFO, not a regular file"


@pytest.mark.parametrize(
    "make",
    [
        _only_a_pickle,
        _index_names_a_pickle,
        _index_climbs_out,
        _index_absolute,
        _link_out_of_the_folder,
        _empty_safetensors,
        _header_longer_than_the_file,
        _offsets_past_the_end,
        _header_not_json,
        _config_names_a_pickle,
        _peft_adapter,
        _tokenizer_is_a_fifo,
    ],
)
def test_weights_kvtui_will_not_load(tmp_path, capsys, monkeypatch, make):
    """Refused in one line before transformers or torch.load sees the folder; no pickle runs."""
    folder, outside, marker = tmp_path / "model", tmp_path / "outside", tmp_path / "marker"
    outside.mkdir()
    write_config(folder, **TINY_LLAMA)
    says = make(folder, outside, marker)
    loads = []
    for owner, name in [
        (transformers.AutoModelForCausalLM, "from_pretrained"),
        (transformers.AutoTokenizer, "from_pretrained"),
        (torch, "load"),
    ]:
        monkeypatch.setattr(owner, name, lambda *a, _n=name, **k: loads.append(_n))
    assert says in bad(capsys, "--model", str(folder))
    assert loads == [] and not marker.exists()
    # ...and the app refuses it before it opens (kvtui.engines.factory.check_engine).
    from kvtui.engines.factory import check_engine
    from kvtui.engines.protocol import RunSettings
    from kvtui.errors import EngineError

    with pytest.raises(EngineError, match="safetensors|PEFT|FIFO|outside|link"):
        check_engine(RunSettings(engine=f"hf:{folder}", device="cpu", tokens=2))
    assert loads == [] and not marker.exists()


def test_sharded_weights_inside_the_folder_load(saved, tmp_path, capsys):
    """The index form: every shard named, inside the folder, checked; then it runs."""
    directory, model, tokenizer = saved
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    tokenizer.save_pretrained(sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").exists()
    expected = bench(capsys, directory, "--greedy")["token_ids"]
    assert bench(capsys, sharded, "--greedy")["token_ids"] == expected


def test_too_many_tokens_for_the_model_is_refused_before_loading(saved, capsys, monkeypatch):
    directory, _, _ = saved
    loads = []
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a)
    )
    code = main(["bench", "--model", str(directory), "--device", "cpu", "--tokens", "300"])
    err = capsys.readouterr().err
    assert code == 2 and "past" in err and "256" in err and err.count("\n") == 1
    assert loads == []
