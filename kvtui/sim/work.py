"""Exact decode-work counts, without a UI.

An answer of `n` generated tokens follows a prompt of `p` tokens (p >= 1: a model needs a token to
start from). Work is counted in *positions computed*: one position is one token's pass through the
model, which produces that token's keys and values in every layer. The rule is the engines' own
(kvtui.engines.protocol states it): the step that emits token t (t = 1..n)

- without a cache recomputes every position so far: p + t - 1 of them; over the answer
  n*p + n(n-1)/2;
- with a cache computes the p prompt positions on the first step (the prefill) and only the newest
  position on every later step: p, then 1, 1, ...; over the answer p + n - 1.

With a one-token prompt (p = 1, the default) these are the lesson's figures: n = 24 -> last step
24, total 300, wasted 276; n = 32 -> 528 against 32, 16.5x; n = 4096 -> 8,390,656 against 4,096.
All counts are closed forms over Python integers: exact and instant for any n.

The second half prices one decode step of a real model in FLOPs and bytes read, after Kaplan et
al. 2020 ("Scaling Laws for Neural Language Models", arXiv:2001.08361, section 2.1: a forward
pass costs about 2N FLOPs per token plus attention over the context) and kipp.ly, "Transformer
Inference Arithmetic" (2022, https://kipp.ly/transformer-inference-arithmetic/): each step reads
every weight once plus the KV cache so far, so at batch 1 decode does about one multiply-add per
byte read and is memory-bound on every GPU in the catalog.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvtui.sim.catalog import GPUSpec, ModelSpec, dtype_bytes
from kvtui.sim.memory import cached_layer_positions, kv_bytes

# --- positions computed --------------------------------------------------------------------------


def _check(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, not {value}")


def naive_step_positions(t: int, prompt: int = 1) -> int:
    """Positions the uncached loop computes in the step that emits token t (1-based): p + t - 1."""
    _check("t", t, 1)
    _check("prompt", prompt, 1)
    return prompt + t - 1


def cached_step_positions(t: int, prompt: int = 1) -> int:
    """Positions the cached loop computes in step t (1-based): p (the prefill), then 1."""
    _check("t", t, 1)
    _check("prompt", prompt, 1)
    return prompt if t == 1 else 1


def naive_cumulative(t: int, prompt: int = 1) -> int:
    """Positions the uncached loop has computed after t steps: t*p + t(t-1)/2."""
    _check("t", t, 0)
    _check("prompt", prompt, 1)
    return t * prompt + t * (t - 1) // 2


def cached_cumulative(t: int, prompt: int = 1) -> int:
    """Positions the cached loop has computed after t steps: p + t - 1 (0 before the first)."""
    _check("t", t, 0)
    _check("prompt", prompt, 1)
    return prompt + t - 1 if t else 0


@dataclass(frozen=True)
class WorkSummary:
    """Work for one answer, both ways."""

    length: int
    """Tokens generated (n)."""
    prompt: int
    """Prompt tokens before them (p)."""
    naive_last_step: int
    """Positions the uncached loop computes for the last token: p + n - 1."""
    naive_total: int
    """All positions the uncached loop computes: n*p + n(n-1)/2."""
    cached_total: int
    """All positions the cached loop computes: p + n - 1."""
    wasted: int
    """Positions computed more than once: naive_total - cached_total."""
    speedup: float
    """naive_total / cached_total: how many times more work the uncached loop does."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def work_summary(length: int, prompt: int = 1) -> WorkSummary:
    """The work of generating `length` tokens after `prompt` tokens, with and without a cache."""
    _check("length", length, 1)
    _check("prompt", prompt, 1)
    naive = naive_cumulative(length, prompt)
    cached = cached_cumulative(length, prompt)
    return WorkSummary(
        length=length,
        prompt=prompt,
        naive_last_step=naive_step_positions(length, prompt),
        naive_total=naive,
        cached_total=cached,
        wasted=naive - cached,
        speedup=naive / cached,
    )


# --- FLOPs and bytes of one step of a real model -------------------------------------------------


def _weights_read_bytes(spec: ModelSpec, weights_dtype: str) -> int:
    return math.ceil(spec.params_per_token * dtype_bytes(weights_dtype))


def attention_flops(spec: ModelSpec, context_tokens: int) -> int:
    """FLOPs of one query attending to `context_tokens` keys in every layer.

    Scores (q . k) and the weighted sum of values each take one multiply-add per head dimension
    per key: 2 x 2 x heads x head_dim per key per layer (kipp.ly; Kaplan et al. count only the
    first half, 2 x n_layer x n_ctx x d_attn). Sliding-window layers attend to their window only.
    """
    _check("context_tokens", context_tokens, 0)
    return 4 * spec.heads * spec.head_dim * cached_layer_positions(spec, context_tokens)


