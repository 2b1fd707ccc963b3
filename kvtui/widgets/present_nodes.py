"""Presenter mode's lesson, without a UI: its nodes, how far a room has been shown each node's part
of the live run, and the figures read off the run at that point.

A node's part of the run is shown at a room's pace (`reveal`): the steps the engine has already
measured are revealed a few a second (node 1's staircase, node 3's cache filling its pool), and
node 2's race replays both loops on the measured seconds, scaled so that the slower one takes
RACE_S. Pacing is presentation only: every figure is the run's own at the step shown (measured,
or modelled by `sim:`), and the screen says so.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvtui.bigtext import IDEA, SUBTITLE, TITLE
from kvtui.engines.protocol import Loop
from kvtui.format import format_bytes, format_count, format_percent, format_ratio
from kvtui.run.live import LiveRun
from kvtui.run.pool import LivePool
from kvtui.sim.budget import LESSON_BUDGET, Budget, budget
from kvtui.sim.catalog import get_gpu, get_model

PACE_S = 4.0
"""Seconds over which nodes 1 and 3 reveal their loop's steps (a room can follow each one)."""
RACE_S = 5.0
"""Seconds node 2's race takes for the slower loop (the measured seconds, scaled)."""
UNPACED = "uncached", "cached"


@dataclass(frozen=True)
class Reveal:
    """How far a node's part of the run has been shown: steps revealed per loop, and whether
    the node has shown all of it (its run ended and its pace ran out)."""

    steps: Mapping[str, int] = field(default_factory=dict)
    done: bool = True
    scale: float | None = None
    """Node 2's race: measured seconds shown per second on screen (None: not replaying)."""

    def of(self, loop: Loop) -> int:
        return self.steps.get(loop, 0)


@dataclass(frozen=True)
class Shown:
    """A figure as shown: its text for large type, unit included ("3,072 B", "12.5x"; None
    before the run has it), and a caption that says first how it was had."""

    big: str | None
    caption: str


@dataclass(frozen=True)
class Figure:
    """One headline figure of a node: its label and how it is read off the run at a reveal."""

    label: str
    read: Callable[[LiveRun, Reveal], Shown]


@dataclass(frozen=True)
class Node:
    """One idea of the lesson: its title (in words), its headline (large), the sentence it
    teaches, what its picture is, and its figures."""

    title: str
    headline: str
    idea: str
    part: str
    """What the node shows of the run: "title", "staircase", "race", "memory" or "question"."""
    figures: tuple[Figure, ...] = ()

    @property
    def live(self) -> bool:
        """Whether the node shows a part of the run (paced), not words alone."""
        return self.part in ("staircase", "race", "memory")


def _how(run: LiveRun) -> str:
    return run.how or "not yet run"


def _cumulative(run: LiveRun, loop: Loop) -> tuple[list[int], list[float]]:
    figures = run.loop(loop).figures
    return list(figures.positions_cumulative), list(figures.seconds_cumulative)


# --- how far a node has been shown ----------------------------------------------------------


def reveal(node: Node, run: LiveRun, elapsed: float) -> Reveal:
    """How far `node`'s part of `run` is shown `elapsed` seconds after its pace began."""
    if node.part == "staircase":
        return _paced(run, "uncached", run.run_tokens, elapsed)
    if node.part == "memory":
        pool = run.pool()
        stops = pool.stops_at if pool is not None else None
        return _paced(run, "cached", stops or run.run_tokens, elapsed)
    if node.part == "race":
        return _race(run, elapsed)
    return Reveal()


def _ended(run: LiveRun, loop: Loop) -> bool:
    return run.loop(loop).finished is not None or run.state in ("failed", "stopped")


def _paced(run: LiveRun, loop: Loop, total: int, elapsed: float) -> Reveal:
    """`loop`'s measured steps, `total` of them over PACE_S: never ahead of the run."""
    measured = run.loop(loop).steps
    paced = max(0.0, min(elapsed, PACE_S)) / PACE_S * max(1, total)
    shown = measured if elapsed >= PACE_S else min(measured, math.ceil(paced))
    return Reveal({loop: shown}, done=_ended(run, loop) and shown >= measured)


def _race(run: LiveRun, elapsed: float) -> Reveal:
    """Both loops on their measured seconds, the slower over RACE_S; while the run is still
    being measured, each loop as far as it has run."""
    ended = all(_ended(run, loop) for loop in UNPACED)
    seconds = {loop: _cumulative(run, loop)[1] for loop in UNPACED}
    if not ended:
        return Reveal({loop: len(seconds[loop]) for loop in UNPACED}, done=False)
    slowest = max((s[-1] for s in seconds.values() if s), default=0.0)
    if slowest <= 0:
        return Reveal({loop: len(seconds[loop]) for loop in UNPACED})
    scale = slowest / RACE_S
    shown = max(0.0, min(elapsed, RACE_S)) * scale
    steps = {loop: bisect_right(s, shown * (1 + 1e-9)) for loop, s in seconds.items()}
    return Reveal(steps, done=elapsed >= RACE_S, scale=scale)


