"""Presenter mode: the lesson one idea at a time, its headline figures in large digits, the live
cache picture beside them, and the technical detail (the device) left to help.

The lesson's three nodes and its closing question, after a title that shows the engine getting
ready. Space (or right, page down: a presenter's clicker) reveals the node's next figure, then
moves to the next node; left (page up) goes back. The figures are the live run's, saying how they
were had (measured or modelled), as on the screens they summarise; `s` pauses the decode, since
space moves on here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import var
from textual.widgets import Digits, Static

from kvtui.engines.protocol import Loop
from kvtui.format import format_bytes, format_count, format_digits, format_percent, format_ratio
from kvtui.run.live import CachePicture, LiveRun
from kvtui.screens.base import LessonScreen
from kvtui.widgets.cache_grid import CacheGrid
from kvtui.widgets.note import Note
from kvtui.widgets.plain import plain


@dataclass(frozen=True)
class Shown:
    """A figure as it is shown: large digits (or None, before the run has it) and a line."""

    digits: str | None
    line: str


@dataclass(frozen=True)
class Figure:
    """One headline figure of a node: its label and how it is read off the live run."""

    label: str
    read: Callable[[LiveRun], Shown]


@dataclass(frozen=True)
class Node:
    """One idea of the lesson: a title, a sentence, the loop whose cache is drawn, its figures."""

    title: str
    idea: str
    loop: Loop | None
    figures: tuple[Figure, ...] = ()


def _how(run: LiveRun) -> str:
    return run.how or "not yet run"


def _per_step(run: LiveRun) -> Shown:
    trace = run.loop("uncached")
    if trace.last is None:
        return Shown(None, "positions the newest step computed")
    return Shown(
        format_digits(trace.last_positions), f"{_how(run)}: positions at step {trace.steps:,}"
    )


def _total(run: LiveRun) -> Shown:
    trace = run.loop("uncached")
    if trace.last is None:
        return Shown(None, "positions computed in all")
    done = trace.positions_cumulative[-1]
    return Shown(
        format_digits(done), f"{_how(run)}: positions in {format_count(trace.steps, 'step')}"
    )


def _wasted(run: LiveRun) -> Shown:
    trace = run.loop("uncached")
    if trace.last is None:
        return Shown(None, "positions computed more than once")
    done = trace.positions_cumulative[-1]
    redone = done - trace.last_positions  # every position but the newest step's, again
    return Shown(
        format_digits(redone), f"{_how(run)}: {format_percent(redone / done)} computed again"
    )


def _with_cache(run: LiveRun) -> Shown:
    n = run.compared_steps()
    if not n:
        return Shown(None, "positions computed with the cache")
    uncached, cached = run.work_over(n)
    return Shown(format_digits(cached), f"{_how(run)}: positions, {uncached:,} without")


def _by_count(run: LiveRun) -> Shown:
    n = run.compared_steps()
    if not n:
        return Shown(None, "fewer positions computed")
    uncached, cached = run.work_over(n)
    return Shown(format_ratio(uncached / cached), f"{_how(run)}: less work, same tokens")


def _wall(run: LiveRun) -> Shown:
    ratio = run.wall_speedup()
    what = {"measured": "faster in wall time", "modelled": "faster by the roofline"}
    line = what.get(run.how, "faster")
    if not ratio:
        return Shown(None, line)
    return Shown(format_ratio(ratio), f"{_how(run)}: {line}, less than by count")


def _token_bytes(run: LiveRun) -> Shown:
    picture = run.picture("cached")
    started = run.started
    if picture.row_bytes is None or started is None:
        return Shown(None, "bytes of keys and values a token")
    elements = 2 * started.layers * started.kv_heads * started.head_dim
    per = started.kv_bytes_per_token // max(1, elements)
    formula = (
        f"2 x {started.layers} layers x {started.kv_heads} heads x {started.head_dim} x {per} B"
    )
    return Shown(format_digits(picture.row_bytes), f"{_how(run)}: bytes a token = {formula}")


def _held(run: LiveRun) -> Shown:
    last = run.loop("cached").last
    if last is None:
        return Shown(None, "keys and values held")
    number, _, unit = format_bytes(last.kv_bytes).partition(" ")
    held = format_count(last.position, "token")
    return Shown(number.replace(",", " "), f"{unit}, {_how(run)}: {held} held, more each step")


def _fills(run: LiveRun) -> Shown:
    pool = run.pool()
    if pool is None:
        return Shown(None, "no pool: the engine keeps a cache of its own")
    at = pool.pool.tokens_before_full(pool.prompt_tokens, pool.batch)
    capacity = format_bytes(pool.pool.capacity_bytes)
    return Shown(
        format_digits(at), f"formula: tokens until the {capacity} pool ({pool.source}) is full"
    )


NODES: tuple[Node, ...] = (
    Node(
        "kvtui · why LLM decoding needs a KV cache",
        "A real model decodes beside this screen, with and without a cache: every figure is "
        "measured on it, or says it is modelled. Space moves on.",
        None,
    ),
    Node(
        "1 · Without a cache, every step redoes the whole history",
        "Each token becomes a key and a value the model reads back; without a cache, every step "
        "computes all of them again.",
        "uncached",
        (Figure("PER STEP", _per_step), Figure("TOTAL", _total), Figure("WASTED", _wasted)),
    ),
    Node(
        "2 · With the cache, you compute only the new token",
        "Keys and values of past tokens never change, so they are kept: a step writes one new "
        "row, and its query reads every row once and is dropped.",
        "cached",
        (
            Figure("WITH THE CACHE", _with_cache),
            Figure("BY COUNT", _by_count),
            Figure("TIME", _wall),
        ),
    ),
    Node(
        "3 · The cache grows and eats memory",
        "Every token keeps its keys and values in every layer, beside the weights, until the "
        "memory is full and generation stops.",
        "cached",
        (
            Figure("A TOKEN", _token_bytes),
            Figure("HELD NOW", _held),
            Figure("FULL AT", _fills),
        ),
    ),
    Node(
        "The closing question",
        "A model has plenty of compute left, but a long chat suddenly refuses to continue. Why, "
        "and what actually ran out?",
        None,
        (
            Figure(
                "ANSWER",
                lambda run: Shown(
                    None,
                    "GPU memory: the KV cache grew with every token and ran out of room. A "
                    "shorter context, a smaller batch, a smaller KV dtype or a bigger GPU are the "
                    "ways out.",
                ),
            ),
        ),
    ),
)


class BigFigure(Vertical):
    """A headline figure: its label, large digits, and the line that says what it is."""

    DEFAULT_CSS = """
    BigFigure {
        height: auto;
        margin-bottom: 1;
    }
    BigFigure > .big--label {
        color: $text-muted;
        text-style: bold;
    }
    BigFigure > Digits {
        color: $text;
        text-style: bold;
        width: auto;
    }
    BigFigure > .big--line {
        color: $text-muted;
    }
    """

    def compose(self) -> ComposeResult:
        yield Note(classes="big--label")
        yield Digits()
        yield Note(classes="big--line")

    def show(self, label: str, shown: Shown) -> None:
        self.query_one(".big--label", Note).show(label)
        digits = self.query_one(Digits)
        digits.display = shown.digits is not None
        if shown.digits is not None:
            digits.update(shown.digits)
        self.query_one(".big--line", Note).show(plain(shown.line))  # a record's words in it


class PresentScreen(LessonScreen):
    """The lesson for a room: see the module's docstring."""

    BINDINGS = [
        Binding("space,right,pagedown", "next", "Next", key_display="space"),
        Binding("left,pageup,backspace", "back", "Back", key_display="←"),
        Binding("s", "app.pause", "Pause"),
        Binding("p", "app.present", "Leave"),
    ]

    node: var[int] = var(0, init=False)
    """The node shown (an index into NODES)."""
    revealed: var[int] = var(0, init=False)
    """How many of the node's figures are shown."""

    def compose_body(self) -> ComposeResult:
        yield Static(id="present-idea")
        with Horizontal(id="present-main"):
            yield CacheGrid(CachePicture("uncached"), id="present-grid")
            with Vertical(id="present-figures"):
                for _ in range(max(len(node.figures) for node in NODES)):
                    yield BigFigure()
        yield Note(id="present-status")

    def on_mount(self) -> None:
        super().on_mount()
        self.set_interval(0.5, self._tick)
        self._show_node()

    def _tick(self) -> None:
        """While the engine gets ready, keep its waiting line moving (the seconds it has
        taken): no dead air."""
        if self.run.state == "starting" and self.is_current:
            self._show_status()

    def watch_node(self) -> None:
        self._show_node()

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

    def _show_node(self) -> None:
        if not self.ready:
            return
        node = NODES[self.node]
        self.query_one(".lesson-title", Static).update(node.title)
        self.query_one("#present-idea", Static).update(node.idea)
        self.set_class(node.loop is None, "-no-picture")
        self.set_class(self.node == 0, "-title-node")
        self.mark_dirty()

    def _show_status(self) -> None:
        run = self.run
        words = run.status_line()
        if run.state == "starting":
            words += f" {time.monotonic() - run.since:.0f} s"
        elif run.started is not None:
            words = f"{run.started.model} on {run.started.device}: {words}"
        self.query_one("#present-status", Note).show(plain(words))  # the engine's words

    def redraw(self) -> None:
        node = NODES[self.node]
        self._show_status()
        if node.loop is not None:
            self.query_one(CacheGrid).show(self.run.picture(node.loop))
        for i, figure in enumerate(self.query(BigFigure)):
            shown = i < self.revealed and i < len(node.figures)
            figure.display = shown
            if shown:
                figure.show(node.figures[i].label, node.figures[i].read(self.run))
                if not figure.size.width:  # just revealed: its line gets the rows it needs
                    # (a Note asks for a layout only once shown, and kept the text before's)
                    figure.query_one(".big--line").refresh(layout=True)
