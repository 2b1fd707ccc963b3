"""The models kvtui's own decoder runs, without a UI: the shipped tiny-austen (from assets/, never
through pickle) and a catalog model's exact shape with seeded random weights (`shape:NAME`), each
made ready to decode on its device."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from safetensors import safe_open

from kvtui.errors import EngineError
from kvtui.format import format_bytes
from kvtui.gpu.device import available_bytes, out_of_memory
from kvtui.gpu.model import ModelArgs, Transformer
from kvtui.paths import TINY_WEIGHTS, asset_path
from kvtui.sim.catalog import ModelSpec, spec_matrix_params
from kvtui.sim.hf_config import safetensors_dtype

TINY_ARGS = ModelArgs(n_layer=6, n_head=8, n_kv_head=2, dim=256, intermediate_size=512)
"""The tiny model's shape, used for seeded random weights when the shipped file is missing."""


def spec_from_args(name: str, args: ModelArgs) -> ModelSpec:
    """The kvtui.sim view of a torch model's shape, so its formulas apply to it unchanged (its
    FLOPs exactly: `matrix_params` counted from the shape)."""
    spec = ModelSpec(
        name=name,
        layers=args.n_layer,
        heads=args.n_head,
        kv_heads=args.n_kv_head,
        head_dim=args.head_dim,
        hidden_size=args.dim,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        params=args.params,
        max_context=args.max_positions,
        default_dtype="fp32",
    )
    return replace(spec, matrix_params=spec_matrix_params(spec))


def load_tiny(
    device: torch.device, dtype: torch.dtype, seed: int = 0
) -> tuple[Transformer, dict[str, str]]:
    """The shipped model from assets/ (never through pickle), or, when the file is missing, the
    same architecture with seeded random weights, ready to decode on `device`. Returns the model
    and its metadata."""
    path = asset_path(TINY_WEIGHTS)
    if not path.exists():
        model = Transformer(TINY_ARGS, dtype=dtype, device=device)
        model.init_weights(seed)
        return ready_to_decode(model), {"name": "tiny-random", "weights": "random"}
    with (
        safe_open(path, framework="pt") as f,
        out_of_memory_is_one_line(TINY_WEIGHTS, format_bytes(path.stat().st_size), device),
    ):
        metadata = dict(f.metadata() or {})
        args = ModelArgs.from_json(json.loads(metadata["config"]))
        model = Transformer(args, dtype=dtype, device=device)
        model.load_state_dict({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
        return ready_to_decode(model), metadata


def tiny_stored_dtype() -> str:
    """The dtype the shipped weights are stored in (fp16), read from their file's header; fp32
    for the seeded random weights used when the file is missing."""
    return safetensors_dtype(asset_path(TINY_WEIGHTS)) or "fp32"


def trained_context(metadata: dict[str, str]) -> int | None:
    """The longest window the shipped weights were trained on, from their metadata: the
    `context_trained` of a long-context stage, else the training config's `context`."""
    if "context_trained" in metadata:
        return int(metadata["context_trained"])
    try:
        return int(json.loads(metadata.get("train", "{}"))["context"])
    except (KeyError, TypeError, ValueError):
        return None


def ready_to_decode(model: Transformer) -> Transformer:
    """In eval mode and, on a CPU, with its weights laid out for matrix-vector products and each
    layer's one-vector kernel chosen by timing them on this machine (`choose_matvec`)."""
    if model.output.weight.device.type == "cpu":
        model.store_weights_transposed()
    return model.eval()


def args_for_shape(spec: ModelSpec) -> ModelArgs:
    """Our decoder with a catalog model's exact attention and MLP shape."""
    if spec.is_mla or spec.active_params is not None:
        raise EngineError(
            f"shape:{spec.name} is not supported: its attention (MLA) or experts (MoE) are not "
            f"a dense grouped-query decoder; use sim:{spec.name}@GPU instead"
        )
    return ModelArgs(
        n_layer=spec.layers,
        n_head=spec.heads,
        n_kv_head=spec.kv_heads,
        dim=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_positions=min(spec.max_context, 131072),
        head_dim_override=spec.head_dim if spec.head_dim * spec.heads != spec.hidden_size else None,
    )


def build_shape(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    context: int,
    seed: int,
    batch: int = 1,
) -> Transformer:
    """Random weights in a catalog model's shape; `EngineError`, before allocating, if too big
    (the weights and the KV cache of `batch` sequences of `context` tokens)."""
    from kvtui.sim.memory import shape_bytes

    args = args_for_shape(spec)
    need, what = shape_bytes(spec, context, batch, gpu=device.type == "cuda")
    have, where = available_bytes(device)
    if need > have:
        raise EngineError(
            f"shape:{spec.name} needs {format_bytes(need)} ({what}) but only "
            f"{format_bytes(have)} of {where} is available"
        )
    with out_of_memory_is_one_line(f"shape:{spec.name}", f"{format_bytes(need)} ({what})", device):
        model = Transformer(args, dtype=dtype, device=device)
        model.init_weights(seed)
        return ready_to_decode(model)


@contextmanager
def out_of_memory_is_one_line(name: str, need: str, device: torch.device) -> Iterator[None]:
    """An allocation that fails while a model is built or loaded (the pre-check passed, but a
    limit it could not see, or another process, took the memory): `EngineError`, one line."""
    try:
        yield
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise EngineError(
            f"{name}: out of memory while building it on {device.type} (it needs {need})"
        ) from None


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of a loaded model's parameters, as they sit in memory (a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
