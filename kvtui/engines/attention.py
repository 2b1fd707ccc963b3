"""The newest query's attention, as a step carries it: bounded in size and rate, and read back.
No torch, no UI.

A torch engine that can see its model's attention (kvtui's own decoder) sends, with some of its
steps, how the step's newest query spread its attention over the keys it read: in one layer
(`RunStarted.attention_layer`), averaged over that layer's query heads, for the batch's first
sequence. That query is at position `position - 1` (the token fed in: the step's output token is
at `position`, and its key and value are written by the next step) and read the keys of every
position before it and its own, `position` of them in all.

Bounded in size: the weights go as at most MAX_SPANS spans of keys (`spans_for`): each position
alone where there are few, else each of the first EXACT_FIRST and the last EXACT_LAST alone and
the middle in buckets that begin on the KV pool's block boundaries; each span's share is an
integer in millionths (ATTENTION_SCALE). Bounded in rate: at most ATTENTION_PER_SECOND steps of a
loop a second carry them, always the first and the last (the engine keeps time, outside the
timed step). `Attention` reads a step's spans back: the share of any range of positions.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

ATTENTION_PER_SECOND = 15.0
"""The most steps of one loop a second that carry attention: a little more than the app redraws
(10 a second), so that each redraw has a fresh one."""

ATTENTION_SCALE = 1_000_000
"""Shares go as integers, in millionths of the query's attention."""

MAX_SPANS = 256
"""The most spans (and shares) a step carries: under 3 KB of JSON however long the context."""

EXACT_FIRST = 16
"""Positions at the start of the context that always go alone: the attention sink's."""

EXACT_LAST = 96
"""Positions at the end of the context that always go alone: the newest, which a picture lists."""

SINK_TOKENS = 4
"""The first positions whose share is called the attention sink (StreamingLLM keeps 4: Xiao et
al. 2023, "Efficient Streaming Language Models with Attention Sinks")."""


def spans_for(first: int, end: int, block_tokens: int) -> list[int]:
    """The first position of each span summarising keys `first..end-1`: every position alone
    when there are at most MAX_SPANS; else the first EXACT_FIRST and the last EXACT_LAST alone,
    and between them buckets of whole blocks of `block_tokens` (each beginning on a block
    boundary but the first), as many blocks to a bucket as keep the spans within MAX_SPANS."""
    if end - first <= MAX_SPANS:
        return list(range(first, end))
    head_end, tail_start = first + EXACT_FIRST, end - EXACT_LAST
    room = MAX_SPANS - EXACT_FIRST - EXACT_LAST - 1  # buckets after the one at head_end
    block = max(1, block_tokens)
    blocks = -(-(tail_start - head_end) // block)  # rounded up
    width = -(-blocks // room) * block  # whole blocks to a bucket, at most `room` buckets

    boundaries = range((head_end // width + 1) * width, tail_start, width)
    return [*range(first, head_end), head_end, *boundaries, *range(tail_start, end)]


def check_attention(spans: Sequence[int], shares: Sequence[int], position: int) -> None:
    """ValueError unless `spans` and `shares` are a step's attention as `spans_for` lays it out:
    as many of each, 1 to MAX_SPANS, spans rising from 0 or more and below `position`, each share
    from 0 to ATTENTION_SCALE."""
    if len(spans) != len(shares) or not 1 <= len(spans) <= MAX_SPANS:
        raise ValueError(
            f"step event: attention has {len(shares)} shares for {len(spans)} spans "
            f"(1 to {MAX_SPANS} of each)"
        )
    if spans[0] < 0 or spans[-1] >= position:
        raise ValueError(
            f"step event: attention spans {spans[0]}..{spans[-1]} not in 0..{position - 1}"
        )
    if any(b <= a for a, b in zip(spans, spans[1:], strict=False)):
        raise ValueError("step event: attention spans do not rise")
    if any(not 0 <= s <= ATTENTION_SCALE for s in shares):
        raise ValueError(f"step event: an attention share is not 0 to {ATTENTION_SCALE:,}")


@dataclass(frozen=True)
class Attention:
    """One step's attention, read back: its newest query at `query_position` over the keys
    `first..query_position`."""

    step: int
    query_position: int
    spans: tuple[int, ...]
    shares: tuple[int, ...]
    """Millionths of the attention each span's keys got."""

    @property
    def first(self) -> int:
        """The first position whose key was read."""
        return self.spans[0]

    @property
    def keys(self) -> int:
        """How many keys the query read (itself included)."""
        return self.query_position + 1 - self.first

    def _end(self, i: int) -> int:
        return self.spans[i + 1] if i + 1 < len(self.spans) else self.query_position + 1

    def at(self, position: int) -> float | None:
        """The share of one position's key, where it went alone; None where it is in a bucket
        of several (or was not read)."""
        i = bisect.bisect_right(self.spans, position) - 1
        if i < 0 or position > self.query_position or self._end(i) - self.spans[i] != 1:
            return None
        return self.shares[i] / ATTENTION_SCALE

    def share(self, start: int, end: int) -> float:
        """The share of the keys at positions `start..end-1`: exact where the range begins and
        ends on span boundaries (a bucket cut by it counts in proportion to its positions)."""
        total = 0.0
        for i, first in enumerate(self.spans):
            last = self._end(i)
            inside = min(end, last) - max(start, first)
            if inside > 0:
                total += self.shares[i] * inside / (last - first)
        return total / ATTENTION_SCALE

    def exact(self, start: int, end: int) -> bool:
        """Whether `share(start, end)` is exact: the range begins and ends on span boundaries."""
        bounds = set(self.spans) | {self.query_position + 1}
        return max(start, self.first) in bounds and min(end, self.query_position + 1) in bounds
