"""A user's model that is not what it says, refused in one line (exit 2) rather than decoded:
weights that do not match the config (a wrong `model_type`, a tensor missing or left over), a
`sliding_window` of 0, a tokenizer whose ids pass the vocabulary; and a forward that fails
mid-run ends the run with one line naming the loop and the step, never a traceback."""

from __future__ import annotations

import functools
import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from safetensors.torch import load_file, save_file  # noqa: E402

from kvtui.cli import main  # noqa: E402
from tests.engines.test_hf import build_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A small random Llama, saved as safetensors with its tokenizer: loads and runs as is."""
    tokenizer = build_tokenizer()
    directory = tmp_path_factory.mktemp("llama")
    build_model("llama", tokenizer).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def copy(source, target, **config):
    """A copy of the model folder with these config.json fields changed (None: removed)."""
    shutil.copytree(source, target)
    data = json.loads((target / "config.json").read_text())
    for key, value in config.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (target / "config.json").write_text(json.dumps(data))
    return target


def edit_weights(directory, change):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def refused(capsys, directory, *args) -> str:
    """`kvtui bench --model DIR` refused: exit 2, nothing on stdout, one line on stderr."""
    code = main(["bench", "--model", str(directory), "--device", "cpu", "--tokens", "3", *args])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_weights_of_another_architecture(llama, tmp_path, capsys):
    """Llama's weights under a config that says GPT-2: every GPT-2 tensor would be random."""
    directory = copy(llama, tmp_path / "as-gpt2", model_type="gpt2", architectures=None)
    err = refused(capsys, directory)
    assert "missing" in err and "transformer.h.0" in err and "unexpected" in err


def test_a_model_type_one_tensor_kind_away(llama, tmp_path, capsys):
    """Qwen2 is Llama plus q/k/v biases: the biases would be random."""
    directory = copy(llama, tmp_path / "as-qwen2", model_type="qwen2", architectures=None)
    assert "self_attn.k_proj.bias" in refused(capsys, directory)


def test_a_missing_tensor(llama, tmp_path, capsys):
    directory = copy(llama, tmp_path / "missing")
    edit_weights(directory, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    err = refused(capsys, directory)
    assert "missing" in err and "model.layers.1.mlp.down_proj.weight" in err


def test_a_tensor_left_over(llama, tmp_path, capsys):
    directory = copy(llama, tmp_path / "extra")
    edit_weights(directory, lambda t: t.update({"model.extra.weight": torch.zeros(4)}))
    assert "unexpected" in refused(capsys, directory)


def test_a_sliding_window_of_nothing(llama, tmp_path, capsys):
    directory = copy(llama, tmp_path / "window", model_type="mistral", sliding_window=0)
    assert "sliding_window" in refused(capsys, directory)


def test_a_tokenizer_past_the_vocabulary(tmp_path, capsys):
    tokenizer = build_tokenizer()  # about 300 ids
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        vocab_size=40,
    )
    directory = tmp_path / "small-vocab"
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    capsys.readouterr()  # transformers' own progress bar
    err = refused(capsys, directory)
    assert "vocab_size" in err and "40" in err


def test_a_forward_that_fails_mid_run_is_one_line(llama, capsys, monkeypatch):
    """Whatever a model's forward raises on its third call, the run ends in one line."""
    calls = []
    forward = transformers.LlamaForCausalLM.forward

    @functools.wraps(forward)  # the same signature: kvtui reads which keywords it takes
    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("The size of tensor a (0) must match the size of tensor b (26)")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", failing)
    err = refused(capsys, llama)
    assert "loop failed at step" in err and "RuntimeError: The size of tensor a" in err


def test_flash_attention_asked_for_is_one_line(llama, tmp_path):
    """A config.json asking for `flash_attention_2` (not installed here) is refused in one line,
    transformers' reason, where the `kernels` library it calls first said "Skipping publisher
    trust check ... offline mode" on stderr (logging's last-resort handler: a subprocess, since
    pytest's own log handler would take it here)."""
    import subprocess
    import sys

    directory = copy(llama, tmp_path / "flash", attn_implementation="flash_attention_2")
    command = [sys.executable, "-m", "kvtui", "bench", "--model", str(directory), "--tokens", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.count("\n") == 1 and "FlashAttention2" in done.stderr, done.stderr
    assert "Skipping publisher trust check" not in done.stderr
