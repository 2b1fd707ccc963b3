"""What a served cache was under while kvtui watched, folded from the server's polls, without a
UI: when vLLM preempted and how many, the usage and queue around each; the most requests it
ran at once while others waited; and from these, why a load did or did not fill the cache.

vLLM's /metrics counts preemptions (`vllm:num_preemptions_total`) but never says which request
was preempted, and counts one when its request's next output comes back to the front end (the
PREEMPTED event rides with it: vllm/v1/metrics/stats.py), so after the fact; nor does it expose
`--max-num-seqs`: what kvtui says of either is read from the polls, and says that it is.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field

from kvtui.engines.protocol import ServerMetrics
from kvtui.format import format_percent

FULL = 0.95
"""Usage from which a cache counts as full (vLLM preempts before its last block)."""
BURSTS = 20
"""Bursts of preemptions kept (the newest)."""


@dataclass(frozen=True)
class Preemptions:
    """Preemptions counted between two polls, and the cache and queue around them."""

    seconds: float
    """When the poll that counted them answered (the run's clock)."""
    count: int
    usage_before: float | None
    usage: float | None
    waiting_before: int | None
    waiting: int | None
    running: int | None


@dataclass
class Pressure:
    """The polls of a served cache, folded for its preemptions and its limits (`add`)."""

    bursts: deque[Preemptions] = field(default_factory=lambda: deque(maxlen=BURSTS))
    preempted: int = 0
    """Preemptions counted while watched, every burst's."""
    first_burst: Preemptions | None = None
    """The first rise of the counter while watched (`bursts` keeps the newest)."""
    busy_polls: int = 0
    """Polls that found a request running or waiting."""
    most_running: int = 0
    most_running_waiting: int = 0
    """The most requests running in a poll where others waited."""
    queued_polls: int = 0
    """Polls where requests waited."""
    most_usage_queued: float = 0.0
    """The highest usage of a poll where requests waited."""
    _last: ServerMetrics | None = None

    def add(self, poll: ServerMetrics) -> None:
        """Fold one poll that answered with figures."""
        last, self._last = self._last, poll
        running, waiting = poll.requests_running or 0, poll.requests_waiting or 0
        if running or waiting:
            self.busy_polls += 1
        self.most_running = max(self.most_running, running)
        if waiting:
            self.queued_polls += 1
            self.most_running_waiting = max(self.most_running_waiting, running)
            self.most_usage_queued = max(self.most_usage_queued, poll.kv_usage or 0.0)
        if last is None or last.preemptions is None or poll.preemptions is None:
            return
        count = poll.preemptions - last.preemptions
        if count > 0:
            self.preempted += count
            self.bursts.append(
                burst := Preemptions(
                    poll.seconds,
                    count,
                    last.kv_usage,
                    poll.kv_usage,
                    last.requests_waiting,
                    poll.requests_waiting,
                    poll.requests_running,
                )
            )
            self.first_burst = self.first_burst or burst

    def copy(self) -> Pressure:
        copied = copy.copy(self)
        copied.bursts = deque(self.bursts, maxlen=self.bursts.maxlen)
        return copied

    @property
    def peak_seen(self) -> bool:
        """A poll found the server busy: its peak usage was looked at while a request ran (a
        run shorter than a poll has none, and no peak to show)."""
        return self.busy_polls > 0

    def held_back(self) -> bool:
        """Requests waited while the cache never came near full, and vLLM never preempted (it
        does only when it has no block to give: the cache was full between two polls):
        something other than the cache (how many sequences run at once) held them."""
        return self.queued_polls > 0 and self.most_usage_queued < FULL and not self.preempted

    def filled(self, peak_usage: float) -> bool:
        """Whether the cache was full while watched: a poll saw it so, or vLLM preempted."""
        return peak_usage >= FULL or self.preempted > 0

    def limit_words(self, capacity_tokens: int | None, max_model_len: int | None) -> str:
        """Why requests waited with room in the cache, in words (empty where they did not)."""
        if not self.held_back() or not self.most_running_waiting:
            return ""
        n = self.most_running_waiting
        line = (
            f"at most {n:,} running while others waited, the cache at most "
            f"{self.most_usage_queued:.0%} full: a limit on sequences at once (max-num-seqs, "
            "inferred: not in /metrics)"
        )
        if capacity_tokens and max_model_len:
            most = n * max_model_len
            if most < capacity_tokens:
                line += (
                    f"; {n:,} x max_model_len {max_model_len:,} = {most:,} tokens < "
                    f"{capacity_tokens:,}: this cache cannot fill"
                )
        return line

    def burst_words(self, newest: int = 3) -> str:
        """When vLLM's preemption counter rose while watched, and the cache and queue around
        the first rises and the newest, in words."""
        if not self.bursts:
            return ""

        def said(b: Preemptions) -> str:
            usage = f"{b.usage:.0%}" if b.usage is not None else "?"
            before = f"{b.usage_before:.0%} -> " if b.usage_before is not None else ""
            waiting = f", {b.waiting:,} waiting" if b.waiting is not None else ""
            return f"{b.count:,} at {b.seconds:.1f} s (cache {before}{usage}{waiting})"

        bursts = list(self.bursts)[-newest:]
        shown = [said(b) for b in bursts]
        if self.first_burst is not None and self.first_burst is not bursts[0]:
            shown = [said(self.first_burst), "...", *shown]
        return (
            f"preempted {self.preempted:,} while watched, as vLLM's counter rose: "
            + "; ".join(shown)
            + ". vLLM does not say which requests, and counts each with the request's next "
            "output, after the fact."
        )


NOT_SEEN_WHY = "no poll caught a request running: shorter than a poll"
"""Why a run or a load has no peak usage to show."""


def peak_words(peak: float | None, *, why: bool = False) -> str:
    """The peak KV-cache usage the polls saw (`ServerWatch.seen_peak`): "peak 93%", or "peak not
    seen" (with `why`, why not) rather than a peak of 0% that no poll looked at."""
    if peak is not None:
        return f"peak {format_percent(peak)}"
    return f"peak not seen ({NOT_SEEN_WHY})" if why else "peak not seen"


def fill_words(
    peak: float | None,
    pressure: Pressure,
    capacity_tokens: int | None,
    max_model_len: int | None,
) -> list[str]:
    """Whether a load filled the server's cache and made it preempt, and why not where it did
    not, in a few lines (every figure the server's, from the polls while it ran; `peak`: the
    peak usage they saw, `ServerWatch.seen_peak`)."""
    peak_usage = peak or 0.0
    if not pressure.peak_seen and not pressure.preempted:  # (its counter rising is its word)
        return ["vLLM's cache: no poll caught a request running (the load was shorter than a poll)"]
    if peak_usage >= FULL:
        full = "full"
    elif pressure.preempted:
        full = "full between polls: vLLM preempts only when it has no block to give"
    else:
        full = "not full"
    lines = [
        f"vLLM's cache: {peak_words(peak)} "
        f"({full}), {pressure.preempted:,} preemptions "
        "while watched"
    ]
    lines += [
        w
        for w in (pressure.burst_words(), pressure.limit_words(capacity_tokens, max_model_len))
        if w
    ]
    if not pressure.filled(peak_usage) and not pressure.held_back():
        lines.append(
            "no request waited with the cache below full: the load asked for less than it holds"
            if not pressure.queued_polls
            else "requests waited only once the cache was full"
        )
    return lines
