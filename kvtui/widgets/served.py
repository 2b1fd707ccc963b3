"""A served run's server, as screens 2 and 3 show it: vLLM's KV cache block by block with its
requests, preemptions and prefix cache (every figure labelled as vLLM's), kvtui's prediction of
its capacity beside it, and the latency kvtui measured against the server's own. Drawing is a
pure read of the run (kvtui.engine.serving folds it)."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from kvtui.engine.client import ServerURL
from kvtui.engine.protocol import EngineError, RunStarted
from kvtui.engine.serving import CapacityCheck, ServerWatch
from kvtui.engine.spec import parse_engine
from kvtui.format import (
    format_bytes,
    format_count,
    format_int,
    format_percent,
    format_seconds,
    safe_text,
)

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


def capacity_words(server: ServerWatch, check: CapacityCheck | str) -> Text:
    """The server's capacity beside kvtui's prediction, and whether they agree."""
    m = server.latest
    words = Text()
    if m is not None and m.kv_blocks is not None and m.kv_block_tokens:
        tokens = m.kv_capacity_tokens or m.kv_blocks * m.kv_block_tokens
        words.append(
            f"vLLM: {format_int(tokens)} tokens = {format_int(m.kv_blocks)} blocks x "
            f"{m.kv_block_tokens} · "
        )
    if isinstance(check, str):
        words.append(f"no prediction by kvtui: {safe_text(check, one_line=True)}", style="dim")
        return words
    per = f"{check.block_tokens} x {format_int(check.kv_bytes_per_token)} B {check.kv_dtype}"
    if check.predicted is not None:
        words.append(
            f"kvtui: {format_bytes(check.predicted.capacity_bytes)} / ({per}) = "
            f"{format_int(check.predicted.blocks)} blocks: "
        )
        if check.override is not None:
            words.append("vLLM was told its blocks (--num-gpu-blocks-override)", style="bold")
        elif check.agree:
            words.append("agree", style="bold green")
        else:
            ratio = check.ratio
            words.append("DISAGREE" + (f" ({ratio:.2f}x)" if ratio else ""), style="bold red")
    else:
        words.append(
            f"no memory figure from vLLM; at {format_int(check.kv_bytes_per_token)} B a token "
            f"({check.kv_dtype}, kvtui) its blocks take {format_bytes(check.implied_bytes)}"
        )
    return words


def request_words(server: ServerWatch) -> Text:
    """Requests running and waiting, preemptions and the prefix cache, as vLLM reports them."""
    m = server.latest
    words = Text()
    if m is None:
        return words
    parts = []
    if m.requests_running is not None:
        parts.append(f"{m.requests_running:,} running")
    if m.requests_waiting is not None:
        reasons = [r.replace("=", " ") for r in m.waiting_reasons if not r.endswith("=0")]
        parts.append(
            f"{m.requests_waiting:,} waiting" + (f" ({', '.join(reasons)})" if reasons else "")
        )
    words.append("requests " + ", ".join(parts) if parts else "requests: not reported")
    seen = server.preemptions_seen
    if seen is not None:
        words.append(" · ")
        words.append(
            f"{format_count(seen, 'preemption')} while watched",
            style="bold red" if seen else "",
        )
    words.append(f" · peak {format_percent(server.peak_usage)}")
    queries, hits = server.prefix_queries_seen, server.prefix_hits_seen
    if queries == 0:
        words.append("\nprefix cache: no prompt looked up while watched")
    elif queries is not None and hits is not None:
        share = f" ({format_percent(hits / queries)})" if queries else ""
        words.append(
            f"\nprefix cache: {format_int(hits)} of {format_int(queries)} prompt tokens hit "
            f"while watched{share}"
        )
    elif m.prefix_hit_rate is not None:
        words.append(f"\nprefix cache hit rate {format_percent(m.prefix_hit_rate)}")
    return words


def latency_words(server: ServerWatch | None, ttft: float | None, tpot: float | None) -> str:
    """Time to first token and per later token, measured here (client-side, over HTTP: `ttft`,
    `tpot`) beside the server's own histograms (their means over the requests it finished while
    kvtui watched)."""
    ours = (
        f"Measured here (kvtui's clock, HTTP included): first token "
        f"{format_seconds(ttft) if ttft is not None else '…'}, each later "
        f"{format_seconds(tpot) if tpot is not None else '…'}."
    )
    if server is None or server.latest is None:
        why = server.error if server is not None and server.error else "no figures yet"
        return f"{ours}\nvLLM's own: {safe_text(why, one_line=True)}."
    theirs_ttft, theirs_itl, n = server.ttft_mean_s, server.itl_mean_s, server.ttft_requests
    return (
        f"{ours}\nvLLM's histograms, mean over the {format_count(n or 0, 'request')} it "
        f"finished while watched: first token "
        f"{format_seconds(theirs_ttft) if theirs_ttft is not None else '…'}, between tokens "
        f"{format_seconds(theirs_itl) if theirs_itl is not None else '…'}. "
        "Positions computed are the server's: kvtui cannot count them over HTTP."
    )


class ServedCache(Widget):
    """vLLM's KV cache, live: a cell per block (in use, free), its capacity beside kvtui's
    prediction, requests, preemptions and prefix hits; red while full. `show` draws a run."""

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
    ServedCache > .served--error { color: $error; text-style: bold; }
    """

    COMPONENT_CLASSES = {"served--used", "served--free", "served--error"}

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
        self.border_subtitle = f"{where} · /metrics twice a second" if where else ""
        self.refresh(layout=True)

    def render(self) -> Text:
        server = self._server
        if server is None:
            return Text("Waiting for the server to answer...", style="dim")
        lines: list[Text] = []
        m = server.latest
        if server.error:
            last = " The figures below are its last." if m is not None else ""
            lines.append(
                Text(
                    f"{safe_text(server.error, one_line=True)}.{last}",
                    style=self.get_component_rich_style("served--error"),
                )
            )
        if m is not None:
            lines.append(self._blocks(server))
            lines.append(capacity_words(server, server.capacity(self._started)))
            lines.append(request_words(server))
            lines.append(self._fill_words(server))
        elif not server.error:
            lines.append(Text("Waiting for the server's first figures...", style="dim"))
        return Text("\n").join(lines)

    def _blocks(self, server: ServerWatch) -> Text:
        m = server.latest
        assert m is not None  # render draws blocks only with figures
        usage = m.kv_usage or 0.0
        line = Text(no_wrap=True, overflow="ellipsis")
        if m.kv_blocks:
            used = round(usage * m.kv_blocks)
            blocks = f"{format_int(used)}/{format_int(m.kv_blocks)}"
            summary = f" {blocks} blocks in use ({format_percent(usage)})"
            width = max(4, self.content_size.width - len(summary))
            on, off = block_cells(used, m.kv_blocks, width)
            line.append("▇" * on, style=self.get_component_rich_style("served--used"))
            line.append(" " * off, style=self.get_component_rich_style("served--free"))
            line.append(summary, style="bold" if usage >= FULL else "")
        else:
            line.append(f"KV cache usage {format_percent(usage)} (vLLM's figure)")
        return line

    def _fill_words(self, server: ServerWatch) -> Text:
        from kvtui.engine.load import fill_plan  # the load's modules, only for a served run

        m, url, started = server.latest, self._url, self._started
        if m is None or url is None or not m.kv_capacity_tokens:
            return Text("")
        limit = started.max_positions if started is not None else None
        plan = fill_plan(url, m.kv_capacity_tokens, limit)
        return Text(
            f"f fills it: {plan.requests} requests of {format_int(plan.prompt_tokens)} + "
            f"{format_int(plan.max_tokens)} tokens, 2x its {format_int(m.kv_capacity_tokens)} "
            "(kvtui load)",
            style="dim",
        )
