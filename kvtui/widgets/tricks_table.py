"""Screen 4's table of tricks as text: the lines `kvtui tricks` reports (kvtui.reports.table),
folded into a `TableState`, drawn as a Rich table, a row's cells at a time; and the few words a
sentence about a row needs. Pure: nothing here reads or changes a widget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.table import Table
from rich.text import Text

from kvtui.format import format_int, format_ratio
from kvtui.reports.table import TABLE_ROWS, TABLE_SINKS, TABLE_WINDOW
from kvtui.reports.tricks import row_speed

SHORT_LABELS = {
    "plain": "plain cache",
    "fp8": "fp8",
    "int8": "int8 (+ scales)",
    "window": f"window {TABLE_WINDOW - TABLE_SINKS}+{TABLE_SINKS} sinks",
    "window-nosinks": f"window {TABLE_WINDOW} alone",
    "prefix": "prefix cache x4",
    "mqa": "MQA: 1 KV head",
    "mha": "MHA (by formula)",
}
"""The table's rows as the screen names them (`kvtui tricks`' own labels are longer)."""


@dataclass
class TableState:
    """The table as its process has reported it so far."""

    engine: str = ""
    header: dict[str, Any] | None = None
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: str = ""
    done: bool = False
    started: bool = False


def tricks_table(state: TableState) -> Table:
    """The table as reported so far: a row per trick, measured or modelled, and each row still to
    come saying whether it is waiting, being measured or will not run."""
    table = Table(box=None, pad_edge=False, show_edge=False, padding=(0, 1), expand=False)
    table.add_column("trick", no_wrap=True)
    for name in ("B/token", "stops at", "reach", "Δnats/B", "top-1", "speed"):
        table.add_column(name, justify="right", no_wrap=True)
    rows, plain = state.rows, state.rows.get("plain")
    measuring = next((r.key for r in TABLE_ROWS if r.key not in rows), None)
    for spec in TABLE_ROWS:
        row = rows.get(spec.key)
        if row is None:
            running = spec.key == measuring and state.started and not state.failed
            words = "not run" if state.failed else "measuring…" if running else "waiting"
            label = Text(SHORT_LABELS.get(spec.key, spec.label))
            table.add_row(label, Text(words, style="dim italic"), *[""] * 5)
            continue
        table.add_row(*cells(row, plain))
    return table


def short_name(row: dict[str, Any]) -> str:
    """A row's trick in a few words, for a sentence ("int8", "a window")."""
    return {"fp8": "fp8", "int8": "int8", "window": "a window", "mqa": "1 KV head"}.get(
        str(row.get("key")), str(row.get("label", ""))
    )


def reach_words(row: dict[str, Any], plain: dict[str, Any] | None) -> str:
    """How far the same pool takes the trick, against the plain cache: "5.4x the tokens", or
    "never fills" (a window)."""
    predicted = row.get("tokens_before_full_predicted")
    if predicted is None:
        return "never fills"
    base = (plain or {}).get("steps") or 0
    return f"{format_ratio(predicted / base)} the tokens" if base else ""


def cost_words(row: dict[str, Any]) -> str:
    """What a row's trick costs in quality, in a parenthesis: " (+0.0012 nats/B)"; "" if
    unmeasured."""
    q = row.get("quality")
    if not isinstance(q, dict):
        return ""
    delta = q.get("nats_per_byte", 0.0) - q.get("nats_per_byte_baseline", 0.0)
    return f" ({delta:+.4f} nats/B)"


def cells(row: dict[str, Any], plain: dict[str, Any] | None) -> list[Text]:
    """One row of the table as cells; a row of formulas is dimmed."""
    label = Text(SHORT_LABELS.get(str(row.get("key")), str(row.get("label", ""))))
    formula, measured = row.get("kv_bytes_per_token_formula"), row.get("kv_bytes_per_token")
    predicted = row.get("tokens_before_full_predicted")
    base = (plain or {}).get("steps")
    if row.get("baseline"):  # a batch: against the plain cache at the same batch
        base = row["baseline"].get("steps")
    reach = Text("")
    if plain is not None and row.get("key") != "plain":
        if predicted is None:
            reach = Text("∞")
        elif base:
            reach = Text(format_ratio(predicted / base))
        elif base == 0:
            reach = Text(f"0 → {format_int(predicted)}")
    if row.get("how") == "formula":
        dim = "dim"
        reach.stylize(dim)
        label.stylize(dim)
        return [
            label,
            Text(format_int(formula or 0), style=dim),
            Text(format_int(predicted or 0), style=dim),
            reach,
            Text("-", style=dim),
            Text("-", style=dim),
            Text("-", style=dim),
        ]
    if isinstance(measured, int):  # from the cache's tensors
        per_token = Text(format_int(measured))
        if measured == formula:
            per_token.append(" ✓", style="bold")
    else:  # modelled (sim:): the formula is all there is
        per_token = Text(format_int(formula) if isinstance(formula, int) else "?")
    steps = row.get("steps") or 0
    if row.get("stopped"):
        stops = Text(format_int(steps))
        if steps == predicted:
            stops.append(" ✓", style="bold")
    else:
        stops = Text("never" if predicted is None else f"{format_int(steps)}+")
    q = row.get("quality")
    if isinstance(q, dict):
        delta = Text(f"{q['nats_per_byte'] - q['nats_per_byte_baseline']:+.4f}")
        top1 = Text(f"{q['top1_agreement']:.0%}")
    else:
        delta = Text("ref" if row.get("key") == "plain" else "-", style="dim")
        top1 = Text("")
    return [label, per_token, stops, reach, delta, top1, speed(row, plain)]


def speed(row: dict[str, Any], plain: dict[str, Any] | None) -> Text:
    """The row's step against the plain cache's (kvtui.reports.tricks.row_speed): timed in turns
    where the table does (a measured one), else its own run's (modelled on sim:); "…" while the
    turns are still to come."""
    measured = row.get("how") == "measured"
    ratio = row_speed(row, plain, in_turns=measured).vs_plain
    if ratio:
        return Text(f"{ratio:.2f}x")
    if measured:
        return Text("…" if row.get("key") not in ("prefix",) else "", style="dim")
    return Text("")
