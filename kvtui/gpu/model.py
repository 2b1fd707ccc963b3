"""kvtui's own decoder, in torch, without a UI: one `forward` for training, prefill, the cached
step and the uncached loop.

A Llama-style decoder in the manner of nanoGPT and gpt-fast (`model.py`): RMSNorm, rotary position
embeddings, a SwiGLU MLP and grouped-query attention with fewer key/value heads than query heads, so
that its KV cache has the same structure as the catalog models' and `kvtui.sim.memory` applies to it
unchanged. The vocabulary is bytes (256 values): no tokenizer file.

`Transformer.forward(idx, start, use_cache)` is the only code that runs the model: a whole
sequence (training, the uncached loop), a prompt into the cache (prefill) and one token against
it (the cached step) are the same lines. With `use_cache` each layer writes its new keys and
values into the `PagedKVCache` (kvtui.gpu.cache). On a CPU a small model's step is bound by
per-call overhead, not arithmetic, so `forward` runs flat over each layer's weights as
`LayerWeights` (gathered once with the caches, or per call without them) rather than through a
module call per norm and projection; and each linear layer multiplies one vector by the kernel
`kvtui.gpu.kernels.choose_matvec` timed fastest here. `benchmarks/decode_step.py` and
`benchmarks/compare_transformers.py` measure both.

The model counts what it computes: `key_rows` is the rows of keys its layers' projections have
produced, summed over layers, so the loops report the positions a step really ran, observed
rather than restated (a "cached" step that recomputed the history would show it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvtui.gpu.cache import KVCache, LayerCache, PagedKVCache
from kvtui.gpu.kernels import Linear, MatvecTiming, attend_one, choose_matvec
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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class RMSNorm(nn.Module):
    """An RMSNorm's weight: `x * rsqrt(mean(x^2) + eps) * weight`, applied by `forward` as one
    `F.rms_norm` call."""

    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **factory))


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
    exact = x.dtype == torch.float32  # a cast, even to itself, is a dispatch a step can save
    pairs = torch.view_as_complex((x if exact else x.float()).unflatten(-1, (-1, 2)))  # type: ignore[no-untyped-call]
    rotated = torch.view_as_real(pairs * freqs).flatten(-2)  # (..., head_dim)
    return rotated if exact else rotated.type_as(x)


class Attention(nn.Module):
    """One layer's attention weights: the query, key and value projections as one matrix, and the
    output projection."""

    def __init__(self, args: ModelArgs, **factory: Any) -> None:
        super().__init__()
        q_dim = args.n_head * args.head_dim
        kv_dim = args.n_kv_head * args.head_dim
        self.wqkv = Linear(args.dim, q_dim + 2 * kv_dim, **factory)
        self.wo = Linear(q_dim, args.dim, **factory)


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x), w1 and w3 as one matrix."""

    def __init__(self, args: ModelArgs, **factory: Any) -> None:
        super().__init__()
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, **factory)
        self.w2 = Linear(args.intermediate_size, args.dim, **factory)


class Block(nn.Module):
    """One layer's parameters, named as the shipped weights name them."""

    def __init__(self, args: ModelArgs, **factory: Any) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, **factory)
        self.attention = Attention(args, **factory)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, **factory)
        self.feed_forward = FeedForward(args, **factory)

    def weights(self) -> LayerWeights:
        """This layer as `Transformer.forward` reads it."""
        attn, ff = self.attention, self.feed_forward
        return LayerWeights(
            self.attention_norm.weight,
            attn.wqkv.bound(),
            attn.wo.bound(),
            self.ffn_norm.weight,
            ff.w13.bound(),
            ff.w2.bound(),
        )


class LayerWeights(NamedTuple):
    """One layer's weights as `forward` reads them: on a CPU an `nn.Module` attribute costs about
    a microsecond, and a step would read a hundred."""

    attention_norm: Tensor
    wqkv: Callable[[Tensor], Tensor]
    wo: Callable[[Tensor], Tensor]
    ffn_norm: Tensor
    w13: Callable[[Tensor], Tensor]
    w2: Callable[[Tensor], Tensor]


class Weights(NamedTuple):
    """The whole model as `forward` reads it."""

    embedding: Tensor
    layers: list[LayerWeights]
    norm: Tensor
    output: Callable[[Tensor], Tensor]
    rotations: Tensor
    """The RoPE table as complex numbers, `(max_positions, 1, head_dim // 2)`."""


