"""The KV cache in blocks, without a UI: as a serving engine sizes it at start-up (`kv_capacity`:
vLLM's whole blocks of tokens in what a share of each GPU's memory leaves) and as kvtui's live
engines allocate it (`KVPool`: blocks taken on demand, the stop where they run out)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from kvtui.format import format_bytes, format_int
from kvtui.sim.catalog import (
    GPUSpec,
    ModelSpec,
    normalize_dtype,
)
from kvtui.sim.memory import (
    RUNTIME_RESERVE_BYTES,
    ceil_bytes,
    check_count,
    kv_bytes_per_token_per_layer,
    weights_bytes,
)
from kvtui.sim.parallel import shard

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
    check_count("context_tokens", context_tokens, minimum=1)
    check_count("block_size", block_size, minimum=1)
    check_count("reserve_bytes", reserve_bytes, minimum=0)
    if not (isinstance(gpu_memory_utilization, (int, float)) and 0 < gpu_memory_utilization <= 1):
        raise ValueError(
            f"gpu_memory_utilization must be above 0 and at most 1, not {gpu_memory_utilization!r}"
        )
    share = shard(spec, tp)
    usable = math.floor(gpu.memory_bytes * Fraction(str(gpu_memory_utilization)))
    available = usable - weights_bytes(share, weights_dtype) - reserve_bytes
    per_block = ceil_bytes(
        block_size * share.layers * kv_bytes_per_token_per_layer(share, normalize_dtype(kv_dtype))
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
        check_count("capacity_bytes", self.capacity_bytes, minimum=0)
        check_count("kv_bytes_per_token", self.kv_bytes_per_token, minimum=1)
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
        check_count("batch", batch, minimum=1)
        return self.blocks // batch * self.block_tokens

    def tokens_before_full(self, prompt_tokens: int, batch: int = 1) -> int:
        """Tokens the cached loop generates, after a prompt of `prompt_tokens`, before a step
        finds no block: with C = `tokens_per_sequence(batch)` slots, C - P + 1.

        The prefill caches the prompt's P positions (none fit when P > C: 0 tokens) and emits
        token 1; the step that emits token t then caches position P + t - 2, the one before it.
        So the step that emits token C - P + 1 fills the last slot, and the next step, which
        must cache position C, finds the pool empty."""
        check_count("prompt_tokens", prompt_tokens, minimum=1)
        slots = self.tokens_per_sequence(batch)
        return max(0, slots - prompt_tokens + 1)

    def full_message(self, prompt_tokens: int, batch: int = 1) -> str:
        """What a run that stopped on this pool says, in one line: the token it stopped after
        (tokens generated, as the run counts them) and the rows its slots hold (the prompt's
        and the tokens' before the last: `tokens_before_full`)."""
        slots = self.tokens_per_sequence(batch)
        per = f" per sequence ({batch} decoded together)" if batch > 1 else ""
        head = (
            f"the KV cache is full after token {self.tokens_before_full(prompt_tokens, batch):,}"
            f"{per}"
            if prompt_tokens <= slots
            else f"the KV cache cannot hold the prompt's {prompt_tokens:,} tokens{per}"
        )
        return (
            f"{head}: {format_bytes(self.capacity_bytes)} holds {slots:,} rows of "
            f"{format_int(self.kv_bytes_per_token)} bytes of keys and values each "
            f"({self.blocks // batch:,} blocks of {self.block_tokens} slots)"
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
