"""`kvtui bench`: both loops on the same prompt, measured, as one JSON-ready summary. No UI.

The engine runs in this process (there is no UI to fight for the GIL), the cached loop first and
then the uncached one, each to its end, so that their step times do not interleave.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvtui.engine.protocol import (
    Event,
    RunFailed,
    RunFinished,
    RunSettings,
    RunStarted,
    StepSample,
    run_events,
)
from kvtui.engine.replay import RecordWriter
from kvtui.engine.spec import open_engine
from kvtui.format import format_bandwidth, format_bytes, format_count, format_int, format_ratio


@dataclass
class _Collected:
    started: RunStarted | None = None
    steps: dict[str, list[StepSample]] = field(
        default_factory=lambda: {"cached": [], "uncached": []}
    )
    finished: dict[str, RunFinished] = field(default_factory=dict)


def loop_stats(steps: list[StepSample]) -> dict:
    """Throughput and step-time shape of one loop (times in ms)."""
    if not steps:
        return {
            "tokens": 0,
            "tokens_per_s": None,
            "step_ms_p50": None,
            "step_ms_first_quartile": None,
            "step_ms_last_quartile": None,
            "step_ms_p99": None,
            "total_s": 0.0,
            "ms_per_position": None,
        }
    ms = [s.step_seconds * 1e3 for s in steps]
    total = sum(s.step_seconds for s in steps)
    q = max(1, len(ms) // 4)
    return {
        "tokens": len(steps),
        "tokens_per_s": len(steps) / total if total > 0 else None,
        "step_ms_p50": statistics.median(ms),
        "step_ms_first_quartile": statistics.median(ms[:q]),
        "step_ms_last_quartile": statistics.median(ms[-q:]),
        "step_ms_p99": sorted(ms)[min(len(ms) - 1, int(0.99 * len(ms)))],
        "total_s": total,
        "ms_per_position": _slope([s.position for s in steps[1:]], ms[1:]),
    }


def _slope(xs: list[int], ys: list[float]) -> float | None:
    """Least-squares slope of ys against xs (the first step, a prefill, is left out by callers)."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else None


def summarize(c: _Collected, settings: RunSettings) -> dict:
    started = c.started
    cached, uncached = c.steps["cached"], c.steps["uncached"]
    ids_c, ids_u = [s.token_id for s in cached], [s.token_id for s in uncached]
    divergence = next(
        (i for i, (a, b) in enumerate(zip(ids_c, ids_u, strict=False)) if a != b), None
    )
    if divergence is None and len(ids_c) != len(ids_u):
        divergence = min(len(ids_c), len(ids_u))
    stats_c, stats_u = loop_stats(cached), loop_stats(uncached)
    work_c = sum(s.positions_computed for s in cached)
    work_u = sum(s.positions_computed for s in uncached)
    decode_steps = cached[1:]
    achieved = (
        statistics.median(s.bytes_read / s.step_seconds for s in decode_steps if s.step_seconds > 0)
        if decode_steps
        else None
    )
    intensity = (
        statistics.fmean(s.flops / s.bytes_read for s in decode_steps) if decode_steps else None
    )
    finished_c = c.finished.get("cached")
    P = started.prompt_tokens
    return {
        "engine": settings.engine,
        "device": started.device,
        "model": started.model,
        "dtype": started.dtype,
        "threads": started.threads,
        "prompt_tokens": P,
        "tokens": started.tokens,
        "seed": settings.seed,
        "greedy": settings.greedy,
        "text": "".join(s.text for s in (cached or uncached)),
        "token_ids": ids_c or ids_u,
        "identical": bool(cached) and bool(uncached) and divergence is None,
        "first_divergence": divergence,
        "cached": {**stats_c, "finished": finished_c.reason if finished_c else None},
        "uncached": {
            **stats_u,
            "finished": c.finished["uncached"].reason if "uncached" in c.finished else None,
        },
        "speedup_wall": stats_u["total_s"] / stats_c["total_s"]
        if stats_c["total_s"] and stats_u["total_s"]
        else None,
        "last_quartile_ratio": (
            stats_u["step_ms_last_quartile"] / stats_c["step_ms_last_quartile"]
            if stats_c["step_ms_last_quartile"] and stats_u["step_ms_last_quartile"]
            else None
        ),
        "work_cached": work_c,
        "work_uncached": work_u,
        "work_ratio": work_u / work_c if work_c else None,
        "kv_bytes_per_token": started.kv_bytes_per_token,
        "kv_bytes_measured": finished_c.kv_bytes_allocated if finished_c else None,
        "kv_bytes_formula": started.kv_bytes_per_token * (P + started.tokens),
        "weights_bytes": started.weights_bytes,
        "achieved_bandwidth_bytes_per_s": achieved,
        "peak_bandwidth_bytes_per_s": started.peak_bandwidth_bytes_per_s,
        "flops_per_byte": intensity,
        "messages": [f.message for f in c.finished.values() if f.message],
    }


