"""One run's figures, folded once from its events, without a UI.

A run's events (kvtui.engines.protocol: one `RunStarted`, the `StepSample`s of one or both loops,
a `RunFinished` per loop, or a `RunFailed`) go one at a time into `RunSummary.apply`. The screens
(kvtui.run.live.LiveRun) and `kvtui bench` both read their figures from it, so each figure is
worked out in one place:

- per loop (`LoopSummary`): steps, positions computed, the first step's time and the later steps'
  mean, tokens per second of each sequence and of all of them, the bandwidth the steps imply
  (the formula's bytes read over the measured time), FLOPs torch counted on the sampled steps
  against the formula's for the same steps, and the KV cache filled and allocated;
- per run (`RunSummary`): the KV cache by kvtui.sim.memory.kv_bytes (sliding windows cap a
  layer's positions) and whether the measured bytes equal it, the first step at which the two
  loops chose different tokens, and the speedups over the steps both loops have done.

Counts are the whole batch's, as the protocol's: `batch` B sequences' positions, FLOPs and bytes;
`positions_cumulative` alone is per sequence (the lesson's staircase). Each step is kept as six
numbers in columns (48 bytes), so a run of MAX_TOKENS steps a loop stays a few MiB; a `snapshot`
of the fold, the screens' copy, shares them as views (kvtui.run.columns) and costs no more at the
run's end than at its start.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtui.engines.protocol import (
    LOOPS,
    Event,
    Loop,
    RunFailed,
    RunFinished,
    RunStarted,
    ServerMetrics,
    StepSample,
)
from kvtui.run.columns import Column
from kvtui.sim.catalog import ModelSpec
from kvtui.sim.memory import kv_bytes, kv_bytes_per_token
from kvtui.sim.pool import KVPool
from kvtui.sim.tricks import positions_held, tokens_before_full

if TYPE_CHECKING:
    from kvtui.run.fleet import FleetWatch
    from kvtui.run.serving import ServerWatch

RECENT_STEPS = 64
"""Later steps whose bandwidth `LoopSummary.recent_bandwidth_bytes_per_s` takes the median of."""


@dataclass
class LoopSummary:
    """One loop's steps so far, as columns of numbers, and the figures made of them (seconds,
    bytes, positions; None where a figure has nothing to stand on yet)."""

    loop: Loop
    batch: int = 1
    """Sequences each step's counts cover."""
    token_ids: Column[int] = field(default_factory=lambda: Column("q"))
    """Row 0's token of each step."""
    step_seconds: Column[float] = field(default_factory=lambda: Column("d"))
    seconds_cumulative: Column[float] = field(default_factory=lambda: Column("d"))
    """Seconds after each step, summed from the first."""
    positions_cumulative: Column[int] = field(default_factory=lambda: Column("q"))
    """Positions computed after each step, summed from the first, per sequence (the engine's
    count over the batch, divided by it)."""
    positions_computed: int = 0
    """Positions computed over every step, every sequence's."""
    first_positions: int = 0
    """Positions the first step computed, every sequence's: the prompt (a prefill, cached)."""
    bandwidth: Column[float] = field(default_factory=lambda: Column("d"))
    """Bytes read by the formula per measured second, of each timed step after the first."""
    intensity: Column[float] = field(default_factory=lambda: Column("d"))
    """FLOPs per byte read, both by the formula, of each step after the first that reads."""
    flops_counted: int | None = None
    """FLOPs torch's FlopCounterMode counted, summed over the sampled steps (None: none was)."""
    flops_formula: int = 0
    """FLOPs of the same sampled steps by the formula (kvtui.sim.work.step_cost)."""
    flops_sampled_steps: int = 0
    last: StepSample | None = None
    finished: RunFinished | None = None

    def add(self, sample: StepSample, batch: int = 1) -> None:
        """Fold one step of this loop in (`batch`: sequences each of its counts covers)."""
        self.batch = batch
        later = self.last is not None
        self.token_ids.append(sample.token_id)
        self.step_seconds.append(sample.step_seconds)
        self.seconds_cumulative.append(self.seconds_total + sample.step_seconds)
        done = self.positions_cumulative[-1] if later else 0
        self.positions_cumulative.append(done + sample.positions_computed // batch)
        self.positions_computed += sample.positions_computed
        if not later:
            self.first_positions = sample.positions_computed
        else:
            if sample.step_seconds > 0:
                self.bandwidth.append(sample.bytes_read / sample.step_seconds)
            if sample.bytes_read > 0:
                self.intensity.append(sample.flops / sample.bytes_read)
        if sample.flops_counted is not None:
            self.flops_counted = (self.flops_counted or 0) + sample.flops_counted
            self.flops_formula += sample.flops
            self.flops_sampled_steps += 1
        self.last = sample

    def snapshot(self) -> LoopSummary:
        """A read-only copy that later steps leave as it is, whatever the run's length: each
        column a view of its steps so far (kvtui.run.columns), the events shared (frozen)."""
        copied = copy.copy(self)
        copied.token_ids = self.token_ids.snapshot()
        copied.step_seconds = self.step_seconds.snapshot()
        copied.seconds_cumulative = self.seconds_cumulative.snapshot()
        copied.positions_cumulative = self.positions_cumulative.snapshot()
        copied.bandwidth = self.bandwidth.snapshot()
        copied.intensity = self.intensity.snapshot()
        return copied

    # --- steps and time ------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        return len(self.step_seconds)

    @property
    def seconds_total(self) -> float:
        return self.seconds_cumulative[-1] if self.seconds_cumulative else 0.0

    @property
    def last_positions(self) -> int:
        """Positions the newest step computed, per sequence."""
        return self.last.positions_computed // self.batch if self.last is not None else 0

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: the first step (the prompt's pass; a prefill, cached)."""
        return self.step_seconds[0] if self.step_seconds else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: the later steps' mean (the whole batch's)."""
        later = self.steps - 1
        return (self.seconds_total - self.step_seconds[0]) / later if later > 0 else None

    def tpot_over(self, steps: int) -> float | None:
        """The mean time of the first `steps` steps after the first (all of them, if fewer): a
        step's time grows with the context it reads, so runs of different lengths compare their
        speed over the same steps."""
        later = self.step_seconds[1 : steps + 1]
        return sum(later) / len(later) if later else None

    @property
    def tokens_per_s_per_sequence(self) -> float | None:
        """Steps per second: each sequence gets one token a step."""
        total = self.seconds_total
        return self.steps / total if self.steps and total > 0 else None

    @property
    def tokens_per_s_total(self) -> float | None:
        """Tokens per second of all the batch's sequences together."""
        each = self.tokens_per_s_per_sequence
        return self.batch * each if each is not None else None

    @property
    def first_step_positions_per_s(self) -> float | None:
        """Positions the first step computed per second, every sequence's (a prefill reads the
        whole prompt in one pass)."""
        first = self.ttft_s
        return self.first_positions / first if first else None

    @property
    def later_step_positions_per_s(self) -> float | None:
        """Positions the later steps computed per second, every sequence's."""
        if self.steps < 2:
            return None
        seconds = self.seconds_total - self.step_seconds[0]
        work = self.positions_computed - self.first_positions
        return work / seconds if seconds > 0 else None

    def step_seconds_quantile(self, q: float) -> float | None:
        """The step time below which a share `q` of the steps fall (nearest rank, 0 <= q < 1)."""
        if not self.step_seconds:
            return None
        ordered = sorted(self.step_seconds)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def step_seconds_p50(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None

    @property
    def step_seconds_first_quartile(self) -> float | None:
        """The median of the first quarter of the steps (at least one)."""
        if not self.step_seconds:
            return None
        return statistics.median(self.step_seconds[: max(1, self.steps // 4)])

    @property
    def step_seconds_last_quartile(self) -> float | None:
        """The median of the last quarter of the steps (at least one)."""
        if not self.step_seconds:
            return None
        return statistics.median(self.step_seconds[-max(1, self.steps // 4) :])

    @property
    def step_seconds_growth_per_position(self) -> float | None:
        """How much longer each later step takes than the one before (its position one more):
        the least-squares slope of the later steps' times, where the steps resolve it. None
        where they do not: under three later steps, or a slope under twice its standard error
        (noise makes such a slope come out negative as often as not, and a step is never
        quicker for holding more). A slope, not a time per position: see `seconds_per_position`
        for that."""
        ys = self.step_seconds[1:]
        n = len(ys)
        if n < 3:
            return None
        mx, my = (n - 1) / 2, statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in range(n))
        slope = sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sxx
        residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in enumerate(ys))
        standard_error = math.sqrt(residual / (n - 2) / sxx)
        return slope if slope > 0 and slope > 2 * standard_error else None

    @property
    def seconds_per_position(self) -> float | None:
        """The later steps' time over the positions they computed, every sequence's: what one
        position costs as this loop computes them (measured, never negative). The reciprocal
        of `later_step_positions_per_s`."""
        rate = self.later_step_positions_per_s
        return 1 / rate if rate else None

    # --- bytes and FLOPs -----------------------------------------------------------------------

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """The median bandwidth of the later steps: the formula's bytes read over the measured
        time (the first step, a prefill in the cached loop, reads another way)."""
        return statistics.median(self.bandwidth) if self.bandwidth else None

    def recent_bandwidth_bytes_per_s(self, steps: int = RECENT_STEPS) -> float | None:
        """As `bandwidth_bytes_per_s`, over the newest `steps` later steps only."""
        return statistics.median(self.bandwidth[-steps:]) if self.bandwidth else None

    @property
    def flops_per_byte(self) -> float | None:
        """The later steps' mean arithmetic intensity, by the formula."""
        return statistics.fmean(self.intensity) if self.intensity else None

    @property
    def flops_ratio(self) -> float | None:
        """FLOPs counted over the formula's, on the sampled steps: 1 when the model computed
        what the lesson says."""
        if self.flops_counted is None or not self.flops_formula:
            return None
        return self.flops_counted / self.flops_formula

    @property
    def kv_bytes_filled(self) -> int | None:
        """KV bytes of the positions written, every sequence's: as the loop's end measured them,
        else after its newest step; None before either."""
        finished = self.finished
        if finished is not None and finished.kv_bytes_filled is not None:
            return finished.kv_bytes_filled
        return self.last.kv_bytes if self.last is not None else None

    @property
    def kv_bytes_allocated(self) -> int | None:
        """KV bytes allocated (whole blocks), as `kv_bytes_filled` is read."""
        finished = self.finished
        if finished is not None and finished.kv_bytes_allocated is not None:
            return finished.kv_bytes_allocated
        return self.last.kv_bytes_allocated if self.last is not None else None

    @property
    def kv_bytes_per_position(self) -> int | None:
        """Keys and values of one position of one sequence, every layer, as the loop's end
        measured them from its cache's tensors; None before it ends, or without a cache."""
        return self.finished.kv_bytes_per_position if self.finished is not None else None

    @property
    def cached_positions(self) -> int:
        """Positions each sequence's cache holds after the newest step: every one before the new
        token (its own keys and values are written when it is fed back in, at the next step)."""
        return self.last.position if self.last is not None else 0


@dataclass
class RunSummary:
    """A run folded from its events, one at a time (`apply`), as far as it has got."""

    spec: ModelSpec | None = None
    """The shape whose sliding windows the KV formula caps positions by; None: the windows the
    run's start states (`windowed_spec`)."""
    started: RunStarted | None = None
    loops: dict[str, LoopSummary] = field(
        default_factory=lambda: {loop: LoopSummary(loop) for loop in LOOPS}
    )
    failure: str = ""
    """A RunFailed's message (empty unless the run failed)."""
    _fleet: FleetWatch | None = field(default=None, init=False, repr=False)
    first_divergence: int | None = None
    """The first step at which the two loops chose different tokens; None while none has."""
    _kv_spec: ModelSpec | None = field(default=None, init=False, repr=False)
    _checked: int = field(default=0, init=False, repr=False)
    """Steps whose tokens have been compared (both loops had made them)."""

    def apply(self, event: Event) -> None:
        """Fold one engine event in."""
        if isinstance(event, StepSample):
            self.loops[event.loop].add(event, self.batch)
            self._compare()
        elif isinstance(event, RunStarted):
            self.started = event
            self._kv_spec = _checked_spec(self.spec or windowed_spec(event), event)
        elif isinstance(event, RunFinished):
            self.loops[event.loop].finished = event
        elif isinstance(event, RunFailed):
            self.failure = event.message
        elif isinstance(event, ServerMetrics):
            self.fleet.add(event)

    def snapshot(self) -> RunSummary:
        """A copy that later events leave as it is (each loop's `snapshot`, the server's)."""
        copied = copy.copy(self)
        copied.loops = {name: loop.snapshot() for name, loop in self.loops.items()}
        copied._fleet = None if self._fleet is None else self._fleet.snapshot()
        return copied

    @property
    def fleet(self) -> FleetWatch:
        """A served run's (`vllm:`) servers' figures, as their polls reported them, a watch per
        replica of a fleet (kvtui.run.fleet); made on first need (kvtui's own engines have
        none, and do not import it)."""
        if self._fleet is None:
            from kvtui.run.fleet import FleetWatch

            self._fleet = FleetWatch()
        return self._fleet

    @property
    def server(self) -> ServerWatch:
        """The server the decode streams from (the fleet's first replica)."""
        return self.fleet.decode

    def _compare(self) -> None:
        """Compare the tokens of the steps both loops have newly made (each step once)."""
        a, b = self.loops["uncached"].token_ids, self.loops["cached"].token_ids
        n = min(len(a), len(b))
        while self.first_divergence is None and self._checked < n:
            if a[self._checked] != b[self._checked]:
                self.first_divergence = self._checked
            self._checked += 1

    def loop(self, name: Loop) -> LoopSummary:
        return self.loops[name]

    @property
    def batch(self) -> int:
        """Sequences decoded together (1 before the run starts)."""
        return self.started.batch if self.started else 1

    # --- both loops over the same steps --------------------------------------------------------

    @property
    def compared_steps(self) -> int:
        """Steps that both loops have made."""
        return min(self.loops["uncached"].steps, self.loops["cached"].steps)

    @property
    def identical(self) -> bool:
        """Both loops made steps and chose the same tokens over all they both made."""
        return self.compared_steps > 0 and self.first_divergence is None

    def work_over(self, steps: int) -> tuple[int, int]:
        """Positions the uncached and the cached loop computed over their first `steps` steps,
        per sequence (both loops must have run that far)."""
        if steps == 0:
            return 0, 0
        return (
            self.loops["uncached"].positions_cumulative[steps - 1],
            self.loops["cached"].positions_cumulative[steps - 1],
        )

    def positions_speedup(self) -> float | None:
        """Uncached over cached positions computed, over the steps both loops have made."""
        uncached, cached = self.work_over(self.compared_steps)
        return uncached / cached if cached else None

    def wall_speedup(self) -> float | None:
        """Uncached over cached seconds, over the steps both loops have made."""
        n = self.compared_steps
        if n == 0:
            return None
        uncached = self.loops["uncached"].seconds_cumulative[n - 1]
        cached = self.loops["cached"].seconds_cumulative[n - 1]
        return uncached / cached if cached > 0 and uncached > 0 else None

    @property
    def last_quartile_ratio(self) -> float | None:
        """Uncached over cached median step time over each loop's last quarter of steps: how
        far apart the loops' steps have grown by the end."""
        uncached = self.loops["uncached"].step_seconds_last_quartile
        cached = self.loops["cached"].step_seconds_last_quartile
        return uncached / cached if uncached and cached else None

    @property
    def messages(self) -> list[str]:
        """What the loops said as they ended (the cached loop's first), each message once."""
        ends = (self.loops["cached"].finished, self.loops["uncached"].finished)
        return list(dict.fromkeys(f.message for f in ends if f is not None and f.message))

    # --- the KV pool ---------------------------------------------------------------------------

    @property
    def pool(self) -> KVPool | None:
        """The engine's KV pool, as its start said; None before the start, or for an engine
        without a pool (`hf:`)."""
        started = self.started
        if started is None or started.kv_capacity_bytes is None or not started.kv_block_tokens:
            return None
        return KVPool(
            started.kv_capacity_bytes, started.kv_block_tokens, started.kv_bytes_per_token
        )

    @property
    def tokens_before_full(self) -> int | None:
        """Tokens the cached loop generates before the pool is full, predicted in the run's
        layout (kvtui.sim.tricks); None without a pool, or where it never fills."""
        pool, started = self.pool, self.started
        if pool is None or started is None:
            return None
        return tokens_before_full(pool, started.layout, started.prompt_tokens, started.batch)

    def kv_blocks_allocated(self, loop: Loop = "cached") -> int | None:
        """Whole blocks a loop's cache holds: its allocated bytes over a block's; None before a
        step, or for an engine that keeps no blocks."""
        started, allocated = self.started, self.loops[loop].kv_bytes_allocated
        if started is None or allocated is None or not started.kv_block_tokens:
            return None
        block_bytes = started.kv_block_tokens * started.kv_bytes_per_token
        return allocated // block_bytes if block_bytes else None

    # --- the KV cache against its formula ------------------------------------------------------

    def kv_bytes_formula(self, loop: Loop = "cached") -> int | None:
        """The KV bytes a loop's cache should hold after its newest step, every sequence's: by
        kvtui.sim.memory.kv_bytes for the engine's shape where its windows are known (a sliding
        layer keeps at most its window), else the run's bytes per token x positions x batch.
        None for the uncached loop (it keeps no cache) and before a step."""
        trace = self.loops[loop]
        started = self.started
        if loop != "cached" or started is None or trace.last is None or started.served_by:
            return None  # a served run's cache is the server's: kvtui holds none of it
        positions = trace.cached_positions
        layout = started.layout
        if not layout.paged_as_is:  # a window or shared blocks: the positions it holds
            held = positions_held(layout, positions, started.batch, started.kv_shared_tokens)
            return held * started.kv_bytes_per_token
        if self._kv_spec is not None:
            return kv_bytes(self._kv_spec, positions, started.batch, started.dtype)
        return started.batch * started.kv_bytes_per_token * positions

    def kv_matches_formula(self, loop: Loop = "cached") -> bool | None:
        """Whether a loop's filled KV bytes equal the formula's; None with nothing to compare."""
        formula, filled = self.kv_bytes_formula(loop), self.loops[loop].kv_bytes_filled
        return None if formula is None or filled is None else filled == formula


def windowed_spec(started: RunStarted) -> ModelSpec | None:
    """The shape of the cache of the engine that sent `started`, where one of its model's layers
    keeps a sliding window, as its start states it: its layers, key/value heads and head size,
    and its windows (`RunStarted.sliding_window`: `sim:`'s catalog model, one GPU's share;
    `hf:`'s config.json, read in the engine's process). The KV formula reads nothing else of a
    shape: its other sizes are 0. None where no layer slides (kvtui's own decoder, `tiny` and
    `shape:`, keeps every position in every layer). Reads no file: the fold runs on the UI's
    thread."""
    if started.sliding_window is None:
        return None
    return ModelSpec(
        name=started.model,
        layers=started.layers,
        heads=started.kv_heads,
        kv_heads=started.kv_heads,
        head_dim=started.head_dim,
        hidden_size=0,
        intermediate_size=0,
        vocab_size=0,
        params=0,
        max_context=started.max_positions or 0,
        sliding_window=started.sliding_window,
        sliding_layers=started.sliding_layers,
    )


def _checked_spec(spec: ModelSpec | None, started: RunStarted) -> ModelSpec | None:
    """`spec` if it describes the run's cache (the same KV bytes per token in the run's dtype),
    else None: a formula of another shape would report a mismatch the engine did not make."""
    if spec is None:
        return None
    try:
        same = kv_bytes_per_token(spec, started.dtype) == started.kv_bytes_per_token
    except (ValueError, KeyError):  # a dtype kvtui does not know
        return None
    return spec if same else None


def summarize_events(events: Iterable[Event], spec: ModelSpec | None = None) -> RunSummary:
    """A whole run's events, folded."""
    summary = RunSummary(spec=spec)
    for event in events:
        summary.apply(event)
    return summary
