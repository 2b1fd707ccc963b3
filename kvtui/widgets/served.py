"""A served run's server, as screens 2 and 3 show it: vLLM's KV cache block by block with its
requests, preemptions and prefix cache (every figure labelled as vLLM's), kvtui's prediction of
its capacity beside it, and the latency kvtui measured against the server's own. Drawing is a
pure read of the run (kvtui.run.serving folds it)."""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from kvtui.engines.factory import parse_engine
from kvtui.engines.protocol import RunStarted
from kvtui.engines.vllm.url import ServerURL
from kvtui.errors import EngineError
from kvtui.format import (
    format_bytes,
    format_count,
    format_int,
    format_percent,
    format_seconds,
    safe_text,
)
from kvtui.run.pressure import peak_words
from kvtui.run.served_layout import ELEMENT_WORDS
from kvtui.run.serving import CapacityCheck, ServerWatch
from kvtui.widgets.plain import plain

FULL = 0.99
"""Usage from which the cache is drawn full."""


def served_url(engine: str) -> ServerURL | None:
    """The server a `vllm:` engine watches (None for another engine)."""
    try:
        return parse_engine(engine).url
    except EngineError:
        return None


def block_cells(used: int, blocks: int, width: int) -> tuple[int, int]:
    """(used, free) cells of a picture `width` cells wide of `blocks` blocks, `used` of them in
    use: a cell a block where they fit, else in proportion (a used block always shows)."""
    if blocks <= 0 or width <= 0:
        return 0, 0
    cells = min(blocks, width)
    shown = round(used * cells / blocks)
    if used > 0:
        shown = max(1, shown)
    return min(shown, cells), cells - min(shown, cells)


def latency_words(server: ServerWatch | None, ttft: float | None, tpot: float | None) -> str:
    """Time to first token and per later token, measured here (client-side, over HTTP: `ttft`,
    `tpot`) beside the server's own histograms (their means over the requests it finished while
    kvtui watched)."""
    ours = (
        f"This request, measured here (kvtui's clock, HTTP included): first token "
        f"{format_seconds(ttft) if ttft is not None else '…'}, each later "
        f"{format_seconds(tpot) if tpot is not None else '…'}."
    )
    if server is None or server.latest is None:
        why = server.error if server is not None and server.error else "no figures yet"
        return f"{ours}\nThe server, all clients (vLLM's own): {safe_text(why, one_line=True)}."
    theirs_ttft, theirs_itl, n = server.ttft_mean_s, server.itl_mean_s, server.ttft_requests
    return (
        f"{ours}\nThe server, all clients (not comparable to one request): vLLM's histograms, "
        f"mean over the {format_count(n or 0, 'request')} it finished while watched, from "
        "whoever sent them: first token "
        f"{format_seconds(theirs_ttft) if theirs_ttft is not None else '…'}, between tokens "
        f"{format_seconds(theirs_itl) if theirs_itl is not None else '…'}. "
        "Positions computed are the server's: kvtui cannot count them over HTTP."
    )


def engines_words(engines: int | None, check: CapacityCheck | str) -> str:
    """Each data-parallel engine's share of the blocks vLLM reports as one total."""
    if not engines or engines < 2:
        return ""
    each = check.blocks_per_engine if isinstance(check, CapacityCheck) else None
    if each is None:
        return f" over {engines} data-parallel engines"
    memory = check.memory_bytes if isinstance(check, CapacityCheck) else None
    of = f", {format_bytes(memory)}" if memory is not None else ""
    return f" ({engines} DP engines x {format_int(each)}{of} each)"


def served_dtype_words(check: CapacityCheck) -> str:
    """Where the server's blocks say it serves the KV cache in another dtype (or split over
    GPUs) than config.json's, in words; empty where they agree with config.json."""
    layout = check.layout
    if layout is None or not layout.differs or layout.fit is None:
        return ""
    fit, others = layout.fit, layout.fits[1:]
    per_token = layout.served_bytes_per_token
    line = f"served in {fit.words()}"
    if fit.element_bytes != layout.config_element_bytes:
        config = ELEMENT_WORDS.get(int(layout.config_element_bytes), "")
        line += f", not config.json's {config or format_int(int(layout.config_element_bytes))}"
    if per_token is not None:
        line += f": {float(per_token):,.0f} B a token = its memory over its blocks"
    if others:
        line += " (or " + ", or ".join(o.words() for o in others)
        line += ": vLLM does not say its tensor/pipeline parallel size)"
    return line


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int) -> str:
    """The newest `width` values (each 0 to 1) as one line of block characters."""
    top = len(SPARKS) - 1
    return "".join(SPARKS[max(0, min(top, round(v * top)))] for v in values[-width:])