def decode_step_flops(spec: ModelSpec, context_tokens: int, batch: int = 1) -> int:
    """FLOPs of one cached decode step: about 2 x parameters + attention over the context.

    `context_tokens` counts the keys the new token attends to, itself included. A mixture of
    experts multiplies only its active parameters. (Kaplan et al. 2020, eq. 2.2: C_forward ~ 2N +
    2 n_layer n_ctx d_attn; kipp.ly, "Transformer Inference Arithmetic".)
    """
    _check("batch", batch, 1)
    return batch * (2 * spec.multiplied_params + attention_flops(spec, context_tokens))


def _causal_keys(positions: int, window: int | None) -> int:
    """Keys attended over a causal pass of `positions` queries: sum of min(i, window), i=1..P."""
    if window is None or positions <= window:
        return positions * (positions + 1) // 2
    return window * (window + 1) // 2 + (positions - window) * window


def head_params(spec: ModelSpec) -> int:
    """Parameters of the output head (the vocabulary's logits from the last hidden state)."""
    return spec.vocab_size * spec.hidden_size


def uncached_step_flops(spec: ModelSpec, positions: int, batch: int = 1) -> int:
    """FLOPs of one uncached step (or a prefill) that computes `positions` positions at once.

    About 2 x parameters per position, but the output head once: a step needs the newest
    position's logits only (transformers' `logits_to_keep=1`; kvtui's forward with `last_only`).
    Plus causal attention: query i attends to i keys (its window, in a sliding layer), 4 x heads
    x head_dim FLOPs per key. So it is the cached steps at contexts 1..P, less P - 1 heads.
    """
    return prefill_chunk_flops(spec, 0, positions, batch)


def prefill_chunk_flops(spec: ModelSpec, start: int, positions: int, batch: int = 1) -> int:
    """FLOPs of one pass that computes `positions` new positions after `start` positions already
    cached (an uncached step or a prefill: `start` 0): as `uncached_step_flops`, query i of the
    chunk attending to the start + i keys before it and itself (its window, in a sliding layer).
    A sequence whose prompt begins with blocks another holds computes only the rest so
    (kvtui.sim.tricks, prefix caching)."""
    _check("start", start, 0)
    _check("positions", positions, 1)
    _check("batch", batch, 1)
    keys = sum(
        _causal_keys(start + positions, w) - _causal_keys(start, w) for w in spec.layer_windows()
    )
    body = spec.multiplied_params - head_params(spec)
    attention = 4 * spec.heads * spec.head_dim * keys
    return batch * (2 * body * positions + 2 * head_params(spec) + attention)


def decode_step_bytes(
    spec: ModelSpec,
    context_tokens: int,
    weights_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    batch: int = 1,
) -> int:
    """Bytes one cached decode step reads: every (active) weight once, plus the KV cache so far.

    The weights are read once however large the batch; each sequence reads its own cache
    (kipp.ly, "Transformer Inference Arithmetic": the memory-bound step time is
    (2 x params + KV bytes) / bandwidth at fp16).
    """
    return _weights_read_bytes(spec, weights_dtype) + kv_bytes(
        spec, context_tokens, batch, kv_dtype
    )


def uncached_step_bytes(
    spec: ModelSpec,
    positions: int,
    weights_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    batch: int = 1,
) -> int:
    """Bytes one uncached step reads, roughly: the weights once, plus the keys and values it
    recomputes for `positions` positions of each of `batch` sequences (attention reads them back;
    nothing is kept)."""
    _check("positions", positions, 1)
    _check("batch", batch, 1)
    return _weights_read_bytes(spec, weights_dtype) + kv_bytes(spec, positions, batch, kv_dtype)


@dataclass(frozen=True)
class StepCost:
    """The formula's price of one step of a loop, every sequence's: the one place a step is
    priced (the `sim:` engine's steps, the torch engines' formula beside what they measured, the
    test fakes)."""

    positions: int
    """Positions computed (kvtui.engines.protocol's counting rule), times the batch."""
    flops: int
    bytes_read: int


def step_cost(
    spec: ModelSpec,
    cached: bool,
    step: int,
    prompt: int,
    batch: int = 1,
    weights_dtype: str = "bf16",
    kv_dtype: str = "bf16",
) -> StepCost:
    """What step `step` (0-based) after a `prompt`-token prompt costs by the formulas: with a
    cache, the prefill (`prompt` positions) and then one position against a context of
    `prompt + step` keys; without, every one of the `prompt + step` positions again."""
    _check("step", step, 0)
    _check("prompt", prompt, 1)
    context = prompt + step
    if cached and step > 0:
        return StepCost(
            batch,
            decode_step_flops(spec, context, batch),
            decode_step_bytes(spec, context, weights_dtype, kv_dtype, batch),
        )
    positions = prompt if cached else context
    return StepCost(
        batch * positions,
        uncached_step_flops(spec, positions, batch),
        uncached_step_bytes(spec, positions, weights_dtype, kv_dtype, batch),
    )


