"""The decode loops, in torch, without a UI: with and without a KV cache, step by step, timed, and
counted as the model computed them.

In the manner of gpt-fast's `generate.py`, generic over models (the `hf:` engine runs them through
transformers' forward):

- `cached_loop`: prefill (the prompt's P positions in one pass, filling the cache), then one new
  position per step against the cache;
- `recompute_loop`: no cache; the step that emits token t runs all P + t - 1 positions so far.

Both take a batch of prompts `(B, P)` and decode the B rows together, one model call per step.
Both sample with their own `Sampler`, row r seeded `seed + r`, one draw per row per step, so with
the same prompt, seed and settings they emit the same tokens, row by row. Every step is timed after
synchronising the device.

What a step computed is observed, not restated: the positions are read off a `PositionCounter`
(kvtui.gpu.counting) before and after the step, and on sampled steps (`counts_flops`) the step's
model call is run once more, outside its timing, under torch's `FlopCounterMode`, so that the
counter's overhead never reaches a measured time. That second call writes the same keys and
values at the same positions (`CachedModel.replay_flops` sets the cache up for it, or declines),
and never samples.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kvtui.gpu.counting import PositionCounter, count_flops
from kvtui.gpu.device import synchronize
from kvtui.gpu.model import Transformer
from kvtui.gpu.tricks import LayoutKVCache, prefill_shared, setup_layout_caches
from kvtui.sim.pool import DEFAULT_BLOCK_SIZE
from kvtui.sim.tricks import KVLayout
from kvtui.text import encode_bytes


def never(index: int) -> bool:
    """Count no step's FLOPs."""
    return False


def counts_flops(index: int) -> bool:
    """Whether the loops count the FLOPs of step `index` (0-based): the first two (a cached
    loop's prefill and first one-token step) and every power of two, so a run of n steps counts
    about log2(n) of them and the replays cost about one more of the longest uncached step."""
    return index < 2 or index & (index - 1) == 0


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits."""

    temperature: float = 0.8
    top_k: int = 40
    seed: int = 0
    greedy: bool = False


@dataclass(frozen=True)
class Step:
    """One measured decode step of a batch of sequences (one sequence: a batch of 1)."""

    index: int
    """0-based index of the generated token."""
    position: int
    """Position of the generated tokens in their sequences."""
    token_ids: tuple[int, ...]
    """Each row's token."""
    positions_computed: int
    """Positions whose keys and values this step computed, every row's: observed, the rows of
    keys the model's layers produced during the step (`PositionCounter`)."""
    step_seconds: float
    kv_bytes: int
    """KV-cache bytes filled after this step, every row's (0 without a cache)."""
    kv_bytes_allocated: int = 0
    """KV-cache bytes allocated after this step: whole blocks, or the buffers a cache holds."""
    flops_counted: int | None = None
    """FLOPs torch's FlopCounterMode counted over this step's model call, on the steps
    `counts_flops` samples (None on the others, and where the model cannot replay a step)."""

    @property
    def token_id(self) -> int:
        """Row 0's token."""
        return self.token_ids[0]


class Sampler:
    """Greedy or seeded top-k sampling of `batch` rows: row r draws from its own generator,
    seeded `seed + r`, one draw per row per step whatever the logits."""

    def __init__(self, sampling: Sampling, device: torch.device, batch: int = 1) -> None:
        self.sampling = sampling
        self.generators = [
            torch.Generator(device=device).manual_seed(sampling.seed + row) for row in range(batch)
        ]

    def __call__(self, logits: Tensor) -> Tensor:
        """The next tokens `(B, 1)` from the last position's logits `(B, vocab)`."""
        s = self.sampling
        if s.greedy or s.temperature <= 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits.float() / s.temperature
        if 0 < s.top_k < logits.size(-1):
            kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if len(self.generators) == 1:
            return torch.multinomial(probs, 1, generator=self.generators[0])
        return torch.cat(  # each row from its own stream: row r's tokens do not depend on B
            [
                torch.multinomial(probs[row : row + 1], 1, generator=generator)
                for row, generator in enumerate(self.generators)
            ]
        )


class CachedModel(Protocol):
    """What the cached loop needs of a model whose KV cache is already set up."""

    def prefill(self, prompt: Tensor) -> Tensor:
        """Run the prompts `(B, P)` into the cache; the last position's logits `(B, vocab)`."""
        ...

    def decode_one_token(self, token: Tensor, position: int) -> Tensor:
        """Feed one token per row `(B, 1)` at `position`, computing only their keys and values;
        their logits `(B, vocab)`."""
        ...

    def kv_bytes_filled(self, positions: int) -> int:
        """Bytes of keys and values the cache holds for the first `positions` positions of
        every row."""
        ...

    def kv_bytes_allocated(self) -> int:
        """Bytes of the cache's storage taken so far, measured from its tensors."""
        ...

    def kv_bytes_per_position(self) -> int | None:
        """Bytes of one position of one sequence, every layer, measured from the cache's
        tensors (codes and scales); None where the cache does not say."""
        ...

    def replay_flops(self, call: Callable[[], Tensor], start: int) -> int | None:
        """The FLOPs of a step's call (whose new positions begin at `start`) run once more,
        leaving the cache as the step left it (the same keys and values written over
        themselves); None where the cache cannot replay a step."""
        ...


Counter = Callable[[], int]
"""Positions the model has computed so far (kvtui.gpu.counting.PositionCounter)."""


Call = Callable[[], Tensor]
"""One step's model call: the last position's logits `(B, vocab)`."""


