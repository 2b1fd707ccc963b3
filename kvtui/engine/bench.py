"""`kvtui bench`: both loops on the same prompt, measured, as one JSON-ready summary. No UI.

The engine runs in this process (there is no UI to fight for the GIL), the cached loop first and
then the uncached one, each to its end, so that their step times do not interleave.

A run of `batch` B decodes B sequences together; its summary says how fast each sequence went
(`tokens_per_s_per_sequence`, one token of each per step) and all of them (`tokens_per_s_total`),
and counts the work and the KV cache of all of them. `run_sweep` runs one bench per batch size
(`kvtui bench --batch 1,2,4,8,16`): how throughput, step time and arithmetic intensity (FLOPs per
byte read, against the device's ridge point where known) move with the batch.

Memory stays bounded: each step is kept as a few numbers in arrays (about 40 bytes, not a
360-byte StepSample), with at most MAX_TEXT_CHARS of text, and a run has at most MAX_TOKENS steps
per loop (kvtui.engine.spec.check_run). Every float of the summary is finite or None, so its JSON
is JSON. `--record FILE` writes to a temporary file beside FILE and renames it onto FILE when the
run ends, Ctrl-C included (the loops then end "cancelled"), so FILE is either untouched or a
whole, replayable record; an existing FILE is replaced only with `force`, and never a link.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import tempfile
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from kvtui.engine.protocol import (
    EngineError,
    Event,
    RunFailed,
    RunFinished,
    RunSettings,
    RunStarted,
    StepSample,
    run_events,
)
from kvtui.engine.replay import RecordWriter
from kvtui.engine.spec import check_run, open_engine
from kvtui.format import (
    format_bandwidth,
    format_bytes,
    format_count,
    format_int,
    format_ratio,
    safe_text,
)

MAX_TEXT_CHARS = 65_536
"""The most generated text a summary keeps (its table shows the first 200 characters)."""


@dataclass
class _Series:
    """One loop's steps as columns of numbers: what the summary needs of each, and no more."""

    token_ids: array = field(default_factory=lambda: array("q"))
    seconds: array = field(default_factory=lambda: array("d"))
    positions: array = field(default_factory=lambda: array("q"))
    work: int = 0
    """Positions computed, summed."""
    first_positions: int = 0
    """Positions the first step computed: the prompt (the cached loop's prefill)."""
    text: list[str] = field(default_factory=list)
    text_chars: int = 0
    bandwidth: array = field(default_factory=lambda: array("d"))
    """Bytes read per second of each step after the first (a prefill, in the cached loop)."""
    intensity: list[float] = field(default_factory=list)
    """FLOPs per byte read of each step after the first."""

    def add(self, s: StepSample) -> None:
        first = not self.seconds
        self.token_ids.append(s.token_id)
        self.seconds.append(s.step_seconds)
        self.positions.append(s.position)
        self.work += s.positions_computed
        if first:
            self.first_positions = s.positions_computed
        if self.text_chars < MAX_TEXT_CHARS:
            piece = s.text[: MAX_TEXT_CHARS - self.text_chars]
            self.text.append(piece)
            self.text_chars += len(piece)
        if not first:
            if s.step_seconds > 0:
                self.bandwidth.append(s.bytes_read / s.step_seconds)
            if s.bytes_read > 0:
                self.intensity.append(s.flops / s.bytes_read)

    def __len__(self) -> int:
        return len(self.seconds)


@dataclass
class _Collected:
    started: RunStarted | None = None
    steps: dict[str, _Series] = field(
        default_factory=lambda: {"cached": _Series(), "uncached": _Series()}
    )
    finished: dict[str, RunFinished] = field(default_factory=dict)


