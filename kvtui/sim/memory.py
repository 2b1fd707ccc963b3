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

Split over N GPUs by tensor parallelism (Megatron-LM, arXiv:1909.08053), each GPU holds a share,
by vLLM's rules (`shard` states them): its query heads and 1/N of the sharded weights, and
max(1, kv_heads / N) KV heads, so that with fewer KV heads than GPUs each head is kept whole on
several GPUs. `kv_capacity` then counts the KV cache as vLLM sizes it at start-up: whole blocks of
tokens in what a share of each GPU's memory leaves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
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


# --- tensor parallelism: one GPU's share ---------------------------------------------------------

MAX_TENSOR_PARALLEL = 1024
"""The most GPUs a model is split over: far past one NVLink domain (8 GPUs in an HGX board, 72 in
a GB200 NVL72 rack); a model also splits over at most as many GPUs as it has query heads."""


def tensor_parallel_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why vLLM cannot split `spec` over `tp` GPUs, in one line; None when it can.

    vLLM's rules: the query heads split evenly (`ModelConfig.verify_with_parallel_config`,
    vllm/config/model.py: "Total number of attention heads must be divisible by tensor parallel
    size"), and the KV heads either split evenly or, when there are fewer of them than GPUs, each
    is kept whole on tp / kv_heads GPUs (`QKVParallelLinear`, vllm/model_executor/layers/linear.py:
    `divide(total_num_kv_heads, tp_size)` or `divide(tp_size, total_num_kv_heads)`). An MLA model
    caches one latent that every GPU keeps whole, so only its query heads must split.
    """
    _check_count("tp", tp, minimum=1)
    if tp > MAX_TENSOR_PARALLEL:
        return f"at most {format_int(MAX_TENSOR_PARALLEL)} GPUs, not {format_int(tp)}"
    if _splits(spec, tp):
        return None
    sizes = [format_int(n) for n in tensor_parallel_sizes(spec)]
    if len(sizes) > 10:  # a config's head count can have many divisors
        sizes = [*sizes[:9], "...", sizes[-1]]
    use = f"use {', '.join(sizes[:-1])} or {sizes[-1]}" if len(sizes) > 1 else "use 1"
    if spec.heads % tp:
        return (
            f"{spec.label}'s {spec.heads} attention heads do not split evenly over {tp} GPUs; {use}"
        )
    return (
        f"{spec.label}'s {spec.kv_heads} KV heads neither split evenly over {tp} GPUs nor "
        f"repeat evenly across them; {use}"
    )


def _splits(spec: ModelSpec, tp: int) -> bool:
    kv_ok = spec.is_mla or spec.kv_heads % tp == 0 or tp % spec.kv_heads == 0
    return spec.heads % tp == 0 and kv_ok


def tensor_parallel_sizes(spec: ModelSpec) -> list[int]:
    """Every number of GPUs vLLM can split `spec` over, smallest first (1 always)."""
    most = min(spec.heads, MAX_TENSOR_PARALLEL)
    return [tp for tp in range(1, most + 1) if _splits(spec, tp)]


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """ValueError, with `tensor_parallel_problem`'s line, unless `spec` splits over `tp` GPUs."""
    problem = tensor_parallel_problem(spec, tp)
    if problem is not None:
        raise ValueError(problem)


