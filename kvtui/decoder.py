"""The project's own decoder and its KV cache, in torch, without a UI.

A Llama-style decoder in the manner of nanoGPT and gpt-fast (`model.py`): RMSNorm, rotary position
embeddings, a SwiGLU MLP and grouped-query attention with fewer key/value heads than query heads, so
that its KV cache has the same structure as the catalog models' and `kvtui.sim.memory` applies to it
unchanged. The vocabulary is bytes (256 values): no tokenizer file.

The model is `forward(idx, start, use_cache)`: training (a whole sequence, causal), prefill and the
uncached loop run it, and with `use_cache` each layer writes its new keys and values into the
`PagedKVCache`: blocks of token slots taken from a pool as the sequence grows, as vLLM does, so
that a run can find the pool empty (`KVCacheFull`). Two bounded pieces make the cached loop's
one-token step cheap on a CPU, each measured by `benchmarks/decode_step.py`:

- `Transformer.decode`, the step itself: `forward` on one token, bit for bit (a test checks), in
  the fewest Python steps: on a CPU that step is bound by per-call overhead, not arithmetic;
- how a linear layer multiplies one vector (`Linear.matvec`): by whichever kernel `choose_matvec`
  times fastest on the machine that runs, on the model's own weights.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvtui.sim.catalog import estimate_params


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a decoder. `head_dim` is `dim // n_head`."""

    n_layer: int = 6
    n_head: int = 8
    n_kv_head: int = 2
    dim: int = 256
    intermediate_size: int = 512
    vocab_size: int = 256
    max_positions: int = 4096
    """Rotary tables are built this long; decoding may run to here."""
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    head_dim_override: int | None = None
    """Where head_dim is not `dim // n_head` (Gemma-2: 3584 / 16 heads, but head_dim 256)."""

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_head

    @property
    def params(self) -> int:
        """Parameters of this shape, by kvtui.sim's one counter (exact: a test counts tensors)."""
        return estimate_params(
            layers=self.n_layer,
            heads=self.n_head,
            kv_heads=self.n_kv_head,
            head_dim=self.head_dim,
            hidden_size=self.dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            tied_embeddings=False,
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ModelArgs:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class KVCacheFull(Exception):
    """A step needed a block of the KV pool and none was left."""


class BlockPool:
    """Which blocks of a KV pool are free. Taken lowest first, so that the blocks one sequence
    takes from an empty pool are consecutive and its keys and values read as one view."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self._free = list(range(blocks))  # a heap: the lowest free block first
        self.taken = 0

    @property
    def free(self) -> int:
        return self.blocks - self.taken

    def take(self, n: int) -> list[int]:
        """`n` blocks, lowest first; `KVCacheFull`, taking none, when fewer are free."""
        if n > self.free:
            raise KVCacheFull(f"{n} blocks asked of a pool with {self.free} free")
        self.taken += n
        return [heapq.heappop(self._free) for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        for block in blocks:
            heapq.heappush(self._free, block)
        self.taken -= len(blocks)


class PagedKVCache:
    """Every layer's keys and values, in blocks of `block_tokens` token slots taken from a pool
    as positions are written: vLLM's PagedAttention layout (kvtui.sim.memory.KVPool), in torch.

    Each layer stores keys and values as `(1, n_kv_head, n_blocks x block_tokens, head_dim)`;
    block b is slots b x block_tokens onwards in every layer. Each sequence has a block table,
    the blocks it holds in order, and position p of it sits in slot
    `table[p // block_tokens] x block_tokens + p % block_tokens`. `reserve` takes the blocks a
    step's new positions need, for every sequence at once, before any layer runs: a step either
    has its slots or raises `KVCacheFull` having changed nothing.

    A sequence whose blocks are consecutive (one sequence in a fresh pool: `BlockPool` hands out
    the lowest first) reads its keys and values as one view of the storage, as a contiguous cache
    would; otherwise (a batch, or a table with gaps) they are gathered by slot. `length` is an
    integer that `reserve` advances: fullness is never inferred from the buffers.
    """

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_kv_head: int,
        head_dim: int,
        *,
        block_tokens: int,
        n_blocks: int,
        max_positions: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (1, n_kv_head, n_blocks * block_tokens, head_dim)
        self.layers: list[LayerKV] = []
        for _ in range(n_layer):
            k = torch.empty(shape, dtype=dtype, device=device)
            self.layers.append(LayerKV(self, k, torch.empty_like(k)))
        self.pool = BlockPool(n_blocks)
        self.batch, self.block_tokens = batch, block_tokens
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.length = 0
        slots = n_blocks * block_tokens
        held = sum(t.numel() * t.element_size() for kv in self.layers for t in (kv.k, kv.v))
        self.bytes_per_position = held // slots if slots else 0
        """Keys and values of one position of one sequence, every layer: measured, the storage's
        bytes over its slots (0 for a pool of no blocks, which never holds a position)."""
        self.block_bytes = block_tokens * self.bytes_per_position
        self.base: int | None = 0
        """The slot of position 0 when there is one sequence and its blocks are consecutive
        (its keys and values are then a view of the storage); None otherwise."""
        self._slots = torch.zeros((batch, max_positions), dtype=torch.long, device=device)
        """Slot of each position of each sequence, filled as blocks are taken."""
        self._consecutive = True
        self._held = 0
        """Blocks every sequence holds at least."""
        self.write_slots = self.read_slots = self._slots[0, :0]
        """The slots a step writes and reads, every sequence's in turn, where `base` is None."""

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the blocks taken: whole blocks, the last one's tail included."""
        return self.pool.taken * self.block_bytes

    @property
    def filled_bytes(self) -> int:
        """Bytes of the positions written so far (keys and values, every sequence)."""
        return self.length * self.batch * self.bytes_per_position

    def reserve(self, start: int, n: int) -> None:
        """Make positions `start..start+n-1` of every sequence writable: take the blocks they
        need (`KVCacheFull`, taking none, when the pool has too few), and address the step's
        writes and reads for the layers."""
        end, bt, limit = start + n, self.block_tokens, self._slots.shape[1]
        if end > limit:
            raise ValueError(f"position {end} is past the cache's {limit}")
        wanted = -(-end // bt)
        short = sum(max(0, wanted - len(t)) for t in self.tables) if wanted > self._held else 0
        new = iter(self.pool.take(short))
        for row, table in enumerate(self.tables):
            while len(table) < wanted:
                block, first = next(new), len(table) * bt
                if table and block != table[-1] + 1:
                    self._consecutive = False
                table.append(block)
                slots = torch.arange(block * bt, (block + 1) * bt, device=self._slots.device)
                self._slots[row, first : first + bt] = slots[: limit - first]
        self._held = min(len(t) for t in self.tables)
        self.length = max(self.length, end)
        if self.batch == 1 and self._consecutive:
            self.base = self.tables[0][0] * bt
        else:
            self.base = None
            self.write_slots = self._slots[:, start:end].reshape(-1)
            self.read_slots = self._slots[:, :end].reshape(-1)

    def free(self) -> None:
        """Give every block back to the pool."""
        for table in self.tables:
            self.pool.give_back(table)
            table.clear()
        self.length = self._held = 0
        self.base, self._consecutive = 0, True


class LayerKV:
    """One layer's keys and values in a `PagedKVCache`, written and read at the slots its
    `reserve` addressed for the step."""

    def __init__(self, owner: PagedKVCache, k: Tensor, v: Tensor) -> None:
        self.owner, self.k, self.v = owner, k, v

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write `k`, `v` `(B, n_kv_head, T, head_dim)` at the positions `reserve` made ready;
        return the keys and values of every position so far, `(B, n_kv_head, length, head_dim)`."""
        owner = self.owner
        base = owner.base
        if base is not None:  # one sequence, consecutive blocks: as a contiguous cache
            end = base + start + k.shape[2]
            self.k[:, :, base + start : end] = k
            self.v[:, :, base + start : end] = v
            return self.k[:, :, base:end], self.v[:, :, base:end]
        B, KV, T, hd = k.shape
        self.k[0].index_copy_(1, owner.write_slots, k.transpose(0, 1).reshape(KV, B * T, hd))
        self.v[0].index_copy_(1, owner.write_slots, v.transpose(0, 1).reshape(KV, B * T, hd))
        return self.read()

    def read(self) -> tuple[Tensor, Tensor]:
        """The keys and values of every position so far, `(B, n_kv_head, length, head_dim)`:
        a view where `base` is set, else gathered by slot."""
        owner = self.owner
        if owner.base is not None:
            end = owner.base + owner.length
            return self.k[:, :, owner.base : end], self.v[:, :, owner.base : end]
        B, S, KV, hd = owner.batch, owner.length, self.k.shape[1], self.k.shape[3]
        slots = owner.read_slots
        return (
            self.k[0].index_select(1, slots).view(KV, B, S, hd).transpose(0, 1),
            self.v[0].index_select(1, slots).view(KV, B, S, hd).transpose(0, 1),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **factory))

    def forward(self, x: Tensor) -> Tensor:
        """`x * rsqrt(mean(x^2) + eps) * weight`, in one call."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_table(n_positions: int, head_dim: int, base: float) -> Tensor:
    """Rotary embeddings (Su et al. 2021): (cos, sin) `(n_positions, head_dim // 2, 2)` by which
    position t turns the pair (x[2i], x[2i+1]): angle t / base^(2i / head_dim).

    Kept real, not complex: `Module.to(dtype)` would cast a complex buffer to real and drop the
    sines. `Transformer.forward` views it as complex, once per call."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(n_positions, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate the pairs of `x` `(B, T, H, head_dim)` by the angles of its positions `(T, 1, hd//2)`
    (or any shapes that broadcast so): one complex multiply (as in Llama's reference code)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (..., head_dim // 2)
    return torch.view_as_real(pairs * freqs).flatten(-2).type_as(x)


# --- one vector times a weight, on a CPU: the kernel measured fastest here --------------------


def row_sum(x: Tensor, weight: Tensor) -> Tensor:
    """`F.linear(x, weight)`, for one vector `x` `(1, 1, in_features)` against a weight stored
    transposed on a CPU, as FBGEMM's weighted sum of the weight's rows (`embedding_bag`).

    Stored transposed (`Transformer.store_weights_transposed`), a weight is in memory one row of
    `out_features` per input feature, and `x @ weight.T` is the sum of those rows weighted by
    `x`'s features: `embedding_bag(mode="sum", per_sample_weights=x)`. Anything else (several
    vectors, the layout as trained, a GPU) goes to `F.linear`.
    """
    if weight.stride(0) == 1 and x.numel() == x.shape[-1] and x.device.type == "cpu":
        rows = weight.t()  # (in_features, out_features), contiguous
        index, offsets = _rows_and_offsets(rows.shape[0])
        out = F.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=x.reshape(-1))
        return out.view(*x.shape[:-1], -1)
    return F.linear(x, weight)


@functools.cache
def _rows_and_offsets(n_rows: int) -> tuple[Tensor, Tensor]:
    """Every row once, in one bag: the indices and offsets `embedding_bag` takes for a matvec.
    Made outside inference mode, so that a later call with gradients may use them too."""
    with torch.inference_mode(False):
        return torch.arange(n_rows), torch.zeros(1, dtype=torch.long)


MATVEC_KERNELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"linear": F.linear}
"""What `choose_matvec` times for one vector against a weight: `F.linear` (MKL's product on a
CPU) and, where torch has FBGEMM (x86 builds), `row_sum`. In the order ties are broken."""
if "fbgemm" in torch.backends.quantized.supported_engines:
    MATVEC_KERNELS["row_sum"] = row_sum


class Linear(nn.Linear):
    """`nn.Linear` without bias, multiplying through `self.matvec`: `F.linear`, unless
    `choose_matvec` measured another kernel faster for one vector against this weight."""

    def __init__(self, in_features: int, out_features: int, **factory: object) -> None:
        super().__init__(in_features, out_features, bias=False, **factory)
        self.matvec: Callable[[Tensor, Tensor], Tensor] = F.linear

    def forward(self, x: Tensor) -> Tensor:
        return self.matvec(x, self.weight)

    def bound(self) -> Callable[[Tensor], Tensor]:
        """`self` as a plain function of `x`: its kernel with its weight bound, for
        `Transformer.decode` (a module call costs more than a small op on a CPU)."""
        return functools.partial(self.matvec, weight=self.weight)


@dataclass(frozen=True)
class MatvecTiming:
    """What `choose_matvec` measured for the weights of one shape."""

    shape: tuple[int, int]
    """`(out_features, in_features)`."""
    weights: int
    """Weights of this shape in the model; the first `timed` of them were timed."""
    timed: int
    seconds: dict[str, float]
    """Best time of each kernel of `MATVEC_KERNELS` for one vector against each timed weight."""

    @property
    def kernel(self) -> str:
        """The fastest (the first of equals)."""
        return min(self.seconds, key=self.seconds.__getitem__)


@torch.inference_mode()
def choose_matvec(
    model: nn.Module, rounds: int = 5, bytes_per_pass: int = 64 << 20
) -> list[MatvecTiming]:
    """Time every kernel of `MATVEC_KERNELS` on the model's own weights, one vector at a time as
    a cached step multiplies them, and give each CPU `Linear` the fastest for its shape.

    Per shape, each kernel multiplies one vector by the model's weights of that shape in turn
    (as many as fit in `bytes_per_pass`, so that they stream from memory as in a step rather
    than sit in a core's cache), `rounds` times after one round to warm up, the kernels taking
    turns; each keeps its best time. Some 30-40 ms for the tiny model. Which kernel wins depends
    on the CPU (FBGEMM's row sum won on an AVX-512 EPYC, MKL on an AVX2 one), so it is measured
    where the model runs.
    """
    groups: dict[tuple[int, int], list[Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu":
            groups.setdefault(tuple(module.weight.shape), []).append(module)
    timings = []
    for shape, linears in groups.items():
        first = linears[0].weight
        weights = [m.weight for m in linears[: max(1, bytes_per_pass // first.nbytes)]]
        x = torch.ones(1, 1, shape[1], dtype=first.dtype)
        seconds = dict.fromkeys(MATVEC_KERNELS, math.inf)
        for warm_up in [True] + [False] * rounds:
            for name, kernel in MATVEC_KERNELS.items():
                t0 = time.perf_counter()
                for w in weights:
                    kernel(x, w)
                if not warm_up:
                    seconds[name] = min(seconds[name], time.perf_counter() - t0)
        timing = MatvecTiming(shape, len(linears), len(weights), seconds)
        for m in linears:
            m.matvec = MATVEC_KERNELS[timing.kernel]
        timings.append(timing)
    return timings


def attend_one(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention of one new query per sequence, `q` `(B, n_head, head_dim)`, over every cached
    key and value `(B, n_kv_head, S, head_dim)`: `(B, 1, n_head * head_dim)`.

    Not is_causal: SDPA aligns that mask top-left, so a single query would see only key 0. Each
    key/value head serves n_head // n_kv_head query heads, which become rows against it: no copy
    of the cache."""
    B, H, hd = q.shape
    group = q.view(B, k.shape[1], -1, hd)  # (B, n_kv_head, n_head // n_kv_head, head_dim)
    return F.scaled_dot_product_attention(group, k, v).reshape(B, 1, H * hd)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, **factory: object) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.n_kv_head, args.head_dim
        self.q_dim = args.n_head * args.head_dim
        self.kv_dim = args.n_kv_head * args.head_dim
        self.wqkv = Linear(args.dim, self.q_dim + 2 * self.kv_dim, **factory)
        self.wo = Linear(self.q_dim, args.dim, **factory)

    def forward(self, x: Tensor, freqs: Tensor, cache: LayerKV | None, start: int) -> Tensor:
        B, T, _ = x.shape
        H, KV, hd = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * KV, hd)
        # Queries and keys are rotated together: one RoPE over n_head + n_kv_head heads.
        qk = apply_rope(qkv[:, :, : H + KV], freqs)
        k = qk[:, :, H:].transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        v = qkv[:, :, H + KV :].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(start, k, v)  # (B, n_kv_head, start + T, head_dim)
        S = k.shape[2]
        # Grouped-query attention: each key/value head serves n_head // n_kv_head query heads.
        if T == 1:
            return self.wo(attend_one(qk[:, 0, :H], k, v))
        q = qk[:, :, :H].transpose(1, 2)  # (B, n_head, T, head_dim)
        if T == S:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            # Several new queries after a cached prefix: causal mask aligned bottom-right.
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.q_dim))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs, **factory: object) -> None:
        super().__init__()
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, **factory)
        self.w2 = Linear(args.intermediate_size, args.dim, **factory)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, **factory: object) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, **factory)
        self.attention = Attention(args, **factory)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, **factory)
        self.feed_forward = FeedForward(args, **factory)

    def forward(self, x: Tensor, freqs: Tensor, cache: LayerKV | None, start: int) -> Tensor:
        x = x + self.attention(self.attention_norm(x), freqs, cache, start)
        return x + self.feed_forward(self.ffn_norm(x))

    def step_weights(self) -> StepWeights:
        """This layer as `Transformer.decode` reads it."""
        attn, ff = self.attention, self.feed_forward
        return StepWeights(
            self.attention_norm.weight,
            attn.wqkv.bound(),
            attn.wo.bound(),
            self.ffn_norm.weight,
            ff.w13.bound(),
            ff.w2.bound(),
        )