def race_seconds(run: LiveRun, loop: Loop, shown: Reveal) -> float:
    """The measured seconds of `loop`'s steps shown so far."""
    seconds = _cumulative(run, loop)[1]
    steps = shown.of(loop)
    return seconds[steps - 1] if steps else 0.0


# --- the figures --------------------------------------------------------------------------


def _per_step(run: LiveRun, shown: Reveal) -> Shown:
    k = shown.of("uncached")
    if not k:
        return Shown(None, "positions the newest step computed")
    done = _cumulative(run, "uncached")[0]
    per = done[k - 1] - (done[k - 2] if k > 1 else 0)
    return Shown(f"{per:,}", f"{_how(run)}: positions step {k:,} computed")


def _total(run: LiveRun, shown: Reveal) -> Shown:
    k = shown.of("uncached")
    if not k:
        return Shown(None, "positions computed in all")
    done = _cumulative(run, "uncached")[0][k - 1]
    return Shown(f"{done:,}", f"{_how(run)}: positions in {format_count(k, 'step')}")


def _wasted(run: LiveRun, shown: Reveal) -> Shown:
    k = shown.of("uncached")
    if not k:
        return Shown(None, "positions computed more than once")
    done = _cumulative(run, "uncached")[0]
    redone = done[k - 2] if k > 1 else 0  # every position before the newest step's, again
    return Shown(
        f"{redone:,}", f"{_how(run)}: {format_percent(redone / done[k - 1])} computed again"
    )


def _compared(shown: Reveal) -> int:
    return min(shown.of("uncached"), shown.of("cached"))


def _with_cache(run: LiveRun, shown: Reveal) -> Shown:
    n = _compared(shown)
    if not n:
        return Shown(None, "positions computed with the cache")
    uncached, cached = run.work_over(n)
    return Shown(f"{cached:,}", f"{_how(run)}: positions, {uncached:,} without")


def _by_count(run: LiveRun, shown: Reveal) -> Shown:
    n = _compared(shown)
    if not n:
        return Shown(None, "fewer positions computed")
    uncached, cached = run.work_over(n)
    diverged = run.first_divergence()
    same = "same tokens" if diverged is None or diverged >= n else "tokens differ"
    return Shown(format_ratio(uncached / max(1, cached)), f"{_how(run)}: less work, {same}")


def wall_ratio(run: LiveRun, steps: int) -> float | None:
    """Uncached over cached seconds over the first `steps` steps of both loops."""
    if not steps:
        return None
    uncached = _cumulative(run, "uncached")[1][steps - 1]
    cached = _cumulative(run, "cached")[1][steps - 1]
    return uncached / cached if cached > 0 and uncached > 0 else None


def _wall(run: LiveRun, shown: Reveal) -> Shown:
    n = _compared(shown)
    ratio = wall_ratio(run, n)
    what = "faster by the roofline" if run.how == "modelled" else "faster in wall time"
    if ratio is None:
        return Shown(None, what)
    return Shown(format_ratio(ratio), f"{_how(run)}: {what}")


def why_time(run: LiveRun, shown: Reveal) -> str:
    """Where time and work disagree (the cache saves far less time than work), why: "" where
    they agree or nothing is shown yet."""
    n = _compared(shown)
    ratio = wall_ratio(run, n)
    if ratio is None:
        return ""
    uncached, cached = run.work_over(n)
    if ratio >= uncached / max(1, cached) / 2:
        return ""
    if run.how == "modelled":
        return (
            f"Why only {format_ratio(ratio)}: a step reads all the weights whether it "
            f"recomputes {n:,} positions or 1 (memory-bound), so at this length time saves less "
            "than work. + runs longer: the gap grows."
        )
    return (
        f"Why only {format_ratio(ratio)}: every step also reads all the weights and pays a fixed "
        "cost, whatever it computes, so at this length time saves less than work. + runs "
        "longer: the gap grows."
    )


def _rows_shown(run: LiveRun, shown: Reveal) -> int:
    """Positions the cached loop holds after the steps shown (P + k - 1)."""
    k = shown.of("cached")
    return run.prompt_tokens + k - 1 if k else 0


def row_bytes(run: LiveRun) -> int | None:
    """Keys and values of one position, every layer, measured: the cache's bytes over its
    rows at the newest cached step."""
    return run.picture("cached").row_bytes


def held_bytes(run: LiveRun, shown: Reveal) -> int:
    """The cache's bytes after the steps shown: the engine's own at its newest step, and the
    measured bytes a row times the rows at the steps before it."""
    trace, k = run.loop("cached"), shown.of("cached")
    if not k:
        return 0
    if k >= trace.steps and trace.last is not None:
        return trace.last.kv_bytes
    return (row_bytes(run) or 0) * _rows_shown(run, shown) * run.batch


