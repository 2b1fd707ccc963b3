"""Exact KV-cache and weight memory, and a budget against one GPU, without a UI.

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

Sizes are exact integers of bytes; int4 (half a byte) is counted exactly and rounded up once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from kvtui.format import format_bytes, format_int
from kvtui.sim.catalog import (
    DTYPE_BYTES,
    GIB,
    GPUSpec,
    ModelSpec,
    dtype_bytes,
    get_gpu,
    gpu_names,
    normalize_dtype,
)

RUNTIME_RESERVE_BYTES = GIB
"""Memory a decode process needs beside weights and KV cache: 1 GiB.

It stands for the CUDA context (about 300-500 MiB), cuBLAS/attention workspaces, one step's
activations and allocator slack. A stated round figure rather than a measured one: a serving
engine keeps more (vLLM leaves 10% of the GPU by default), a bare decode loop less.
"""


@dataclass(frozen=True)
class LessonBudget:
    """The scenario behind the lesson's memory card, and the budget screen's default."""

    model: str
    gpu: str
    context_tokens: int
    batch: int
    kv_dtype: str
    weights_dtype: str


LESSON_BUDGET = LessonBudget(
    model="llama-3.1-8b",
    gpu="h100",
    context_tokens=24_000,
    batch=8,
    kv_dtype="bf16",
    weights_dtype="bf16",
)
""""23.4 GB of KV on an 80 GB GPU is 29% and fits": Llama 3.1 8B (128 KiB of bf16 KV per token)
serving 8 sequences of 24,000 tokens holds 192,000 x 131,072 = 25,165,824,000 bytes = 23.4 GiB of
KV, 29.3% of an H100's 80 GiB, beside 15.0 GiB of bf16 weights and the 1 GiB reserve."""


# --- per-token and total sizes -------------------------------------------------------------------


def kv_elements_per_token_per_layer(spec: ModelSpec) -> int:
    """Numbers cached per token in one layer: 2 x kv_heads x head_dim, or the MLA latent."""
    if spec.kv_lora_rank is not None:
        return spec.kv_lora_rank + (spec.qk_rope_head_dim or 0)
    return 2 * spec.kv_heads * spec.head_dim


def cached_layer_positions(spec: ModelSpec, context_tokens: int) -> int:
    """Sum over layers of the positions each layer keeps for a context (windows cap theirs)."""
    _check_count("context_tokens", context_tokens, minimum=0)
    windows = spec.layer_windows()
    return sum(context_tokens if w is None else min(context_tokens, w) for w in windows)


def _ceil(value: Fraction) -> int:
    return math.ceil(value)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str = "bf16") -> int:
    """KV-cache bytes one more token adds while no window is full (rounded up for int4)."""
    return _ceil(spec.layers * kv_elements_per_token_per_layer(spec) * dtype_bytes(kv_dtype))


def kv_bytes(spec: ModelSpec, context_tokens: int, batch: int = 1, kv_dtype: str = "bf16") -> int:
    """KV-cache bytes for `batch` sequences of `context_tokens` each (exact; int4 rounded up)."""
    _check_count("batch", batch, minimum=1)
    elements = batch * cached_layer_positions(spec, context_tokens)
    return _ceil(elements * kv_elements_per_token_per_layer(spec) * dtype_bytes(kv_dtype))


def weights_bytes(spec: ModelSpec, weights_dtype: str | None = None) -> int:
    """Bytes of all the model's parameters in a dtype (its published dtype by default)."""
    return _ceil(spec.params * dtype_bytes(weights_dtype or spec.default_dtype))


