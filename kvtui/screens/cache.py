"""Screen 2: with the cache, you compute only the new token."""

from __future__ import annotations

import statistics

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Static
from textual_plotext.plot import Plot

from kvtui.format import format_int, format_ratio, format_seconds, format_tick
from kvtui.screens.base import WorkScreen
from kvtui.sim.work import (
    cached_cumulative,
    cached_step_positions,
    naive_cumulative,
    naive_step_positions,
    work_summary,
)
from kvtui.widgets.cards import StatCard
from kvtui.widgets.chart import Chart, fitting_ticks, nice_ticks, sample_points
from kvtui.widgets.stream import TokenStream

CAPTION = "[$primary]━[/] without a cache   [$success]━[/] with a cache   x: answer tokens"
CAPTION_NARROW = "[$primary]━[/] without a cache  [$success]━[/] with a cache  x: tokens"


def _axes(plt: Plot, length: int, top: float, rows: int) -> None:
    """Step axis 1..length and a work axis 0..top, with round, short tick labels."""
    plt.xlim(1, max(2, length))
    plt.ylim(0, top)
    xt = [t for t in nice_ticks(length, 4) if t >= 1] or [1]
    plt.xticks(xt, [format_tick(t) for t in xt])
    yt = fitting_ticks(top, 3, rows)
    plt.yticks(yt, [format_tick(t) for t in yt])


class CacheScreen(WorkScreen):
    """Both loops side by side: the same tokens, a staircase against a flat line."""

    TITLE_TEXT = "2 · With the cache, you compute only the new token"

    BINDINGS = [Binding("c", "app.toggle_cache", "Cache")]

    cache_on: reactive[bool] = reactive(True, init=False)

    def compose_body(self) -> ComposeResult:
        with Horizontal(classes="cards"):
            yield StatCard("WITHOUT", id="without")
            yield StatCard("WITH", id="with")
            yield StatCard("SPEEDUP", id="speedup")
            yield StatCard("MEASURED", id="measured")
        with Horizontal(classes="middle"):
            with Vertical(classes="streams"):
                yield TokenStream("Without a cache", id="stream-uncached")
                yield Static("", id="same-mark")
                yield TokenStream("With a cache", id="stream-cached")
            with Vertical(classes="charts"):
                yield Chart(id="per-step")
                yield Chart(id="cumulative")
                yield Static(CAPTION, classes="caption -wide-caption")
                yield Static(CAPTION_NARROW, classes="caption -narrow-caption")
                yield Static("", id="run-note", classes="run-note")
        yield Static("", classes="narrative", id="why")

    def watch_cache_on(self, cache_on: bool) -> None:
        self.set_class(not cache_on, "-cache-off")
        self.show_cards()
        self.mark_dirty()

    def show_cards(self) -> None:
        if not self.ready:
            return
        w = work_summary(self.length)
        without = self.query_one("#without", StatCard)
        without.value, without.note = format_int(w.naive_total), "positions"
        with_card = self.query_one("#with", StatCard)
        speedup = self.query_one("#speedup", StatCard)
        if self.cache_on:
            with_card.value, with_card.note = format_int(w.cached_total), "positions"
            speedup.value, speedup.note = format_ratio(w.speedup), "by count"
        else:
            with_card.value, with_card.note = "off", "c turns it on"
            speedup.value, speedup.note = "1x", "no cache, no saving"
        speedup.set_class(self.cache_on, "-good")
        self._show_measured()

    def _show_measured(self) -> None:
        measured = self.query_one("#measured", StatCard)
        ratio = self.live.wall_speedup()
        measured.value = format_ratio(ratio) if ratio else "…"
        measured.note = "wall time"

    def redraw(self) -> None:
        uncached, cached = self.live.loop("uncached"), self.live.loop("cached")
        self.query_one("#stream-uncached", TokenStream).show(
            uncached.text, uncached.last_text, uncached.steps
        )
        self.query_one("#stream-cached", TokenStream).show(
            cached.text, cached.last_text, cached.steps
        )
        self._show_mark()
        self._show_measured()
        self.show_run_note()
        self.query_one("#why", Static).update(self._why())
        self.query_one("#per-step", Chart).draw(self._draw_per_step)
        self.query_one("#cumulative", Chart).draw(self._draw_cumulative)

    def _show_mark(self) -> None:
        mark = self.query_one("#same-mark", Static)
        n = self.live.compared_steps()
        diverged = self.live.first_divergence()
        mark.set_class(diverged is not None, "-diverged")
        mark.set_class(diverged is None and n > 0, "-identical")
        if diverged is not None:
            mark.update(f"✗ first divergence at step {diverged + 1:,}")
        elif n:
            mark.update(f"✓ identical: all {n:,} tokens")
        else:
            mark.update("… comparing the two streams")

    def _why(self) -> str:
        cached = self.live.loop("cached").step_seconds
        lines = ["Measured is below the count: a batched recompute costs less per position."]
        values = cached.values[1:]
        if len(values) >= 8:
            quarter = len(values) // 4
            early = statistics.median(values[:quarter])
            late = statistics.median(values[-quarter:])
            lines.append(
                f"A cached step: {format_seconds(early)} early, {format_seconds(late)} lately; "
                "it still reads every cached key and value (screen 3)."
            )
        else:
            lines.append(
                "A cached step gets slowly dearer with position: it still reads every cached "
                "key and value (screen 3)."
            )
        return "\n".join(lines)

    def _draw_per_step(self, plt: Plot, points: int) -> None:
        chart = self.query_one("#per-step", Chart)
        length, prompt = self.length, 1
        steps = sample_points(length, points)
        plt.plot(
            steps,
            [naive_step_positions(t, prompt) for t in steps],
            color=chart.rgb("primary"),
            marker="braille",
        )
        if self.cache_on:
            plt.plot(
                steps,
                [cached_step_positions(t, prompt) for t in steps],
                color=chart.rgb("success"),
                marker="braille",
            )
        plt.title("Work per step")
        _axes(plt, length, naive_step_positions(length, prompt) * 1.05, chart.rows)
        if self.has_class("-short"):  # the chart below labels the same steps: keep a row
            plt.xticks([], [])

    def _draw_cumulative(self, plt: Plot, points: int) -> None:
        chart = self.query_one("#cumulative", Chart)
        length = self.length
        steps = sample_points(length, points)
        plt.plot(
            steps,
            [naive_cumulative(t) for t in steps],
            color=chart.muted("primary", 0.7),
            marker="braille",
            fillx=True,
        )
        if self.cache_on:
            plt.plot(
                steps,
                [cached_cumulative(t) for t in steps],
                color=chart.rgb("success"),
                marker="braille",
                fillx=True,
            )
        saved = naive_cumulative(length) - (cached_cumulative(length) if self.cache_on else 0)
        plt.title(
            f"Total work: {format_int(saved)} positions saved"
            if self.cache_on
            else "Total work without a cache"
        )
        _axes(plt, length, naive_cumulative(length) * 1.05, chart.rows)