class Transformer(nn.Module):
    rope: Tensor
    """The RoPE table `(max_positions, head_dim // 2, 2)`: (cos, sin) of each position's angles."""

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
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, **factory)
        self.layers = nn.ModuleList(Block(args, **factory) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps, **factory)
        self.output = Linear(args.dim, args.vocab_size, **factory)
        freqs = rope_table(args.max_positions, args.head_dim, args.rope_base).to(device)
        self.register_buffer("rope", freqs, persistent=False)
        self.kv: KVCache | None = None
        self._weights: Weights | None = None
        """The weights (and kernels) as `forward` reads them, gathered with the caches and
        dropped with them; without caches, gathered on every call (training replaces them)."""
        self.matvec_timings: list[MatvecTiming] = []
        """What `choose_matvec` measured when the weights were laid out for a CPU, if they were."""
        self.key_rows = 0
        """Rows of keys the layers' projections have produced so far, summed over layers: B x T
        per layer per call. The loops read it before and after a step to count the positions it
        really computed."""
        self.watch_layer: int | None = None
        """A layer whose queries and keys `forward` keeps (`watched`) for a look after the call;
        None (the default, and in training) keeps nothing."""
        self.watched: tuple[Tensor, Tensor] | None = None
        """The watched layer's queries `(B, T, n_head, head_dim)` and the keys they attended
        `(B, n_kv_head, S, head_dim)` in the latest call: references, not copies (the engine
        reads the newest query's attention from them outside the timed step)."""

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
        than that), and gather the weights (and kernels) as they are now for `forward`."""
        if max_len > self.args.max_positions:
            raise ValueError(f"{max_len} positions is past the model's {self.args.max_positions}")
        block_tokens = block_tokens or max_len
        usable = batch * -(-max_len // block_tokens)
        p = self.output.weight
        kv = PagedKVCache(
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
        self.adopt_cache(kv)
        return kv

    def adopt_cache(self, kv: KVCache) -> None:
        """Decode with `kv` (a cache made elsewhere: kvtui.gpu.tricks' layouts), the weights
        gathered for it as `setup_caches` gathers them."""
        self.kv = kv
        self._weights = self._gather()

    def drop_caches(self) -> None:
        self.kv = None
        self._weights = None
        self.watched = None  # it may hold a view of the cache's storage

    def rotations(self) -> Tensor:
        """The RoPE table as complex numbers, `(max_positions, 1, head_dim // 2)`."""
        return torch.view_as_complex(self.rope.to(torch.float32)).unsqueeze(1)

    def _gather(self) -> Weights:
        layers = [cast(Block, layer).weights() for layer in self.layers]
        return Weights(
            self.tok_embeddings.weight,
            layers,
            self.norm.weight,
            self.output.bound(),
            self.rotations(),
        )

    def forward(
        self, idx: Tensor, start: int = 0, use_cache: bool = False, last_only: bool = False
    ) -> Tensor:
        """Logits `(B, T, vocab)` for tokens `idx` `(B, T)` at positions `start..start+T-1`;
        with `last_only`, `(B, 1, vocab)`: the newest position's, all a decode step needs (the
        output head runs once, as transformers' `logits_to_keep=1`).

        With `use_cache`, each layer writes its new keys and values into the KV cache (the
        positions reserved first, for every layer at once: `KVCacheFull` changes nothing) and
        attends over everything cached so far; without, attention covers `idx` alone (causal).
        Prefill is `forward(prompt, 0, True)`, the cached step `forward(token, position, True)`,
        the uncached step `forward(ids)`.
        """
        B, T = idx.shape
        kv = self.kv if use_cache else None
        if start + T > self.args.max_positions and not (kv and kv.keys_rotated_on_read):
            limit = self.args.max_positions
            raise ValueError(f"position {start + T} is past the model's {limit}")
        caches: list[LayerCache | None] = [None] * self.args.n_layer
        rope_at, rotate_keys = start, True
        if use_cache:
            if kv is None:
                raise RuntimeError("setup_caches() first")
            kv.reserve(start, T)
            caches = list(kv.layers)
            rope_at, rotate_keys = kv.rope_start(start, T), not kv.keys_rotated_on_read
        w = self._weights or self._gather()
        a = self.args
        H, KV, hd, dim, eps = a.n_head, a.n_kv_head, a.head_dim, (a.dim,), a.norm_eps
        freqs = w.rotations.narrow(0, rope_at, T)  # (T, 1, head_dim // 2)
        rows, watch = 0, self.watch_layer
        x = F.embedding(idx, w.embedding)  # (B, T, dim)
        for i, (layer, cache) in enumerate(zip(w.layers, caches, strict=True)):
            qkv = layer.wqkv(F.rms_norm(x, dim, layer.attention_norm, eps))
            qkv = qkv.view(B, T, H + 2 * KV, hd)
            rows += qkv.shape[0] * qkv.shape[1]  # the rows this layer's projection produced
            if rotate_keys:  # queries and keys together: one RoPE over n_head + n_kv_head heads
                qk = apply_rope(qkv.narrow(2, 0, H + KV), freqs)
                q, k = qk.narrow(2, 0, H), qk.narrow(2, H, KV)
            else:  # the cache rotates keys by their index in it as it reads them
                q, k = apply_rope(qkv.narrow(2, 0, H), freqs), qkv.narrow(2, H, KV)
            k = k.transpose(1, 2)  # (B, n_kv_head, T, head_dim)
            v = qkv.narrow(2, H + KV, KV).transpose(1, 2)
            if cache is not None:
                k, v = cache.update(start, k, v)  # (B, n_kv_head, positions attended, head_dim)
            if i == watch:
                self.watched = (q, k)
            x = x + layer.wo(attend(q, k, v))
            gate, up = layer.w13(F.rms_norm(x, dim, layer.ffn_norm, eps)).chunk(2, dim=-1)
            x = x + layer.w2(F.silu(gate) * up)
        self.key_rows += rows
        if last_only:
            x = x.narrow(1, T - 1, 1)
        return w.output(F.rms_norm(x, dim, w.norm, eps))


def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention of T new queries `q` `(B, T, n_head, head_dim)` over the keys and values of every
    position so far `(B, n_kv_head, S, head_dim)`, the last T of them the new ones':
    `(B, T, n_head * head_dim)`. Grouped-query: each key/value head serves n_head // n_kv_head
    query heads, without a copy of the cache."""
    B, T, H, hd = q.shape
    if T == 1:  # one query per sequence: not is_causal, which would align it with key 0
        return attend_one(q[:, 0], k, v)
    S = k.shape[2]
    q = q.transpose(1, 2)  # (B, n_head, T, head_dim)
    if T == S:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:  # several new queries after a cached prefix: the causal mask aligned bottom-right
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return y.transpose(1, 2).reshape(B, T, H * hd)