def _check_count(name: str, value: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, not {value}")


# --- a budget against one GPU --------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """Weights + KV cache + runtime reserve against one GPU's memory."""

    model: str
    gpu: str
    context_tokens: int
    batch: int
    kv_dtype: str
    weights_dtype: str
    kv_bytes_per_token: int
    """Bytes each token adds to one sequence's cache (before any sliding window fills)."""
    kv_bytes: int
    weights_bytes: int
    reserve_bytes: int
    """The stated runtime reserve (see RUNTIME_RESERVE_BYTES)."""
    vram_bytes: int
    used_bytes: int
    """weights + KV + reserve."""
    kv_fraction_of_vram: float
    status: str
    """"fits" when used_bytes <= vram_bytes, else "overflow"."""
    max_context_tokens: int | None
    """The longest context (at this batch and dtypes) that fits: 0 when none does, None when the
    cache stops growing (every layer slides) before memory runs out."""
    advice: tuple[str, ...] = field(default=())
    """What to change, in plain words: empty when it fits and nothing needs saying."""
    model_label: str = ""
    gpu_label: str = ""

    @property
    def fits(self) -> bool:
        return self.status == "fits"

    @property
    def free_bytes(self) -> int:
        """VRAM left over (negative when it overflows)."""
        return self.vram_bytes - self.used_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "gpu": self.gpu,
            "context_tokens": self.context_tokens,
            "batch": self.batch,
            "kv_dtype": self.kv_dtype,
            "weights_dtype": self.weights_dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes": self.kv_bytes,
            "weights_bytes": self.weights_bytes,
            "reserve_bytes": self.reserve_bytes,
            "vram_bytes": self.vram_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "kv_fraction_of_vram": self.kv_fraction_of_vram,
            "status": self.status,
            "max_context_tokens": self.max_context_tokens,
            "advice": list(self.advice),
        }


def _fits(spec: ModelSpec, context: int, batch: int, kv_dtype: str, room: int) -> bool:
    return kv_bytes(spec, context, batch, kv_dtype) <= room


def max_context_tokens(
    spec: ModelSpec, room_bytes: int, batch: int = 1, kv_dtype: str = "bf16"
) -> int | None:
    """The longest context whose KV cache fits in `room_bytes`: 0 if not even one token does,
    None if every layer slides and the full windows fit (the cache stops growing)."""
    if not _fits(spec, 1, batch, kv_dtype, room_bytes):
        return 0
    windows = spec.layer_windows()
    if all(w is not None for w in windows):
        widest = max(w for w in windows if w is not None)
        if _fits(spec, widest, batch, kv_dtype, room_bytes):
            return None
    low, high = 1, 2
    while _fits(spec, high, batch, kv_dtype, room_bytes):
        low, high = high, high * 2
    while high - low > 1:  # low fits, high does not
        mid = (low + high) // 2
        if _fits(spec, mid, batch, kv_dtype, room_bytes):
            low = mid
        else:
            high = mid
    return low


def budget(
    spec: ModelSpec,
    gpu: GPUSpec,
    context_tokens: int,
    batch: int = 1,
    kv_dtype: str = "bf16",
    weights_dtype: str = "bf16",
    reserve_bytes: int = RUNTIME_RESERVE_BYTES,
) -> Budget:
    """Does `batch` sequences of `context_tokens` of `spec` fit on `gpu`? With advice if not."""
    _check_count("context_tokens", context_tokens, minimum=1)
    _check_count("batch", batch, minimum=1)
    _check_count("reserve_bytes", reserve_bytes, minimum=0)
    kv_dtype, weights_dtype = normalize_dtype(kv_dtype), normalize_dtype(weights_dtype)
    weights = weights_bytes(spec, weights_dtype)
    kv = kv_bytes(spec, context_tokens, batch, kv_dtype)
    used = weights + kv + reserve_bytes
    room = gpu.memory_bytes - weights - reserve_bytes
    status = "fits" if used <= gpu.memory_bytes else "overflow"
    longest = max_context_tokens(spec, room, batch, kv_dtype)
    result = Budget(
        model=spec.name,
        gpu=gpu.name,
        context_tokens=context_tokens,
        batch=batch,
        kv_dtype=kv_dtype,
        weights_dtype=weights_dtype,
        kv_bytes_per_token=kv_bytes_per_token(spec, kv_dtype),
        kv_bytes=kv,
        weights_bytes=weights,
        reserve_bytes=reserve_bytes,
        vram_bytes=gpu.memory_bytes,
        used_bytes=used,
        kv_fraction_of_vram=kv / gpu.memory_bytes,
        status=status,
        max_context_tokens=longest,
        model_label=spec.label,
        gpu_label=gpu.display_name,
    )
    return _with_advice(result, spec, gpu)


