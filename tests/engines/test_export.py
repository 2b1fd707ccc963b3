"""`kvtui export-hf DIR`: the shipped tiny-austen as a Hugging Face Llama checkpoint that
transformers loads and runs to kvtui's own greedy ids, and that `--engine hf:DIR` runs to them
too (the same checkpoint a vLLM server serves in tests/vllm)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvtui.cli import main  # noqa: E402
from kvtui.engines.protocol import DEFAULT_PROMPT, RunSettings  # noqa: E402
from kvtui.gpu.export import EXPORT_FILES, export_hf, permute_heads  # noqa: E402
from kvtui.gpu.model import apply_rope, rope_table  # noqa: E402
from kvtui.reports.bench import run_bench  # noqa: E402

TOKENS = 64
GREEDY = RunSettings(engine="tiny", tokens=TOKENS, greedy=True, loops=("cached",))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("export") / "tiny-austen"
    export_hf(directory)
    return directory


def test_the_export_is_a_llama_checkpoint_without_an_eos(exported):
    assert sorted(p.name for p in exported.iterdir()) == sorted(EXPORT_FILES)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    assert (config["head_dim"], config["max_position_embeddings"]) == (32, 4096)
    assert config["eos_token_id"] is None and config["torch_dtype"] == "float32"
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] is None


def test_the_tokenizers_ids_are_the_bytes(exported):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    text = "It is a truth\n\tuniversally  acknowledged, café \u2603 \x00\x7f"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id is None and tokenizer.bos_token_id is None


def test_the_rope_permutation_keeps_every_query_key_product():
    """kvtui turns interleaved pairs, HF Llama the halves: permuted rows give the same q.k at
    every pair of positions, so the attention is unchanged."""
    head_dim, heads, positions = 32, 3, 12
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(positions, heads, head_dim, generator=gen)
    k = torch.randn(positions, heads, head_dim, generator=gen)
    table = rope_table(positions, head_dim, 10000.0)
    freqs = torch.view_as_complex(table).unsqueeze(1)  # (T, 1, head_dim // 2)
    ours = torch.einsum("thd,shd->hts", apply_rope(q, freqs), apply_rope(k, freqs))

    def halves(x):  # HF's rotate_half RoPE on rows permuted for it
        x = permute_heads(x.reshape(positions * heads, head_dim).T.contiguous(), 1, head_dim)
        x = x.T.reshape(positions, heads, head_dim)
        cos = torch.cat([table[..., 0]] * 2, dim=-1).unsqueeze(1)
        sin = torch.cat([table[..., 1]] * 2, dim=-1).unsqueeze(1)
        rotated = torch.cat((-x[..., head_dim // 2 :], x[..., : head_dim // 2]), dim=-1)
        return x * cos + rotated * sin

    theirs = torch.einsum("thd,shd->hts", halves(q), halves(k))
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)


def test_transformers_and_hf_engine_give_kvtuis_greedy_ids(exported):
    ours = run_bench(GREEDY)["token_ids"]
    assert len(ours) == TOKENS

    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([list(DEFAULT_PROMPT.encode("utf-8"))])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=TOKENS, do_sample=False)
    assert out[0, prompt.shape[1] :].tolist() == ours

    hf = run_bench(replace(GREEDY, engine=f"hf:{exported}"))
    assert hf["prompt_tokens"] == len(DEFAULT_PROMPT.encode("utf-8"))
    assert hf["token_ids"] == ours


def test_export_hf_command(tmp_path, capsys):
    target = tmp_path / "new" / "tiny"
    assert main(["export-hf", str(target)]) == 0
    assert "LlamaForCausalLM of 3,476,736 parameters" in capsys.readouterr().out
    assert (target / "model.safetensors").stat().st_size > 13_000_000

    assert main(["export-hf", str(target)]) == 2  # not empty
    err = capsys.readouterr().err
    assert "is not empty (--force" in err and err.count("\n") == 1
    (target / "notes.txt").write_text("mine")
    assert main(["export-hf", str(target), "--force"]) == 0
    assert (target / "notes.txt").read_text() == "mine"  # only the export's files replaced


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p.write_text("x"), "exists and is not a directory"),
        (lambda p: (p.parent / "real").mkdir() or p.symlink_to(p.parent / "real"), "link"),
    ],
)
def test_export_hf_refuses_a_bad_directory_in_one_line(tmp_path, capsys, make, says):
    target = tmp_path / "target"
    make(target)
    assert main(["export-hf", str(target)]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_export_hf_refuses_a_path_under_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["export-hf", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and err.count("\n") == 1


def _small_files() -> None:
    """In the child, before it runs: files past 1 MiB fail to write (EFBIG), as on a full disk."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))


