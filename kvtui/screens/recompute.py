"""Screen 1: without a cache, every step redoes the whole history."""

from __future__ import annotations

import statistics

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Static
from textual_plotext.plot import Plot

from kvtui.format import format_count, format_int, format_percent, format_seconds, format_tick
from kvtui.run.live import CachePicture
from kvtui.screens.base import WorkScreen
from kvtui.sim.work import naive_step_positions
from kvtui.widgets.cache_grid import CacheGrid
from kvtui.widgets.cards import StatCard
from kvtui.widgets.chart import (
    Caption,
    Chart,
    downsample,
    fitting_ticks,
    nice_ticks,
    rolling_median,
    sample_points,
    step_line,
)
from kvtui.widgets.note import Note
from kvtui.widgets.stream import TokenStream

NARRATIVE = (
    "Keys and values are the saved notes of each token, read by every later token. Without a "
    "cache each step rebuilds all notes so far: the step that emits token t after a P-token "
    "prompt recomputes P + t - 1 positions, so the total grows with the square of the length."
)

CAPTION = (
    "{uncached} positions recomputed per step, measured   {formula} the formula, steps to come\n"
    "{time} measured time per step, smoothed (right axis: one position = its median time)"
)
CAPTION_NARROW = (
    "{uncached} positions per step, measured\n"
    "{formula} the formula, steps to come\n"
    "{time} measured time per step (right axis)"
)

SMOOTHING_STEPS = 9
"""The measured step times are drawn as a rolling median of this many steps (a CPU step's time
jitters by about +-20% from one step to the next)."""


class RecomputeScreen(WorkScreen):
    """The uncached loop of the live run: its tokens, its staircase of work per step, measured,
    and the cards the lesson draws from it."""

    TITLE_TEXT = "1 · Without a cache, every step redoes the whole history"

    BINDINGS = [Binding("c", "app.cache_on", "Cache on")]

    def compose_body(self) -> ComposeResult:
        with Horizontal(classes="cards"):
            yield StatCard("PER STEP", "…", id="per-step")
            yield StatCard("TOTAL", "…", id="total")
            yield StatCard("WASTED", "…", id="wasted")
            yield StatCard("ANSWER", "…", id="length")
        with Horizontal(classes="middle"):
            yield TokenStream("Without a cache", id="stream")
            with Vertical(classes="chart-box"):
                yield Chart(id="staircase")
                yield Caption(CAPTION, classes="caption -wide-caption")
                yield Caption(CAPTION_NARROW, classes="caption -narrow-caption")
                yield Note(id="run-note", classes="run-note")
            yield CacheGrid(CachePicture("uncached"), id="grid")
        yield Static(NARRATIVE, classes="narrative")

    def show_cards(self) -> None:
        """The uncached loop's figures so far, as the engine counted them."""
        trace = self.run.loop("uncached")
        per_step, total, wasted = (
            self.query_one(f"#{i}", StatCard) for i in ("per-step", "total", "wasted")
        )
        last = trace.last
        how = self.run.how
        captions = zip(self.query(Caption), (CAPTION, CAPTION_NARROW), strict=True)
        for caption, template in captions:  # how the run's figures were had, once it says
            caption.show(template.replace("measured", how or "the engine's"))
        if last is None:
            per_step.value = total.value = wasted.value = "…"
            per_step.note = total.note = wasted.note = how or "…"
        else:
            done = trace.positions_cumulative[-1]  # per sequence, as the staircase
            newest = trace.last_positions
            redone = done - newest  # every position but the newest, again
            per_step.value = format_int(newest)  # a count of positions, not a ratio
            per_step.note = "positions"
            total.value, total.note = format_int(done), format_count(trace.steps, "step")
            wasted.value = format_int(redone)
            wasted.note = f"{format_percent(redone / done)} redone"
            wasted.set_class(redone > 0, "-bad")
        length = self.query_one("#length", StatCard)
        length.value = format_int(self.run.run_tokens)
        length.note = (f"tokens, {trace.steps:,} done", f"{trace.steps:,} done")

    def redraw(self) -> None:
        trace = self.run.loop("uncached")
        self.query_one(TokenStream).show(
            trace.text,
            trace.last_text,
            trace.steps,
            prompt=self.run.prompt_text,
            placeholder=self.run.how == "modelled",
        )
        self.show_cards()
        self.show_run_note()
        self.query_one("#staircase", Chart).draw(self._draw_staircase)
        self.query_one(CacheGrid).show(self.run.picture("uncached"))

    def _draw_staircase(self, plt: Plot, points: int) -> None:
        """Positions per step as the engine counted them (bright), the formula's steps still to
        come (dotted), and the measured time per step, smoothed, on the right axis, scaled so
        that one position is the run's median time per position."""
        chart = self.query_one("#staircase", Chart)
        live, trace = self.run, self.run.loop("uncached")
        n, P = live.run_tokens, max(1, live.prompt_tokens)
        top = naive_step_positions(n, P)
        stairs = n <= points // 4  # few enough steps to draw each one flat
        self._draw_time(plt, points, top)  # first: the counted stairs are drawn over it
        todo = [t for t in sample_points(n, points) if t > trace.steps]
        if todo:
            ys = [naive_step_positions(t, P) for t in todo]
            xs, ys = step_line(todo, ys) if stairs else (todo, ys)
            plt.plot(xs, ys, color=chart.colour("formula"), marker="dot")
        counted = trace.positions
        if counted.steps:
            xs, ys = downsample([s + 1 for s in counted.steps], counted.values, points)
            xs, ys = step_line(xs, ys) if stairs else (xs, ys)
            plt.plot(xs, ys, color=chart.colour("uncached"), marker="braille")
        plt.ylim(0, top * 1.05)
        left = fitting_ticks(top, 4, chart.rows)
        plt.yticks(left, [format_tick(t) for t in left])
        plt.xlim(0.5, n + 0.5)
        xt = [t for t in nice_ticks(n, 5) if t >= 1] or [1]
        plt.xticks(xt, [format_tick(t) for t in xt])

    def _draw_time(self, plt: Plot, points: int, top_positions: int) -> None:
        chart = self.query_one("#staircase", Chart)
        trace = self.run.loop("uncached")
        measured, counted = trace.step_seconds, trace.positions
        if not measured.steps:
            return
        at, _ = downsample(range(len(measured.steps)), range(len(measured.steps)), points)
        smooth = rolling_median(measured.values, SMOOTHING_STEPS, at=at)
        per_position = statistics.median(
            s / max(1, p) for s, p in zip(measured.values, counted.values, strict=False)
        )
        top = top_positions * 1.05 * per_position or 1.0
        plt.plot(
            [measured.steps[i] + 1 for i in at],
            [y / top for y in smooth],
            color=chart.colour("time"),
            marker="braille",
            yside="right",
        )
        ticks = fitting_ticks(top, 3, chart.rows)
        plt.ylim(0, 1, yside="right")
        plt.yticks(
            [t / top for t in ticks],
            [format_seconds(t) if t else "0" for t in ticks],
            yside="right",
        )