def _with_advice(b: Budget, spec: ModelSpec, gpu: GPUSpec) -> Budget:
    advice: list[str] = []
    if b.context_tokens > spec.max_context:
        advice.append(
            f"{spec.label} was built for at most {format_int(spec.max_context)} tokens of "
            f"context; beyond that its output degrades."
        )
    if b.fits:
        return _replace_advice(b, advice)

    room = b.vram_bytes - b.weights_bytes - b.reserve_bytes
    if room < 0 or b.max_context_tokens == 0:
        advice.append(
            f"The {b.weights_dtype} weights ({format_bytes(b.weights_bytes)}) and the "
            f"{format_bytes(b.reserve_bytes)} runtime reserve leave no room for a KV cache on the "
            f"{gpu.display_name}, which has {format_bytes(b.vram_bytes)}."
        )
        for dtype in (d for d in DTYPE_BYTES if DTYPE_BYTES[d] < DTYPE_BYTES[b.weights_dtype]):
            smaller = weights_bytes(spec, dtype)
            smaller_room = b.vram_bytes - smaller - b.reserve_bytes
            longest = max_context_tokens(spec, smaller_room, b.batch, b.kv_dtype)
            if longest == 0:
                continue
            change = f"Quantize the weights to {dtype} ({format_bytes(smaller)})"
            if b.kv_bytes <= smaller_room:
                advice.append(f"{change}: then it fits.")
            else:
                advice.append(f"{change} and shorten the context to {format_int(longest)} tokens.")
            break
    else:
        advice.append(
            f"Shorten the context to {format_int(b.max_context_tokens or 0)} tokens or fewer."
        )
        per_sequence = kv_bytes(spec, b.context_tokens, 1, b.kv_dtype)
        if b.batch > 1 and per_sequence <= room:
            fewer = min(b.batch - 1, room // per_sequence)
            while fewer > 1 and kv_bytes(spec, b.context_tokens, fewer, b.kv_dtype) > room:
                fewer -= 1
            advice.append(f"Run a batch of {fewer} instead of {b.batch}.")
        for dtype in DTYPE_BYTES:
            if DTYPE_BYTES[dtype] >= DTYPE_BYTES[b.kv_dtype]:
                continue
            smaller_kv = kv_bytes(spec, b.context_tokens, b.batch, dtype)
            if smaller_kv <= room:
                advice.append(
                    f"Store the KV cache in {dtype}: {format_bytes(smaller_kv)} instead of "
                    f"{format_bytes(b.kv_bytes)}."
                )
                break

    bigger = [
        get_gpu(name)
        for name in gpu_names()
        if get_gpu(name).memory_bytes > gpu.memory_bytes
        and b.weights_bytes + b.kv_bytes + b.reserve_bytes <= get_gpu(name).memory_bytes
    ]
    if bigger:
        best = min(bigger, key=lambda g: g.memory_bytes)
        spare = format_bytes(best.memory_bytes - b.used_bytes)
        advice.append(
            f"Use a bigger GPU: the {best.display_name}, with {format_bytes(best.memory_bytes)}, "
            f"holds it with {spare} to spare."
        )
    else:
        advice.append(
            "No GPU in the catalog holds this alone: split the model across several "
            "(tensor or pipeline parallelism)."
        )
    return _replace_advice(b, advice)


def _replace_advice(b: Budget, advice: list[str]) -> Budget:
    return replace(b, advice=tuple(advice))


# --- a bar to draw -------------------------------------------------------------------------------


@dataclass(frozen=True)
class VramSplit:
    """A GPU's memory in four parts for a bar: weights | KV | runtime reserve | free.

    When the budget overflows, the parts are clipped to the VRAM in that order and
    `overflow_bytes` says how much did not fit.
    """

    vram_bytes: int
    weights_bytes: int
    kv_bytes: int
    reserve_bytes: int
    free_bytes: int
    overflow_bytes: int

    def fractions(self) -> tuple[float, float, float, float]:
        """(weights, KV, reserve, free) as fractions of VRAM, summing to 1."""
        total = self.vram_bytes
        return (
            self.weights_bytes / total,
            self.kv_bytes / total,
            self.reserve_bytes / total,
            self.free_bytes / total,
        )


def vram_split(b: Budget) -> VramSplit:
    """The budget's VRAM as weights | KV | reserve | free, clipped to the GPU when it overflows."""
    left = b.vram_bytes
    parts = []
    for wanted in (b.weights_bytes, b.kv_bytes, b.reserve_bytes):
        shown = min(wanted, left)
        parts.append(shown)
        left -= shown
    return VramSplit(
        vram_bytes=b.vram_bytes,
        weights_bytes=parts[0],
        kv_bytes=parts[1],
        reserve_bytes=parts[2],
        free_bytes=left,
        overflow_bytes=max(0, b.used_bytes - b.vram_bytes),
    )
