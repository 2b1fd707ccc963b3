"""Decoding with and without a KV cache, step by step and timed, without a UI.

Four named pieces, as in gpt-fast's `generate.py`:

- `prefill` runs the prompt once and fills every layer's KV cache;
- `decode_one_token` feeds one token at its position, computing only its keys and values;
- `cached_loop` is prefill, then one `decode_one_token` per step;
- `uncached_loop` recomputes keys and values for every position at every step (the lesson's
  staircase): the step that emits token t runs the whole sequence so far through the model.

Both loops sample with their own generator seeded the same way and draw once per step, so with the
same prompt, seed and settings they emit the same tokens. Every step is timed after synchronising
the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from kvtui.gpu.model import Transformer
from kvtui.text import encode_bytes


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits."""

    temperature: float = 0.8
    top_k: int = 40
    seed: int = 0
    greedy: bool = False


@dataclass(frozen=True)
class Step:
    """One measured decode step."""

    index: int
    """0-based index of the generated token."""
    position: int
    """Position of the generated token in the sequence."""
    token_id: int
    positions_computed: int
    """Positions whose keys and values this step computed."""
    step_seconds: float
    kv_bytes: int
    """KV-cache bytes filled after this step (0 without a cache)."""


class Sampler:
    """Greedy or seeded top-k sampling; one random draw per step whatever the logits."""

    def __init__(self, sampling: Sampling, device: torch.device) -> None:
        self.sampling = sampling
        self.generator = torch.Generator(device=device).manual_seed(sampling.seed)

    def __call__(self, logits: Tensor) -> Tensor:
        """The next token `(1, 1)` from the last position's logits `(1, vocab)`."""
        s = self.sampling
        if s.greedy or s.temperature <= 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits.float() / s.temperature
        if 0 < s.top_k < logits.size(-1):
            kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(model: Transformer, prompt: Tensor) -> Tensor:
    """Run the prompt `(1, P)` through the model, filling the KV caches; logits `(1, vocab)`."""
    return model(prompt, start=0, use_cache=True)[:, -1]


@torch.inference_mode()
def decode_one_token(model: Transformer, token: Tensor, position: int) -> Tensor:
    """Feed one token `(1, 1)` at `position`, computing only its keys and values."""
    return model.decode(token, position)


@torch.inference_mode()
def recompute_all(model: Transformer, ids: Tensor) -> Tensor:
    """Run the whole sequence `(1, T)` with no cache: keys and values for all T positions again."""
    return model(ids, start=0, use_cache=False)[:, -1]


def cached_loop(
    model: Transformer, prompt: Tensor, n_tokens: int, sampling: Sampling
) -> Iterator[Step]:
    """Prefill, then one new position per step. Caches are preallocated for prompt + n_tokens."""
    device = prompt.device
    P = prompt.shape[1]
    model.setup_caches(batch=1, max_len=P + n_tokens)
    sample = Sampler(sampling, device)
    try:
        token = None
        for i in range(n_tokens):
            synchronize(device)
            t0 = time.perf_counter()
            if i == 0:
                logits, computed = prefill(model, prompt), P
            else:
                logits, computed = decode_one_token(model, token, P + i - 1), 1
            token = sample(logits)
            token_id = int(token.item())  # .item() synchronises too
            synchronize(device)
            seconds = time.perf_counter() - t0
            yield Step(i, P + i, token_id, computed, seconds, model.kv_bytes_filled)
    finally:
        model.drop_caches()


def uncached_loop(
    model: Transformer, prompt: Tensor, n_tokens: int, sampling: Sampling
) -> Iterator[Step]:
    """Every step runs the whole sequence so far: keys and values for every position, again."""
    return recompute_loop(lambda ids: recompute_all(model, ids), prompt, n_tokens, sampling)


def recompute_loop(
    recompute: Callable[[Tensor], Tensor], prompt: Tensor, n_tokens: int, sampling: Sampling
) -> Iterator[Step]:
    """The uncached loop around any model: `recompute(ids)` gives the last position's logits
    `(1, vocab)` of the whole sequence `ids` `(1, T)`, computed from scratch."""
    device = prompt.device
    P = prompt.shape[1]
    ids = torch.empty((1, P + n_tokens), dtype=torch.long, device=device)
    ids[:, :P] = prompt
    sample = Sampler(sampling, device)
    for i in range(n_tokens):
        synchronize(device)
        t0 = time.perf_counter()
        logits = recompute(ids[:, : P + i])
        token = sample(logits)
        ids[:, P + i] = token[0, 0]
        token_id = int(token.item())
        synchronize(device)
        seconds = time.perf_counter() - t0
        yield Step(i, P + i, token_id, P + i, seconds, 0)


def encode_text(text: str, device: torch.device | str = "cpu") -> Tensor:
    """The byte-level tokens of `text`, `(1, n_bytes)`."""
    return torch.tensor([encode_bytes(text)], dtype=torch.long, device=device)
