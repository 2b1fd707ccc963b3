"""A served run's server figures, folded once from its `ServerMetrics` polls, without a UI: what
the server reported (first, newest, the peak of its KV-cache usage, what changed while kvtui
watched), and kvtui's own prediction of its KV cache set beside it.

The prediction is kvtui's arithmetic on two inputs, each labelled with where it came from: the
model's KV bytes per token (kvtui.sim.memory on its config.json, as `RunStarted` carries them, in
the server's cache dtype) and the memory the server sized its cache from (vLLM's
`kv_cache_memory_bytes`). A pool of that memory in the server's blocks (kvtui.sim.pool.KVPool)
holds floor(memory / (block tokens x bytes per token)) blocks: that is what vLLM's own rule
gives, so the two agree unless kvtui's bytes per token are wrong (another KV dtype, a layer kvtui
does not count) or the server was told its blocks (`--num-gpu-blocks-override`). A server that
reports no memory figure (a GPU server sizes its cache from free memory and reports None) is
checked the other way round: its blocks at kvtui's bytes per token are how much memory its cache
must take.

Histogram figures (time to first token, inter-token latency) are means over the requests the
server finished while kvtui watched (the change in their sums over the change in their counts),
not since the server started.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction

from kvtui.engines.protocol import RunStarted, ServerMetrics
from kvtui.run.pressure import Pressure
from kvtui.run.served_layout import ServedLayout, read_layout
from kvtui.sim.catalog import UnknownNameError, dtype_bytes, normalize_dtype
from kvtui.sim.pool import KVPool

USAGE_POINTS = 600
"""Polls of KV-cache usage kept for a chart: five minutes at two polls a second."""


@dataclass(frozen=True)
class CapacityCheck:
    """The server's KV cache as it reported it, beside kvtui's prediction of it."""

    blocks: int
    """The server's blocks (num_gpu_blocks)."""
    block_tokens: int
    tokens: int
    """The server's token slots (kv_cache_size_tokens)."""
    kv_dtype: str
    """The KV dtype kvtui predicted for, and why it is that one, in `dtype_source`."""
    dtype_source: str
    kv_bytes_per_token: int
    memory_bytes: int | None
    """What the server sized its cache from (kv_cache_memory_bytes); None where it said not."""
    override: int | None
    """--num-gpu-blocks-override, when the server was given one."""
    predicted: KVPool | None
    """kvtui's pool of `memory_bytes` in the server's blocks (one engine's, one GPU's); None
    without a memory figure."""
    layout: ServedLayout | None = None
    """The blocks read with the server's settings: its engines, the dtype that gives them
    (kvtui.run.served_layout)."""

    @property
    def engines(self) -> int:
        return self.layout.engines if self.layout is not None else 1

    @property
    def predicted_blocks(self) -> int | None:
        return self.predicted.blocks * self.engines if self.predicted is not None else None

    @property
    def predicted_tokens(self) -> int | None:
        return self.predicted.tokens * self.engines if self.predicted is not None else None

    @property
    def agree(self) -> bool | None:
        """Whether the server's blocks are the ones kvtui predicts (None: nothing to compare,
        or the server was told its blocks)."""
        if self.predicted is None or self.override is not None:
            return None
        return self.predicted_blocks == self.blocks

    @property
    def reason(self) -> str:
        """Why the arithmetic disagrees, in words (empty where it agrees)."""
        if self.agree is not False:
            return ""
        return self.layout.reason() if self.layout is not None else ""

    @property
    def blocks_per_engine(self) -> int | None:
        return self.layout.blocks_per_engine if self.layout is not None else self.blocks

    @property
    def implied_bytes(self) -> int:
        """The memory one engine's blocks take at kvtui's bytes per token."""
        blocks = self.blocks_per_engine or self.blocks
        return blocks * self.block_tokens * self.kv_bytes_per_token

    @property
    def ratio(self) -> float | None:
        """The server's blocks over kvtui's predicted ones (2.0: each token takes half the bytes
        kvtui thinks)."""
        predicted = self.predicted_blocks
        return self.blocks / predicted if predicted else None