def run_bench(
    settings: RunSettings,
    *,
    record: Path | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> dict:
    """Run both loops, cached first; return the summary. `EngineError` for a bad engine."""
    settings = _cached_first(settings)
    engine = open_engine(settings)
    settings = getattr(engine, "settings", settings)  # a replay runs what was recorded
    collected = _Collected()
    out = open(record, "w", encoding="utf-8") if record else None  # noqa: SIM115
    try:
        writer = (
            RecordWriter(out, settings, recorded_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            if out
            else None
        )
        last_report = time.monotonic()
        for event in run_events(engine, settings, lockstep=False):
            if writer:
                writer.write(event)
            _collect(collected, event)
            if isinstance(event, StepSample) and time.monotonic() - last_report > 1.0:
                last_report = time.monotonic()
                progress(f"{event.loop}: {event.step + 1}/{collected.started.tokens} tokens")
    finally:
        engine.close()
        if out:
            out.close()
    return summarize(collected, settings)


def _cached_first(settings: RunSettings) -> RunSettings:
    loops = tuple(loop for loop in ("cached", "uncached") if loop in settings.loops)
    return replace(settings, loops=loops)


def _collect(c: _Collected, event: Event) -> None:
    if isinstance(event, RunStarted):
        c.started = event
    elif isinstance(event, StepSample):
        c.steps[event.loop].append(event)
    elif isinstance(event, RunFinished):
        c.finished[event.loop] = event
    elif isinstance(event, RunFailed):
        raise RuntimeError(event.message)


def format_table(r: dict) -> str:
    """The summary as a small table for a terminal."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} ms"

    def tps(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    rows = [
        ("", "cached", "uncached"),
        ("tokens/s", tps(r["cached"]["tokens_per_s"]), tps(r["uncached"]["tokens_per_s"])),
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
        ("positions computed", format_int(r["work_cached"]), format_int(r["work_uncached"])),
    ]
    width = max(len(row[0]) for row in rows)
    lines = [
        f"{r['model']} on {r['device']} ({r['dtype']}, {format_count(r['threads'], 'thread')}), "
        f"{r['prompt_tokens']} prompt + {r['tokens']} tokens"
    ]
    lines += [f"  {a:<{width}}  {b:>14}  {c:>14}" for a, b, c in rows]
    same = "identical" if r["identical"] else f"DIFFER from step {r['first_divergence']}"
    lines.append(f"  tokens: {same}")
    if r["speedup_wall"]:
        lines.append(
            f"  speedup: {format_ratio(r['speedup_wall'])} measured, "
            f"{format_ratio(r['work_ratio'])} in positions computed"
        )
    if r["kv_bytes_measured"] is not None:
        lines.append(
            f"  KV cache: {format_bytes(r['kv_bytes_measured'])} measured, "
            f"{format_bytes(r['kv_bytes_formula'])} by the formula"
        )
    if r["achieved_bandwidth_bytes_per_s"]:
        peak = r["peak_bandwidth_bytes_per_s"]
        lines.append(
            f"  cached step reads {format_bandwidth(r['achieved_bandwidth_bytes_per_s'])}"
            + (f" of {format_bandwidth(peak)} peak" if peak else "")
            + f", {r['flops_per_byte']:.2f} FLOPs per byte"
        )
    lines += [f"  {m}" for m in r["messages"]]
    lines.append(f"  text: {r['text'][:200]!r}")
    return "\n".join(lines)