def kv_heads_per_gpu(spec: ModelSpec, tp: int) -> int:
    """KV heads each GPU caches: max(1, kv_heads / tp), as vLLM's `ModelConfig.get_num_kv_heads`
    (vllm/config/model.py) computes it; 1 for MLA, whose latent "becomes MQA" there.

    With fewer KV heads than GPUs each GPU still keeps one whole head, not a fraction of one:
    Llama 3.1 70B's 8 KV heads over 16 GPUs are 1 per GPU, each on 2 GPUs.
    """
    check_tensor_parallel(spec, tp)
    return 1 if spec.is_mla else max(1, spec.kv_heads // tp)


def kv_head_copies(spec: ModelSpec, tp: int) -> int:
    """On how many GPUs each KV head is kept: 1 while they split, tp / kv_heads when there are
    fewer KV heads than GPUs (vLLM's `num_kv_head_replicas`), tp for an MLA latent."""
    check_tensor_parallel(spec, tp)
    return tp if spec.is_mla else max(1, tp // spec.kv_heads)


def replicated_params(spec: ModelSpec) -> int:
    """Parameters every GPU keeps whole: the norms, hidden_size each, two per layer and a final
    one (Llama's layout; Gemma 2's four per layer are counted as two, under 0.01% of it)."""
    return (2 * spec.layers + 1) * spec.hidden_size


def kv_projection_params(spec: ModelSpec, kv_heads: int | None = None) -> int:
    """Parameters of the projections that make the cached keys and values, over all layers:
    hidden_size x kv_heads x head_dim for each of K and V (for `kv_heads` heads, the model's by
    default); for MLA the projection down to the latent and the rotary key, hidden_size x
    (kv_lora_rank + qk_rope_head_dim), which vLLM keeps whole on every GPU (a ReplicatedLinear)."""
    if spec.kv_lora_rank is not None:
        return spec.layers * spec.hidden_size * (spec.kv_lora_rank + (spec.qk_rope_head_dim or 0))
    heads = spec.kv_heads if kv_heads is None else kv_heads
    return spec.layers * 2 * spec.hidden_size * heads * spec.head_dim


def params_per_gpu(spec: ModelSpec, tp: int, params: int | None = None) -> int:
    """Parameters each of `tp` GPUs holds, of `params` (all of the model's by default).

    The rule: everything is split evenly (rounded up) except the norms, which every GPU keeps
    (`replicated_params`), and the K and V projections, of which each GPU keeps its own
    `kv_heads_per_gpu` heads whole (so a head kept on two GPUs is counted on both). The embedding
    and the LM head are split too: vLLM shards them by vocabulary (VocabParallelEmbedding,
    ParallelLMHead). vLLM pads the vocabulary to a multiple of 64 first; kvtui leaves out those
    padding rows (at most 63 x hidden_size), and counts biases and learned position tables, which
    are small, as split.
    """
    check_tensor_parallel(spec, tp)
    total = spec.params if params is None else params
    if tp == 1:
        return total
    whole = replicated_params(spec) + kv_projection_params(spec)
    own_kv = kv_projection_params(spec, kv_heads_per_gpu(spec, tp))  # MLA: the whole projection
    return -(-max(0, total - whole) // tp) + replicated_params(spec) + own_kv


def shard(spec: ModelSpec, tp: int) -> ModelSpec:
    """One GPU's share of `spec` split over `tp` GPUs, as a ModelSpec: heads / tp query heads,
    `kv_heads_per_gpu` KV heads and `params_per_gpu` parameters (active ones too, for an MoE).

    Every per-model formula then gives the per-GPU figure: `kv_bytes_per_token`, `kv_bytes`,
    `weights_bytes`, and kvtui.sim.work's FLOPs and bytes of a step. `spec` itself when tp is 1.
    """
    check_tensor_parallel(spec, tp)
    if tp == 1:
        return spec
    return replace(
        spec,
        heads=spec.heads // tp,
        kv_heads=kv_heads_per_gpu(spec, tp),
        params=params_per_gpu(spec, tp),
        active_params=None
        if spec.active_params is None
        else params_per_gpu(spec, tp, spec.active_params),
    )


def fewest_gpus(spec: ModelSpec, fits: Callable[[ModelSpec], bool]) -> int | None:
    """The fewest GPUs vLLM can split `spec` over whose per-GPU share `fits` (a test of one
    GPU's share, from `shard`); None when no split does."""
    return next((tp for tp in tensor_parallel_sizes(spec) if fits(shard(spec, tp))), None)


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
    _check_count("context_tokens", context_tokens, minimum=1)
    _check_count("batch", batch, minimum=1)
    _check_count("reserve_bytes", reserve_bytes, minimum=0)
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


# --- the KV cache a serving engine sizes at start-up ---------------------------------------------

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""The share of each GPU's memory a vLLM instance takes, --gpu-memory-utilization: 0.9, the
default vLLM documented for years (engine arguments, docs.vllm.ai/en/v0.6.4). Its current docs
(docs.vllm.ai/en/stable/cli/serve, and `CacheConfig` in vllm/config/cache.py) give 0.92: pass that
to match a recent vLLM."""
DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV-cache block, vLLM's default (`CacheConfig.DEFAULT_BLOCK_SIZE`,
vllm/config/cache.py). Some attention backends choose another (MLA kernels use 64)."""


@dataclass(frozen=True)
class KVCapacity:
    """The KV cache a vLLM-style server allocates on each GPU, and how many requests it holds.

    vLLM's rule (vllm/v1/worker/gpu_worker.py `determine_available_memory`, then
    vllm/v1/core/kv_cache_utils.py `get_num_blocks`, `_report_kv_cache_config` and
    `get_max_concurrency_for_kv_cache_config`):

        available = total memory x utilization - weights - everything else it measured
        blocks    = floor(available / (block_size x KV bytes per token, all layers, per GPU))
        "GPU KV cache size: {blocks x block_size} tokens"
        "Maximum concurrency for {M} tokens per request: {blocks / ceil(M / block_size):.2f}x"

    "Everything else" is measured at start-up (the activation peak of a profiling step, CUDA
    graphs, NCCL and the CUDA context); kvtui puts the stated RUNTIME_RESERVE_BYTES there instead.
    Every GPU of a split holds the same blocks, each its own KV heads of them, so the figures are
    the same per GPU and for the server. A request takes whole blocks in every layer; sliding
    windows are not counted (vLLM keeps fewer blocks for a sliding-window layer, so it reports
    more concurrency for Mistral 7B v0.1 or Gemma 2 than this).

    A real server usually reports less: its measured activation peak is often more than 1 GiB,
    CUDA graphs take memory, the driver shows a little under the label (79.6 GiB of an H100's 80),
    other processes on the GPU count against the same share, and fragmentation wastes some.
    """

    tp: int
    gpu_memory_utilization: float
    block_size: int
    """Tokens per block."""
    context_tokens: int
    """Tokens per request (vLLM's --max-model-len)."""
    usable_bytes_per_gpu: int
    """floor(GPU memory x utilization)."""
    kv_bytes_available_per_gpu: int
    """usable - weights per GPU - reserve (negative when nothing is left)."""
    block_bytes_per_gpu: int
    """One block of block_size tokens in every layer, on one GPU."""
    kv_blocks: int
    kv_capacity_tokens: int
    """kv_blocks x block_size: vLLM's "GPU KV cache size"."""
    blocks_per_request: int
    """ceil(context / block_size)."""
    max_concurrency: float
    """kv_blocks / blocks_per_request: vLLM's "Maximum concurrency"."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def kv_capacity(
    spec: ModelSpec,
    gpu: GPUSpec,
    context_tokens: int,
    tp: int = 1,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str = "bf16",
    weights_dtype: str = "bf16",
    reserve_bytes: int = RUNTIME_RESERVE_BYTES,
) -> KVCapacity:
    """The KV cache a vLLM-style server sizes for `spec` on `tp` GPUs of `gpu` (see KVCapacity).

    The utilization is read as the decimal it prints as (0.9 is nine tenths exactly).
    ValueError for a utilization outside (0, 1], a block size or context below 1, or a split
    vLLM cannot make.
    """
    _check_count("context_tokens", context_tokens, minimum=1)
    _check_count("block_size", block_size, minimum=1)
    _check_count("reserve_bytes", reserve_bytes, minimum=0)
    if not (isinstance(gpu_memory_utilization, (int, float)) and 0 < gpu_memory_utilization <= 1):
        raise ValueError(
            f"gpu_memory_utilization must be above 0 and at most 1, not {gpu_memory_utilization!r}"
        )
    share = shard(spec, tp)
    usable = math.floor(gpu.memory_bytes * Fraction(str(gpu_memory_utilization)))
    available = usable - weights_bytes(share, weights_dtype) - reserve_bytes
    per_block = _ceil(
        block_size
        * share.layers
        * kv_elements_per_token_per_layer(share)
        * dtype_bytes(normalize_dtype(kv_dtype))
    )
    blocks = max(0, available) // per_block
    per_request = -(-context_tokens // block_size)
    return KVCapacity(
        tp=tp,
        gpu_memory_utilization=float(gpu_memory_utilization),
        block_size=block_size,
        context_tokens=context_tokens,
        usable_bytes_per_gpu=usable,
        kv_bytes_available_per_gpu=available,
        block_bytes_per_gpu=per_block,
        kv_blocks=blocks,
        kv_capacity_tokens=blocks * block_size,
        blocks_per_request=per_request,
        max_concurrency=blocks / per_request,
    )


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


# --- the live engines' KV pool -------------------------------------------------------------------

CPU_KV_BUDGET_BYTES = 256 * 2**20
"""The KV pool of a torch engine on a CPU when no `--kv-budget` is given: 256 MiB. It holds the
shipped model's every position (4,096 x 3,072 bytes = 12 MiB) twenty times over, and a 4,096-token
run of Llama 3.2 1B's shape in fp32 (64 KiB a token). Storage is taken only for the blocks a run
can use, and on a CPU a page costs memory only once it is written."""
MAX_KV_BLOCK_TOKENS = 65_536
"""The largest block a pool takes: past any model's context, so one block may hold a whole run."""


@dataclass(frozen=True)
class KVPool:
    """A KV cache cut into blocks of token slots, taken on demand from a capacity in bytes.

    vLLM's PagedAttention layout (Kwon et al. 2023, arXiv:2309.06180): a block holds the keys and
    values of `block_tokens` consecutive positions of one sequence in every layer, so

        block bytes = block_tokens x KV bytes per token
        blocks      = floor(capacity / block bytes)
        tokens      = blocks x block_tokens               (the longest context that fits, one
                                                            sequence; vLLM's "KV cache size")

    A sequence takes a new block when it writes the first position of one, so it holds
    ceil(positions / block_tokens) blocks, and the last one's unused slots are allocated but not
    filled. B sequences decoded together each take a block at the same step, so each can reach
    floor(blocks / B) blocks; `tokens_before_full` says where generation stops.
    """

    capacity_bytes: int
    block_tokens: int
    kv_bytes_per_token: int
    """Keys and values of one position of one sequence, every layer."""

    def __post_init__(self) -> None:
        _check_count("capacity_bytes", self.capacity_bytes, minimum=0)
        _check_count("kv_bytes_per_token", self.kv_bytes_per_token, minimum=1)
        if not 1 <= self.block_tokens <= MAX_KV_BLOCK_TOKENS:
            raise ValueError(
                f"block_tokens must be from 1 to {MAX_KV_BLOCK_TOKENS:,}, not {self.block_tokens}"
            )

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token

    @property
    def blocks(self) -> int:
        return self.capacity_bytes // self.block_bytes

    @property
    def tokens(self) -> int:
        """Positions the pool holds for one sequence: whole blocks."""
        return self.blocks * self.block_tokens

    def blocks_for(self, positions: int, batch: int = 1) -> int:
        """Blocks `batch` sequences of `positions` each hold."""
        return batch * -(-positions // self.block_tokens)

    def tokens_per_sequence(self, batch: int = 1) -> int:
        """Positions each of `batch` sequences decoded together can cache before the pool is
        empty."""
        _check_count("batch", batch, minimum=1)
        return self.blocks // batch * self.block_tokens

    def tokens_before_full(self, prompt_tokens: int, batch: int = 1) -> int:
        """Tokens the cached loop generates, after a prompt of `prompt_tokens`, before a step
        finds no block: with C = `tokens_per_sequence(batch)` slots, C - P + 1.

        The prefill caches the prompt's P positions (none fit when P > C: 0 tokens) and emits
        token 1; the step that emits token t then caches position P + t - 2, the one before it.
        So the step that emits token C - P + 1 fills the last slot, and the next step, which
        must cache position C, finds the pool empty."""
        _check_count("prompt_tokens", prompt_tokens, minimum=1)
        slots = self.tokens_per_sequence(batch)
        return max(0, slots - prompt_tokens + 1)

    def full_message(self, prompt_tokens: int, batch: int = 1) -> str:
        """What a run that stopped on this pool says, in one line."""
        slots = self.tokens_per_sequence(batch)
        per = f" per sequence ({batch} decoded together)" if batch > 1 else ""
        head = (
            f"the KV cache is full at token {slots:,}{per}"
            if prompt_tokens <= slots
            else f"the KV cache cannot hold the prompt's {prompt_tokens:,} tokens{per}"
        )
        return (
            f"{head}: {format_bytes(self.capacity_bytes)} holds {slots:,} tokens of "
            f"{format_int(self.kv_bytes_per_token)} bytes of keys and values each "
            f"({self.blocks // batch:,} blocks of {self.block_tokens})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "block_bytes": self.block_bytes,
            "blocks": self.blocks,
            "tokens": self.tokens,
        }


def step_budget(current: int, need: int, direction: int, *, smallest: int) -> int:
    """The KV budget one key press from `current` (bytes), for a run that fills `need` bytes:
        powers of two. Down (-1) from a budget more than twice the run's need, the first press lands
        on the smallest power of two that holds the run whole (so a presenter is one press from a
        run that fits exactly and two from one that stops halfway); otherwise it halves. Up (1) is
        the next power of two. Never below the power of two that holds `smallest` (one block), and a
    budget already at or below it stays where it is."""
    floor = 1 << max(0, smallest - 1).bit_length()
    if direction < 0:
        if current <= floor:  # already the smallest (or, from --kv-budget, below it): stay
            return current
        fits = 1 << max(0, need - 1).bit_length()
        target = fits if current > 2 * need else 1 << max(0, current - 1).bit_length() - 1
        return max(floor, min(target, current))
    return max(floor, 1 << current.bit_length())


def gpu_pool_bytes(total_bytes: int, free_bytes: int, gpu_memory_utilization: float) -> int:
    """The KV pool a torch engine takes on a GPU without `--kv-budget`, as vLLM sizes its cache
    (`determine_available_memory`): its share of the whole device, floor(total x utilization),
    less everything already in use there (weights, the CUDA context, other processes: total -
    free, measured once the weights are loaded). What is left of the device beyond the share is
    for activations. 0 when nothing is left."""
    usable = math.floor(total_bytes * Fraction(str(gpu_memory_utilization)))
    return max(0, usable - (total_bytes - free_bytes))
