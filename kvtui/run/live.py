"""The running engine as the screens see it: what has arrived so far, bounded, without widgets.

The app's decode worker posts batches of engine events, at most RUN_UPDATES_PER_SECOND a second;
the app, the one owner of the run's `LiveRun`, folds them in and hands the screens a read-only
`snapshot()` of it as its `run` var, which the screens follow (`data_bind`): a screen redraws when
the run changes, never per event and never by polling, so a run of 10,000 steps a second still
costs at most that rate in redraws.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvtui.engines.attention import Attention
from kvtui.engines.capabilities import NOTHING, Capabilities
from kvtui.engines.factory import parse_engine
from kvtui.engines.protocol import (
    Loop,
    RunFailed,
    RunFinished,
    RunProgress,
    RunSettings,
    RunStarted,
    ServerMetrics,
    StepSample,
)
from kvtui.errors import EngineError
from kvtui.run.columns import Series
from kvtui.run.pool import LivePool
from kvtui.run.summary import LoopSummary, RunSummary

if TYPE_CHECKING:
    from kvtui.run.fleet import FleetWatch
    from kvtui.run.serving import ServerWatch

RunState = Literal["starting", "running", "paused", "done", "failed", "stopped"]

RUN_UPDATES_PER_SECOND = 10
"""How often the run the screens see may change: the one throttle between the engine and the
screen (the app's reader posts at most this often; a burst coalesces into the latest)."""

MAX_TEXT_CHARS = 6000
"""Characters of each token stream kept for display (the tail)."""

FIRST_PIECES = 16
"""Generated tokens kept one by one from the start of a loop, for the cache picture's rows."""
LAST_PIECES = 128
"""Generated tokens kept one by one at the end of a loop (the picture lists the newest)."""

SERVED_CACHE = (
    "The server keeps this run's keys and values: they are not seen over HTTP. Screen 3 shows "
    "its blocks as the server reports them."
)
"""What the cache picture says of a served (`vllm:`) run."""


@dataclass(frozen=True)
class CachePicture:
    """One step of one loop, as the picture draws it (built by the screen from the live run)."""

    loop: Loop
    how: str = ""
    """"measured", "modelled" or "" (nothing has run yet)."""
    step: int | None = None
    """The step drawn, 0-based; None before the first."""
    rows: int = 0
    """Positions whose keys and values the step's query read: the rows the cache holds after
    the step (cached), or the rows the step computed again (uncached)."""
    new_rows: int = 0
    """Rows the step wrote: the prompt's on a prefill, one on a later cached step, all of them
    without a cache."""
    pieces: Mapping[int, str] = field(default_factory=dict)
    """The token text of the positions the picture may list (the first and the newest)."""
    next_piece: str | None = None
    """The text of the token the step emitted: its keys and values are the next step's row."""
    block_tokens: int | None = None
    """Token slots per block of the pool (None: the engine keeps no pool)."""
    blocks: int | None = None
    """Blocks the cache held after the step."""
    row_bytes: int | None = None
    """Keys and values of one row, every layer: the bytes held over the rows."""
    layers: int = 0
    attention: Attention | None = None
    attention_layer: int | None = None
    attention_heads: int | None = None
    no_attention: str = ""
    """Why there are no weights, in words ("" where there are)."""
    behind: int = 0
    """Steps the loop has run past the one whose attention is drawn (weights come at most 15
    times a second; the rows, the query and the counts are always the step drawn)."""
    prompt: int = 0
    """Positions of the prompt: the rows are `prompt` + the first `rows - prompt` tokens
    generated (the newest token's row is written by the next step)."""
    unseen: str = ""
    """Why this run's cache cannot be drawn, in words (a served run's is the server's), or ""."""

    @property
    def cached(self) -> bool:
        return self.loop == "cached"


@dataclass
class LoopTrace:
    """What one loop (cached or uncached) has produced so far, as the screens draw it: the tail
    of its text and its chart series here, its figures in `figures` (kvtui.run.summary, the
    fold `kvtui bench` reads too)."""

    figures: LoopSummary
    text: str = ""
    """The tail of the generated text (at most MAX_TEXT_CHARS)."""
    last_text: str = ""
    """The text of the newest token, for marking the current step."""
    step_seconds: Series = field(default_factory=Series)
    positions: Series = field(default_factory=Series)
    """Positions each step computed, per sequence."""
    first_pieces: list[str] = field(default_factory=list)
    """The text of the first FIRST_PIECES tokens generated, one a step (the cache picture's
    first rows after a short prompt)."""
    last_pieces: deque[str] = field(default_factory=lambda: deque(maxlen=LAST_PIECES))
    """The text of the newest LAST_PIECES tokens generated, one a step."""
    attention: StepSample | None = None
    """The newest step that carried its attention (kvtui.engines.attention)."""

    def add(self, sample: StepSample) -> None:
        """Draw a step the figures have just folded in."""
        self.text = (self.text + sample.text)[-MAX_TEXT_CHARS:]
        self.last_text = sample.text
        self.step_seconds.add(sample.step, sample.step_seconds)
        self.positions.add(sample.step, self.figures.last_positions)
        if len(self.first_pieces) < FIRST_PIECES:
            self.first_pieces.append(sample.text)
        self.last_pieces.append(sample.text)
        if sample.attention is not None:
            self.attention = sample

    def snapshot(self, figures: LoopSummary) -> LoopTrace:
        """A copy that later steps leave as it is, drawing `figures` (the summary's snapshot of
        this loop): the series and pieces copied (bounded), the text and the steps shared (a
        string, and frozen events)."""
        copied = copy.copy(self)
        copied.figures = figures
        copied.step_seconds = self.step_seconds.snapshot()
        copied.positions = self.positions.snapshot()
        copied.first_pieces = self.first_pieces[:]
        copied.last_pieces = deque(self.last_pieces, maxlen=LAST_PIECES)
        return copied

    def piece(self, step: int) -> str | None:
        """The text of the token step `step` generated, where it is still kept."""
        if step < len(self.first_pieces):
            return self.first_pieces[step]
        back = self.steps - step
        return self.last_pieces[-back] if 0 < back <= len(self.last_pieces) else None

    @property
    def steps(self) -> int:
        return self.figures.steps

    @property
    def last(self) -> StepSample | None:
        return self.figures.last

    @property
    def finished(self) -> RunFinished | None:
        return self.figures.finished

    @property
    def seconds_total(self) -> float:
        return self.figures.seconds_total

    @property
    def seconds_cumulative(self) -> Sequence[float]:
        """Seconds after each step, summed from the first (for the wall-time speedup)."""
        return self.figures.seconds_cumulative

    @property
    def positions_cumulative(self) -> Sequence[int]:
        """Positions computed after each step, per sequence, as the engine counted them."""
        return self.figures.positions_cumulative

    @property
    def last_positions(self) -> int:
        """Positions the newest step computed, per sequence."""
        return self.figures.last_positions


@dataclass(eq=False)
class LiveRun:
    """Everything the screens show about the engine run: its state, and its events folded by
    kvtui.run.summary (`summary`), the fold `kvtui bench` reads too. Compared by identity: a
    new snapshot is a new run to draw (a var holding one never compares the folds field by
    field)."""

    settings: RunSettings
    device_description: str = "probing the device..."
    device_label: str = "probing..."
    """The device in a few words, for a narrow header: "CPU, no GPU", "NVIDIA H100 80GB HBM3"."""
    probe: dict[str, Any] | None = None
    state: RunState = "starting"
    failure: str = ""
    progress: str = ""
    """What the engine said it is doing while it gets ready (its latest `RunProgress`)."""
    since: float = 0.0
    """When the run was asked for (time.monotonic): how long the engine takes to start."""
    summary: RunSummary = field(default_factory=RunSummary)
    loops: dict[str, LoopTrace] = field(default_factory=dict)
    read_only: bool = field(default=False, compare=False)
    """A `snapshot`: what the screens read; folding into it raises."""

    def __post_init__(self) -> None:
        self.reset(self.settings)

    def snapshot(self) -> LiveRun:
        """A read-only copy of the run as it is now, for the screens: the app keeps folding
        into this one while a screen draws from the copy. Nothing is copied whole: the fold's
        columns are shared as views of their steps so far (kvtui.run.columns), the bounded series
        copy on write, the events, settings and text (never changed in place) are shared. On this
        project's shared 2-core machine (benchmarks/live_snapshot.py: `sim:`, 4,000 steps a loop)
        a copy takes about 0.07 ms at any length, where a deep copy took 2.4 ms at 4,096 steps
        and grew with the run."""
        copied = copy.copy(self)
        copied.summary = self.summary.snapshot()
        copied.loops = {
            name: trace.snapshot(copied.summary.loops[name]) for name, trace in self.loops.items()
        }
        copied.read_only = True
        return copied

    def _changing(self) -> None:
        if self.read_only:
            raise RuntimeError("a snapshot of the run is read-only: the app folds the live one")

    def reset(self, settings: RunSettings) -> None:
        """Forget the old run: a new one with these settings is starting."""
        self._changing()
        self.settings = settings
        self.state = "starting"
        self.since = time.monotonic()
        self.failure = ""
        self.progress = ""
        self.summary = RunSummary()
        self.loops = {name: LoopTrace(figures) for name, figures in self.summary.loops.items()}

    def set_probe(self, probe: dict[str, Any]) -> None:
        self._changing()
        self.probe = probe
        self.device_description = str(probe.get("description") or "device unknown")
        self.device_label = str(probe.get("label") or self.device_description)

    def set_state(self, state: RunState) -> None:
        self._changing()
        self.state = state

    def apply(
        self,
        event: RunStarted | StepSample | RunFinished | RunFailed | ServerMetrics | RunProgress,
    ) -> None:
        """Fold one engine event in."""
        self._changing()
        if isinstance(event, RunProgress):
            self.progress = event.phrase
            return
        self.summary.apply(event)
        if isinstance(event, StepSample):
            self.loops[event.loop].add(event)
            if self.state == "starting":
                self.state = "running"
        elif isinstance(event, RunStarted):
            if self.state == "starting":
                self.state = "running"
        elif isinstance(event, RunFinished):
            if event.reason == "error":  # the engine refused or broke: say why in the header
                self.state = "failed"
                self.failure = event.message or "the engine stopped with an error"
            if all(
                self.loops[loop].finished is not None for loop in self.settings.loops
            ) and self.state not in ("failed", "stopped"):
                self.state = "done"
        elif isinstance(event, RunFailed):
            self.state = "failed"
            self.failure = event.message

    # --- what the screens ask ---------------------------------------------------------------

    def loop(self, name: Loop) -> LoopTrace:
        return self.loops[name]

    @property
    def started(self) -> RunStarted | None:
        """What the engine said it is running, once it has started."""
        return self.summary.started

    @property
    def can(self) -> Capabilities:
        """What the run's engine can do: as its start says, or before it (and where a start
        made by hand does not say) as its name does; nothing for a name that does not parse."""
        started = self.started
        if started is not None and started.can is not None:
            return started.can
        try:
            return parse_engine(self.settings.engine).can
        except EngineError:
            return NOTHING

    @property
    def server(self) -> ServerWatch | None:
        """A served run's (`vllm:`) server figures, as its polls reported them; None for
        kvtui's own engines."""
        started = self.started
        return self.summary.server if started is not None and started.served_by else None

    @property
    def fleet(self) -> FleetWatch | None:
        """A served run's servers, every replica of a fleet (kvtui.run.fleet); None for kvtui's
        own engines."""
        started = self.started
        return self.summary.fleet if started is not None and started.served_by else None

    @property
    def model(self) -> str:
        return self.started.model if self.started else self.settings.engine

    @property
    def batch(self) -> int:
        """Sequences the run decodes together (each step's counts are all of theirs)."""
        return self.started.batch if self.started else self.settings.batch

    @property
    def prompt_tokens(self) -> int:
        return self.started.prompt_tokens if self.started else 0

    def past_training(self) -> int | None:
        """The first answer token at a position past the context the model was trained on, if
        this run goes that far (allowed where the architecture allows it; text may degrade)."""
        started = self.started
        if started is None or started.trained_positions is None:
            return None
        first = started.trained_positions - started.prompt_tokens + 1
        return first if first <= started.tokens else None

    @property
    def run_tokens(self) -> int:
        """The length of the run: what was asked, or what a replay recorded."""
        return self.started.tokens if self.started else self.settings.tokens

    def first_divergence(self) -> int | None:
        """The first step at which the two loops chose different tokens; None if none yet."""
        return self.summary.first_divergence

    def compared_steps(self) -> int:
        """Steps that both loops have produced."""
        return self.summary.compared_steps

    def wall_speedup(self) -> float | None:
        """Uncached over cached wall seconds, over the steps both loops have done."""
        return self.summary.wall_speedup()

    def work_over(self, steps: int) -> tuple[int, int]:
        """Positions the uncached and the cached loop computed over their first `steps` steps,
        per sequence, as the engine counted them (both loops must have run that far)."""
        return self.summary.work_over(steps)

    @property
    def timing(self) -> str:
        """ "measured", or how else the engine's step times were had ("modelled (roofline)");
        empty before the engine says (nothing is called measured that has not run)."""
        return self.started.timing if self.started else ""

    @property
    def how(self) -> str:
        """How the run's figures were had, in a word, the one every screen's captions read:
        "measured" (a torch engine, now), "replayed" (a record of a measured run, played back:
        see `recorded`), "modelled" (any other timing: the `sim:` engine's roofline, or a record
        of one), or "" before the engine says."""
        timing = self.timing
        if not timing:
            return ""
        if timing != "measured":
            return "modelled"
        return "replayed" if self.replayed else "measured"

    @property
    def replayed(self) -> bool:
        """The run is a record played back (`RunStarted.recorded_at` says when it was made)."""
        return bool(self.started and self.started.recorded_at)

    @property
    def recorded(self) -> str:
        """Where and when a replayed run was recorded, in words ("recorded on cpu, 2026-12-02",
        "recorded on NVIDIA H100 80GB HBM3, 2026-12-02"); empty for a run happening now."""
        started = self.started
        if started is None or not started.recorded_at:
            return ""
        when = started.recorded_at[:10]
        date = when if len(when) == 10 and when[4] == when[7] == "-" else "date unknown"
        where, _, name = started.device.partition(" (")  # "cuda:0 (NVIDIA H100 80GB HBM3)"
        device = name.removesuffix(")") if where.startswith("cuda") and name else started.device
        return f"recorded on {device}, {date}"

    @property
    def prompt_text(self) -> str:
        return self.started.prompt_text if self.started else ""

    def achieved_bandwidth(self) -> float | None:
        """Median bytes read per second of the recent cached steps (the first excluded: a
        prefill's bytes and time are of a different kind)."""
        return self.summary.loop("cached").recent_bandwidth_bytes_per_s()

    def kv_bytes_measured(self) -> tuple[int, int] | None:
        """(KV bytes the engine holds, the formula's bytes for the same positions), or None
        (kvtui.run.summary.RunSummary.kv_bytes_formula: sliding windows counted)."""
        held, formula = self.summary.loop("cached").kv_bytes_filled, self.summary.kv_bytes_formula()
        return None if held is None or formula is None else (held, formula)

    def pool(self) -> LivePool | None:
        """The running engine's KV pool and what the cached loop holds of it now, measured; None
        before the run starts or for an engine without a pool (`hf:`)."""
        started, pool = self.started, self.summary.pool
        if started is None or pool is None:
            return None
        trace = self.loops["cached"]
        last, finished = trace.last, trace.finished
        return LivePool(
            pool=pool,
            source=started.kv_pool_source,
            prompt_tokens=started.prompt_tokens,
            run_tokens=started.tokens,
            batch=started.batch,
            allocated_bytes=last.kv_bytes_allocated if last else 0,
            filled_bytes=last.kv_bytes if last else 0,
            steps=trace.steps,
            full=finished.message
            if finished is not None and finished.reason == "out_of_memory"
            else "",
            freed=finished is not None,
            layout=started.layout,
            model_dtype=started.dtype,
        )

    def piece(self, loop: Loop, position: int) -> str | None:
        """The text of the token at `position` of `loop`'s sequence, where it is known: the
        prompt's (if the engine gave them), then the tokens the loop generated."""
        P = self.prompt_tokens
        if position < P:
            pieces = self.started.prompt_pieces if self.started else ()
            return pieces[position] if position < len(pieces) else None
        return self.loops[loop].piece(position - P)

    def picture(self, loop: Loop) -> CachePicture:
        """`loop`'s KV cache as the picture draws it (kvtui.widgets.cache_grid), at its newest
        step: the step the cards, the stream and the header count. Where the engine sends
        attention (at most ATTENTION_PER_SECOND steps a second), the weights are the newest
        step's that carried them, over the rows that step read, and `behind` says how many
        steps ago that was."""
        started, trace = self.started, self.loops[loop]
        if self.server is not None:
            return CachePicture(loop, self.how, unseen=SERVED_CACHE)
        sample = trace.last
        if started is None or sample is None:
            return CachePicture(loop, self.how)
        weighed = trace.attention if started.attention_layer is not None else None
        step, rows = sample.step, sample.position  # keys read: every position before the output
        P = self.prompt_tokens
        cached = loop == "cached"
        listed = [*range(min(rows, FIRST_PIECES)), *range(max(0, rows - LAST_PIECES), rows)]
        pieces = {i: piece for i in listed if (piece := self.piece(loop, i)) is not None}
        attention = None
        if weighed is not None and weighed.attention is not None and weighed.attention_spans:
            attention = Attention(
                weighed.step, weighed.position - 1, weighed.attention_spans, weighed.attention
            )
        block = started.kv_block_tokens if cached else None
        # measured: the bytes the cache's tensors hold over the rows they hold, per sequence
        row_bytes = sample.kv_bytes // (rows * self.batch) if cached and rows else 0
        return CachePicture(
            loop=loop,
            how=self.how,
            step=step,
            rows=rows,
            new_rows=(P if step == 0 else 1) if cached else rows,
            pieces=pieces,
            next_piece=self.piece(loop, rows),
            block_tokens=block,
            blocks=sample.kv_bytes_allocated // (block * row_bytes * self.batch)
            if block and row_bytes
            else None,
            row_bytes=row_bytes or None,
            layers=started.layers,
            attention=attention,
            attention_layer=started.attention_layer,
            attention_heads=started.attention_heads,
            no_attention="" if attention else self._no_attention(),
            behind=step - attention.step if attention else 0,
            prompt=P,
        )

    def _no_attention(self) -> str:
        """Why the picture has no weights, in a few words."""
        started = self.started
        if started is not None and started.attention_layer is not None:
            return "weights: with a later step"
        if self.how == "modelled":
            return "sim: no attention (modelled)"
        can = self.can
        if can.torch and not can.attention:  # hf: transformers' attention, unobserved
            return "hf: attention not observed"
        if can.replay:
            return "no weights in this record"
        return "no attention weights"

    def status_line(self, brief: bool = False, least: bool = False) -> str:
        """The run state in a few words, for the header; `brief`, fewer, for a narrow one;
        `least`, the state and what stopped or shapes it, for a header that must still hold the
        engine at 80 columns ("done · 300/300 · KV cache full · lesson")."""
        total = self.run_tokens
        if self.state == "failed":
            return f"failed: {self.failure}" if self.failure else "failed"  # why, always
        if self.state == "starting":
            progress = f": {self.progress}" if self.progress and not least else ""
            return f"starting the engine{progress}..."
        words = {
            "running": "running",
            "paused": "paused",
            "done": "done",
            "stopped": "stopped",
        }[self.state]
        steps = [self.loops[loop].steps for loop in self.settings.loops]
        if len(set(steps)) <= 1:
            n = max(steps, default=0)
            words += f" · {n:,}/{total:,}" if least else f" · step {n:,}/{total:,}"
        elif not least:  # least: each loop's count is in its stream's border
            each = ", ".join(f"{loop} {self.loops[loop].steps:,}" for loop in self.settings.loops)
            words += f" · {each} of {total:,}"
        cached = self.loops["cached"].finished
        if cached is not None and cached.reason == "out_of_memory":
            words += (
                " · KV cache full" if brief or least else " · cached loop stopped: KV cache full"
            )
        lesson = self.settings.lesson and not self.replayed  # a replay plays what it recorded
        return words + (" · lesson" if least else " · lesson mode") * lesson
