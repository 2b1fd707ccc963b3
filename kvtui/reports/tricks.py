"""`kvtui tricks` for a terminal: the table kvtui.reports.table measures, one row a trick, with
what each column is and where its figures came from. No UI."""

from __future__ import annotations

from typing import Any

from kvtui.reports.table import SPEED_ROUNDS, SPEED_STEPS

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
        "tok/s",
        "TPOT",
        "speed",
    )
    lines_out = []
    for row in rows:
        q = row.get("quality") or {}
        speed = row.get("speed") or {}
        tpot = speed.get("tpot_first_steps_s")
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
                f"{speed['tokens_per_s']:,.0f}" if speed.get("tokens_per_s") else "-",
                f"{tpot * 1e3:.2f} ms" if tpot else "-",
                f"{speed['vs_plain_in_turns']:.2f}x" if speed.get("vs_plain_in_turns") else "-",
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
    lines.append(
        f"  tok/s, TPOT (the mean of the first {bench.SPEED_STEPS} steps after the first): each "
        "row's run alone; "
        "speed: the plain step's time over the row's, the layouts timed in turns "
        f"({SPEED_ROUNDS} rounds of {SPEED_STEPS} steps)"
    )
    for row in rows:
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
    lines += [f"    {r['trick']}: {r['claim']} ({r['source']})" for r in header["references"]]
    return safe_text("\n".join(lines))