def _token_bytes(run: LiveRun, shown: Reveal) -> Shown:
    started, per_row = run.started, row_bytes(run)
    if per_row is None or started is None:
        return Shown(None, "bytes of keys and values a token")
    elements = 2 * started.layers * started.kv_heads * started.head_dim
    size = started.kv_bytes_per_token // max(1, elements)
    formula = f"2x{started.layers}x{started.kv_heads}x{started.head_dim}x{size} B"
    # The figure is the engine's: the bytes its cache holds over the rows it holds, K and V of
    # every layer; the formula beside it is the lesson's, and says whether the two agree.
    said = "agrees" if elements * size == per_row else f"says {format_bytes(elements * size)}"
    return Shown(
        format_bytes(per_row),
        f"{_how(run)}: bytes held per row (K + V); the formula {formula} {said}",
    )


def _held(run: LiveRun, shown: Reveal) -> Shown:
    k = shown.of("cached")
    if not k:
        return Shown(None, "keys and values held")
    rows = format_count(_rows_shown(run, shown), "row")
    tokens = f"{run.prompt_tokens:,} prompt + {format_count(k - 1, 'token')}"
    return Shown(format_bytes(held_bytes(run, shown)), f"{_how(run)}: {rows} = {tokens}")


def _full_at(run: LiveRun, shown: Reveal) -> Shown:
    live = run.pool()
    if live is None:
        return Shown(None, "no pool here: the engine keeps a cache of its own")
    predicted = live.tokens_before_full
    size = format_bytes(live.pool.capacity_bytes)
    if shown.done and live.full:
        said = f"{predicted:,}" if predicted is not None else "none"
        return Shown(f"{live.steps:,}", f"{_how(run)}: it stopped there; the formula said {said}")
    if predicted is None or predicted >= live.run_tokens:
        return Shown("FITS", f"formula: {live.run_tokens:,} tokens fit the {size} pool")
    slots = format_count(live.pool.tokens, "slot")
    return Shown(f"{predicted:,}", f"formula: the {size} pool has {slots} for rows")


def lesson_budget() -> Budget:
    """The lesson's own memory figure: Llama 3.1 8B, 8 x 24,000 tokens on an 80 GB H100 (23.4
    GiB of KV, 29%: it fits), by the formula."""
    b = LESSON_BUDGET
    return budget(
        get_model(b.model), get_gpu(b.gpu), b.context_tokens, b.batch, b.kv_dtype, b.weights_dtype
    )


def room_pool_bytes(live: LivePool, length: int) -> int | None:
    """A KV pool for node 3 that the cached loop fills within the node: about two thirds into
    a run of `length` tokens, whole blocks; None where no pool smaller than the run's need
    stops it (a run shorter than a block)."""
    pool, P, B = live.pool, live.prompt_tokens, live.batch
    bt = pool.block_tokens
    blocks = -(-(P + max(1, round(length * 2 / 3)) - 1) // bt)
    if blocks * bt - P + 1 >= length:  # it would fit: the largest that stops it
        blocks = (P + length - 2) // bt
    if blocks < 1:
        return None
    return blocks * B * pool.block_bytes


NODES: tuple[Node, ...] = (
    Node(f"{TITLE} · {SUBTITLE}", TITLE, IDEA, "title"),  # the title card's, as the CLI draws it
    Node(
        "1 · Without a cache, every step redoes the whole history",
        "1 Without a cache",
        "Each token becomes a key and a value the model reads back; without a cache, every step "
        "computes all of them again.",
        "staircase",
        (Figure("PER STEP", _per_step), Figure("TOTAL", _total), Figure("WASTED", _wasted)),
    ),
    Node(
        "2 · With the cache, you compute only the new token",
        "2 With the cache",
        "Keys and values of past tokens never change, so they are kept: a step writes one new "
        "row, and its query reads every row once.",
        "race",
        (
            Figure("WITH THE CACHE", _with_cache),
            Figure("BY COUNT", _by_count),
            Figure("TIME", _wall),
        ),
    ),
    Node(
        "3 · The cache grows and eats memory",
        "3 It eats memory",
        "Every token keeps its keys and values in every layer, beside the weights, until the "
        "memory is full and generation stops.",
        "memory",
        (
            Figure("A TOKEN", _token_bytes),
            Figure("HELD NOW", _held),
            Figure("FULL AT TOKEN", _full_at),
        ),
    ),
    Node(
        "The closing question",
        "What ran out?",
        "A model has plenty of compute left, but a long chat suddenly refuses to continue. Why, "
        "and what actually ran out?",
        "question",
        (
            Figure(
                "ANSWER",
                lambda run, shown: Shown(
                    "GPU memory",
                    "The KV cache grew with every token and ran out of room. A shorter context, "
                    "a smaller batch, a smaller KV dtype or a bigger GPU are the ways out.",
                ),
            ),
        ),
    ),
)
