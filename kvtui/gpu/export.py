"""The shipped tiny-austen as a Hugging Face Llama checkpoint (`kvtui export-hf DIR`), without a
UI: the same weights, named and laid out as transformers' `LlamaForCausalLM` and vLLM load them,
with a byte-level tokenizer whose ids are the bytes, so that transformers, vLLM and kvtui's own
engine run one model and, greedy, emit the same ids.

Three things differ between kvtui's decoder (kvtui.gpu.model) and HF Llama's, and each is undone
here, exactly:

- kvtui fuses the query, key and value projections into one `wqkv` and the MLP's gate and up
  projections into one `w13`; HF keeps them apart (`q_proj`, `k_proj`, `v_proj`; `gate_proj`,
  `up_proj`). They are split by rows: q, k, v in that order; gate (`w1`), then up (`w3`).
- kvtui's RoPE turns interleaved pairs (x[2i], x[2i+1]) as complex numbers (Llama's reference
  code); HF's `rotate_half` turns the halves (x[i], x[i + head_dim/2]). Permuting each q and k
  head's rows from the one order to the other (as Meta-to-HF conversion scripts do) leaves every
  q.k product, and so the attention, unchanged; v and o keep their order.
- The vocabulary is bytes: kvtui needs no tokenizer, HF does. `tokenizer.json` is a byte-level
  BPE with no merges and no special tokens whose vocabulary maps each byte's ByteLevel character
  to the byte's value, so the ids of a text are its UTF-8 bytes, as kvtui's.

The weights are written in float32 (the shipped fp16 values, widened exactly) and the config says
float32, so a server's `--dtype auto` runs the precision kvtui's CPU engine runs. No eos, bos or
pad token: nothing stops a run early.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from kvtui.errors import EngineError
from kvtui.gpu.model import ModelArgs
from kvtui.paths import TINY_NAME, TINY_WEIGHTS, asset_path

EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
"""What an export writes: replaced all together with `--force`, nothing else in DIR touched."""


class ExportError(EngineError):
    """The export cannot be written where asked: one line for a person to read."""


# --- the weights ---------------------------------------------------------------------------------


def interleaved_to_halves(head_dim: int) -> Tensor:
    """The row order that turns kvtui's RoPE pairs (x[2i], x[2i+1]) into HF's halves
    (x[i], x[i + head_dim/2]): even rows first, then odd."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def permute_heads(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """`interleaved_to_halves` applied to the rows of every head of a q or k projection
    `(n_heads * head_dim, dim)`."""
    order = interleaved_to_halves(head_dim)
    return w.reshape(n_heads, head_dim, -1)[:, order].reshape(n_heads * head_dim, -1)


def hf_state_dict(state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """kvtui's state dict (the shipped file's names) as `LlamaForCausalLM`'s, contiguous: fused
    projections split, q and k rows permuted for `rotate_half` (see the module's docstring)."""
    q_dim, kv_dim = args.n_head * args.head_dim, args.n_kv_head * args.head_dim
    out = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"],
        "model.norm.weight": state["norm.weight"],
        "lm_head.weight": state["output.weight"],
    }
    for i in range(args.n_layer):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        wq, wk, wv = torch.split(state[ours + "attention.wqkv.weight"], [q_dim, kv_dim, kv_dim])
        gate, up = state[ours + "feed_forward.w13.weight"].chunk(2, dim=0)
        out |= {
            theirs + "self_attn.q_proj.weight": permute_heads(wq, args.n_head, args.head_dim),
            theirs + "self_attn.k_proj.weight": permute_heads(wk, args.n_kv_head, args.head_dim),
            theirs + "self_attn.v_proj.weight": wv,
            theirs + "self_attn.o_proj.weight": state[ours + "attention.wo.weight"],
            theirs + "mlp.gate_proj.weight": gate,
            theirs + "mlp.up_proj.weight": up,
            theirs + "mlp.down_proj.weight": state[ours + "feed_forward.w2.weight"],
            theirs + "input_layernorm.weight": state[ours + "attention_norm.weight"],
            theirs + "post_attention_layernorm.weight": state[ours + "ffn_norm.weight"],
        }
    return {name: t.contiguous() for name, t in out.items()}