@dataclass
class ServerWatch:
    """The polls of one served run, folded (`add`): every figure the server's own."""

    first: ServerMetrics | None = None
    """The first poll that answered with figures: the baseline of what changed."""
    latest: ServerMetrics | None = None
    """The newest poll that answered with figures."""
    polls: int = 0
    failed: int = 0
    """Polls that got no figures."""
    error: str = ""
    """Why the newest poll got no figures; empty once one answers again."""
    error_since: float | None = None
    """When the polls began to fail (the run's clock), while they fail."""
    peak_usage: float = 0.0
    usage: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=USAGE_POINTS))
    """(seconds, KV-cache usage) of the newest polls."""
    pressure: Pressure = field(default_factory=Pressure)
    """Its preemptions and limits (kvtui.run.pressure)."""

    def add(self, poll: ServerMetrics) -> None:
        self.polls += 1
        if poll.error:
            self.failed += 1
            if not self.error:
                self.error_since = poll.seconds
            self.error = poll.error
            return
        self.error, self.error_since = "", None
        if self.first is None:
            self.first = poll
        self.latest = poll
        self.pressure.add(poll)
        if poll.kv_usage is not None:
            self.peak_usage = max(self.peak_usage, poll.kv_usage)
            self.usage.append((poll.seconds, poll.kv_usage))

    @property
    def seen_peak(self) -> float | None:
        """The peak KV-cache usage the polls saw; None where none caught the server busy or its
        cache in use (a run shorter than a poll), rather than a peak of 0% no poll looked at."""
        return self.peak_usage if self.pressure.peak_seen or self.peak_usage > 0 else None

    def snapshot(self) -> ServerWatch:
        """A copy that later polls leave as it is (the polls themselves are frozen)."""
        copied = copy.copy(self)
        copied.usage = deque(self.usage, maxlen=self.usage.maxlen)
        copied.pressure = self.pressure.copy()
        return copied

    @property
    def answering(self) -> bool:
        """The newest poll got figures."""
        return self.latest is not None and not self.error

    def _change(self, name: str) -> int | None:
        first, latest = self.first, self.latest
        if first is None or latest is None:
            return None
        before, now = getattr(first, name), getattr(latest, name)
        return None if before is None or now is None else max(0, now - before)

    @property
    def preemptions_seen(self) -> int | None:
        """Preemptions the server counted while kvtui watched."""
        return self._change("preemptions")

    @property
    def prefix_queries_seen(self) -> int | None:
        """Prompt tokens looked up in the prefix cache while kvtui watched."""
        return self._change("prefix_queries_tokens")

    @property
    def prefix_hits_seen(self) -> int | None:
        """Of those, tokens found cached."""
        return self._change("prefix_hits_tokens")

    def _mean(self, quantity: str) -> float | None:
        first, latest = self.first, self.latest
        if first is None or latest is None:
            return None
        sum_0: float | None = getattr(first, f"{quantity}_seconds_sum")
        sum_1: float | None = getattr(latest, f"{quantity}_seconds_sum")
        count_0: int | None = getattr(first, f"{quantity}_count")
        count_1: int | None = getattr(latest, f"{quantity}_count")
        if sum_0 is None or sum_1 is None or count_0 is None or count_1 is None:
            return None
        return max(0.0, (sum_1 - sum_0) / (count_1 - count_0)) if count_1 > count_0 else None

    @property
    def ttft_mean_s(self) -> float | None:
        """The server's mean time to first token over the requests it finished while kvtui
        watched (its histogram's sum and count), or None before one finished."""
        return self._mean("ttft")

    @property
    def ttft_requests(self) -> int | None:
        return self._change("ttft_count")

    @property
    def itl_mean_s(self) -> float | None:
        """The server's mean inter-token latency over the gaps it recorded while kvtui
        watched."""
        return self._mean("itl")

    def capacity(self, started: RunStarted | None) -> CapacityCheck | str:
        """The server's KV cache beside kvtui's prediction, or why there is neither, in words."""
        m = self.latest
        if m is None:
            return self.error or "no figures from the server yet"
        if m.kv_blocks is None or not m.kv_block_tokens:
            return "the server reports no KV-cache blocks (vllm:cache_config_info)"
        if started is None or not started.kv_bytes_per_token:
            why = started.kv_pool_source if started is not None else ""
            return why or "the model's config.json is unknown"
        per_token, dtype, source = started.kv_bytes_per_token, started.dtype, "config.json"
        cache = m.kv_cache_dtype
        if cache and cache != "auto":
            try:
                dtype = normalize_dtype(cache)
            except UnknownNameError:
                return f"the server's KV dtype {cache!r} is not one kvtui knows"
            scale = Fraction(dtype_bytes(dtype)) / Fraction(dtype_bytes(started.dtype))
            per_token = math.ceil(per_token * scale)
            source = "the server's cache_dtype"
        elif cache == "auto":
            source = "cache_dtype auto: the model's dtype in config.json"
        layout = read_layout(
            blocks_total=m.kv_blocks,
            block_tokens=m.kv_block_tokens,
            engines=m.engines,
            memory_bytes=m.kv_cache_memory_bytes,
            elements_per_token=started.kv_bytes_per_token / Fraction(dtype_bytes(started.dtype)),
            element_bytes=Fraction(dtype_bytes(dtype)),
            cache_dtype_told=bool(cache and cache != "auto"),
            layers=started.layers,
            kv_heads=started.kv_heads,
        )
        if layout.differs and layout.fit is not None:  # the blocks say another dtype or split
            per_token, dtype = layout.fit.bytes_per_token, layout.fit.dtype
            source = f"the server's blocks: {layout.fit.words()} (config.json says {started.dtype})"
        predicted = None
        if m.kv_cache_memory_bytes is not None:
            predicted = KVPool(m.kv_cache_memory_bytes, m.kv_block_tokens, per_token)
        tokens = m.kv_capacity_tokens or m.kv_blocks * m.kv_block_tokens
        return CapacityCheck(
            blocks=m.kv_blocks,
            block_tokens=m.kv_block_tokens,
            tokens=tokens,
            kv_dtype=dtype,
            dtype_source=source,
            kv_bytes_per_token=per_token,
            memory_bytes=m.kv_cache_memory_bytes,
            override=m.kv_blocks_override,
            predicted=predicted,
            layout=layout,
        )