class StepWeights(NamedTuple):
    """One layer's weights as the one-token step reads them, gathered by `setup_caches`: on a
    CPU an `nn.Module` attribute costs about a microsecond, and a step would read a hundred."""

    attention_norm: Tensor
    wqkv: Callable[[Tensor], Tensor]
    wo: Callable[[Tensor], Tensor]
    ffn_norm: Tensor
    w13: Callable[[Tensor], Tensor]
    w2: Callable[[Tensor], Tensor]


class Transformer(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """The model with its parameters allocated once, in `dtype` on `device` (torch's
        defaults when None): RMSNorm weights are ones, the rest waits for weights to be loaded
        or for `init_weights`."""
        super().__init__()
        self.args = args
        factory = {"dtype": dtype, "device": device}
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, **factory)
        self.layers = nn.ModuleList(Block(args, **factory) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps, **factory)
        self.output = Linear(args.dim, args.vocab_size, **factory)
        freqs = rope_table(args.max_positions, args.head_dim, args.rope_base).to(device)
        self.register_buffer("rope", freqs, persistent=False)
        self.kv: PagedKVCache | None = None
        self._step: tuple[list[StepWeights], Tensor, Callable[[Tensor], Tensor]] | None = None
        """Each layer's `StepWeights`, the final norm's weight and the output projection, for
        `decode`: gathered with the caches, dropped with them."""
        self.matvec_timings: list[MatvecTiming] = []
        """What `choose_matvec` measured when the weights were laid out for a CPU, if they were."""

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded initialisation as in nanoGPT: normal(0, 0.02), residual projections scaled,
        drawn in place on the parameters' own device and dtype (no copy of the model)."""
        gen = torch.Generator(device=self.output.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = (
                0.02 / math.sqrt(2 * self.args.n_layer)
                if name.endswith(("wo.weight", "w2.weight"))
                else 0.02
            )
            p.normal_(0.0, std, generator=gen)

    def store_weights_transposed(self) -> list[MatvecTiming]:
        """Lay the linear weights out for a CPU's one-token step, where each weight multiplies
        one vector: every weight kept in memory as `(in_features, out_features)`, still seen as
        `(out_features, in_features)` (a transposed view), then each multiplied by the kernel
        `choose_matvec` measures fastest for its shape here. Returns those timings.

        Values, shapes and the state dict's keys are unchanged, though its tensors are no longer
        contiguous (call `.contiguous()` on them before saving with safetensors). MKL streams this
        layout faster than the one as trained, on AVX-512 and AVX2 CPUs alike; prefill and the
        uncached loop, which multiply matrices, run as fast as before
        (`benchmarks/decode_step.py`).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                w = module.weight
                module.weight = nn.Parameter(w.detach().t().contiguous().t(), w.requires_grad)
        self.matvec_timings = choose_matvec(self)
        return self.matvec_timings

    def setup_caches(
        self,
        batch: int,
        max_len: int,
        *,
        block_tokens: int | None = None,
        pool_blocks: int | None = None,
    ) -> PagedKVCache:
        """Make the KV cache for `batch` sequences of up to `max_len` positions, in blocks of
        `block_tokens` (default: one block of `max_len`, a contiguous cache) from a pool of
        `pool_blocks` (default: as many as the sequences can use; storage is never made for more
        than that), and gather the weights (and kernels) as they are now for `decode`."""
        if max_len > self.args.max_positions:
            raise ValueError(f"{max_len} positions is past the model's {self.args.max_positions}")
        block_tokens = block_tokens or max_len
        usable = batch * -(-max_len // block_tokens)
        p = self.output.weight
        self.kv = PagedKVCache(
            self.args.n_layer,
            batch,
            self.args.n_kv_head,
            self.args.head_dim,
            block_tokens=block_tokens,
            n_blocks=usable if pool_blocks is None else min(pool_blocks, usable),
            max_positions=max_len,
            dtype=p.dtype,
            device=p.device,
        )
        layers = [layer.step_weights() for layer in self.layers]
        self._step = (layers, self.norm.weight, self.output.bound())
        return self.kv

    def drop_caches(self) -> None:
        self.kv = None
        self._step = None

    def _rotations(self, start: int, n: int) -> Tensor:
        """The RoPE angles of positions `start..start+n-1` as complex numbers `(n, 1, hd // 2)`;
        `ValueError` past the table."""
        if start + n > self.args.max_positions:
            limit = self.args.max_positions
            raise ValueError(f"position {start + n} is past the model's {limit}")
        return torch.view_as_complex(self.rope[start : start + n, None].float())

    def forward(self, idx: Tensor, start: int = 0, use_cache: bool = False) -> Tensor:
        """Logits `(B, T, vocab)` for tokens `idx` `(B, T)` at positions `start..start+T-1`.

        With `use_cache`, each layer writes its new keys and values into its KV cache and attends
        over everything cached so far; without, attention covers `idx` alone (causal).
        """
        caches: list[LayerKV | None] = [None] * len(self.layers)
        if use_cache:
            if self.kv is None:
                raise RuntimeError("setup_caches() first")
            self.kv.reserve(start, idx.shape[1])
            caches = self.kv.layers
        freqs = self._rotations(start, idx.shape[1])
        x = self.tok_embeddings(idx)  # (B, T, dim)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, freqs, cache, start)
        return self.output(self.norm(x))

    def decode(self, token: Tensor, position: int) -> Tensor:
        """Logits `(B, vocab)` of one token `(B, 1)` at `position`, its keys and values written
        into the KV caches: the cached loop's step. `forward(token, position, use_cache=True)`
        bit for bit (a test checks), written out flat.

        On a CPU the step of a small model is bound by per-call overhead, not arithmetic:
        `forward` makes ~60 module calls and ~100 module attribute lookups besides its ~200 ops.
        Here the same ops run on the weights `setup_caches` gathered, with the heads kept as
        `(B, heads, head_dim)` (no position axis, no transposes); `benchmarks/decode_step.py`
        times the two.
        """
        if token.shape[1] != 1:
            raise ValueError(
                f"decode takes one token per sequence, (B, 1), not {tuple(token.shape)}"
            )
        if self._step is None or self.kv is None:
            raise RuntimeError("setup_caches() first")
        a = self.args
        H, KV, hd, dim, eps = a.n_head, a.n_kv_head, a.head_dim, (a.dim,), a.norm_eps
        B = token.shape[0]
        layers, norm, output = self._step
        freqs = self._rotations(position, 1)
        self.kv.reserve(position, 1)
        x = F.embedding(token, self.tok_embeddings.weight)  # (B, 1, dim)
        for w, cache in zip(layers, self.kv.layers, strict=True):
            qkv = w.wqkv(F.rms_norm(x, dim, w.attention_norm, eps)).view(B, H + 2 * KV, hd)
            qk = apply_rope(qkv[:, : H + KV], freqs)  # (B, n_head + n_kv_head, head_dim)
            # (B, n_kv_head, position + 1, head_dim)
            k, v = cache.update(position, qk[:, H:, None], qkv[:, H + KV :, None])
            x = x + w.wo(attend_one(qk[:, :H], k, v))
            gate, up = w.w13(F.rms_norm(x, dim, w.ffn_norm, eps)).chunk(2, dim=-1)
            x = x + w.w2(F.silu(gate) * up)
        return output(F.rms_norm(x, dim, norm, eps))[:, -1]