def roofline_seconds(flops: float, bytes_read: float, gpu: GPUSpec) -> float:
    """The least time a step can take on `gpu`: the slower of its compute and its memory reads
    at peak (Williams, Waterman and Patterson 2009, "Roofline")."""
    return max(flops / gpu.peak_bf16_flops, bytes_read / gpu.bandwidth_bytes_per_s)


def compute_bound_positions(
    spec: ModelSpec, gpu: GPUSpec, weights_dtype: str = "bf16", kv_dtype: str = "bf16"
) -> int | None:
    """The fewest positions at which recomputing them (one uncached step) turns compute-bound
    on `gpu`: below it the step costs the same as reading the weights once, as a cached step
    does; above it, it grows with the positions. None if that never happens within the model's
    context. About the GPU's ridge point (FLOPs per byte) for 2-byte weights."""

    def compute_bound(positions: int) -> bool:
        flops = uncached_step_flops(spec, positions) / gpu.peak_bf16_flops
        memory = uncached_step_bytes(spec, positions, weights_dtype, kv_dtype)
        return flops >= memory / gpu.bandwidth_bytes_per_s

    low, high = 1, spec.max_context
    if not compute_bound(high):
        return None
    while low < high:  # the first compute-bound count: flops grow faster than bytes
        middle = (low + high) // 2
        if compute_bound(middle):
            high = middle
        else:
            low = middle + 1
    return low


# --- tensor parallelism: what the GPUs exchange in a step ----------------------------------------

ACTIVATION_BYTES = 2
"""Bytes per element of the activations GPUs exchange: bf16 (they stay 16-bit when the weights
are fp8 or int4)."""


def tensor_parallel_all_reduces(spec: ModelSpec) -> int:
    """All-reduces in one forward pass split over several GPUs: 2 per layer, 1 more at the start.

    Megatron-style tensor parallelism (Shoeybi et al. 2019, arXiv:1909.08053, section 3) splits
    attention by heads and the MLP by columns then rows, so each layer ends both halves with an
    all-reduce of the hidden state (its operators f and g: "two all-reduces in the forward path").
    vLLM's vocabulary-split embedding (VocabParallelEmbedding) adds one before the first layer.
    """
    return 2 * spec.layers + 1


def tensor_parallel_step_link_bytes(
    spec: ModelSpec, positions: int, gpus: int, batch: int = 1
) -> int:
    """Bytes one GPU sends over its link in a step of `positions` positions per sequence, split
    over `gpus` GPUs (0 for one GPU), rounded up once.

    Each all-reduce sums a message of batch x positions x hidden_size x ACTIVATION_BYTES; a ring
    all-reduce sends 2(N-1)/N of the message from every GPU (Patarasuk and Yuan 2009, "Bandwidth
    optimal all-reduce algorithms for clusters of workstations"; NCCL's nccl-tests,
    doc/PERFORMANCE.md: bus bandwidth = algorithm bandwidth x 2(n-1)/n). Then each GPU's slice of
    the logits of the last position, vocab_size / N of them, is gathered on one GPU, which takes
    in (N-1)/N x vocab_size x ACTIVATION_BYTES per sequence.
    """
    _check("positions", positions, 1)
    _check("gpus", gpus, 1)
    _check("batch", batch, 1)
    message = batch * positions * spec.hidden_size * ACTIVATION_BYTES
    logits = batch * spec.vocab_size * ACTIVATION_BYTES
    all_reduces = tensor_parallel_all_reduces(spec) * 2 * (gpus - 1) * message
    return -(-(all_reduces + (gpus - 1) * logits) // gpus)


def tensor_parallel_step_seconds(
    spec: ModelSpec,
    flops: float,
    bytes_read: float,
    positions: int,
    gpus: int,
    gpu: GPUSpec,
    batch: int = 1,
) -> float:
    """The least time a step of `spec` split over `gpus` GPUs can take: one GPU's roofline over
    its own `flops` and `bytes_read` (those of its share, kvtui.sim.parallel.shard), plus the time
    its link takes to send `tensor_parallel_step_link_bytes` at `gpu.interconnect_bytes_per_s`.

    The exchanges are added, not overlapped: every layer waits for its all-reduce before the
    next starts. Bandwidth only, like the rest of the roofline: a small all-reduce (a decode
    step's is a few KiB) is in practice bound by latency, microseconds each, which this leaves
    out. One GPU: exactly `roofline_seconds`.
    """
    _check("gpus", gpus, 1)
    seconds = roofline_seconds(flops, bytes_read, gpu)
    if gpus == 1:
        return seconds
    if not gpu.interconnect_bytes_per_s:
        raise ValueError(f"the catalog gives no GPU-to-GPU bandwidth for the {gpu.display_name}")
    link = tensor_parallel_step_link_bytes(spec, positions, gpus, batch)
    return seconds + link / gpu.interconnect_bytes_per_s
