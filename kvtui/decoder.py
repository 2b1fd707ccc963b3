"""The project's own decoder and its KV cache, in torch, without a UI.

A Llama-style decoder in the manner of nanoGPT and gpt-fast (`model.py`): RMSNorm, rotary position
embeddings, a SwiGLU MLP and grouped-query attention with fewer key/value heads than query heads, so
that its KV cache has the same structure as the catalog models' and `kvtui.sim.memory` applies to it
unchanged. The vocabulary is bytes (256 values): no tokenizer file.

The model is `forward(idx, start, use_cache)`: training (a whole sequence, causal), prefill and the
uncached loop run it, and with `use_cache` each layer writes its new keys and values into its
`KVCache`. Two bounded pieces make the cached loop's one-token step cheap on a CPU, each measured
by `benchmarks/decode_step.py`:

- `Transformer.decode`, the step itself: `forward` on one token, bit for bit (a test checks), in
  the fewest Python steps: on a CPU that step is bound by per-call overhead, not arithmetic;
- how a linear layer multiplies one vector (`Linear.matvec`): by whichever kernel `choose_matvec`
  times fastest on the machine that runs, on the model's own weights.
"""

from __future__ import annotations

import functools
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


class KVCache:
    """Preallocated keys and values of one layer, and how many positions are filled.

    Buffers are `(batch, n_kv_head, max_len, head_dim)`; their bytes are exactly
    `2 x batch x n_kv_head x max_len x head_dim x element size`: kvtui.sim's formula, one layer.
    `length` is an integer that `update` advances: fullness is never inferred from the buffers.
    A plain object, not an `nn.Module`: the model keeps its caches in a list of its own, made on
    its weights' device and dtype, and a module's attribute hooks would cost every step.
    """

    def __init__(
        self,
        batch: int,
        n_kv_head: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.bytes_per_position = self.allocated_bytes // max_len
        """Keys and values of one position, measured once: `filled_bytes` is read every step."""

    @property
    def allocated_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def filled_bytes(self) -> int:
        """Bytes of the positions written so far (keys and values)."""
        return self.length * self.bytes_per_position

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write `k`, `v` `(B, n_kv_head, T, head_dim)` at positions `start..start+T-1`; return
        the keys and values of every position so far, `(B, n_kv_head, length, head_dim)`."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise IndexError(f"KV cache holds {self.max_len} positions; asked to write {end}")
        keys, values = self.k, self.v
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        self.length = max(self.length, end)
        return keys[:, :, : self.length], values[:, :, : self.length]


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

    def forward(self, x: Tensor, freqs: Tensor, cache: KVCache | None, start: int) -> Tensor:
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

    def forward(self, x: Tensor, freqs: Tensor, cache: KVCache | None, start: int) -> Tensor:
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
        self.caches: list[KVCache] | None = None
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

    def setup_caches(self, batch: int, max_len: int) -> None:
        """Preallocate one KV cache per layer for `max_len` positions, and gather the weights
        (and kernels) as they are now for `decode`."""
        if max_len > self.args.max_positions:
            raise ValueError(f"{max_len} positions is past the model's {self.args.max_positions}")
        p = self.output.weight
        self.caches = [
            KVCache(
                batch,
                self.args.n_kv_head,
                max_len,
                self.args.head_dim,
                dtype=p.dtype,
                device=p.device,
            )
            for _ in self.layers
        ]
        layers = [layer.step_weights() for layer in self.layers]
        self._step = (layers, self.norm.weight, self.output.bound())

    def drop_caches(self) -> None:
        self.caches = None
        self._step = None

    @property
    def kv_bytes_allocated(self) -> int:
        return sum(c.allocated_bytes for c in self.caches) if self.caches else 0

    @property
    def kv_bytes_filled(self) -> int:
        return sum(c.filled_bytes for c in self.caches) if self.caches else 0

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
        caches = self.caches if use_cache else None
        if use_cache and caches is None:
            raise RuntimeError("setup_caches() first")
        freqs = self._rotations(start, idx.shape[1])
        x = self.tok_embeddings(idx)  # (B, T, dim)
        for i, layer in enumerate(self.layers):
            x = layer(x, freqs, caches[i] if caches else None, start)
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
        if self._step is None or self.caches is None:
            raise RuntimeError("setup_caches() first")
        a = self.args
        H, KV, hd, dim, eps = a.n_head, a.n_kv_head, a.head_dim, (a.dim,), a.norm_eps
        B = token.shape[0]
        layers, norm, output = self._step
        freqs = self._rotations(position, 1)
        x = F.embedding(token, self.tok_embeddings.weight)  # (B, 1, dim)
        for w, cache in zip(layers, self.caches, strict=True):
            qkv = w.wqkv(F.rms_norm(x, dim, w.attention_norm, eps)).view(B, H + 2 * KV, hd)
            qk = apply_rope(qkv[:, : H + KV], freqs)  # (B, n_head + n_kv_head, head_dim)
            # (B, n_kv_head, position + 1, head_dim)
            k, v = cache.update(position, qk[:, H:, None], qkv[:, H + KV :, None])
            x = x + w.wo(attend_one(qk[:, :H], k, v))
            gate, up = w.w13(F.rms_norm(x, dim, w.ffn_norm, eps)).chunk(2, dim=-1)
            x = x + w.w2(F.silu(gate) * up)
        return output(F.rms_norm(x, dim, norm, eps))[:, -1]
