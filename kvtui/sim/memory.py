"""Exact KV-cache and weight memory, without a UI.

The KV cache holds, for every layer and every cached position, one key and one value vector per
kv head (grouped-query attention shares them across query heads):

    kv bytes per token = 2 x layers x kv_heads x head_dim x bytes per element

(Pope et al. 2022, "Efficiently Scaling Transformer Inference", section 3.1; kipp.ly,
"Transformer Inference Arithmetic", 2022). Two published variations are counted exactly:
- multi-head latent attention (DeepSeek-V2/V3) caches one latent of kv_lora_rank plus the rotary
  key part qk_rope_head_dim per layer, shared by keys and values: no factor 2
  (DeepSeek-V2 paper, arXiv:2405.04434, table 1);
- a sliding-window layer keeps at most its window of positions (Mistral 7B's rolling buffer,
  arXiv:2310.06825; Gemma 2's alternating local/global layers, arXiv:2408.00118).

Sizes are exact integers of bytes; int4 (half a byte) is counted exactly and rounded up once. A
format that keeps a scale beside each vector counts its scales too (KV_SCALE_BYTES: int8).

The rest of the memory model builds on these sizes: one GPU's share under tensor parallelism
(kvtui.sim.parallel), a budget against a GPU with its advice (kvtui.sim.budget), and the KV pool
a serving engine or a live run allocates in blocks (kvtui.sim.pool).
"""

from __future__ import annotations

import math
from fractions import Fraction

from kvtui.sim.catalog import (
    GIB,
    ModelSpec,
    dtype_bytes,
    normalize_dtype,
)

RUNTIME_RESERVE_BYTES = GIB
"""Memory a decode process needs beside weights and KV cache: 1 GiB.

It stands for the CUDA context (about 300-500 MiB), cuBLAS/attention workspaces, one step's
activations and allocator slack. A stated round figure rather than a measured one: a serving
engine keeps more (vLLM leaves 10% of the GPU by default), a bare decode loop less.
"""


# --- per-token and total sizes -------------------------------------------------------------------


def kv_elements_per_token_per_layer(spec: ModelSpec) -> int:
    """Numbers cached per token in one layer: 2 x kv_heads x head_dim, or the MLA latent."""
    if spec.kv_lora_rank is not None:
        return spec.kv_lora_rank + (spec.qk_rope_head_dim or 0)
    return 2 * spec.kv_heads * spec.head_dim


KV_SCALE_BYTES = {"int8": 2}
"""Bytes of the scale a KV-cache format keeps beside each vector it stores (one token's key or
value of one head; an MLA latent). int8 keeps one fp16 scale per token and head, its absolute
maximum over 127 (kvtui.gpu.tricks): with head_dim 32 that is llama.cpp's q8_0 exactly (32 int8
values and an fp16 scale per block; ggml-common.h `block_q8_0`). fp8 keeps vLLM's scale per tensor
(1.0 unless calibrated: docs.vllm.ai, "Quantized KV Cache"), no bytes per token."""


def kv_scale_bytes_per_token_per_layer(spec: ModelSpec, kv_dtype: str) -> int:
    """Bytes of scales one token adds to one layer's cache in `kv_dtype` (0 for most)."""
    vectors = 1 if spec.kv_lora_rank is not None else 2 * spec.kv_heads
    return KV_SCALE_BYTES.get(normalize_dtype(kv_dtype), 0) * vectors


def kv_bytes_per_token_per_layer(spec: ModelSpec, kv_dtype: str) -> Fraction:
    """Bytes one token adds to one layer's cache in `kv_dtype`, scales included (exact)."""
    return kv_elements_per_token_per_layer(spec) * dtype_bytes(
        kv_dtype
    ) + kv_scale_bytes_per_token_per_layer(spec, kv_dtype)


def cached_layer_positions(spec: ModelSpec, context_tokens: int) -> int:
    """Sum over layers of the positions each layer keeps for a context (windows cap theirs)."""
    check_count("context_tokens", context_tokens, minimum=0)
    windows = spec.layer_windows()
    return sum(context_tokens if w is None else min(context_tokens, w) for w in windows)


def ceil_bytes(value: Fraction) -> int:
    return math.ceil(value)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str = "bf16") -> int:
    """KV-cache bytes one more token adds while no window is full (rounded up for int4)."""
    return ceil_bytes(spec.layers * kv_bytes_per_token_per_layer(spec, kv_dtype))


def kv_bytes(spec: ModelSpec, context_tokens: int, batch: int = 1, kv_dtype: str = "bf16") -> int:
    """KV-cache bytes for `batch` sequences of `context_tokens` each (exact; int4 rounded up)."""
    check_count("batch", batch, minimum=1)
    positions = batch * cached_layer_positions(spec, context_tokens)
    return ceil_bytes(positions * kv_bytes_per_token_per_layer(spec, kv_dtype))


def weights_bytes(spec: ModelSpec, weights_dtype: str | None = None) -> int:
    """Bytes of all the model's parameters in a dtype (its published dtype by default)."""
    return ceil_bytes(spec.params * dtype_bytes(weights_dtype or spec.default_dtype))


def check_count(name: str, value: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, not {value}")


def shape_bytes(model: ModelSpec, context: int, batch: int, *, gpu: bool) -> tuple[int, str]:
    """What `shape:MODEL` needs on a GPU or a CPU, and what that is in words: kvtui's decoder in
    the model's shape (its own parameters, kvtui.sim.catalog.estimate_params, in the dtype it
    computes in there: kvtui.sim.catalog.compute_dtype) and the KV cache of `batch` sequences of
    `context` tokens; on a CPU also a copy of the largest weight, which laying the weights out
    for one-vector products makes one at a time."""
    from kvtui.sim.catalog import compute_dtype, dtype_bytes, estimate_params

    dtype, _ = compute_dtype(model.default_dtype, gpu=gpu)
    element = int(dtype_bytes(dtype))
    params = estimate_params(
        layers=model.layers,
        heads=model.heads,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        vocab_size=model.vocab_size,
        tied_embeddings=False,
    )
    need = params * element + kv_bytes(model, context, batch, dtype)
    what = f"{dtype} weights + KV cache for {context:,} tokens" + (
        f" x {batch}" if batch > 1 else ""
    )
    if not gpu:
        q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
        largest = model.hidden_size * max(
            q + 2 * kv, q, 2 * model.intermediate_size, model.vocab_size
        )
        need += largest * element
        what += " + a copy of the largest weight"
    return need, what
