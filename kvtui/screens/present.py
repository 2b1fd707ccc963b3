"""Presenter mode: the lesson one idea at a time, for a room: its headline and figures in large
type that grows with the screen, and each node's part of the live run shown as it opens, at a
pace a room can follow.

A title (shown while the engine gets ready, its line moving), the three nodes and the closing
question (kvtui.widgets.present_nodes). Opening a node starts its part of the run: node 1's
staircase of uncached work climbs step by step with its figures counting up, node 2 races the two
loops on their measured seconds, node 3 fills a KV pool sized for the room until it is full,
turns red and stops at the predicted token, beside the lesson's own figure. Space (or right,
page down: a presenter's clicker) reveals the node's next figure, then moves on; left (page up)
goes back; r runs the node again; + and - (up, down) double or halve the answer and run again.
Pacing is presentation only: the figures are the run's own at the step shown, saying how they
were had. `s` pauses the decode, since space moves on here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.events import Resize
from textual.reactive import var
from textual.widgets import Static

from kvtui.format import format_bytes, format_count, format_percent
from kvtui.run.live import CachePicture, LiveRun
from kvtui.screens.base import MAX_LENGTH, LessonScreen
from kvtui.sim.budget import vram_split
from kvtui.widgets.big import BigText, FontGroup, TitleCard
from kvtui.widgets.cache_grid import CacheGrid, fit
from kvtui.widgets.note import Note
from kvtui.widgets.plain import plain
from kvtui.widgets.present_nodes import (
    NODES,
    Node,
    Reveal,
    lesson_budget,
    race_seconds,
    reveal,
    room_pool_bytes,
    row_bytes,
    why_time,
)
from kvtui.widgets.slides import Lane, Race, Staircase, TallBar
from kvtui.widgets.vram import Bar, Part, whatif_bar

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
TICK_S = 1 / 12
"""How often a paced node (and the title's waiting line) moves on."""


@runtime_checkable
class Reruns(Protocol):
    """What presenter mode asks of the app to run a node again (kvtui.app.KVApp has it): the
    next run's length and KV budget, and `r`."""

    length: int
    kv_budget: int | None

    def action_restart(self) -> None: ...


@dataclass(frozen=True)
class ShownFigure:
    """A figure as the room sees it: label, figure (unit included), caption, and how many rows
    its large type takes (0: in words)."""

    label: str
    value: str | None
    caption: str
    rows: int


@dataclass(frozen=True)
class Slide:
    """What presenter mode shows now (`PresentScreen.slide`): the node, its title, the figures
    revealed, and whether its part of the run has all been shown."""

    node: int
    title: str
    figures: tuple[ShownFigure, ...]
    done: bool
    headline_rows: int


class BigFigure(Vertical):
    """A headline figure: its label, the figure in large type, and the caption saying how it
    was had (wrapped, never cut)."""

    DEFAULT_CSS = """
    BigFigure {
        height: 1fr;
    }
    BigFigure > .big--label {
        color: $text-muted;
        text-style: bold;
        height: 1;
    }
    BigFigure > .big--line {
        color: $text-muted;
        height: auto;
    }
    """

    def __init__(self, group: FontGroup) -> None:
        super().__init__()
        self._group = group

    def compose(self) -> ComposeResult:
        yield Note(classes="big--label")
        yield BigText(group=self._group)
        yield Static(classes="big--line")

    def show(self, label: str, value: str | None, sizing: str, caption: str) -> None:
        self.query_one(".big--label", Note).show(label)
        self.query_one(BigText).show(value or "", sizing or value or "")
        line = self.query_one(".big--line", Static)
        if str(line.render()) != caption:  # it may take another number of rows: a layout
            line.update(plain(caption))  # a record's words in it

    def shown(self) -> ShownFigure:
        label = str(self.query_one(".big--label", Note).render())
        big = self.query_one(BigText)
        caption = str(self.query_one(".big--line", Static).render())
        return ShownFigure(label, big.text or None, caption, big.rows)


class PresentScreen(LessonScreen):
    """The lesson for a room: see the module's docstring."""

    BINDINGS = [
        Binding("space,right,pagedown", "next", "Next", key_display="space"),
        Binding("left,pageup,backspace", "back", "Back", key_display="←"),
        Binding("r", "again", "Again"),
        Binding("plus,equals_sign,up", "longer", "Length", key_display="+-"),
        Binding("minus,down", "shorter", "Shorter", show=False),
        Binding("s", "app.pause", "Pause"),
        Binding("p", "app.present", "Leave"),
        # The app's keys work here as anywhere; the footer keeps a presenter's own to one line.
        *(Binding(str(n), f"app.screen({n})", show=False) for n in range(1, 5)),
        Binding("t", "app.quiz", show=False),
    ]

    node: var[int] = var(0, init=False)
    """The node shown (an index into NODES)."""
    revealed: var[int] = var(0, init=False)
    """How many of the node's figures are shown."""

    def __init__(self, run: LiveRun, *, name: str | None = None) -> None:
        super().__init__(run, name=name)
        self._fonts = FontGroup()
        self._paced_from = time.monotonic()
        """When the node's pace began: it opened, or its run (re)started."""
        self._run_since = run.since
        self._ended_at: float | None = None
        """When both loops of the run were first seen ended (node 2 races from then)."""
        self._room_pool = False
        """Node 3 asked for a KV pool sized for the room (the others ask for the default)."""
        self._ticks = 0
        self._drawn: Reveal | None = None
        """How far the last redraw showed the node (a tick redraws until it shows all of it)."""

    def compose_body(self) -> ComposeResult:
        yield TitleCard(id="present-card")
        yield BigText(wrap=True, id="present-headline")
        yield Static(id="present-title")
        yield Static(id="present-idea")
        with Horizontal(id="present-main"):
            with Vertical(id="present-left"):
                yield Staircase(id="present-stairs")
                yield Race(id="present-race")
                yield Note(id="present-why")
                with Horizontal(id="present-pool-row"):
                    yield Static(id="present-weights")
                    yield TallBar(id="present-pool")
                yield TallBar(id="present-lesson")
                yield CacheGrid(CachePicture("cached"), id="present-grid")
            with Vertical(id="present-figures"):
                for _ in range(max(len(node.figures) for node in NODES)):
                    yield BigFigure(self._fonts)
        yield Note(id="present-status")

    def on_mount(self) -> None:
        super().on_mount()
        self.set_interval(TICK_S, self._tick)
        self._show_node()

    # --- the pace ----------------------------------------------------------------------------

    def follow_run(self, run: LiveRun) -> None:
        """A new run restarts the node's pace; node 2 races once both loops have ended; node 3
        asks for its pool once the run says what its pool is."""
        if run.since != self._run_since:
            self._run_since, self._paced_from, self._ended_at = run.since, time.monotonic(), None
        ended = all(run.loop(loop).finished is not None for loop in run.settings.loops)
        if self._ended_at is None and (ended or run.state in ("done", "failed", "stopped")):
            self._ended_at = time.monotonic()
        if self.ready and NODES[self.node].part == "memory":
            self._ask_for_pool()

    def _elapsed(self) -> float:
        start = self._paced_from
        if NODES[self.node].part == "race":
            start = max(start, self._ended_at or time.monotonic())
        return time.monotonic() - start

    def _reveal(self) -> Reveal:
        return reveal(NODES[self.node], self.run, self._elapsed())

    def _tick(self) -> None:
        """Move a paced node on, and keep the waiting line moving while the engine starts: no
        dead air."""
        if not self.is_current:
            return
        self._ticks += 1
        if self.run.state == "starting":
            self._show_status()
        if NODES[self.node].live and self._reveal() != self._drawn:
            self.mark_dirty()

    # --- keys --------------------------------------------------------------------------------

    def watch_node(self) -> None:
        self._paced_from = time.monotonic()
        self._show_node()
        part = NODES[self.node].part
        if part == "memory":
            self._ask_for_pool()
        elif part in ("staircase", "race") and self._room_pool:
            self._room_pool = False  # the lesson's own run again, on the engine's pool
            self._rerun(kv_budget=None)

    def watch_revealed(self) -> None:
        self.mark_dirty()

    def action_next(self) -> None:
        """The node's next figure, else the next node."""
        if self.revealed < len(NODES[self.node].figures):
            self.revealed += 1
        elif self.node + 1 < len(NODES):
            self.revealed = 0
            self.node += 1

    def action_back(self) -> None:
        """Hide the node's last figure, else back to the previous node, all of it shown."""
        if self.revealed > 0:
            self.revealed -= 1
        elif self.node > 0:
            self.node -= 1
            self.revealed = len(NODES[self.node].figures)

    def action_again(self) -> None:
        """Run the node again: the same length, from its first step."""
        self._rerun()

    def action_longer(self) -> None:
        """Twice the answer (the context node 3's pool must hold), and run it."""
        self._rerun(length=min(MAX_LENGTH, self.run.run_tokens * 2))

    def action_shorter(self) -> None:
        """Half the answer, and run it."""
        self._rerun(length=max(1, self.run.run_tokens // 2))

    def _rerun(self, length: int | None = None, kv_budget: int | None | bool = False) -> None:
        """`r` on the app, after setting its next run's length and (unless False) KV budget."""
        app = self.app
        if not isinstance(app, Reruns):
            return
        if length is not None:
            app.length = length
        if kv_budget is not False:
            app.kv_budget = kv_budget if isinstance(kv_budget, int) else None
        self._paced_from = time.monotonic()
        app.action_restart()

    def on_screen_suspend(self) -> None:
        """Leaving presenter mode: the next run (r on another screen) asks for the engine's own
        pool again, not the one sized for the room."""
        app = self.app
        if self._room_pool and isinstance(app, Reruns):
            self._room_pool = False
            app.kv_budget = None

    def _ask_for_pool(self) -> None:
        """Node 3: a pool the run fills within the node, once the run says what its pool is
        (not for a replay, which plays what was recorded, nor a run that already stops)."""
        live = self.run.pool()
        if self._room_pool or live is None or self.run.replayed or live.stops_at is not None:
            return
        size = room_pool_bytes(live, self.run.run_tokens)
        if size is not None:
            self._room_pool = True
            self._rerun(kv_budget=size)

    # --- drawing -----------------------------------------------------------------------------

    def on_resize(self, event: Resize) -> None:
        super().on_resize(event)
        self.call_after_refresh(self.mark_dirty)

    def _show_node(self) -> None:
        if not self.ready:
            return
        node = NODES[self.node]
        for part in ("title", "staircase", "race", "memory", "question"):
            self.set_class(node.part == part, f"-{part}")
        self.query_one("#present-headline", BigText).show(node.headline)
        self.query_one("#present-title", Static).update(node.title)
        self.query_one("#present-idea", Static).update(node.idea)
        for i, figure in enumerate(self.query(BigFigure)):
            figure.display = i < len(node.figures)
            if not figure.display:
                figure.show("", None, "", "")
            figure.query_one(BigText).wrap = node.part == "question"  # words, not figures
        self.mark_dirty()

    def _show_status(self) -> None:
        self.query_one("#present-status", Note).show(plain(self._status_line()))

    def _status_line(self) -> str:
        run, node = self.run, NODES[self.node]
        width = max(20, self.size.width - 4)
        if run.state == "starting":
            spin = SPINNER[self._ticks % len(SPINNER)]
            seconds = f"{time.monotonic() - run.since:.0f} s"
            words = [f"{spin} {run.status_line()} {seconds}", f"{spin} starting {seconds}"]
            return fit(words, width)
        who = f"{run.model} on {run.started.device}" if run.started else run.model
        if not node.live:
            return fit([f"{who}: {run.status_line()}", run.status_line(True)], width)
        shown = self._reveal()
        loop = "uncached" if node.part == "staircase" else "cached"
        k, ran = shown.of(loop), run.loop(loop).steps
        live = run.pool() if node.part == "memory" else None
        total = (live.stops_at if live is not None else None) or run.run_tokens
        pace = "all shown" if shown.done else f"step {k:,} of {total:,}"
        how = run.how or "not yet run"
        if not shown.done and run.loop(loop).finished is None:
            pace += f" ({ran:,} {how} so far)"
        return fit(
            [
                f"{how}: {who}, shown at a room's pace: {pace} · r again · +/- length "
                f"{run.run_tokens:,}",
                f"{how}, shown at a room's pace: {pace} · r again · +/- length",
                f"{how}, paced: {pace} · r · +/-",
                f"{how}: {pace}",
            ],
            width,
        )

    def redraw(self) -> None:
        node, run = NODES[self.node], self.run
        shown = self._reveal()
        self._drawn = shown
        self._show_status()
        if node.part == "staircase":
            self._draw_staircase(shown)
        elif node.part == "race":
            self._draw_race(shown)
        elif node.part == "memory":
            self._draw_memory(shown)
        final = reveal(node, run, float("inf"))
        for i, figure in enumerate(self.query(BigFigure)):
            if i >= len(node.figures):
                continue
            figure.visible = i < self.revealed
            now = node.figures[i].read(run, shown)
            widest = node.figures[i].read(run, final).big or ""
            figure.show(node.figures[i].label, now.big, widest, now.caption)

    def _draw_staircase(self, shown: Reveal) -> None:
        run = self.run
        done = list(run.loop("uncached").figures.positions_cumulative[: shown.of("uncached")])
        per_step = [b - a for a, b in zip([0, *done], done, strict=False)]
        steps = run.run_tokens
        tallest = run.prompt_tokens + steps - 1
        how = run.how or "not yet run"
        self.query_one(Staircase).show(
            per_step,
            steps,
            tallest,
            [
                f"No cache: positions each step computes ({how}): all of them, again",
                f"No cache: positions each step computes ({how})",
                f"Positions a step computes ({how})",
                f"Work a step ({how})",
                "Work a step",
            ],
            ["the area is the total", ""],
        )

    def _draw_race(self, shown: Reveal) -> None:
        run = self.run
        lanes = [
            Lane(
                name,
                shown.of(loop),
                run.run_tokens,
                race_seconds(run, loop, shown),
                shown.of(loop) >= run.loop(loop).steps and run.loop(loop).finished is not None,
            )
            for name, loop in (("no cache", "uncached"), ("KV cache", "cached"))
        ]
        how = run.how or "not yet run"
        per = (
            f"1 s here = {shown.scale * 1000:,.1f} ms {how}"
            if shown.scale
            else "measuring..."
            if run.how == "measured"
            else "running..."
        )
        same = f"the same {run.run_tokens:,} tokens"
        thick = 2 if self.size.height >= 42 else 1
        self.query_one(Race).show(
            lanes,
            [f"The race: {same}, {per}", f"{same.capitalize()}: {per}", per, "The race"],
            [],
            thick,
        )
        why = self.query_one("#present-why", Note)
        words = why_time(run, shown) if self.revealed >= 3 else ""
        why.show(words)
        why.display = bool(words)
        self._draw_grid(shown)

    def _draw_grid(self, shown: Reveal) -> None:
        """The cached loop's cache at the step shown."""
        picture = self.run.picture("cached")
        k = shown.of("cached")
        if picture.step is not None and k and k - 1 < picture.step:
            picture = _at_step(picture, k, self.run.prompt_tokens)
        self.query_one(CacheGrid).show(picture)

    def _draw_memory(self, shown: Reveal) -> None:
        self._draw_grid(shown)
        run, started, live = self.run, self.run.started, self.run.pool()
        pool_bar = self.query_one("#present-pool", TallBar)
        weights = self.query_one("#present-weights", Static)
        if started is None or live is None:
            words = "once the engine starts" if started is None else "no KV pool in this run"
            pool_bar.show(Bar((), 1), f"LIVE: the running engine's memory, {words}")
            weights.update("")
        else:
            pool = live.pool
            k = shown.of("cached")
            rows = run.prompt_tokens + k - 1 if k else 0
            per_row = row_bytes(run) or pool.kv_bytes_per_token
            filled = per_row * rows * live.batch
            taken = pool.blocks_for(rows, live.batch) * pool.block_bytes if rows else 0
            if k >= live.steps:
                filled, taken = live.filled_bytes, live.allocated_bytes
            full = bool(live.full) and shown.done
            parts = (
                Part("KV", filled, "kv", f"({format_count(rows, 'row')})"),
                Part("block tail", max(0, taken - filled), "tail", short="tail"),
                Part("free", max(0, pool.capacity_bytes - taken), "free"),
            )
            size = format_bytes(pool.capacity_bytes)
            how = run.how or "not yet run"
            state = f"FULL at token {live.steps:,}" if full else f"token {k:,}"
            pool_bar.show(
                Bar(parts, pool.capacity_bytes, full=full),
                [
                    f"LIVE ({how}): KV pool {size}, {format_count(pool.tokens, 'slot')} · {state}",
                    f"KV pool {size} · {state}",
                    state,
                ],
                [f"sized for this room ({live.source})", "sized for this room", ""]
                if self._room_pool
                else [f"this run's pool ({live.source})", "this run's pool", ""],
            )
            weights.update(f"weights\n{format_bytes(started.weights_bytes)}\n(not to scale)")
        b = lesson_budget()
        wanted = (b.weights_bytes_per_gpu, b.kv_bytes_per_gpu, b.reserve_bytes, b.free_bytes)
        share = f"{format_bytes(b.kv_bytes)} of {format_bytes(b.vram_bytes)}"
        verdict = f"{share} = {format_percent(b.kv_fraction_of_vram)}: {b.status.upper()}"
        self.query_one("#present-lesson", TallBar).show(
            whatif_bar(vram_split(b), (wanted[0], wanted[1], wanted[2], max(0, wanted[3]))),
            [
                f"THE LESSON (formula): {b.model_label}, {b.batch} x {b.context_tokens:,} "
                f"tokens on an {b.gpu_label}",
                f"THE LESSON: {b.model_label}, {b.batch} x {b.context_tokens:,} tokens",
                f"THE LESSON: {b.model_label}",
                "THE LESSON",
            ],
            [f"KV {verdict}", verdict, format_percent(b.kv_fraction_of_vram)],
        )

    # --- for tests: what a room sees ---------------------------------------------------------

    def slide(self) -> Slide:
        """The node shown, its title, the figures revealed and whether its part of the run has
        all been shown (kvtui.testing reads this)."""
        node: Node = NODES[self.node]
        figures = tuple(
            figure.shown()
            for i, figure in enumerate(self.query(BigFigure))
            if i < min(self.revealed, len(node.figures))
        )
        headline = self.query_one("#present-headline", BigText)
        rows = headline.rows if headline.display else 0
        return Slide(self.node, node.title, figures, self._reveal().done, rows)


def _at_step(picture: CachePicture, steps: int, prompt: int) -> CachePicture:
    """The cached loop's picture after `steps` steps (its rows, tokens and blocks then, without
    the attention the engine measured at a later step)."""
    from dataclasses import replace

    rows = prompt + steps - 1
    block = picture.block_tokens
    return replace(
        picture,
        step=steps - 1,
        rows=rows,
        new_rows=prompt if steps == 1 else 1,
        next_piece=picture.pieces.get(rows),
        blocks=-(-rows // block) if block else picture.blocks,
        attention=None,
        no_attention="weights: with the last step",
        behind=0,
    )
