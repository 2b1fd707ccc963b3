"""One GPU's share of a model split by tensor parallelism, without a UI.

Split over N GPUs by tensor parallelism (Megatron-LM, arXiv:1909.08053), each GPU holds a share,
by vLLM's rules (`shard` states them): its query heads and 1/N of the sharded weights, and
max(1, kv_heads / N) KV heads, so that with fewer KV heads than GPUs each head is kept whole on
several GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvtui.format import format_int
from kvtui.sim.catalog import (
    ModelSpec,
)
from kvtui.sim.memory import check_count

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
    check_count("tp", tp, minimum=1)
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