class ServedCache(Widget):
    """vLLM's KV cache, live: a cell per block (in use, free), its capacity beside kvtui's
    prediction, requests, preemptions and prefix hits, its usage over the last minutes; red
    while full. `show` draws a served run."""

    DEFAULT_CSS = """
    ServedCache {
        height: auto;
        border: round $primary 40%;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
    }
    ServedCache.-full { border: round $error; border-title-color: $error; }
    ServedCache > .served--used { background: $warning; }
    ServedCache.-full > .served--used { background: $error; }
    ServedCache > .served--free { background: $surface-lighten-1; }
    ServedCache > .served--bad { color: $error; text-style: bold; }
    ServedCache > .served--good { color: $success; text-style: bold; }
    ServedCache > .served--spark { color: $warning; }
    """

    COMPONENT_CLASSES = {
        "served--used",
        "served--free",
        "served--bad",
        "served--good",
        "served--spark",
    }

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._server: ServerWatch | None = None
        self._started: RunStarted | None = None
        self._url: ServerURL | None = None

    def show(self, server: ServerWatch, started: RunStarted | None, engine: str) -> None:
        """Draw a served run: its server's figures, what it said it runs, its engine's name."""
        self._server, self._started, self._url = server, started, served_url(engine)
        m = server.latest
        self.set_class(m is not None and (m.kv_usage or 0) >= FULL, "-full")
        where = safe_text(started.served_by, one_line=True) if started is not None else ""
        self.border_title = "vLLM's KV CACHE (the server's figures)"
        # what the server says it serves: text, never markup
        self.border_subtitle = plain(f"{where} · /metrics twice a second" if where else "")
        self.refresh(layout=True)

    def _style(self, name: str) -> Style:
        return self.get_component_rich_style(f"served--{name}")

    def render(self) -> Text:
        server = self._server
        if server is None:
            return Text("Waiting for the server to answer...", style="dim")
        lines: list[Text] = []
        m = server.latest
        if server.error:
            last = " The figures below are its last." if m is not None else ""
            lines.append(
                Text(f"{safe_text(server.error, one_line=True)}.{last}", self._style("bad"))
            )
        if m is not None:
            lines += [
                self._blocks(server),
                *self._capacity(server),
                *self._requests(server),
                self._history(server),
            ]
        elif not server.error:
            lines.append(Text("Waiting for the server's first figures...", style="dim"))
        return Text("\n").join(lines)

    def _blocks(self, server: ServerWatch) -> Text:
        m = server.latest
        assert m is not None  # render draws blocks only with figures
        line = Text(no_wrap=True, overflow="ellipsis")
        if m.kv_usage is None:  # a poll without the usage gauge: said, not drawn as 0%
            line.append(
                f" KV-cache usage: not in this poll, {peak_words(server.seen_peak, why=True)}"
            )
            return line
        usage = m.kv_usage
        peak = peak_words(server.seen_peak, why=True)
        summary = f" {format_percent(usage)} in use, {peak}"
        if m.kv_blocks:  # vLLM reports a share: the cells are that share of its blocks
            summary = f" {format_percent(usage)} of {format_int(m.kv_blocks)} blocks in use, {peak}"
            used = round(usage * m.kv_blocks)
            width = max(4, self.content_size.width - len(summary))
            on, off = block_cells(used, m.kv_blocks, width)
            line.append("▇" * on, style=self._style("used"))
            line.append(" " * off, style=self._style("free"))
        line.append(summary, style="bold" if usage >= FULL else "")
        return line

    def _capacity(self, server: ServerWatch) -> list[Text]:
        """vLLM's capacity, then kvtui's prediction of it and whether they agree."""
        m, check = server.latest, server.capacity(self._started)
        lines = []
        if m is not None and m.kv_blocks is not None and m.kv_block_tokens:
            tokens = m.kv_capacity_tokens or m.kv_blocks * m.kv_block_tokens
            lines.append(
                Text(
                    f"vLLM: {format_int(tokens)} tokens = {format_int(m.kv_blocks)} blocks of "
                    f"{m.kv_block_tokens} tokens{engines_words(m.engines, check)}"
                )
            )
        if isinstance(check, str):
            lines.append(Text(f"kvtui: no prediction, {safe_text(check, one_line=True)}", "dim"))
            return lines
        words = Text()
        if check.predicted is not None:
            times = f" x {check.engines} engines" if check.engines > 1 else ""
            words.append(
                f"kvtui: {format_bytes(check.predicted.capacity_bytes)} / ({check.block_tokens} x "
                f"{format_int(check.kv_bytes_per_token)} B, {check.kv_dtype}) = "
                f"{format_int(check.predicted.blocks)} blocks{times}: "
            )
            if check.override is not None:
                words.append("vLLM was told its blocks (--num-gpu-blocks-override)", "bold")
            elif check.agree:
                words.append("agree", self._style("good"))
            else:
                ratio = f" ({check.ratio:.2f}x)" if check.ratio else ""
                words.append(f"DISAGREE{ratio}", self._style("bad"))
                if check.reason:
                    words.append(f": {check.reason}")
        else:
            words.append(
                f"kvtui: vLLM gives no memory figure; at {format_int(check.kv_bytes_per_token)} "
                f"B a token ({check.kv_dtype}) its blocks take {format_bytes(check.implied_bytes)}"
            )
        lines.append(words)
        served = served_dtype_words(check)
        if served:
            lines.append(Text(served, "dim"))
        return lines

    def _requests(self, server: ServerWatch) -> list[Text]:
        """Requests running and waiting, preemptions and the prefix cache, as vLLM said."""
        m = server.latest
        assert m is not None  # render asks only with figures
        parts = []
        if m.requests_running is not None:
            parts.append(f"{m.requests_running:,} running")
        if m.requests_waiting is not None:
            reasons = [
                r.replace("capacity=", "for scheduling capacity: ").replace("=", " ")
                for r in m.waiting_reasons
                if not r.endswith("=0")
            ]
            why = f" ({', '.join(reasons)})" if reasons else ""
            parts.append(f"{m.requests_waiting:,} waiting{why}")
        line = Text("requests " + ", ".join(parts) if parts else "requests: not reported")
        seen = server.preemptions_seen
        if seen is not None:
            line.append(" · ")
            line.append(
                f"{format_count(seen, 'preemption')} while watched",
                self._style("bad") if seen else "",
            )
        queries, hits = server.prefix_queries_seen, server.prefix_hits_seen
        if m.prefix_caching is False:
            prefix = "prefix caching off"
        elif queries == 0:
            prefix = "prefix cache: no prompt looked up while watched"
        elif queries is not None and hits is not None:
            prefix = (
                f"prefix cache: {format_int(hits)} of {format_int(queries)} prompt tokens hit "
                f"while watched ({format_percent(hits / queries)})"
            )
        elif m.prefix_hit_rate is not None:
            prefix = f"prefix cache hit rate {format_percent(m.prefix_hit_rate)}"
        else:
            prefix = "prefix cache: not reported"
        started = self._started
        limit = started.max_positions if started is not None else None
        pressure = server.pressure
        if limit:
            prefix += f" · max_model_len {format_int(limit)}"
        prefix += " · max-num-seqs not exposed"
        lines = [line, Text(prefix)]
        for words in (
            pressure.burst_words(),
            pressure.limit_words(m.kv_capacity_tokens, limit),
        ):
            if words:
                lines.append(Text(words, "dim"))
        return lines

    def _history(self, server: ServerWatch) -> Text:
        """Usage over the newest polls, and what `f` would put on the server."""
        from kvtui.engines.vllm.load import fill_plan  # the load's modules, only for a served run

        polls = list(server.usage)
        usage = [u for _, u in polls]
        m, url, started = server.latest, self._url, self._started
        tail = ""
        if m is not None and url is not None and m.kv_capacity_tokens:
            limit = started.max_positions if started is not None else None
            plan = fill_plan(url, m.kv_capacity_tokens, limit)
            tail = f"  f: {plan.requests} x ({plan.prompt_tokens} + {plan.max_tokens}) tokens"
        width = max(8, self.content_size.width - len("usage ") - len(" 300 s") - len(tail))
        shown = min(len(usage), width)
        line = Text("usage ", no_wrap=True, overflow="ellipsis")
        line.append(sparkline(usage, width).ljust(width), self._style("spark"))
        span = polls[-1][0] - polls[-shown][0] if shown else 0.0  # the polls' own clock
        line.append(f" {span:>3.0f} s" + tail, "dim")
        return line
