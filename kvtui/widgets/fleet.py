"""A fleet of served replicas (`vllm:URL1,URL2,...`) as screen 3 shows it under the decode's own
server: a row per replica (its model, its capacity read and kvtui's prediction, KV usage live and
peak, requests running and waiting by reason, preemptions and prefix hits while watched), the
fleet's totals, the skew between replicas in words, and which replica stopped answering. Every
figure is the replica's own, as its /metrics said; the totals are kvtui's sums of them. Drawing
is a pure read of the run (kvtui.run.fleet folds it)."""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from kvtui.engines.factory import parse_engine
from kvtui.engines.protocol import RunStarted
from kvtui.engines.vllm.fleet import FLEET_DECODE, replica_name
from kvtui.engines.vllm.url import ServerURL
from kvtui.errors import EngineError
from kvtui.format import format_count, format_int, format_percent, format_seconds, safe_text
from kvtui.run.fleet import FleetWatch
from kvtui.run.pressure import peak_words
from kvtui.run.serving import ServerWatch


def fleet_urls(engine: str) -> tuple[ServerURL, ...]:
    """The servers a `vllm:` engine watches (none for another engine)."""
    try:
        return parse_engine(engine).urls
    except EngineError:
        return ()


def _capacity_words(fleet: FleetWatch, replica: int, started: RunStarted | None) -> str:
    """A replica's capacity as it read it, and kvtui's prediction beside it."""
    m = fleet.replicas[replica].latest
    if m is None or m.kv_blocks is None or not m.kv_block_tokens:
        read = "capacity not reported"
    else:
        tokens = m.kv_capacity_tokens or m.kv_blocks * m.kv_block_tokens
        read = f"{format_int(tokens)} = {format_int(m.kv_blocks)} x {m.kv_block_tokens} tokens"
    check = fleet.capacity(replica, started)
    if isinstance(check, str):
        return f"{read} · kvtui: no prediction ({check})"
    if check.predicted is None:
        return f"{read} · kvtui: no memory figure to predict from"
    if check.override is not None:
        return f"{read} · kvtui {format_int(check.predicted.blocks)} (blocks overridden)"
    verdict = "agree" if check.agree else f"DISAGREE {check.ratio or 0:.2f}x"
    each = format_int(check.predicted.blocks)
    predicted = each if check.engines == 1 else f"{each} x {check.engines} engines"
    return f"{read} · kvtui {predicted}: {verdict}"


def _use_words(watch: ServerWatch) -> str:
    """A replica's KV usage, requests, preemptions and prefix hits while watched."""
    m = watch.latest
    assert m is not None  # drawn only with figures
    parts = [
        f"KV {format_percent(m.kv_usage) if m.kv_usage is not None else '…'} "
        f"({peak_words(watch.seen_peak)})"
    ]
    if m.requests_running is not None or m.requests_waiting is not None:
        reasons = [r.replace("=", " ") for r in m.waiting_reasons if not r.endswith("=0")]
        why = f" ({', '.join(reasons)})" if reasons else ""
        parts.append(f"{m.requests_running or 0:,} run, {m.requests_waiting or 0:,} wait{why}")
    seen = watch.preemptions_seen
    if seen is not None:
        parts.append(format_count(seen, "preemption"))
    queries, hits = watch.prefix_queries_seen, watch.prefix_hits_seen
    if m.prefix_caching is False:
        parts.append("prefix caching off")
    elif queries and hits is not None:
        parts.append(f"prefix {format_percent(hits / queries)} hit")
    elif m.prefix_hit_rate is not None:
        parts.append(f"prefix {format_percent(m.prefix_hit_rate)} hit")
    elif queries == 0:
        parts.append("prefix: none looked up")
    return " · ".join(parts)


def fleet_lines(
    fleet: FleetWatch, started: RunStarted | None, urls: tuple[ServerURL, ...]
) -> list[tuple[str, str]]:
    """The fleet in lines of (text, how it is drawn: "", "bad", "dim", "bold"): two a replica,
    then the totals, the skew and the replicas gone, in words."""
    names = [replica_name(urls, i) for i in range(fleet.size)]
    lines: list[tuple[str, str]] = []
    for i, watch in enumerate(fleet.replicas):
        m = watch.latest
        where = f"{i + 1} {urls[i].netloc}" if i < len(urls) else f"replica {i + 1}"  # a replay
        where += " decode" if i == FLEET_DECODE else ""
        other = m is not None and m.model and (started is None or m.model != started.model)
        model = f" · serves {m.model}" if m is not None and other else ""
        if m is None:
            why = watch.error or "no figures yet"
            lines.append((f"{where}: {why}", "bad" if watch.error else "dim"))
            continue
        lines.append((f"{where} · {_capacity_words(fleet, i, started)}{model}", ""))
        if watch.error:
            since = f" since {format_seconds(watch.error_since)}" if watch.error_since else ""
            lines.append((f"  NOT ANSWERING{since}: {watch.error}; its last figures above", "bad"))
        else:
            lines.append(("  " + _use_words(watch), ""))
    t = fleet.totals()
    capacity = f"{format_int(t.capacity_tokens)} tokens, " if t.capacity_tokens else ""
    usage = f"KV {format_percent(t.usage)}, " if t.usage is not None else ""
    hits = (
        f", prefix {format_percent(t.prefix_hits_seen / t.prefix_queries_seen)} hit"
        if t.prefix_queries_seen
        else ""
    )
    lines.append(
        (
            f"Sum of {t.answering}/{t.replicas} answering: "
            f"{capacity}{usage}{t.running:,} run, {t.waiting:,} wait, "
            f"{format_count(t.preemptions_seen, 'preemption')}{hits}",
            "bold",
        )
    )
    skew = fleet.skew([f"replica {i + 1}" for i in range(fleet.size)])  # the rows say where
    if skew:
        lines.append((skew, "bad"))
    gone = fleet.gone()
    if gone and len(gone) < fleet.size:
        which = ", ".join(names[i] for i in gone)
        rest = fleet.size - len(gone)
        lines.append((f"{which} stopped answering; the other {rest} still watched", "bad"))
    return [(safe_text(text, one_line=True), style) for text, style in lines]


class FleetTable(Widget):
    """Every replica of a served fleet, a row each, and the fleet's totals (see the module's
    docstring). `show` draws a served run's fleet."""

    DEFAULT_CSS = """
    FleetTable {
        height: auto;
        border: round $primary 40%;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    FleetTable.-skewed { border: round $warning; }
    FleetTable > .fleet--bad { color: $error; text-style: bold; }
    """

    COMPONENT_CLASSES = {"fleet--bad"}

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._lines: list[tuple[str, str]] = []

    def show(self, fleet: FleetWatch, started: RunStarted | None, engine: str) -> None:
        """Draw a served run's fleet (its engine's name says its servers)."""
        self._lines = fleet_lines(fleet, started, fleet_urls(engine))
        self.set_class(any(style == "bad" for _, style in self._lines), "-skewed")
        self.border_title = f"THE FLEET: {fleet.size} replicas (each server's own figures)"
        self.border_subtitle = "kvtui's decode streams from replica 1; all are watched"
        self.refresh(layout=True)

    def render(self) -> Text:
        bad = self.get_component_rich_style("fleet--bad")
        styles = {"": Style(), "bad": bad, "dim": Style(dim=True), "bold": Style(bold=True)}
        lines = [
            Text(text, styles[style], no_wrap=True, overflow="ellipsis")
            for text, style in self._lines
        ]
        return Text("\n", no_wrap=True, overflow="ellipsis").join(lines)
