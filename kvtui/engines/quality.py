"""What a KV-cache trick costs in quality, measured on the model, without a UI.

Teacher-forced on held-out text (the model is fed the text, not its own tokens): the nats per byte
of the next byte with the trick and without (the shipped model's tokens are bytes), the KL
divergence of the trick's next-token distribution from the plain cache's, and how often their
likeliest tokens agree. Free-running: the first step at which greedy decoding with the trick
chooses another token than without. A window's cost is also read by position (`nats_by_position`),
past the model's positions where the plain cache cannot go at all.

The plain reference is the model's own forward over the whole text, without a cache. The trick runs
as the engine runs it: its codes written and read back through a `LayoutKVCache` (kvtui.gpu.tricks)
in chunks, its window one position at a time after a prefill that fits it, its shared prefix
through a batch of two whose second sequence shares the first's blocks, and fewer key/value heads
as the averaged model. Text comes from `heldout_ids` (the shipped 4 KB slice, assets/) or the
whole held-out split (benchmarks/tricks.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvtui.engines.generate import generate
from kvtui.engines.loops import Sampling, never
from kvtui.gpu.model import Transformer
from kvtui.gpu.tricks import prefill_shared, setup_layout_caches
from kvtui.paths import HELDOUT_TEXT, asset_path
from kvtui.sim.tricks import KVLayout

CHUNK = 256
"""Positions fed through a layout's cache per call when teacher-forcing (a window: one)."""
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Quality:
    """A trick's quality against the plain cache, on one text."""

    nats_per_byte: float
    """Mean negative log-likelihood of each next byte, with the trick (teacher-forced)."""
    nats_per_byte_baseline: float
    """The same without it (the model's forward, no cache)."""
    kl: float
    """Mean KL divergence of the trick's next-token distribution from the baseline's, nats."""
    top1_agreement: float
    """Share of positions whose likeliest next token is the same with and without."""
    first_divergence: int | None
    """The first step (0-based) at which greedy decoding with the trick chose another token than
    without; None if none did within `greedy_tokens`."""
    positions: int
    """Positions scored, teacher-forced."""
    greedy_tokens: int
    source: str = ""
    """The text scored, in words."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def heldout_ids(n_bytes: int | None = None, device: torch.device | str = "cpu") -> Tensor:
    """The shipped held-out slice (assets/austen-heldout.txt) as byte tokens `(1, n)`, its first
    `n_bytes` (all of it by default)."""
    data = asset_path(HELDOUT_TEXT).read_bytes()
    if n_bytes is not None:
        data = data[:n_bytes]
    return torch.tensor([list(data)], dtype=torch.long, device=device)


@torch.inference_mode()
def forced_logits(model: Transformer, ids: Tensor, layout: KVLayout | None = None) -> Tensor:
    """Next-token logits at every position of `ids` `(1, N)` but the last, `(N - 1, vocab)`,
    teacher-forced: the model's forward over the whole text without a cache, or (a layout that
    keeps codes or a window) through that layout's cache, as the engine would run it."""
    N = ids.shape[1]
    if layout is None or layout.paged_as_is:
        whole: Tensor = model(ids[:, : N - 1])[0]
        return whole
    if layout.prefix_caching:
        raise ValueError("a shared prefix is scored by shared_prefix_logits")
    setup_layout_caches(model, 1, N, layout, block_tokens=BLOCK_TOKENS)
    try:
        first = min(N - 1, CHUNK if layout.window is None else min(CHUNK, layout.window))
        step = CHUNK if layout.window is None else 1
        head = model(ids[:, :first], 0, use_cache=True)[0]
        return torch.cat([head, *_fed_through_cache(model, ids, first, N - 1, step, row=0)])
    finally:
        model.drop_caches()


@torch.inference_mode()
def shared_prefix_logits(model: Transformer, ids: Tensor, layout: KVLayout, prefix: int) -> Tensor:
    """Next-token logits at positions `prefix - 1` onwards of `ids` `(1, N)`, read off the second
    of two sequences of the text whose first `prefix` bytes they share (prefix caching): its
    full blocks of the prefix are the first sequence's, then both are fed the rest in chunks.
    `(N - prefix, vocab)`."""
    N = ids.shape[1]
    rows = ids.expand(2, -1)
    setup_layout_caches(model, 2, N, layout, block_tokens=BLOCK_TOKENS)
    try:
        head = prefill_shared(model, rows[:, :prefix])[1:2]
        return torch.cat([head, *_fed_through_cache(model, rows, prefix, N - 1, CHUNK, row=1)])
    finally:
        model.drop_caches()


def _fed_through_cache(
    model: Transformer, rows: Tensor, start: int, stop: int, step: int, *, row: int
) -> list[Tensor]:
    """Next-token logits of sequence `row` at positions `start` to `stop - 1` of `rows` `(B, N)`,
    fed through the model's cache `step` positions at a time after the `start` it holds."""
    return [
        model(rows[:, i : min(i + step, stop)], i, use_cache=True)[row]
        for i in range(start, stop, step)
    ]