def hf_config(args: ModelArgs, torch_dtype: str = "float32") -> dict[str, Any]:
    """`config.json` of a `LlamaForCausalLM` of exactly this shape: no bos, eos or pad token."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.n_layer,
        "num_attention_heads": args.n_head,
        "num_key_value_heads": args.n_kv_head,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_positions,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_base,
        "rope_scaling": None,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": torch_dtype,
    }


# --- the tokenizer -------------------------------------------------------------------------------


def byte_level_characters() -> list[str]:
    """The character ByteLevel (GPT-2's `bytes_to_unicode`) writes for each byte 0..255: printable
    Latin-1 bytes stand for themselves, the rest are shifted past U+00FF in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


def tokenizer_json() -> dict[str, Any]:
    """A `tokenizers` file whose ids are bytes: ByteLevel pre-tokenizer and decoder without the
    regex split or a prefix space, and a BPE over the 256 byte characters with no merges, so each
    byte is one token whose id is its value. No added or special tokens shift an id."""
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    vocab = {char: byte for byte, char in enumerate(byte_level_characters())}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def tokenizer_config(max_positions: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": None,
        "pad_token": None,
        "unk_token": None,
    }


GENERATION_CONFIG = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
"""No token ends a generation: a run goes as long as it is asked to."""


# --- writing it ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Export:
    """What `export_hf` wrote."""

    directory: Path
    files: tuple[str, ...]
    params: int
    weights_bytes: int


def read_shipped() -> tuple[dict[str, Tensor], ModelArgs, dict[str, str]]:
    """The shipped model's tensors (as stored), shape and metadata; `ExportError` without it."""
    path = asset_path(TINY_WEIGHTS)
    if not path.is_file():
        raise ExportError(f"the shipped model {path} is missing; reinstall kvtui")
    with safe_open(path, framework="pt") as f:
        metadata = dict(f.metadata() or {})
        state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    return state, ModelArgs.from_json(json.loads(metadata["config"])), metadata


def check_target(directory: Path, force: bool) -> None:
    """`ExportError` (one line) for a DIR an export must not write to: a link, a file, a folder
    that is not empty (unless `force`) or cannot be written, one holding a non-file where an
    export's file goes (`force` replaces files only), or a parent that is not a folder."""
    try:
        _check_target(directory, force)
    except OSError as exc:  # a name too long, a loop of links, no permission to look
        raise ExportError(f"cannot write {directory}: {_reason(exc)}") from None


def _check_target(directory: Path, force: bool) -> None:
    if directory.is_symlink():
        raise ExportError(f"{directory} is a symbolic link; give the folder itself")
    if directory.exists():
        if not directory.is_dir():
            raise ExportError(f"{directory} exists and is not a directory")
        try:
            empty = next(os.scandir(directory), None) is None
        except OSError as exc:
            raise ExportError(f"cannot read {directory}: {exc.strerror}") from None
        if not empty and not force:
            raise ExportError(
                f"{directory} is not empty (--force writes the export's files into it)"
            )
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ExportError(f"{directory} is not writable")
        for name in EXPORT_FILES:
            target = directory / name
            if os.path.lexists(target) and (target.is_symlink() or not target.is_file()):
                raise ExportError(
                    f"{target} is not a regular file (--force replaces the export's files only)"
                )
        return
    parent = directory.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"cannot make {directory}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot make {directory}: {parent} is not writable")


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


SCRATCH_PREFIX = ".kvtui-export-"
"""The folder an export is written into before it takes its place (removed in every case)."""


