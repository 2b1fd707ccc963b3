"""A budget against one GPU, without a UI: weights, KV cache and reserve against its memory, the
longest context that fits, advice in words when it does not, and the split a bar draws."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvtui.format import format_bytes, format_int
from kvtui.sim.catalog import (
    DTYPE_BYTES,
    GPUSpec,
    ModelSpec,
    get_gpu,
    gpu_names,
    normalize_dtype,
)
from kvtui.sim.memory import (
    RUNTIME_RESERVE_BYTES,
    check_count,
    kv_bytes,
    kv_bytes_per_token,
    weights_bytes,
)
from kvtui.sim.parallel import fewest_gpus, kv_heads_per_gpu, shard


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


# --- a budget against one GPU --------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """Weights + KV cache + runtime reserve against one GPU's memory.

    Split over `tp` GPUs, the question is whether each GPU holds its share: `weights_bytes`,
    `kv_bytes` and `kv_bytes_per_token` stay the whole model's, the `_per_gpu` fields are one
    GPU's share (the same figures when tp is 1), and `used_bytes`, `status` and
    `max_context_tokens` are about one GPU.
    """

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
    """weights + KV + reserve, per GPU."""
    kv_fraction_of_vram: float
    status: str
    """"fits" when used_bytes <= vram_bytes, else "overflow"."""
    max_context_tokens: int | None
    """The longest context (at this batch and dtypes) that fits: 0 when none does, None when the
    cache stops growing (every layer slides) before memory runs out."""
    tp: int
    """GPUs the model is split over (tensor parallelism; 1: one GPU holds it all)."""
    kv_heads_per_gpu: int
    """KV heads each GPU caches (see `kv_heads_per_gpu`)."""
    weights_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_gpu: int
    advice: tuple[str, ...] = field(default=())
    """What to change, in plain words: empty when it fits and nothing needs saying."""
    model_label: str = ""
    gpu_label: str = ""
    model_positions: int | None = None
    """The most positions the model runs (its `max_context`); None where it has no limit."""

    @property
    def longest_context_limit(self) -> str:
        """What binds the longest context: "positions" (the model's own, where memory would
        hold more) or "memory"."""
        memory, positions = self.max_context_tokens, self.model_positions
        if positions is not None and (memory is None or memory > positions):
            return "positions"
        return "memory"

    @property
    def longest_context_tokens(self) -> int | None:
        """The longest context that runs: what memory holds (`max_context_tokens`), capped at
        the model's positions; None where neither binds (every layer slides, no limit)."""
        if self.longest_context_limit == "positions":
            return self.model_positions
        return self.max_context_tokens

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
            "longest_context_tokens": self.longest_context_tokens,
            "longest_context_limit": self.longest_context_limit,
            "advice": list(self.advice),
            "tp": self.tp,
            "kv_heads_per_gpu": self.kv_heads_per_gpu,
            "weights_bytes_per_gpu": self.weights_bytes_per_gpu,
            "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
            "kv_bytes_per_gpu": self.kv_bytes_per_gpu,
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
    tp: int = 1,
) -> Budget:
    """Does `batch` sequences of `context_tokens` of `spec` fit on `gpu`? With advice if not.

    With `tp` above 1 the model is split over that many GPUs of the kind, and each must hold its
    share (`shard`) beside the reserve; ValueError when vLLM cannot split it so.
    """
    check_count("context_tokens", context_tokens, minimum=1)
    check_count("batch", batch, minimum=1)
    check_count("reserve_bytes", reserve_bytes, minimum=0)
    kv_dtype, weights_dtype = normalize_dtype(kv_dtype), normalize_dtype(weights_dtype)
    share = shard(spec, tp)
    weights = weights_bytes(share, weights_dtype)
    kv = kv_bytes(share, context_tokens, batch, kv_dtype)
    used = weights + kv + reserve_bytes
    room = gpu.memory_bytes - weights - reserve_bytes
    status = "fits" if used <= gpu.memory_bytes else "overflow"
    longest = max_context_tokens(share, room, batch, kv_dtype)
    result = Budget(
        model=spec.name,
        gpu=gpu.name,
        context_tokens=context_tokens,
        batch=batch,
        kv_dtype=kv_dtype,
        weights_dtype=weights_dtype,
        kv_bytes_per_token=kv_bytes_per_token(spec, kv_dtype),
        kv_bytes=kv_bytes(spec, context_tokens, batch, kv_dtype),
        weights_bytes=weights_bytes(spec, weights_dtype),
        reserve_bytes=reserve_bytes,
        vram_bytes=gpu.memory_bytes,
        used_bytes=used,
        kv_fraction_of_vram=kv / gpu.memory_bytes,
        status=status,
        max_context_tokens=longest,
        tp=tp,
        kv_heads_per_gpu=kv_heads_per_gpu(spec, tp),
        weights_bytes_per_gpu=weights,
        kv_bytes_per_token_per_gpu=kv_bytes_per_token(share, kv_dtype),
        kv_bytes_per_gpu=kv,
        model_label=spec.label,
        gpu_label=gpu.display_name,
        model_positions=spec.max_context or None,
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

    share = shard(spec, b.tp)
    each = "" if b.tp == 1 else "each "  # "on the H100", or "on each H100" of a split
    room = b.vram_bytes - b.weights_bytes_per_gpu - b.reserve_bytes
    if room < 0 or b.max_context_tokens == 0:
        weights = "weights" if b.tp == 1 else "weights per GPU"
        advice.append(
            f"The {b.weights_dtype} {weights} ({format_bytes(b.weights_bytes_per_gpu)}) and the "
            f"{format_bytes(b.reserve_bytes)} runtime reserve leave no room for a KV cache on "
            f"{each or 'the '}{gpu.display_name}, which has {format_bytes(b.vram_bytes)}."
        )
        for dtype in (d for d in DTYPE_BYTES if DTYPE_BYTES[d] < DTYPE_BYTES[b.weights_dtype]):
            smaller = weights_bytes(share, dtype)
            smaller_room = b.vram_bytes - smaller - b.reserve_bytes
            longest = max_context_tokens(share, smaller_room, b.batch, b.kv_dtype)
            if longest == 0:
                continue
            change = f"Quantize the weights to {dtype} ({format_bytes(smaller)})"
            if longest is None or b.kv_bytes_per_gpu <= smaller_room:  # None: windows all fit
                advice.append(f"{change}: then it fits.")
            else:
                advice.append(f"{change} and shorten the context to {format_int(longest)} tokens.")
            break
    else:
        advice.append(
            f"Shorten the context to {format_int(b.max_context_tokens or 0)} tokens or fewer."
        )
        per_sequence = kv_bytes(share, b.context_tokens, 1, b.kv_dtype)
        if b.batch > 1 and per_sequence <= room:
            fewer = min(b.batch - 1, room // per_sequence)
            while fewer > 1 and kv_bytes(share, b.context_tokens, fewer, b.kv_dtype) > room:
                fewer -= 1
            advice.append(f"Run a batch of {fewer} instead of {b.batch}.")
        for dtype in DTYPE_BYTES:
            if DTYPE_BYTES[dtype] >= DTYPE_BYTES[b.kv_dtype]:
                continue
            smaller_kv = kv_bytes(share, b.context_tokens, b.batch, dtype)
            if smaller_kv <= room:
                advice.append(
                    f"Store the KV cache in {dtype}: {format_bytes(smaller_kv)} instead of "
                    f"{format_bytes(b.kv_bytes_per_gpu)}."
                )
                break

    def holds(part: ModelSpec, memory: int) -> bool:
        return (
            weights_bytes(part, b.weights_dtype)
            + kv_bytes(part, b.context_tokens, b.batch, b.kv_dtype)
            + b.reserve_bytes
            <= memory
        )

    more = fewest_gpus(spec, lambda part: holds(part, gpu.memory_bytes))
    if more is not None and b.tp > 1 and more > b.tp:
        advice.append(f"Split it over more GPUs: --tp {more} on the {gpu.display_name} holds it.")
    need = b.weights_bytes_per_gpu + b.kv_bytes_per_gpu + b.reserve_bytes
    bigger = [
        get_gpu(name)
        for name in gpu_names()
        if get_gpu(name).memory_bytes > gpu.memory_bytes and need <= get_gpu(name).memory_bytes
    ]
    if bigger:
        best = min(bigger, key=lambda g: g.memory_bytes)
        spare = format_bytes(best.memory_bytes - b.used_bytes)
        if b.tp == 1:
            advice.append(
                f"Use a bigger GPU: the {best.display_name}, with "
                f"{format_bytes(best.memory_bytes)}, holds it with {spare} to spare."
            )
        else:
            advice.append(
                f"Use bigger GPUs: {b.tp}x the {best.display_name}, with "
                f"{format_bytes(best.memory_bytes)} each, hold it with {spare} to spare on each."
            )
    elif b.tp == 1:
        split = "split the model across several (tensor or pipeline parallelism)"
        if more is not None:
            split += f"; --tp {more} on the {gpu.display_name} holds it"
        advice.append(f"No GPU in the catalog holds this alone: {split}.")
    elif more is None:
        advice.append(
            f"No GPU in the catalog holds its share split {b.tp} ways, and no split over "
            f"{gpu.display_name} GPUs holds it."
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
    """The budget's VRAM (one GPU's, when split) as weights | KV | reserve | free, clipped to the
    GPU when it overflows."""
    left = b.vram_bytes
    parts = []
    for wanted in (b.weights_bytes_per_gpu, b.kv_bytes_per_gpu, b.reserve_bytes):
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
