"""Screen 2: with the cache, you compute only the new token."""

from __future__ import annotations

import statistics

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import var
from textual.widgets import Static
from textual_plotext.plot import Plot

from kvtui.engines.vllm.events import EventsError, parse_events
from kvtui.format import format_int, format_ratio, format_seconds, format_tick
from kvtui.run.live import CachePicture, LiveRun, LoopTrace
from kvtui.run.server_blocks import ServerBlocksFeed
from kvtui.screens.base import WorkScreen
from kvtui.sim.catalog import UnknownNameError, get_gpu, get_model
from kvtui.sim.work import compute_bound_positions
from kvtui.widgets.cache_grid import CacheGrid
from kvtui.widgets.cards import StatCard
from kvtui.widgets.chart import Caption, Chart, downsample, fitting_ticks, nice_ticks
from kvtui.widgets.note import Note
from kvtui.widgets.served import latency_words
from kvtui.widgets.server_blocks import ServerBlocksPanel
from kvtui.widgets.stream import TokenStream

CAPTION = "{uncached} without a cache   {cached} with a cache   (counted by the engine)   x: tokens"
CAPTION_NARROW = "{uncached} without a cache  {cached} with a cache  x: tokens"
CAPTION_OFF = "{uncached} without a cache   (counted by the engine)   x: tokens"
CAPTION_OFF_NARROW = "{uncached} without a cache  x: tokens"


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
    TITLE_OFF = "2 · The cache is off: every step computes every position again (c: on)"
    """The title while `c` has turned the cache off: the screen then shows the uncached loop."""

    BINDINGS = [
        Binding("c", "app.toggle_cache", "Cache"),
        Binding("v", "toggle_totals", "Per step/total", show=False),
    ]

    cache_on: var[bool] = var(True, init=False)
    """The App's cache toggle (bound); its watcher sets a class and redraws what changed."""

    def __init__(self, run: LiveRun, *, kv_events: str | None = None) -> None:
        """`kv_events` (--kv-events): where a served run's server publishes its KV cache events;
        this screen listens from now on (not from when it is first shown) and draws them in the
        charts' place, which a served run leaves empty."""
        super().__init__(run)
        self.server_blocks: ServerBlocksFeed | None = None
        self.events_error = ""
        if kv_events:
            try:
                endpoint, replay, ranks = parse_events(kv_events)
                self.server_blocks = ServerBlocksFeed(endpoint, ranks=ranks, replay=replay)
            except EventsError as exc:
                self.events_error = str(exc)

    def compose_body(self) -> ComposeResult:
        with Horizontal(classes="cards"):
            yield StatCard("WITHOUT", "…", id="without")
            yield StatCard("WITH", "…", id="with")
            yield StatCard("BY COUNT", "…", id="speedup")
            yield StatCard("MEASURED", "…", id="measured")
        with Horizontal(classes="middle"):
            with Vertical(classes="streams"):
                yield TokenStream("Without a cache", id="stream-uncached")
                yield Note(id="same-mark")
                yield TokenStream("With a cache", id="stream-cached")
            with Vertical(classes="charts"):
                yield Chart(id="per-step")
                yield Chart(id="cumulative")
                yield Caption(CAPTION, classes="caption -wide-caption")
                yield Caption(CAPTION_NARROW, classes="caption -narrow-caption")
                yield Note(id="run-note", classes="run-note")
                if self.server_blocks is not None:
                    yield ServerBlocksPanel(self.server_blocks, id="server-blocks")
            yield CacheGrid(CachePicture("cached"), id="grid")
        yield Note(classes="narrative", id="why")

    def on_mount(self) -> None:
        super().on_mount()
        self._show_legend()
        if self.events_error:
            self.notify(self.events_error, title="KV cache events", severity="error", markup=False)

    def on_unmount(self) -> None:
        if self.server_blocks is not None:
            self.server_blocks.close()

    def watch_cache_on(self, cache_on: bool) -> None:
        self.set_class(not cache_on, "-cache-off")
        self._show_legend()
        self.redraw_now()

    def _show_legend(self) -> None:
        """The title and the charts' legend name the cached loop only while it is drawn."""
        on = self.cache_on
        self.query_one(".lesson-title", Static).update(self.TITLE_TEXT if on else self.TITLE_OFF)
        templates = (CAPTION, CAPTION_NARROW) if on else (CAPTION_OFF, CAPTION_OFF_NARROW)
        for caption, template in zip(self.query(Caption), templates, strict=False):
            caption.show(template)

    def action_toggle_totals(self) -> None:
        """On a short terminal, show the running totals instead of the work per step (or back)."""
        self.toggle_class("-totals")
        self.redraw_now()

    def show_cards(self) -> None:
        """Work and time of both loops over the same steps: those both have run so far."""
        live = self.run
        n = live.compared_steps()
        without, with_card = self.query_one("#without", StatCard), self.query_one("#with", StatCard)
        speedup, timed = self.query_one("#speedup", StatCard), self.query_one("#measured", StatCard)
        timed.border_title = live.how.upper() or "TIME"
        span = f"steps 1-{n:,}" if n else "same steps"
        if live.server is not None:  # a served run: what a server's run gives, or why not
            self._served_cards(without, with_card, speedup, timed)
            return
        uncached, cached = live.work_over(n)
        without.value = format_int(uncached) if n else "…"
        without.note = span
        if not self.cache_on:
            with_card.value, with_card.note = "off", "c turns it on"
            speedup.value, speedup.note = "—", ("no cache to compare", "no cache")
            timed.value, timed.note = "—", ("no cache to time", "no cache")
            speedup.set_class(False, "-good")
            return
        with_card.value = format_int(cached) if n else "…"
        with_card.note = span
        speedup.value = format_ratio(uncached / cached) if n else "…"
        speedup.note = ("fewer positions", "less work")
        speedup.set_class(n > 0, "-good")
        ratio = live.wall_speedup()
        timed.value = format_ratio(ratio) if ratio else "…"
        timed.note = {
            "measured": "wall time",
            "replayed": "wall time",
            "modelled": "roofline",
        }.get(live.how, "…")

    def _served_cards(
        self, without: StatCard, with_card: StatCard, speedup: StatCard, timed: StatCard
    ) -> None:
        """A vllm: run's cards: the server keeps its cache (no loop without one to count or
        time) and computes positions kvtui cannot see over HTTP; what this request streamed and
        how fast, on kvtui's clock."""
        cached = self.run.summary.loop("cached")
        without.value, without.note = "—", ("a server keeps its cache", "server caches")
        streamed = self.run.loop("cached").steps
        with_card.value = format_int(streamed) if streamed else "…"
        with_card.note = ("tokens, this request", "tokens")
        speedup.value, speedup.note = "—", ("positions: not over HTTP", "not over HTTP")
        speedup.set_class(False, "-good")
        timed.border_title = "THIS REQUEST"
        timed.value = format_seconds(cached.tpot_s) if cached.tpot_s is not None else "…"
        timed.note = ("a token, kvtui's clock", "a token")

    def redraw(self) -> None:
        uncached, cached = self.run.loop("uncached"), self.run.loop("cached")
        prompt, placeholder = self.run.prompt_text, self.run.how == "modelled"
        self.query_one("#stream-uncached", TokenStream).show(
            uncached.text,
            uncached.last_text,
            uncached.steps,
            prompt=prompt,
            placeholder=placeholder,
        )
        self.query_one("#stream-cached", TokenStream).show(
            cached.text, cached.last_text, cached.steps, prompt=prompt, placeholder=placeholder
        )
        self._show_mark()
        self.show_cards()
        self.show_run_note()
        self.query_one("#why", Note).show(self._why())
        self.query_one("#per-step", Chart).draw(self._draw_per_step)
        self.query_one("#cumulative", Chart).draw(self._draw_cumulative)
        loop = "cached" if self.cache_on else "uncached"
        self.query_one(CacheGrid).show(self.run.picture(loop))
        server = self.run.server
        self.set_class(self.server_blocks is not None and server is not None, "-events")
        for panel in self.query(ServerBlocksPanel):
            panel.show(server.latest if server else None, self.run.prompt_text)

    def _show_mark(self) -> None:
        mark = self.query_one("#same-mark", Note)
        n = self.run.compared_steps()
        diverged = self.run.first_divergence()
        mark.set_class(diverged is not None, "-diverged")
        mark.set_class(diverged is None and n > 0, "-identical")
        both_done = all(self.run.loop(loop).finished for loop in ("uncached", "cached"))
        if diverged is not None:
            mark.show(f"✗ first divergence at step {diverged + 1:,}")
        elif n:
            words = f"identical: {n:,} tokens" if both_done else f"identical so far: {n:,} tokens"
            mark.show(f"[$text-success]✓[/] {words}")  # the mark green, the words text
        elif self.run.server is not None:  # a server has no loop without a cache to compare
            mark.show("one stream: a server caches")
        else:
            mark.show("… comparing the two streams")

    def _why(self) -> str:
        if self.run.server is not None:  # a vllm: run: the server's latency beside ours
            cached = self.run.summary.loop("cached")
            return latency_words(self.run.server, cached.ttft_s, cached.tpot_s)
        if not self.cache_on:
            return (
                "Without a cache each step recomputes every position so far: the staircase. "
                "c puts the cached loop beside it, one position a step."
            )
        if self.run.how == "modelled":
            return self._why_modelled()
        if not self.run.how:  # nothing has run yet: nothing to explain
            return ""
        cached = self.run.loop("cached").step_seconds
        timed = "Measured" if self.run.how == "measured" else "The recorded time"
        lines = [
            f"{timed} is below the count: recomputing many positions in one pass costs less "
            "per position than a one-token step."
        ]
        values = cached.values[1:]
        if len(values) >= 8:
            quarter = len(values) // 4
            early = statistics.median(values[:quarter])
            late = statistics.median(values[-quarter:])
            lines.append(
                f"A cached step: {format_seconds(early)} early, {format_seconds(late)} lately; "
                "it still reads every cached key and value (screen 3)."
            )
        return "\n".join(lines)

    def _why_modelled(self) -> str:
        """Why the roofline's speedup is what it is: an uncached step is memory-bound, as
        cheap as a cached one, until it recomputes enough positions to be compute-bound."""
        started, plain = self.run.started, "Times are modelled (roofline), not measured."
        if started is None:
            return plain
        try:  # a record from before the start event named its GPU has ""
            model, gpu = get_model(started.model), get_gpu(started.modelled_gpu)
        except UnknownNameError:
            return plain
        if started.modelled_gpus > 1:
            return (
                f"Modelled (roofline), not measured: {started.modelled_gpus} {gpu.display_name}s "
                "each read their share of the weights and exchange activations twice a layer; a "
                "step recomputing few positions costs what a cached one does."
            )
        crossover = compute_bound_positions(model, gpu)
        where = (
            f"until it recomputes about {crossover:,} positions"
            if crossover
            else "at every length this model allows"
        )
        return (
            f"Modelled (roofline), not measured: on the {gpu.display_name} an uncached step "
            f"reads the weights once, like a cached one, and costs the same {where}; past that "
            "it is compute-bound and grows with the length."
        )

    def _series(self, trace: LoopTrace, points: int, cumulative: bool) -> tuple[list, list]:
        """One loop's positions per step, or their running total, at most about `points`."""
        if cumulative:
            totals = trace.positions_cumulative
            xs, ys = downsample(range(1, len(totals) + 1), totals, points)
        else:
            steps = [s + 1 for s in trace.positions.steps]
            xs, ys = downsample(steps, trace.positions.values, points)
        return list(xs), list(ys)

    def _draw(self, chart_id: str, plt: Plot, points: int, cumulative: bool) -> None:
        chart = self.query_one(f"#{chart_id}", Chart)
        n = self.run.run_tokens
        top = 1
        loops = ("uncached", "cached") if self.cache_on else ("uncached",)
        if self.run.server is not None:  # a served run: the server's positions, not observed
            loops = ()
        for loop in loops:
            xs, ys = self._series(self.run.loop(loop), points, cumulative)
            if xs:
                plt.plot(xs, ys, color=chart.colour(loop), marker="braille")
                top = max(top, max(ys))
        plt.xlim(1, max(2, n))
        plt.ylim(-0.04 * top, top * 1.05)  # the cached line's 1s stay clear of the axis
        xt = [t for t in nice_ticks(n, 4) if t >= 1] or [1]
        plt.xticks(xt, [format_tick(t) for t in xt])
        yt = fitting_ticks(top, 3, chart.rows)
        plt.yticks(yt, [format_tick(t) for t in yt])

    def _draw_per_step(self, plt: Plot, points: int) -> None:
        served = self.run.server is not None
        plt.title(
            "Positions computed: the server's, not seen over HTTP"
            if served
            else "Positions computed per step"
        )
        self._draw("per-step", plt, points, cumulative=False)

    def _draw_cumulative(self, plt: Plot, points: int) -> None:
        uncached, cached = self.run.work_over(self.run.compared_steps())
        plt.title(
            f"Total: {format_int(uncached - cached)} positions saved so far"
            if self.cache_on and cached
            else "Total positions computed"
        )
        self._draw("cumulative", plt, points, cumulative=True)
