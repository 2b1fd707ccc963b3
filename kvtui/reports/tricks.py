"""`kvtui tricks` for a terminal: the table kvtui.reports.table measures, one row a trick, with
what each column is and where its figures came from. No UI."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvtui.reports.table import SPEED_ROUNDS, SPEED_STEPS

# --- one speed per row ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSpeed:
    """A row's one speed, its three figures of the same timing, so that they agree: a step's
    time, the tokens a second that is (one over it) and the plain step's time over it."""

    step_s: float | None = None
    tokens_per_s: float | None = None
    vs_plain: float | None = None


def timed_in_turns(rows: Iterable[dict[str, Any]]) -> bool:
    """Whether the table timed its layouts in turns (a torch engine's, once its rows are in)."""
    return any("in_turns" in (row.get("speed") or {}) for row in rows)


def row_speed(row: dict[str, Any], plain: dict[str, Any] | None, *, in_turns: bool) -> RowSpeed:
    """The row's speed: of the layouts' steps timed in turns where the table has them
    (`in_turns`; a row the turns did not time has none), else of its own run alone (the mean
    step after the first, over bench.SPEED_STEPS), against the plain cache's own run (at the
    same batch, for a batch). Never one of each: two timings of one row can disagree by more
    than the tricks differ."""
    speed = row.get("speed") or {}
    if in_turns:
        turns = speed.get("in_turns")
        if not isinstance(turns, dict):
            return RowSpeed()
        return RowSpeed(turns["step_s"], turns["tokens_per_s"], turns["vs_plain"])
    step = (speed.get("alone") or {}).get("tpot_first_steps_s")
    if not step:
        return RowSpeed()
    against = row["baseline"] if row.get("baseline") else plain or {}
    base = ((against.get("speed") or {}).get("alone") or {}).get("tpot_first_steps_s")
    return RowSpeed(step, 1 / step, base / step if base else None)


# --- the plain cache the ratios are against -------------------------------------------------------

CODE_BYTES = {"fp8": 1}
"""Bytes a value of the codes whose published figure is a ratio against another cache."""


def plain_cache_words(rows: Iterable[dict[str, Any]]) -> str:
    """The plain cache's dtype here, for beside a ratio against it: "the plain cache here is fp32,
    4 bytes a value"; "" before the plain row is in."""
    from kvtui.sim.catalog import dtype_bytes

    plain = next((r for r in rows if r.get("key") == "plain"), None)
    dtype = (plain or {}).get("kv_dtype")
    if not isinstance(dtype, str):
        return ""
    size = float(dtype_bytes(dtype))
    return f"the plain cache here is {dtype}, {size:g} byte{'s' if size != 1 else ''} a value"


def reference_baseline(trick: str, rows: Iterable[dict[str, Any]]) -> str:
    """What a published ratio of a code is against, beside the plain cache here: fp8 "against a
    16-bit cache; the plain cache here is fp32, 4 bytes a value: 4x by the format alone"."""
    from kvtui.sim.catalog import dtype_bytes

    rows = list(rows)
    words = plain_cache_words(rows)
    plain = next((r for r in rows if r.get("key") == "plain"), {})
    if trick not in CODE_BYTES or not words:
        return ""
    from kvtui.format import format_ratio

    ratio = float(dtype_bytes(plain["kv_dtype"])) / CODE_BYTES[trick]
    return f"{words}, so {trick}'s 1 byte is {format_ratio(ratio)} by the format alone"


# --- a table for a terminal ----------------------------------------------------------------------


def _stop_words(row: dict[str, Any]) -> str:
    """Where the pool stopped the row (measured) against its prediction: "1,317 / 1,317"."""
    predicted = row.get("tokens_before_full_predicted")
    shown = "never" if predicted is None else f"{predicted:,}"
    if row["how"] == "formula":
        return f"- / {shown}"
    steps = row["steps"]
    measured = f"{steps:,}" if row["stopped"] else f"{steps:,}+"
    return f"{measured} / {shown}"


