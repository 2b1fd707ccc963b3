"""How the model's one-token step multiplies on a CPU, without a UI: the matrix-vector kernel
measured fastest on the machine that runs (`choose_matvec`), and attention of one new query over a
cache. Each is one bounded piece with the benchmark that justifies it (`benchmarks/decode_step.py`).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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


class Kernel(Protocol):
    """One vector (or more) times a weight: `F.linear(x, weight)`'s signature."""

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor: ...


MATVEC_KERNELS: dict[str, Kernel] = {"linear": cast(Kernel, F.linear)}
"""What `choose_matvec` times for one vector against a weight: `F.linear` (MKL's product on a
CPU) and, where torch has FBGEMM (x86 builds), `row_sum`. In the order ties are broken."""
if "fbgemm" in torch.backends.quantized.supported_engines:
    MATVEC_KERNELS["row_sum"] = row_sum


class Linear(nn.Linear):
    """`nn.Linear` without bias, multiplying through `self.matvec`: `F.linear`, unless
    `choose_matvec` measured another kernel faster for one vector against this weight."""

    def __init__(self, in_features: int, out_features: int, **factory: Any) -> None:
        super().__init__(in_features, out_features, bias=False, **factory)
        self.matvec: Kernel = MATVEC_KERNELS["linear"]

    def forward(self, x: Tensor) -> Tensor:
        return self.matvec(x, self.weight)

    def bound(self) -> Callable[[Tensor], Tensor]:
        """`self` as a plain function of `x`: its kernel with its weight bound, for
        `Transformer.forward`'s gathered layers (a module call costs more than a small op on a
        CPU)."""
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
            out_features, in_features = module.weight.shape
            groups.setdefault((out_features, in_features), []).append(module)
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


def newest_attention(q: Tensor, k: Tensor) -> Tensor:
    """How the newest query of the first sequence weighs the keys it attends, as `attend_one`
    and SDPA weigh them (softmax(q k^T / sqrt(head_dim))), averaged over the query heads: `q`
    `(B, T, n_head, head_dim)` (the last of its T queries is the newest), `k`
    `(B, n_kv_head, S, head_dim)` with the newest query's own key last; `(S,)` in float32,
    summing to 1. For a look after a step, outside its timing: not a decode kernel."""
    newest, keys = q[0, -1].float(), k[0].float()  # (n_head, head_dim), (n_kv_head, S, head_dim)
    n_kv, _, head_dim = keys.shape
    group = newest.view(n_kv, -1, head_dim)  # (n_kv_head, n_head // n_kv_head, head_dim)
    scores = group @ keys.transpose(1, 2) / math.sqrt(head_dim)  # (n_kv_head, group, S)
    return scores.softmax(dim=-1).mean(dim=(0, 1))
