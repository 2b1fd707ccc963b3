"""Screen 1: without a cache, every step redoes the whole history."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Static
from textual_plotext.plot import Plot

from kvtui.format import format_int, format_percent, format_ratio, format_seconds, format_tick
from kvtui.screens.base import WorkScreen
from kvtui.sim.work import work_summary
from kvtui.widgets.cards import StatCard
from kvtui.widgets.chart import (
    Chart,
    downsample,
    fitting_ticks,
    nice_ticks,
    rolling_median,
    sample_points,
    step_line,
)
from kvtui.widgets.stream import TokenStream

NARRATIVE = (
    "Keys and values are the saved notes of each token, read by every later token. Without a "
    "cache each step rebuilds all notes so far: step t recomputes t positions, so n tokens cost "
    "n(n+1)/2, growing with the square of the length."
)

CAPTION = (
    "[$primary]━[/] positions recomputed per step   [$primary 50%]━[/] still to come\n"
    "[$warning]━[/] measured time per step, smoothed (right axis)"
)
CAPTION_NARROW = (
    "[$primary]━[/] positions recomputed  [$primary 50%]━[/] to come\n"
    "[$warning]━[/] measured time per step, smoothed"
)

SMOOTHING_STEPS = 9
"""The measured step times are drawn as a rolling median of this many steps (a CPU step's time
jitters by about +-20% from one step to the next)."""


class RecomputeScreen(WorkScreen):
    """The uncached run's tokens, its staircase of work per step, and the lesson's cards."""

    TITLE_TEXT = "1 · Without a cache, every step redoes the whole history"

    BINDINGS = [Binding("c", "app.cache_on", "Cache on")]

    def compose_body(self) -> ComposeResult:
        with Horizontal(classes="cards"):
            yield StatCard("PER STEP", id="per-step")
            yield StatCard("TOTAL", id="total")
            yield StatCard("WASTED", id="wasted")
            yield StatCard("ANSWER", id="length")
        with Horizontal(classes="middle"):
            yield TokenStream("Without a cache", id="stream")
            with Vertical(classes="chart-box"):
                yield Chart(id="staircase")
                yield Static(CAPTION, classes="caption -wide-caption")
                yield Static(CAPTION_NARROW, classes="caption -narrow-caption")
                yield Static("", id="run-note", classes="run-note")
        yield Static(NARRATIVE, classes="narrative")

    def show_cards(self) -> None:
        if not self.ready:
            return
        w = work_summary(self.length)
        self.query_one("#per-step", StatCard).value = format_ratio(w.naive_last_step)
        self.query_one("#per-step", StatCard).note = "the last step"
        self.query_one("#total", StatCard).value = format_int(w.naive_total)
        self.query_one("#total", StatCard).note = "positions"
        wasted = self.query_one("#wasted", StatCard)
        wasted.value = format_int(w.wasted)
        wasted.note = f"{format_percent(w.wasted / w.naive_total)} redone"
        wasted.set_class(w.wasted > 0, "-bad")
        length = self.query_one("#length", StatCard)
        length.value = str(w.length)
        length.note = "tokens ←→"

    def redraw(self) -> None:
        trace = self.live.loop("uncached")
        self.query_one(TokenStream).show(trace.text, trace.last_text, trace.steps)
        self.show_run_note()
        self.query_one("#staircase", Chart).draw(self._draw_staircase)

    def _draw_staircase(self, plt: Plot, points: int) -> None:
        """Counted work per step as a step line (the live run's steps bright, the rest muted),
        and the measured time per step, smoothed, on the right axis."""
        chart = self.query_one("#staircase", Chart)
        length = self.length
        trace = self.live.loop("uncached")
        stairs = length <= points // 4  # few enough steps to draw each one flat
        steps = sample_points(length, points)
        xs, ys = step_line(steps, steps) if stairs else (steps, steps)
        plt.plot(xs, ys, color=chart.muted("primary", 0.35), marker="braille")
        done = [t for t in steps if t <= trace.steps]
        if done:
            dx, dy = step_line(done, done) if stairs else (done, done)
            plt.plot(dx, dy, color=chart.rgb("primary"), marker="braille")
        measured = trace.step_seconds
        n = sum(1 for s in measured.steps if s < length)
        if n:
            at, _ = downsample(range(n), range(n), points)
            smooth = rolling_median(measured.values[:n], SMOOTHING_STEPS, at=at)
            top = max(smooth) * 1.15 or 1.0
            plt.plot(
                [measured.steps[i] + 1 for i in at],
                [y / top for y in smooth],
                color=chart.rgb("warning"),
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
        plt.ylim(0, length * 1.05)
        left = fitting_ticks(length, 4, chart.rows)
        plt.yticks(left, [format_tick(t) for t in left])
        plt.xlim(0.5, length + 0.5)
        xt = [t for t in nice_ticks(length, 5) if t >= 1] or [1]
        plt.xticks(xt, [format_tick(t) for t in xt])
