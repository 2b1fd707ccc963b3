"""kvtui's decoder through the loops (kvtui.engines.loops) without an engine: for scripts,
benchmarks, tests and the quality measure (kvtui.engines.quality) that want steps, or a
sequence's logits, with no run around them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator

import torch
from torch import Tensor

from kvtui.engines.loops import (
    DecoderCache,
    Sampling,
    Step,
    cached_loop,
    counts_flops,
    recompute_loop,
)
from kvtui.gpu.counting import PositionCounter
from kvtui.gpu.model import Transformer
from kvtui.gpu.tricks import setup_layout_caches
from kvtui.sim.pool import DEFAULT_BLOCK_SIZE
from kvtui.sim.tricks import KVLayout
from kvtui.text import encode_bytes


def recompute_all(model: Transformer, ids: Tensor) -> Tensor:
    """Run the whole sequences `(B, T)` with no cache: keys and values for all T positions of
    every row again (and the newest position's logits only)."""
    logits: Tensor = model(ids, start=0, use_cache=False, last_only=True)
    return logits[:, -1]


def generate(
    model: Transformer,
    prompt: Tensor,
    n_tokens: int,
    sampling: Sampling,
    *,
    cache: bool,
    flops_at: Callable[[int], bool] = counts_flops,
    layout: KVLayout | None = None,
) -> Generator[Step, None, None]:
    """kvtui's decoder through the cached loop (its caches set up for the run and dropped after)
    or the uncached one, on prompts `(B, P)`: for scripts, benchmarks and tests that want steps
    without an engine. `flops_at` picks the steps whose FLOPs are counted (a benchmark of the
    decode path alone counts none: `never`); `layout` keeps the cache in one of kvtui.gpu.tricks'
    layouts (fewer key/value heads is the model's to have: kvtui.gpu.tricks.average_kv_heads)."""
    counted = PositionCounter(model)
    if not cache:
        recompute = functools.partial(recompute_all, model)
        yield from recompute_loop(recompute, prompt, n_tokens, sampling, counted, flops_at)
        return
    batch, max_len = prompt.shape[0], prompt.shape[1] + n_tokens
    if layout is not None and not layout.paged_as_is:
        setup_layout_caches(model, batch, max_len, layout, block_tokens=DEFAULT_BLOCK_SIZE)
    else:  # in the engine's blocks, from a pool that holds the run
        model.setup_caches(batch=batch, max_len=max_len, block_tokens=DEFAULT_BLOCK_SIZE)
    try:
        yield from cached_loop(DecoderCache(model), prompt, n_tokens, sampling, counted, flops_at)
    finally:
        model.drop_caches()


def encode_text(text: str, device: torch.device | str = "cpu") -> Tensor:
    """The byte-level tokens of `text`, `(1, n_bytes)`."""
    return torch.tensor([encode_bytes(text)], dtype=torch.long, device=device)
