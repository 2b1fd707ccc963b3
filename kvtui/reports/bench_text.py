"""`kvtui bench` for a terminal: the summary (kvtui.reports.bench) as a small table, or a sweep
as a line per batch size. A pure read of the JSON-ready summary, so the table and `--json` say the
same figures; names, messages and text may come from a file (a replay), so all of it is made safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtui.format import (
    format_bandwidth,
    format_bytes,
    format_count,
    format_int,
    format_ratio,
    format_seconds,
    safe_text,
)
from kvtui.run.pressure import peak_words

FULL = "out_of_memory"
"""The reason a loop that stopped for its KV pool gives (kvtui.engines.protocol.RunFinished)."""


def _kv_lines(r: dict[str, Any]) -> list[str]:
    """The KV cache's lines of the table: its pool, what the cached loop took and filled."""
    lines = []
    measured = r["timing"] == "measured"
    how = "measured" if measured else "modelled"
    if r["kv_capacity_bytes"] is not None:
        pool = (
            f"  KV pool: {format_bytes(r['kv_capacity_bytes'])} ({r['kv_pool_source']}), "
            f"blocks of {r['kv_block_tokens']} tokens"
        )
        lines.append(pool)
    elif r["kv_bytes_allocated"] is not None:
        lines.append("  KV pool: none (the engine's own cache, sized for the run; no budget)")
    if r["kv_bytes_allocated"] is not None:
        blocks = r["kv_blocks_allocated"]
        lines.append(
            f"  KV cache at the end: {format_bytes(r['kv_bytes_allocated'])} allocated"
            + (f" ({format_count(blocks, 'block')})" if blocks is not None else "")
            + f", {format_bytes(r['kv_bytes_filled'] or 0)} filled ({how}); "
            f"{format_bytes(r['kv_bytes_formula'] or 0)} by the formula"
        )
    return lines


def _served_lines(r: dict[str, Any]) -> list[str]:
    """A served run's server, as its /metrics said, and kvtui's prediction beside it."""
    server = r["server"]
    lines = [
        f"  times above: kvtui's clock, over HTTP; {r['served_by']}'s own figures "
        f"({server['polls']} polls of its /metrics):"
    ]
    if server["error"]:
        lines.append(f"  the server's metrics: {server['error']}")
    c = server["capacity"]
    if isinstance(c, str):
        lines.append(f"  KV cache: {c}")
    else:
        lines.append(
            f"  KV cache: {format_int(c['tokens'])} tokens = {format_int(c['blocks'])} blocks x "
            f"{c['block_tokens']}"
            + (
                f"; kvtui predicts {format_int(c['predicted_blocks'])} blocks from "
                f"{format_bytes(c['memory_bytes'])} at {format_int(c['kv_bytes_per_token'])} B "
                f"a token ({c['kv_dtype']}): "
                + {True: "agree", False: "DISAGREE", None: "vLLM was told its blocks"}[c["agree"]]
                if c["predicted_blocks"] is not None
                else ""
            )
        )
        if c.get("engines", 1) > 1:
            lines.append(
                f"  {c['engines']} data-parallel engines of {c['blocks_per_engine']} blocks and "
                f"{format_bytes(c['memory_bytes'])} each (vLLM's blocks are their total)"
            )
        if c.get("config_dtype") and c["kv_dtype"] != c["config_dtype"]:
            lines.append(f"  served in {c['kv_dtype']}: {c['dtype_source']}")
        if c.get("reason"):
            lines.append(f"  why: {c['reason']}")
    peak = peak_words(server["kv_usage_peak"], why=True)
    lines.append(f"  usage {peak}, preemptions while watched: {server['preemptions_seen']}")
    ttft, itl = server["ttft_mean_s"], server["itl_mean_s"]
    if ttft is not None or itl is not None:
        lines.append(
            f"  the server, all clients: vLLM's histograms over {server['ttft_requests']} "
            "request(s): first token "
            + ("-" if ttft is None else f"{ttft * 1e3:.2f} ms")
            + ", between tokens "
            + ("-" if itl is None else f"{itl * 1e3:.2f} ms")
        )
    return lines