def _timed_steps(
    calls: Iterator[tuple[Call, Callable[[], int | None]]],
    sample: Sampler,
    device: torch.device,
    counted: Counter,
    flops_at: Callable[[int], bool],
) -> Iterator[tuple[Tensor, tuple[int, ...], int, float, int | None]]:
    """Run each model call as one step: its tokens `(B, 1)` and as ids, the positions the model
    computed in it, its wall time after device sync, and (on sampled steps) the FLOPs its
    `replay` counted over the call run again, outside the timing."""
    for i, (call, replay) in enumerate(calls):
        before = counted()
        synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            token = sample(call())  # (B, 1)
        ids = tuple(token[:, 0].tolist())  # .tolist() synchronises too
        synchronize(device)
        seconds = time.perf_counter() - t0
        computed = counted() - before
        flops = replay() if flops_at(i) else None
        yield token, ids, computed, seconds, flops


def cached_loop(
    model: CachedModel,
    prompt: Tensor,
    n_tokens: int,
    sampling: Sampling,
    counted: Counter,
    flops_at: Callable[[int], bool] = counts_flops,
) -> Generator[Step, None, None]:
    """Prefill (P positions of each of the B rows of `prompt` `(B, P)`), then one new position
    per row per step: P + n - 1 positions in all, per row, if the model computes only what it
    must (`counted` says what it did)."""
    B, P = prompt.shape
    tokens: list[Tensor] = []

    def calls() -> Iterator[tuple[Call, Callable[[], int | None]]]:
        for i in range(n_tokens):
            if i == 0:
                call, start = functools.partial(model.prefill, prompt), 0
            else:
                call, start = (
                    functools.partial(model.decode_one_token, tokens[-1], P + i - 1),
                    P + i - 1,
                )
            yield call, functools.partial(model.replay_flops, call, start)

    sample = Sampler(sampling, prompt.device, B)
    run = _timed_steps(calls(), sample, prompt.device, counted, flops_at)
    for i, (token, ids, computed, seconds, flops) in enumerate(run):
        tokens[:] = [token]
        filled, allocated = model.kv_bytes_filled(P + i), model.kv_bytes_allocated()
        yield Step(i, P + i, ids, computed, seconds, filled, allocated, flops)


def recompute_loop(
    recompute: Callable[[Tensor], Tensor],
    prompt: Tensor,
    n_tokens: int,
    sampling: Sampling,
    counted: Counter,
    flops_at: Callable[[int], bool] = counts_flops,
) -> Generator[Step, None, None]:
    """The uncached loop around any model: `recompute(ids)` gives the last position's logits
    `(B, vocab)` of the whole sequences `ids` `(B, T)`, computed from scratch. The step that
    emits token t (1-based) recomputes all P + t - 1 positions so far of each row of `prompt`
    `(B, P)`."""
    B, P = prompt.shape
    ids = torch.empty((B, P + n_tokens), dtype=torch.long, device=prompt.device)
    ids[:, :P] = prompt
    steps = (functools.partial(recompute, ids[:, : P + i]) for i in range(n_tokens))
    calls = ((call, functools.partial(count_flops, call)) for call in steps)  # a pure call
    sample = Sampler(sampling, prompt.device, B)
    run = _timed_steps(calls, sample, prompt.device, counted, flops_at)
    for i, (token, row_ids, computed, seconds, flops) in enumerate(run):
        ids[:, P + i] = token[:, 0]
        yield Step(i, P + i, row_ids, computed, seconds, 0, 0, flops)


@dataclass
class DecoderCache:
    """kvtui's own decoder as a `CachedModel`, its paged KV cache set up (`setup_caches`): one
    `forward` for the prefill and every step."""

    model: Transformer

    def prefill(self, prompt: Tensor) -> Tensor:
        kv = self.model.kv
        if isinstance(kv, LayoutKVCache) and kv.layout.prefix_caching:
            return prefill_shared(
                self.model, prompt
            )  # the later rows compute what they don't share
        logits: Tensor = self.model(prompt, start=0, use_cache=True, last_only=True)
        return logits[:, -1]

    def decode_one_token(self, token: Tensor, position: int) -> Tensor:
        logits: Tensor = self.model(token, start=position, use_cache=True)
        return logits[:, -1]

    def kv_bytes_filled(self, positions: int) -> int:
        assert self.model.kv is not None
        return self.model.kv.filled_bytes

    def kv_bytes_allocated(self) -> int:
        assert self.model.kv is not None
        return self.model.kv.allocated_bytes

    def kv_bytes_per_position(self) -> int | None:
        assert self.model.kv is not None
        return self.model.kv.bytes_per_position

    def replay_flops(self, call: Call, start: int) -> int | None:
        """A step again: `reserve` takes no block twice and the writes land where they did."""
        return count_flops(call)


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


TRIM_EVERY_STEPS = 64
"""How often the uncached loop hands freed host memory back, in steps: each step's activations
cover the whole sequence and grow with it, and glibc would keep the largest so far."""


def trim_host_memory() -> None:
    """Hand the host memory a finished loop freed back to the system (glibc's `malloc_trim`).

    glibc keeps much of what the uncached loop's long steps freed (the whole sequence's
    activations: +70 MiB of RSS after 4,000 positions of the tiny model, of which all but 5 MiB
    is free), so an engine's RSS would climb run after run without it. Elsewhere than glibc, a
    no-op."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim` from the running process's own symbols; None without glibc."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