def loop_stats(steps: _Series, batch: int = 1) -> dict:
    """Throughput and step-time shape of one loop of `batch` sequences (times in ms): tokens
    (steps) per second of each sequence, and of all of them."""
    if not steps:
        return {
            "tokens": 0,
            "tokens_per_s": None,
            "tokens_per_s_per_sequence": None,
            "tokens_per_s_total": None,
            "step_ms_p50": None,
            "step_ms_first_quartile": None,
            "step_ms_last_quartile": None,
            "step_ms_p99": None,
            "total_s": 0.0,
            "ms_per_position": None,
            "ttft_s": None,
            "tpot_s": None,
            "first_step_positions_per_s": None,
            "later_step_positions_per_s": None,
        }
    ms = [seconds * 1e3 for seconds in steps.seconds]
    total = sum(steps.seconds)
    q = max(1, len(ms) // 4)
    per_sequence = len(steps) / total if total > 0 else None
    return {
        "tokens": len(steps),
        "tokens_per_s": per_sequence,
        "tokens_per_s_per_sequence": per_sequence,
        "tokens_per_s_total": batch * per_sequence if per_sequence is not None else None,
        "step_ms_p50": statistics.median(ms),
        "step_ms_first_quartile": statistics.median(ms[:q]),
        "step_ms_last_quartile": statistics.median(ms[-q:]),
        "step_ms_p99": sorted(ms)[min(len(ms) - 1, int(0.99 * len(ms)))],
        "total_s": total,
        "ms_per_position": _slope(steps.positions[1:].tolist(), ms[1:]),
        **_first_and_later(steps),
    }


def _first_and_later(steps: _Series) -> dict:
    """Time to first token (the first step: the prompt's pass, a prefill with a cache) and time
    per output token after it (the mean of the later steps: the step time of the whole batch),
    and the positions each computes per second, every sequence's: prefill reads the whole prompt
    in one pass, decode one position a step."""
    first, later = steps.seconds[0], steps.seconds[1:]
    later_seconds = sum(later)
    later_work = steps.work - steps.first_positions
    return {
        "ttft_s": first,
        "tpot_s": later_seconds / len(later) if later else None,
        "first_step_positions_per_s": steps.first_positions / first if first > 0 else None,
        "later_step_positions_per_s": later_work / later_seconds if later_seconds > 0 else None,
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
    ids_c, ids_u = cached.token_ids.tolist(), uncached.token_ids.tolist()
    compared = min(len(ids_c), len(ids_u))  # as far as both loops got
    divergence = next(
        (i for i, (a, b) in enumerate(zip(ids_c, ids_u, strict=False)) if a != b), None
    )
    B = started.batch
    stats_c, stats_u = loop_stats(cached, B), loop_stats(uncached, B)
    work_c, work_u = cached.work, uncached.work
    achieved = statistics.median(cached.bandwidth) if cached.bandwidth else None
    intensity = statistics.fmean(cached.intensity) if cached.intensity else None
    finished_c = c.finished.get("cached")
    P = started.prompt_tokens
    allocated = finished_c.kv_bytes_allocated if finished_c else None
    block_bytes = (
        started.kv_block_tokens * started.kv_bytes_per_token if started.kv_block_tokens else None
    )
    return _finite(
        {
            "engine": settings.engine,
            "timing": started.timing,
            "device": started.device,
            "model": started.model,
            "dtype": started.dtype,
            "threads": started.threads,
            "prompt_tokens": P,
            "tokens": started.tokens,
            "batch": B,
            "seed": settings.seed,
            "greedy": settings.greedy,
            "text": "".join((cached or uncached).text),
            "token_ids": ids_c or ids_u,
            "identical": compared > 0 and divergence is None,
            "compared_tokens": compared,
            "first_divergence": divergence,
            "cached": {**stats_c, "finished": _finished(finished_c)},
            "uncached": {**stats_u, "finished": _finished(c.finished.get("uncached"))},
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
            "kv_capacity_bytes": started.kv_capacity_bytes,
            "kv_pool_source": started.kv_pool_source,
            "kv_block_tokens": started.kv_block_tokens,
            "kv_blocks_allocated": allocated // block_bytes
            if allocated is not None and block_bytes
            else None,
            "kv_bytes_allocated": allocated,
            "kv_bytes_filled": finished_c.kv_bytes_filled if finished_c else None,
            "kv_bytes_formula": B * started.kv_bytes_per_token * (P + len(cached) - 1)
            if cached
            else None,
            "weights_bytes": started.weights_bytes,
            "achieved_bandwidth_bytes_per_s": achieved,
            "peak_bandwidth_bytes_per_s": started.peak_bandwidth_bytes_per_s,
            "flops_per_byte": intensity,
            "ridge_flops_per_byte": started.ridge_flops_per_byte,
            "ridge_source": started.ridge_source,
            "messages": list(dict.fromkeys(f.message for f in c.finished.values() if f.message)),
        }
    )


def _finished(f: RunFinished | None) -> dict | None:
    """How a loop ended: its reason ("done", "out_of_memory", ...), steps and message."""
    return {"reason": f.reason, "steps": f.steps, "message": f.message} if f else None


def _finite(data: Any) -> Any:
    """`data` with every float that is not finite (a rate over a zero-length step) made None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_finite(value) for value in data]
    return data


def run_bench(
    settings: RunSettings,
    *,
    record: Path | None = None,
    force: bool = False,
    progress: Callable[[str], None] = lambda line: None,
) -> dict:
    """Run both loops, cached first; return the summary. `EngineError` for a bad engine, a run
    that produced no step, or a record that cannot be written (`RecordError`); Ctrl-C ends the
    run with its record, if any, whole (`Interrupted`)."""
    settings = _cached_first(settings)
    recording = RecordFile(record, force) if record else None  # a bad target costs no load
    try:
        engine = open_engine(settings)
    except BaseException:
        if recording:
            recording.discard()
        raise
    settings = getattr(engine, "settings", settings)  # a replay runs what was recorded
    collected = _Collected()
    try:
        if recording:
            recording.start(settings)
        last_report = time.monotonic()
        for event in run_events(engine, settings, schedule="sequential"):
            if recording:
                recording.write(event)
            _collect(collected, event)
            if isinstance(event, StepSample) and time.monotonic() - last_report > 1.0:
                last_report = time.monotonic()
                progress(f"{event.loop}: {event.step + 1}/{collected.started.tokens} tokens")
    except KeyboardInterrupt:
        steps = sum(len(series) for series in collected.steps.values())
        if recording and steps:
            for loop in settings.loops:
                if loop not in collected.finished:
                    done = len(collected.steps[loop])
                    recording.write(RunFinished(loop, "cancelled", done, "interrupted"))
            recording.commit()
            raise Interrupted(f"interrupted after {steps:,} steps; recorded to {record}") from None
        if recording:
            recording.discard()
        raise Interrupted(f"interrupted after {steps:,} steps") from None
    except BaseException:
        if recording:
            recording.discard()
        raise
    finally:
        engine.close()
    if not any(collected.steps.values()):
        messages = [f.message for f in collected.finished.values() if f.message]
        if recording:
            recording.discard()
        raise EngineError(messages[0] if messages else "the run produced no steps")
    if recording:
        recording.commit()
    return summarize(collected, settings)


def run_sweep(
    settings: RunSettings,
    batches: list[int],
    *,
    progress: Callable[[str], None] = lambda line: None,
) -> dict:
    """One `run_bench` per batch size, in the order given: `{"sweep": [summary, ...]}`. Every
    size is checked (`check_run`) before the first run, so that a bad one costs no run."""
    runs = [replace(settings, batch=batch) for batch in batches]
    for run in runs:
        check_run(run)
    summaries = []
    for run in runs:
        say = functools.partial(_prefixed, progress, f"batch {run.batch}: ")
        summaries.append(run_bench(run, progress=say))
    return {"sweep": summaries}


def _prefixed(progress: Callable[[str], None], prefix: str, line: str) -> None:
    progress(prefix + line)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `run_bench`: what was done, and where it was recorded, in one line."""


class RecordError(EngineError):
    """`--record FILE` cannot be written: one line for a person to read."""


class RecordFile:
    """A record written to a temporary file beside its target and renamed onto it once whole.

    The target must not be a link, nor anything but a regular file, and must not exist unless
    `force`; its directory must. A failed write (a full disk) or a run that fails discards the
    temporary file and leaves the target as it was."""

    def __init__(self, path: Path, force: bool) -> None:
        self.path, self.force = path, force
        if path.is_symlink():
            raise RecordError(f"--record {path}: a symbolic link; kvtui writes records to files")
        if path.exists():
            if not path.is_file():
                raise RecordError(f"--record {path}: exists and is not a regular file")
            if not force:
                raise RecordError(f"--record {path}: already exists (--force replaces it)")
        parent = path.absolute().parent
        if not parent.is_dir():
            raise RecordError(f"--record {path}: no such directory {parent}")
        try:
            fd, temp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".part")
        except OSError as exc:
            raise self._error(exc) from None
        self._temp = Path(temp)
        self._out: IO[str] | None = os.fdopen(fd, "w", encoding="utf-8")
        self._writer: RecordWriter | None = None

    def _error(self, exc: OSError) -> RecordError:
        return RecordError(f"cannot write {self.path}: {exc.strerror or type(exc).__name__}")

    def start(self, settings: RunSettings) -> None:
        """The header line: the settings that ran, and when."""
        try:
            self._writer = RecordWriter(
                self._out, settings, recorded_at=time.strftime("%Y-%m-%dT%H:%M:%S%z")
            )
        except OSError as exc:
            self.discard()
            raise self._error(exc) from None

    def write(self, event: Event) -> None:
        try:
            self._writer.write(event)
        except OSError as exc:
            self.discard()
            raise self._error(exc) from None

    def commit(self) -> None:
        """Close the temporary file and move it onto the target (never over a file that
        appeared meanwhile, unless `force`)."""
        try:
            self._out.close()
            self._out = None
            if self.force:
                os.replace(self._temp, self.path)
                return
            try:
                os.link(self._temp, self.path)  # fails if the target exists: nothing clobbered
            except FileExistsError:
                raise RecordError(
                    f"--record {self.path}: appeared during the run (--force replaces it)"
                ) from None
            except OSError:  # a file system without hard links
                if os.path.lexists(self.path):
                    raise RecordError(f"--record {self.path}: appeared during the run") from None
                os.replace(self._temp, self.path)
                return
            os.unlink(self._temp)
        except OSError as exc:
            self.discard()
            raise self._error(exc) from None
        except RecordError:
            self.discard()
            raise

    def discard(self) -> None:
        """Close and remove the temporary file; the target is left as it was."""
        if self._out is not None:
            with contextlib.suppress(OSError):
                self._out.close()
            self._out = None
        with contextlib.suppress(OSError):
            self._temp.unlink()


def _cached_first(settings: RunSettings) -> RunSettings:
    loops = tuple(loop for loop in ("cached", "uncached") if loop in settings.loops)
    return replace(settings, loops=loops)


def _collect(c: _Collected, event: Event) -> None:
    if isinstance(event, RunStarted):
        c.started = event
    elif isinstance(event, StepSample):
        c.steps[event.loop].add(event)
    elif isinstance(event, RunFinished):
        c.finished[event.loop] = event
    elif isinstance(event, RunFailed):
        raise EngineError(event.message)


def _kv_lines(r: dict) -> list[str]:
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


def format_table(r: dict) -> str:
    """The summary as a small table for a terminal."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} ms"

    def tps(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    def seconds_ms(v: float | None) -> str:
        return "-" if v is None else ms(v * 1e3)

    def both(key: str, show) -> tuple[str, str, str]:
        return show(r["cached"][key]), show(r["uncached"][key])

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
    if r["batch"] > 1:
        rows.insert(2, ("tokens/s, all sequences", *both("tokens_per_s_total", tps)))
    width = max(len(row[0]) for row in rows)
    lines = [
        f"{r['model']} on {r['device']} ({r['dtype']}"
        + (f", {format_count(r['threads'], 'thread')}" if r["threads"] else "")
        + "), "
        f"{r['prompt_tokens']} prompt + {r['tokens']} tokens"
        + (f", a batch of {r['batch']} sequences" if r["batch"] > 1 else "")
    ]
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
        lines.append(
            f"  speedup: {format_ratio(r['speedup_wall'])} {r['timing']}, "
            f"{format_ratio(r['work_ratio'])} in positions computed"
        )
    lines += _kv_lines(r)
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
    lines += [f"  {m}" for m in r["messages"]]
    lines.append(f"  text: {r['text'][:200]!r}")
    return safe_text("\n".join(lines))  # names, messages and text may come from a file


def format_sweep(sweep: dict) -> str:
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