def export_hf(directory: Path, *, force: bool = False) -> Export:
    """Write the shipped model into `directory` as a Hugging Face Llama checkpoint (see the
    module's docstring), whole or not at all: the files are written into a scratch folder, which
    then takes the place of a new (or empty) DIR in one rename; with `force`, into a DIR that
    holds other files, the export's old files are set aside, the new ones renamed in, and on any
    failure or interrupt the old ones put back. `ExportError` with one line when the target is
    refused (`check_target`) or a write fails; the scratch folder, and the folders the export
    made, are removed whatever happens."""
    check_target(directory, force)
    state, args, metadata = read_shipped()
    widened = {name: t.to(torch.float32) for name, t in state.items()}  # fp16, exactly
    tensors = hf_state_dict(widened, args)
    params = sum(t.numel() for t in tensors.values())
    contents: dict[str, Any] = {
        "config.json": hf_config(args),
        "generation_config.json": GENERATION_CONFIG,
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": tokenizer_config(args.max_positions),
        "README.md": _model_card(args, metadata, params),
    }
    try:
        if directory.is_dir() and next(os.scandir(directory), None) is not None:
            _write_among(directory, tensors, contents)
        else:
            _write_new(directory, tensors, contents)
    except (OSError, SafetensorError) as exc:  # safetensors' own for a failed write
        why = _reason(exc) if isinstance(exc, OSError) else str(exc)
        raise ExportError(f"cannot write {directory}: {why}") from None
    size = (directory / "model.safetensors").stat().st_size
    return Export(directory, EXPORT_FILES, params, size)


def _stage(scratch: Path, tensors: dict[str, Tensor], contents: dict[str, Any]) -> None:
    """Every file of the export, written into `scratch`."""
    save_file(tensors, scratch / "model.safetensors", metadata={"format": "pt"})
    for name, content in contents.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=2)
        (scratch / name).write_text(text + "\n", encoding="utf-8")
    for name in EXPORT_FILES:
        os.chmod(scratch / name, 0o644)


def _write_new(directory: Path, tensors: dict[str, Tensor], contents: dict[str, Any]) -> None:
    """The export written beside DIR, then renamed onto it (DIR missing, or an empty folder)."""
    parent = directory.absolute().parent
    # The folders this export makes, deepest first: removed again if it fails.
    made = [p for p in (parent, *parent.parents) if not os.path.lexists(p)]
    scratch: Path | None = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=parent, prefix=SCRATCH_PREFIX))
        _stage(scratch, tensors, contents)
        os.chmod(scratch, 0o755)  # mkdtemp's folder is private; DIR is not
        os.rename(scratch, directory)  # onto nothing, or an empty folder: all at once
        scratch = None
    except BaseException:  # an interrupt too: nothing of the export is left
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _write_among(directory: Path, tensors: dict[str, Tensor], contents: dict[str, Any]) -> None:
    """The export written into a DIR that holds other files (`--force`): staged inside it, the
    old export's files set aside, the new ones renamed in; put back as they were on any failure
    (an interrupt too). The other files are never touched."""
    scratch = Path(tempfile.mkdtemp(dir=directory, prefix=SCRATCH_PREFIX))
    old = scratch / "old"
    set_aside: list[str] = []
    placed: list[str] = []
    try:
        _stage(scratch, tensors, contents)
        old.mkdir()
        for name in EXPORT_FILES:  # each a regular file or absent (check_target)
            if os.path.lexists(directory / name):
                os.rename(directory / name, old / name)
                set_aside.append(name)
        for name in EXPORT_FILES:
            os.rename(scratch / name, directory / name)
            placed.append(name)
        set_aside.clear()  # the new export is in place: the old files go with the scratch folder
    except BaseException:
        for name in placed:
            with contextlib.suppress(OSError):
                os.unlink(directory / name)
        for name in list(set_aside):
            with contextlib.suppress(OSError):
                os.rename(old / name, directory / name)
                set_aside.remove(name)
        raise
    finally:
        if not set_aside:  # else an old file could not be put back: it stays in the scratch
            shutil.rmtree(scratch, ignore_errors=True)


def _model_card(args: ModelArgs, metadata: dict[str, str], params: int) -> str:
    return (
        f"# {TINY_NAME}\n\n"
        f"kvtui's shipped byte-level model, exported by `kvtui export-hf` as a `LlamaForCausalLM`"
        f" ({params:,} parameters: {args.n_layer} layers, {args.n_head} query heads, "
        f"{args.n_kv_head} key/value heads of {args.head_dim}, width {args.dim}), float32.\n\n"
        "Token ids are UTF-8 bytes (tokenizer.json: byte-level, no merges, no special tokens). "
        "Greedy decoding emits the same ids as `kvtui --engine tiny --greedy`.\n\n"
        f"Trained on: {metadata.get('corpus', 'unknown')}. "
        f"Licence: {metadata.get('licence', 'unknown')}.\n"
    )