def format_tricks(header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The table for a terminal, with what each column is and where its figures came from."""
    from kvtui.format import format_bytes, safe_text
    from kvtui.reports import bench

    head = (
        "trick",
        "B/token",
        "formula",
        "stop/pred",
        "Δnats/B",
        "KL",
        "top-1",
        "1st diff",
        "step",
        "tok/s",
        "speed",
    )
    in_turns = timed_in_turns(rows)
    plain = next((r for r in rows if r.get("key") == "plain"), None)
    lines_out = []
    for row in rows:
        q = row.get("quality") or {}
        speed = row_speed(row, plain, in_turns=in_turns)
        first = q.get("first_divergence")
        lines_out.append(
            (
                row["label"],
                "-" if row.get("kv_bytes_per_token") is None else f"{row['kv_bytes_per_token']:,}",
                f"{row.get('kv_bytes_per_token_formula') or 0:,}",
                _stop_words(row),
                f"{q['nats_per_byte'] - q['nats_per_byte_baseline']:+.4f}" if q else "-",
                f"{q['kl']:.4f}" if q else "-",
                f"{q['top1_agreement']:.1%}" if q else "-",
                ("none" if first is None else f"{first + 1:,}") if q else "-",
                f"{speed.step_s * 1e3:.2f} ms" if speed.step_s else "-",
                f"{speed.tokens_per_s:,.0f}" if speed.tokens_per_s else "-",
                f"{speed.vs_plain:.2f}x" if speed.vs_plain else "-",
            )
        )
    widths = [max(len(r[i]) for r in (head, *lines_out)) for i in range(len(head))]
    budget = format_bytes(header["kv_budget_bytes"])
    baseline = next((r["quality"] for r in rows if r.get("quality")), None)
    modelled = any(row.get("how") == "modelled" for row in rows)
    lines = [
        f"{header['engine']}: every trick under a {budget} KV pool, {header['tokens']:,} tokens "
        f"asked, greedy, cached loop"
        + (f" (CPU {header['cpu_capability']})" if header.get("cpu_capability") else "")
        + (": MODELLED (roofline arithmetic), not measured" if modelled else "")
    ]
    lines += [
        "  "
        + "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        for cells in (head, *lines_out)
    ]
    how = "modelled" if modelled else "measured"
    lines.append(
        "  B/token: "
        + (
            "- (a modelled run has no cache tensors to weigh)"
            if modelled
            else "measured from the cache's tensors (codes and scales)"
        )
        + "; formula: kvtui.sim"
    )
    lines.append(
        f"  stop/pred: tokens generated when the pool ran out (+: the run ended first), {how}"
        " / predicted by the trick's own C - P + 1"
    )
    if baseline:
        lines.append(
            f"  Δnats/B, KL, top-1: against the plain cache, teacher-forced on "
            f"{baseline['positions']:,} held-out bytes (plain: "
            f"{baseline['nats_per_byte_baseline']:.3f} nats/byte; prefix caching: the second "
            f"half); 1st diff: the first greedy token of {baseline['greedy_tokens']:,} to differ"
        )
    if in_turns:
        lines.append(
            f"  step, tok/s (1 / step), speed (the plain step's over the row's): one timing, the "
            f"layouts' cached steps taking turns ({SPEED_ROUNDS} rounds of {SPEED_STEPS} steps, the"
            " median round), so a shared machine's drift falls on all alike; each row's run alone"
            " is in --json (speed.alone)"
        )
    else:
        lines.append(
            f"  step, tok/s (1 / step), speed (the plain step's over the row's): each row's run "
            f"alone, {how}, the mean of the first {bench.SPEED_STEPS} steps after the first"
        )
    for row in rows:
        alone = ((row.get("speed") or {}).get("alone") or {}).get("tpot_first_steps_s")
        if in_turns and alone and "in_turns" not in row["speed"]:
            lines.append(
                f"  {row['label']}: not timed in turns (a batch of {row['batch']}); its run alone"
                f" took {alone * 1e3:.2f} ms a step"
            )
        if row.get("baseline"):
            b = row["baseline"]
            unshared = row["batch"] * row["prompt_tokens"]
            lines.append(
                f"  {row['label']}: plain at the same batch stops at {b['steps']:,} "
                f"(predicted {b['tokens_before_full_predicted']:,}); the shared prefill computed "
                f"{row['first_step_positions']:,} positions ({row['how']}) of the {unshared:,} "
                "its sequences' prompts hold"
            )
        if row["how"] == "formula":
            lines.append(f"  {row['label']}: by the formula alone (no such model here)")
    lines.append("  Published (references, not measured here):")
    for r in header["references"]:
        against = reference_baseline(r["trick"], rows)
        lines.append(
            f"    {r['trick']}: {r['claim']} ({r['source']})" + (f"; {against}" if against else "")
        )
    return safe_text("\n".join(lines))