def greedy_tokens_of(
    model: Transformer, prompt: Tensor, n: int, layout: KVLayout | None
) -> list[int]:
    """`n` greedy tokens after `prompt` `(1, P)` through the cached loop (a shared prefix: the
    second of two sequences), as the engine decodes."""
    rows = prompt.expand(2, -1) if layout is not None and layout.prefix_caching else prompt
    steps = generate(
        model, rows, n, Sampling(greedy=True), cache=True, flops_at=never, layout=layout
    )
    return [step.token_ids[-1] for step in steps]


def measure_quality(
    baseline: Transformer,
    model: Transformer,
    layout: KVLayout,
    ids: Tensor,
    *,
    greedy_prompt: int = 64,
    greedy_tokens: int = 128,
    source: str = "",
) -> Quality:
    """The trick's quality on `ids` `(1, N)`: `model` (the baseline itself, or its averaged
    copy for fewer heads) in `layout`, against `baseline` with the plain cache. Teacher-forced
    over the text; free-running greedy from its first `greedy_prompt` bytes (no more than a
    window holds: it prefills a prompt whole) for `greedy_tokens` tokens (no more than the text
    has bytes)."""
    N = ids.shape[1]
    greedy_tokens = min(greedy_tokens, N)
    cache_layout = KVLayout(
        cache_dtype=layout.cache_dtype,
        window=layout.window,
        sinks=layout.sinks,
        prefix_caching=layout.prefix_caching,
    )  # the heads are the model's already
    reference = forced_logits(baseline, ids)
    if cache_layout.prefix_caching:
        prefix = N // 2
        trick = shared_prefix_logits(model, ids, cache_layout, prefix)
        reference = reference[prefix - 1 :]
        targets = ids[0, prefix:]
    else:
        trick = forced_logits(model, ids, cache_layout)
        targets = ids[0, 1:]
    base_logp = F.log_softmax(reference.float(), dim=-1)
    trick_logp = F.log_softmax(trick.float(), dim=-1)
    nll = -trick_logp.gather(1, targets[:, None]).mean().item()
    nll_base = -base_logp.gather(1, targets[:, None]).mean().item()
    kl = (base_logp.exp() * (base_logp - trick_logp)).sum(-1).mean().item()
    top1 = (base_logp.argmax(-1) == trick_logp.argmax(-1)).float().mean().item()
    prompt = ids[:, : min(greedy_prompt, N, layout.window or N)]
    plain = greedy_tokens_of(baseline, prompt, greedy_tokens, None)
    tricked = greedy_tokens_of(model, prompt, greedy_tokens, cache_layout)
    first = next((i for i, (a, b) in enumerate(zip(plain, tricked, strict=True)) if a != b), None)
    return Quality(
        nats_per_byte=nll,
        nats_per_byte_baseline=nll_base,
        kl=max(0.0, kl),
        top1_agreement=top1,
        first_divergence=first,
        positions=targets.numel(),
        greedy_tokens=greedy_tokens,
        source=source,
    )


def step_ms_in_turns(
    ways: dict[str, tuple[Transformer, KVLayout | None]],
    *,
    rounds: int,
    steps: int,
    prompt_tokens: int = 44,
) -> dict[str, list[float]]:
    """Milliseconds per cached step of each way (a model and its cache layout; None: the plain
    cache), the ways taking turns round after round, the order reversed every other round, so
    that a shared machine's drift falls on all alike. Each round of each way: a prefill of
    `prompt_tokens`, then `steps` one-token steps, timed together."""
    prompt = torch.randint(0, 256, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    token = torch.tensor([[65]])

    def ms(model: Transformer, layout: KVLayout | None) -> float:
        n = prompt_tokens + steps
        if layout is None:
            model.setup_caches(1, n, block_tokens=BLOCK_TOKENS)
        else:
            setup_layout_caches(model, 1, n, layout, block_tokens=BLOCK_TOKENS)
        try:
            with torch.inference_mode():
                model(prompt, 0, use_cache=True, last_only=True)
                t0 = time.perf_counter()
                for p in range(prompt_tokens, n):
                    model(token, p, use_cache=True)
                return 1e3 * (time.perf_counter() - t0) / steps
        finally:
            model.drop_caches()

    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(ms(*ways[name]))
    return times


def nats_by_position(logits: Tensor, ids: Tensor, bucket: int) -> list[float]:
    """Mean nats per byte of the next byte in each run of `bucket` positions: position p's
    logits `(N - 1, vocab)` predict `ids[0, p + 1]`."""
    logp = F.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, ids[0, 1 : logits.shape[0] + 1, None])[:, 0]
    return [chunk.mean().item() for chunk in torch.split(nll, bucket)]