def _fleet_lines(r: dict[str, Any]) -> list[str]:
    """A fleet's replicas past the first (whose figures are above), a line each."""
    servers = r.get("servers") or []
    if len(servers) < 2:
        return []
    lines = [
        f"  a fleet of {len(servers)} replicas; the decode ran on replica 1, every one watched:"
    ]
    for s in servers[1:]:
        where = f"  replica {s['replica'] + 1} ({s['url']}): "
        c = s["capacity"]
        if s["error"] and not s["polls"] - s["failed_polls"]:
            lines.append(where + f"no figures ({s['error']})")
            continue
        kv = (
            f"{format_int(c['tokens'])} tokens = {format_int(c['blocks'])} x {c['block_tokens']}"
            if isinstance(c, dict)
            else f"(no prediction: {c})"
        )
        if isinstance(c, dict) and c["predicted_blocks"] is not None:
            verdict = {True: "agree", False: "DISAGREE", None: "blocks overridden"}[c["agree"]]
            kv += f", kvtui {format_int(c['predicted_blocks'])}: {verdict}"
        lines.append(
            where + f"KV cache {kv}; usage peak {(s['kv_usage_peak'] or 0) * 100:.0f}%, "
            f"preemptions while watched: {s['preemptions_seen']}"
            + (f"; now: {s['error']}" if s["error"] else "")
        )
    return lines


def _trick_lines(r: dict[str, Any]) -> list[str]:
    """The KV-cache layout's lines: its bytes per token measured against the formula, where the
    pool stops it, and what each loop's cache costs in quality."""
    lines = []
    layout, cached = r["kv_layout"]["words"], r["cached"]
    measured, formula = cached["kv_bytes_per_token"], cached["kv_bytes_per_token_formula"]
    if measured is not None and formula is not None:
        verdict = "= formula" if measured == formula else f"formula {format_int(formula)}"
        lines.append(
            f"  KV cache ({layout}): {format_int(measured)} bytes per token measured from its "
            f"tensors, {verdict}"
        )
    if r["kv_heads_model"] is not None:
        lines.append(
            f"  key/value heads: the model's {r['kv_heads_model']} averaged into "
            f"{r['kv_layout']['kv_heads']} (no retraining)"
        )
    stop = cached["tokens_before_full_predicted"]
    finished = cached["finished"]
    if finished is not None and finished["reason"] == FULL:
        uncached = r["uncached"]
        went_on, made = uncached["tokens"] > finished["steps"], format_int(uncached["tokens"])
        lines.append(
            f"  the cached loop stopped at {format_int(finished['steps'])} tokens (measured; "
            f"predicted {format_int(stop) if stop is not None else 'never'}): its KV pool was full"
            + (
                f"; the uncached loop keeps no cache and went on to {made}"
                + (
                    f" ({format_int(uncached['positions_computed'])} positions computed)"
                    if uncached["positions_computed"] is not None
                    else ""
                )
                if went_on
                else ""
            )
        )
    for loop in ("cached", "uncached"):
        q = r[loop]["quality"]
        if q is None:
            continue
        first = q["first_divergence"]
        differ = (
            f"greedy tokens first differ at step {first + 1:,}"
            if first is not None
            else f"greedy tokens the same over {q['greedy_tokens']:,}"
        )
        lines.append(
            f"  quality ({loop}, measured on {format_int(q['positions'])} held-out positions): "
            f"{q['nats_per_byte']:.4f} nats/byte vs {q['nats_per_byte_baseline']:.4f} "
            f"without; KL {q['kl']:.5f}; top-1 agreement {q['top1_agreement']:.1%}; {differ}"
        )
    return lines