def test_export_hf_onto_a_disk_that_fills_says_so_in_one_line_and_leaves_nothing(tmp_path):
    """The weights (13 MiB) cannot all be written: one line and exit 2, where safetensors' own
    error was a traceback, and no folder of the export's left behind."""
    import subprocess
    import sys

    target = tmp_path / "new" / "tiny-austen"
    done = subprocess.run(
        [sys.executable, "-m", "kvtui", "export-hf", str(target)],
        capture_output=True,
        text=True,
        preexec_fn=_small_files,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert f"cannot write {target}" in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "new").exists()


def test_export_hf_refuses_an_empty_path_in_one_line(tmp_path, capsys, monkeypatch):
    """`export-hf ''` (a variable left unset): `Path("")` is the current folder, where the export
    wrote its files; an empty path is refused."""
    monkeypatch.chdir(tmp_path)
    assert main(["export-hf", ""]) == 2
    err = capsys.readouterr().err
    assert "an empty path names no folder" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name", ["x" * 300, "x" * 300 + "/sub", "sub/" + "x" * 300], ids=["name", "parent", "child"]
)
def test_export_hf_onto_a_name_too_long_is_one_line(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    assert main(["export-hf", name]) == 2
    err = capsys.readouterr().err
    assert "a name of 300 bytes" in err and err.count("\n") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def _old_export(target):
    """A folder holding an older export's files (each saying "old") and a file of the user's."""
    target.mkdir()
    for name in EXPORT_FILES:
        (target / name).write_text("old")
    (target / "notes.txt").write_text("mine")


def _unchanged(target) -> bool:
    names = sorted(p.name for p in target.iterdir())
    return names == sorted([*EXPORT_FILES, "notes.txt"]) and all(
        (target / name).read_text() == ("mine" if name == "notes.txt" else "old") for name in names
    )


def test_export_hf_force_onto_a_folder_where_a_file_goes_changes_nothing(tmp_path, capsys):
    """--force where `model.safetensors` is a folder: refused before anything is written, where
    config.json was replaced and then the export failed, leaving old and new files mixed."""
    target = tmp_path / "target"
    _old_export(target)
    (target / "model.safetensors").unlink()
    (target / "model.safetensors").mkdir()
    assert main(["export-hf", str(target), "--force"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors is not a regular file" in err and err.count("\n") == 1
    assert (target / "config.json").read_text() == "old"
    assert (target / "model.safetensors").is_dir()
    assert not list(target.glob(".kvtui-export-*"))


class _Interrupt:
    """`os.rename` that raises KeyboardInterrupt (Ctrl-C, or SIGTERM through the command line) on
    its `at`-th call, after doing nothing."""

    def __init__(self, at: int) -> None:
        import os

        self.at, self.calls, self.rename = at, 0, os.rename

    def __call__(self, source, target) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        self.rename(source, target)


@pytest.mark.parametrize("at", [1, 4, 7, 9])  # set aside: 1-6; placed: 7-12
def test_export_hf_force_interrupted_puts_the_old_export_back(tmp_path, capsys, monkeypatch, at):
    """An interrupt while a --force export replaces the old one's files leaves the old ones, all
    of them, and no scratch folder: the export is whole or not there."""
    import kvtui.gpu.export

    target = tmp_path / "target"
    _old_export(target)
    monkeypatch.setattr(kvtui.gpu.export.os, "rename", _Interrupt(at))
    assert main(["export-hf", str(target), "--force"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert _unchanged(target), sorted(p.name for p in target.iterdir())


@pytest.mark.parametrize("where", ["writing", "renaming"])
def test_export_hf_interrupted_leaves_nothing(tmp_path, capsys, monkeypatch, where):
    """An interrupt while a new export is written (or as it takes its place) leaves no folder
    and no `.kvtui-export-*` scratch beside it."""
    import kvtui.gpu.export

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    name = "save_file" if where == "writing" else "os.rename"
    if where == "writing":
        monkeypatch.setattr(kvtui.gpu.export, "save_file", interrupted)
    else:
        monkeypatch.setattr(kvtui.gpu.export.os, "rename", _Interrupt(1))
    assert main(["export-hf", str(tmp_path / "new" / "tiny")]) == 130, name
    assert list(tmp_path.iterdir()) == []
