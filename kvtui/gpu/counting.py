"""What a model really computed, observed rather than restated, without a UI.

Two observations, both of the model as it runs:

- positions: the rows of keys the model's layers produced (kvtui's own decoder counts them itself,
  `Transformer.key_rows`; a transformers model is watched by a forward hook on each layer's key
  projection), so a "cached" step that secretly recomputed the history shows it;
- FLOPs: torch's `FlopCounterMode` over a call of the model, its matrix products counted by
  torch's own formulas and attention by the query-key pairs its mask lets through (4 x head_dim
  FLOPs per pair per query head: scores and the weighted sum, as kvtui.sim.work counts them), and
  the CPU's one-vector kernel (`embedding_bag`, kvtui.gpu.kernels.row_sum) as the product it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from kvtui.gpu.model import Transformer

KEY_PROJECTIONS = ("k_proj", "key", "qkv_proj", "c_attn", "query_key_value", "W_pack", "Wqkv")
"""The names transformers' architectures give the layer that makes each layer's keys (Llama,
Mistral, Qwen, Gemma: `k_proj`; fused ones: Phi-3 `qkv_proj`, GPT-2 `c_attn`, Falcon and GPT-NeoX
`query_key_value`, Baichuan `W_pack`, MPT `Wqkv`)."""


class PositionCounter:
    """Positions a model has computed so far, per sequence summed over the batch: the rows of
    keys its layers produced, divided by the layers that produced them.

    kvtui's decoder counts its own rows; any other model gets a forward hook on each module named
    as a key projection (`KEY_PROJECTIONS`), or, where it has none, on its input embedding (the
    positions entering the model). `close` removes the hooks."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._rows = 0
        self._hooks: list[Any] = []
        self.watched = "the key rows the model counts itself"
        """What is counted, in words."""
        warm_flop_counter()
        if isinstance(model, Transformer):
            self._layers = model.args.n_layer
            return
        found = [
            m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in KEY_PROJECTIONS
        ]
        if found:
            self.watched = f"rows out of {len(found)} key projections"
        else:
            embeddings = model.get_input_embeddings()  # type: ignore[operator]
            found = [embeddings]
            self.watched = "positions entering the input embedding"
        self._layers = len(found)
        self._hooks = [m.register_forward_hook(self._count) for m in found]

    def _count(self, module: nn.Module, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        self._rows += out.shape[:-1].numel()

    def __call__(self) -> int:
        """Positions computed so far."""
        rows = self._model.key_rows if isinstance(self._model, Transformer) else self._rows
        return rows // self._layers

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _attention_flops(query: Tensor, key: Tensor, is_causal: bool, mask: Tensor | None) -> int:
    """4 x head_dim FLOPs for each query head's pair with each key it may attend: all of them,
    the causal ones (aligned top-left, as SDPA's is_causal is) or the ones a mask allows (a
    boolean mask's True entries; an additive one's finite entries, as SDPA turns a boolean mask
    into before its CPU kernel)."""
    *lead, T, hd = query.shape
    S = key.shape[-2]
    heads = 1
    for n in lead:
        heads *= n
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
        pairs = int(allowed.expand(*lead, T, S).sum()) // heads
    elif is_causal:
        pairs = sum(min(i + 1, S) for i in range(T))
    else:
        pairs = T * S
    return 4 * hd * heads * pairs


def _cpu_flash(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout: float = 0.0,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
    *args: Any,
    **kwargs: Any,
) -> int:
    return _attention_flops(query, key, is_causal, attn_mask)


def _cuda_flash(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout: float = 0.0,
    is_causal: bool = False,
    *args: Any,
    **kwargs: Any,
) -> int:
    return _attention_flops(query, key, is_causal, None)


def _cuda_efficient(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Tensor | None = None,
    compute_log_sumexp: bool = False,
    dropout: float = 0.0,
    is_causal: bool = False,
    *args: Any,
    **kwargs: Any,
) -> int:
    return _attention_flops(query, key, is_causal, attn_bias)


def _embedding_bag(
    weight: Tensor, indices: Tensor, offsets: Tensor, *args: Any, **kwargs: Any
) -> int:
    """A weighted sum of rows (kvtui.gpu.kernels.row_sum's matvec): a multiply-add per element
    of every row it takes."""
    return 2 * indices.numel() * weight.shape[-1]


def _wrapped(formula: Callable[..., int]) -> Callable[..., int]:
    """`formula` as FlopCounterMode calls a custom one: on the op's own arguments (`_get_raw`,
    so that a mask's contents can be counted), with the op's output as `out_val`."""

    def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    count._get_raw = True  # type: ignore[attr-defined]
    return count


_aten = torch.ops.aten
FORMULAS: dict[Any, Callable[..., int]] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _wrapped(_cpu_flash),
    _aten._scaled_dot_product_flash_attention: _wrapped(_cuda_flash),
    _aten._scaled_dot_product_efficient_attention: _wrapped(_cuda_efficient),
    _aten._scaled_dot_product_cudnn_attention: _wrapped(_cuda_efficient),
    _aten._embedding_bag_forward_only: _wrapped(_embedding_bag),
    _aten._embedding_bag: _wrapped(_embedding_bag),
}
"""FlopCounterMode's formulas for the ops its own table leaves at 0 or counts as a full square."""


def count_flops(call: Callable[[], object]) -> int:
    """The FLOPs torch's `FlopCounterMode` counts over `call()`, with `FORMULAS`."""
    with torch.inference_mode(), FlopCounterMode(display=False, custom_mapping=FORMULAS) as fc:
        call()
    return int(fc.get_total_flops())


def flop_counter_warm() -> bool:
    """Whether `warm_flop_counter` has run in this process (its next call is free)."""
    return warm_flop_counter.cache_info().currsize > 0


@functools.cache
def warm_flop_counter() -> None:
    """Pay FlopCounterMode's first use (about a second on a CPU: torch sets up its dispatch
    machinery) once, while a model loads, rather than after a run's first token."""
    count_flops(lambda: torch.ones(2, 2) @ torch.ones(2, 2))