def _flops_lines(r: dict[str, Any]) -> list[str]:
    """Per loop, the FLOPs torch counted on the sampled steps against the formula's for them
    (none for an engine that counts none: `sim:`, `replay:` of one)."""
    lines = []
    for loop in ("cached", "uncached"):
        stats = r[loop]
        if stats["flops_counted"] is None:
            continue
        counted, formula = stats["flops_counted"], stats["flops_formula"]
        steps = format_count(stats["flops_sampled_steps"], "sampled step")
        ratio = stats["flops_ratio"]
        verdict = (
            "equal"
            if counted == formula
            else f"{ratio:.4f}x the formula"
            if ratio is not None
            else "the formula counts none"
        )
        lines.append(
            f"  {loop}: FLOPs counted (FlopCounterMode, {steps}) {format_int(counted)} vs "
            f"formula {format_int(formula)}: {verdict}"
        )
    return lines


def format_table(r: dict[str, Any]) -> str:
    """The summary as a small table for a terminal."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} ms"

    def tps(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    def seconds_ms(v: float | None) -> str:
        return "-" if v is None else ms(v * 1e3)

    def per_position(v: float | None) -> str:
        return "-" if v is None else format_seconds(v / 1e3)

    def growth(loop: str) -> str:
        v = r[loop]["step_ms_growth_per_position"]
        if v is not None:
            return f"+{format_seconds(v / 1e3)}"
        return "within noise" if r[loop]["tokens"] >= 4 else "-"

    def both(key: str, show: Callable[[float | None], str]) -> tuple[str, str]:
        return show(r["cached"][key]), show(r["uncached"][key])

    made = {loop: r[loop]["tokens"] for loop in ("cached", "uncached")}
    both_made = r["compared_tokens"]
    short = any(n != both_made for n in made.values())  # a loop stopped before the other
    rows = [
        ("", "cached", "uncached"),
        (
            "tokens/s" + (", each sequence" if r["batch"] > 1 else ""),
            *both("tokens_per_s_per_sequence", tps),
        ),
        ("time to first token", *both("ttft_s", seconds_ms)),
        ("time per later token", *both("tpot_s", seconds_ms)),
        ("positions/s, first step", *both("first_step_positions_per_s", tps)),
        ("positions/s, later steps", *both("later_step_positions_per_s", tps)),
        ("time per position computed", *both("ms_per_position", per_position)),
        ("step growth per position", growth("cached"), growth("uncached")),
        ("step p50", ms(r["cached"]["step_ms_p50"]), ms(r["uncached"]["step_ms_p50"])),
        (
            "step, first quartile",
            ms(r["cached"]["step_ms_first_quartile"]),
            ms(r["uncached"]["step_ms_first_quartile"]),
        ),
        (
            "step, last quartile",
            ms(r["cached"]["step_ms_last_quartile"]),
            ms(r["uncached"]["step_ms_last_quartile"]),
        ),
        (
            "positions computed" + (f", first {format_int(both_made)} tokens" if short else ""),
            *(format_int(r[k] or 0) for k in ("work_cached", "work_uncached")),
        ),
    ]
    if r["batch"] > 1:
        rows.insert(2, ("tokens/s, all sequences", *both("tokens_per_s_total", tps)))
    if r["served_by"]:  # positions are the server's: not observed over HTTP
        rows = [row for row in rows if "position" not in row[0]]
    width = max(len(row[0]) for row in rows)
    lines = [
        f"{r['model']} on {r['device']} ({r['dtype']}"
        + (f", {format_count(r['threads'], 'thread')}" if r["threads"] else "")
        + "), "
        f"{r['prompt_tokens']} prompt + {r['tokens']} tokens"
        + (f", a batch of {r['batch']} sequences" if r["batch"] > 1 else "")
    ]
    if short:
        lines[0] += " asked: " + ", ".join(
            f"the {loop} loop made {format_int(n)}"
            + (" (its KV pool full)" if (r[loop]["finished"] or {}).get("reason") == FULL else "")
            for loop, n in made.items()
        )
    if r["timing"] != "measured":
        lines.append(f"  every time and rate below is {r['timing']}: arithmetic, not a measurement")
    lines += [f"  {a:<{width}}  {b:>14}  {c:>14}" for a, b, c in rows]
    if r["first_divergence"] is not None:
        lines.append(f"  tokens: DIFFER from step {r['first_divergence']}")
    elif r["compared_tokens"]:
        lines.append(f"  tokens: identical over the {format_int(r['compared_tokens'])} both made")
    else:
        lines.append("  tokens: nothing to compare (a loop made none)")
    if r["speedup_wall"] and r["work_ratio"]:
        over = f" over the {format_int(both_made)} tokens both made" if short else ""
        lines.append(
            f"  speedup{over}: {format_ratio(r['speedup_wall'])} {r['timing']}, "
            f"{format_ratio(r['work_ratio'])} in positions computed"
        )
    lines += (
        _served_lines(r) + _fleet_lines(r) if r["served_by"] else _kv_lines(r) + _trick_lines(r)
    )
    if r["achieved_bandwidth_bytes_per_s"]:
        peak = r["peak_bandwidth_bytes_per_s"]
        lines.append(
            f"  cached step reads {format_bandwidth(r['achieved_bandwidth_bytes_per_s'])}"
            + ("" if r["timing"] == "measured" else " (modelled)")
            + (f" of {format_bandwidth(peak)} peak" if peak else "")
            + (f", {r['flops_per_byte']:.2f} FLOPs per byte" if r["flops_per_byte"] else "")
            + (
                f" (ridge {r['ridge_flops_per_byte']:.0f})"
                if r["flops_per_byte"] and r["ridge_flops_per_byte"]
                else ""
            )
        )
    lines += _flops_lines(r)
    lines += [f"  {m}" for m in r["messages"]]
    lines.append(f"  text: {r['text'][:200]!r}")
    return safe_text("\n".join(lines))  # names, messages and text may come from a file


def format_sweep(sweep: dict[str, Any]) -> str:
    """A sweep as a table for a terminal: one line per batch size."""
    runs = sweep["sweep"]
    first = runs[0]

    def num(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.2f} ms"

    header = (
        "batch",
        "tok/s/seq",
        "tok/s total",
        "step (TPOT)",
        "uncached tok/s",
        "KV filled",
        "FLOPs/byte",
    )
    rows = [
        (
            str(r["batch"]),
            num(r["cached"]["tokens_per_s_per_sequence"], ",.1f"),
            num(r["cached"]["tokens_per_s_total"], ",.1f"),
            ms(r["cached"]["tpot_s"]),
            num(r["uncached"]["tokens_per_s_total"], ",.1f"),
            "-" if r["kv_bytes_filled"] is None else format_bytes(r["kv_bytes_filled"]),
            num(r["flops_per_byte"], ".2f"),
        )
        for r in runs
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        f"{first['model']} on {first['device']} ({first['dtype']}"
        + (f", {format_count(first['threads'], 'thread')}" if first["threads"] else "")
        + f"), {first['prompt_tokens']} prompt + {first['tokens']} tokens per sequence"
    ]
    if first["timing"] != "measured":
        lines.append(f"  every time and rate below is {first['timing']}: arithmetic")
    lines += [
        "  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
        for row in (header, *rows)
    ]
    lines.append(
        "  cached loop: tok/s, TPOT (a step after the prefill), FLOPs/byte (their mean); "
        "uncached: tok/s total"
    )
    ridge = first["ridge_flops_per_byte"]
    if ridge is not None:
        lines.append(f"  ridge point: {ridge:.0f} FLOPs per byte ({first['ridge_source']})")
    else:
        lines.append(f"  ridge point: {first['ridge_source'] or 'unknown'}")
    for r in runs:
        lines += [f"  batch {r['batch']}: {m}" for m in r["messages"]]
    return safe_text("\n".join(lines))
