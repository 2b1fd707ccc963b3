"""`kvtui bench`: both loops on the same prompt, measured, as one JSON-ready summary. No UI.

The engine runs in this process (there is no UI to fight for the GIL), the cached loop first and
then the uncached one, each to its end, so that their step times do not interleave.

A run of `batch` B decodes B sequences together; its summary says how fast each sequence went
(`tokens_per_s_per_sequence`, one token of each per step) and all of them (`tokens_per_s_total`),
and counts the work and the KV cache of all of them. `run_sweep` runs one bench per batch size
(`kvtui bench --batch 1,2,4,8,16`): how throughput, step time and arithmetic intensity (FLOPs per
byte read, against the device's ridge point where known) move with the batch.

The events are folded by kvtui.run.summary, the fold the screens use too, so a figure means the
same in both: the summary names its figures, and kvtui.reports.bench_text prints it. Memory stays
bounded: each step is kept as a few numbers in arrays (about 50 bytes, not a 360-byte StepSample),
with at most MAX_TEXT_CHARS of text, and a run has at most MAX_TOKENS steps per loop
(kvtui.engines.factory.check_run). Every float of the summary is finite or None, so its JSON is
JSON. `--record FILE` writes to a temporary file beside FILE and renames it onto FILE when the run
ends, Ctrl-C included (the loops then end "cancelled"), so FILE is either untouched or a whole,
replayable record; an existing FILE is replaced only with `force`, and never a link.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from kvtui.engines.drive import run_events
from kvtui.engines.factory import check_run, open_engine, parse_engine
from kvtui.engines.protocol import (
    Event,
    Loop,
    RunFailed,
    RunFinished,
    RunSettings,
    RunStarted,
    StepSample,
)
from kvtui.engines.replay import RecordWriter
from kvtui.errors import EngineError
from kvtui.run.summary import LoopSummary, RunSummary
from kvtui.sim.tricks import QUALITY_BYTES

MAX_TEXT_CHARS = 65_536
"""The most generated text a summary keeps (its table shows the first 200 characters)."""
SPEED_STEPS = 256
"""Steps after the first over which `tpot_first_steps_s` is taken: the same steps for runs that
stop at different lengths (a step reads more cache the longer the run)."""


@runtime_checkable
class MeasuresQuality(Protocol):
    """An engine that can say what its KV-cache layout costs in quality (kvtui's own decoder on
    its byte-level model); the others report none."""

    def measure_quality(self, loop: Loop, text_bytes: int) -> dict[str, Any] | None: ...


@dataclass
class _Collected:
    """The run folded (kvtui.run.summary), and the first MAX_TEXT_CHARS of each loop's text."""

    run: RunSummary = field(default_factory=RunSummary)
    text: dict[str, list[str]] = field(default_factory=lambda: {"cached": [], "uncached": []})
    text_chars: dict[str, int] = field(default_factory=lambda: {"cached": 0, "uncached": 0})
    quality: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """Per loop, what its cache layout costs in quality (kvtui.engines.quality), where measured."""

    def add_text(self, s: StepSample) -> None:
        done = self.text_chars[s.loop]
        if done < MAX_TEXT_CHARS:
            piece = s.text[: MAX_TEXT_CHARS - done]
            self.text[s.loop].append(piece)
            self.text_chars[s.loop] += len(piece)

    def steps(self, loop: str) -> int:
        return self.run.loops[loop].steps


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _work(run: RunSummary, *, served: bool) -> dict[str, Any]:
    """Positions each loop computed over the tokens both made, every sequence's, and their ratio:
    one count of the same steps, where a loop that stopped early (the cached one, its pool
    full) made fewer tokens than the other (each loop's whole run: its `positions_computed`)."""
    if served:  # positions are the server's: not observed over HTTP
        return {"work_cached": None, "work_uncached": None, "work_ratio": run.positions_speedup()}
    batch = run.started.batch if run.started else 1
    uncached, cached = run.work_over(run.compared_steps)
    return {
        "work_cached": batch * cached,
        "work_uncached": batch * uncached,
        "work_ratio": run.positions_speedup(),
    }


def _growth_note(steps: LoopSummary) -> str:
    """What `step_ms_growth_per_position` is, and why it is null where it is."""
    what = "the later steps' time against their position, least-squares slope"
    if steps.step_seconds_growth_per_position is not None:
        return what
    if steps.steps < 4:
        return f"{what}: null, under three later steps"
    return f"{what}: null, not resolved above the step-to-step noise (under 2 standard errors)"


def loop_stats(steps: LoopSummary, *, served: bool = False) -> dict[str, Any]:
    """Throughput and step-time shape of one loop (times in ms): tokens (steps) per second of
    each sequence and of all of them, the first step's time and the later steps' (TTFT, TPOT)
    and the positions each computes per second, every sequence's (ms_per_position is its
    reciprocal: measured, never negative; the growth of the step time with position is a slope,
    given only where the steps resolve it), and the FLOPs torch counted on
    the sampled steps beside the formula's."""
    return {
        "tokens": steps.steps,
        "tokens_per_s": steps.tokens_per_s_per_sequence,
        "tokens_per_s_per_sequence": steps.tokens_per_s_per_sequence,
        "tokens_per_s_total": steps.tokens_per_s_total,
        "step_ms_p50": _ms(steps.step_seconds_p50),
        "step_ms_first_quartile": _ms(steps.step_seconds_first_quartile),
        "step_ms_last_quartile": _ms(steps.step_seconds_last_quartile),
        "step_ms_p99": _ms(steps.step_seconds_quantile(0.99)),
        "total_s": steps.seconds_total,
        "ms_per_position": _ms(steps.seconds_per_position),
        "step_ms_growth_per_position": _ms(steps.step_seconds_growth_per_position),
        "step_ms_growth_note": _growth_note(steps),
        "ttft_s": steps.ttft_s,
        "tpot_s": steps.tpot_s,
        "tpot_first_steps_s": steps.tpot_over(SPEED_STEPS),
        "positions_computed": None if served else steps.positions_computed,
        "first_step_positions": steps.first_positions if steps.steps else None,
        "first_step_positions_per_s": steps.first_step_positions_per_s,
        "later_step_positions_per_s": steps.later_step_positions_per_s,
        "flops_counted": steps.flops_counted,
        "flops_formula": steps.flops_formula if steps.flops_counted is not None else None,
        "flops_sampled_steps": steps.flops_sampled_steps,
        "flops_ratio": steps.flops_ratio,
    }


def summarize(c: _Collected, settings: RunSettings) -> dict[str, Any]:
    """The JSON-ready summary of a collected run: kvtui.run.summary's figures, by their names."""
    run = c.run
    started = run.started
    assert started is not None  # a run with steps began with its RunStarted (run_events)
    cached, uncached = run.loop("cached"), run.loop("uncached")
    kv = {
        "kv_bytes_per_token": cached.kv_bytes_per_position,
        "kv_bytes_per_token_formula": started.kv_bytes_per_token if cached.steps else None,
        "tokens_before_full_predicted": run.tokens_before_full,
    }
    layout = started.layout
    served = bool(started.served_by)
    summary: dict[str, Any] = _finite(
        {
            "engine": settings.engine,
            "timing": started.timing,
            "device": started.device,
            "model": started.model,
            "dtype": started.dtype,
            "threads": started.threads,
            "prompt_tokens": started.prompt_tokens,
            "tokens": started.tokens,
            "batch": started.batch,
            "seed": settings.seed,
            "greedy": settings.greedy,
            "text": "".join(c.text["cached"] or c.text["uncached"]),
            "token_ids": (cached.token_ids or uncached.token_ids).tolist(),
            "identical": run.identical,
            "compared_tokens": run.compared_steps,
            "first_divergence": run.first_divergence,
            "cached": {**loop_stats(cached, served=served), **kv, **_ending(c, "cached")},
            "uncached": {
                **loop_stats(uncached, served=served),
                **dict.fromkeys(kv),
                **_ending(c, "uncached"),
            },
            "kv_layout": served_layout(run)
            if started.served_by
            else {**layout.to_json(), "words": layout.words()},
            "kv_heads_model": started.kv_heads_model,
            "speedup_wall": run.wall_speedup(),
            "last_quartile_ratio": run.last_quartile_ratio,
            **_work(run, served=served),
            "kv_bytes_per_token": started.kv_bytes_per_token,
            "kv_capacity_bytes": started.kv_capacity_bytes,
            "kv_pool_source": started.kv_pool_source,
            "kv_block_tokens": started.kv_block_tokens,
            "kv_blocks_allocated": run.kv_blocks_allocated(),
            "kv_bytes_allocated": cached.kv_bytes_allocated,
            "kv_bytes_filled": cached.kv_bytes_filled,
            "kv_bytes_formula": run.kv_bytes_formula("cached"),
            "weights_bytes": started.weights_bytes,
            "achieved_bandwidth_bytes_per_s": cached.bandwidth_bytes_per_s,
            "peak_bandwidth_bytes_per_s": started.peak_bandwidth_bytes_per_s,
            "flops_per_byte": cached.flops_per_byte,
            "ridge_flops_per_byte": started.ridge_flops_per_byte,
            "ridge_source": started.ridge_source,
            "served_by": started.served_by,
            "server": served_summary(run) if started.served_by else None,
            "servers": fleet_summary(run, settings.engine) if started.served_by else None,
            "messages": run.messages,
        }
    )
    return summary


def fleet_summary(run: RunSummary, engine: str) -> list[dict[str, Any]]:
    """Every server of a served run (`vllm:URL1,URL2,...`: a fleet of replicas; one for
    `vllm:URL`), each as `served_summary` gives one, with its `replica` (from 0, 0 the one the
    decode streamed from) and `url`."""
    urls = [str(url) for url in parse_engine(engine).urls]
    return [
        {"replica": i, "url": urls[i] if i < len(urls) else None} | served_summary(run, i)
        for i in range(run.fleet.size)
    ]


def served_summary(run: RunSummary, replica: int = 0) -> dict[str, Any]:
    """A served run's server (`replica` of a fleet; the decode's by default), as its /metrics
    said (every figure the server's), beside kvtui's prediction of its KV cache
    (kvtui.run.serving, kvtui.run.fleet)."""
    server = run.fleet.replicas[replica]
    m = server.latest
    check = run.fleet.capacity(replica, run.started)
    capacity: dict[str, Any] | str = (
        check
        if isinstance(check, str)
        else {
            "blocks": check.blocks,
            "block_tokens": check.block_tokens,
            "tokens": check.tokens,
            "memory_bytes": check.memory_bytes,
            "kv_dtype": check.kv_dtype,
            "kv_bytes_per_token": check.kv_bytes_per_token,
            "predicted_blocks": check.predicted_blocks,
            "predicted_tokens": check.predicted_tokens,
            "override": check.override,
            "agree": check.agree,
            "reason": check.reason,
            "engines": check.engines,
            "blocks_per_engine": check.blocks_per_engine,
            "dtype_source": check.dtype_source,
            "config_dtype": run.started.dtype if run.started is not None else None,
        }
    )
    return {
        "polls": server.polls,
        "failed_polls": server.failed,
        "error": server.error,
        "found": list(m.found) if m is not None else [],
        "model": m.model if m is not None else "",
        "capacity": capacity,
        "kv_usage": m.kv_usage if m is not None else None,
        "kv_usage_peak": server.seen_peak,  # None: no poll saw one, rather than 0%
        "kv_used_tokens": m.kv_used_tokens if m is not None else None,
        "kv_evictable_tokens": m.kv_evictable_tokens if m is not None else None,
        "kv_free_tokens": m.kv_free_tokens if m is not None else None,
        "requests_running": m.requests_running if m is not None else None,
        "requests_waiting": m.requests_waiting if m is not None else None,
        "preemptions_seen": server.preemptions_seen,
        "preemptions": [dataclasses.asdict(b) for b in server.pressure.bursts],
        "most_running_seen": server.pressure.most_running,
        "kv_usage_peak_seen": server.pressure.peak_seen,
        "max_model_len": run.started.max_positions if run.started is not None else None,
        "max_num_seqs": None,
        "prefix_caching": m.prefix_caching if m is not None else None,
        "prefix_queries_seen_tokens": server.prefix_queries_seen,
        "prefix_hits_seen_tokens": server.prefix_hits_seen,
        "ttft_mean_s": server.ttft_mean_s,
        "ttft_requests": server.ttft_requests,
        "itl_mean_s": server.itl_mean_s,
    }


def served_layout(run: RunSummary) -> dict[str, Any]:
    """A served run's KV layout as the server serves it (its cache_config_info), never kvtui's
    own defaults: the cache dtype it was told ("auto": the model's), the dtype its blocks say
    it keeps, its block size and whether it caches prefixes."""
    m, check = run.server.latest, run.server.capacity(run.started)
    told = m.kv_cache_dtype if m is not None and m.kv_cache_dtype else None
    caching = m.prefix_caching if m is not None else None
    blocks = m.kv_block_tokens if m is not None else None
    return {
        "kv_cache_dtype": told,
        "kv_cache_dtype_served": None if isinstance(check, str) else check.kv_dtype,
        "kv_block_tokens": blocks,
        "kv_window": None,
        "kv_sinks": 0,
        "enable_prefix_caching": caching,
        "kv_heads": None,
        "source": "the server's /metrics (vllm:cache_config_info)",
        "words": f"served: {told or 'cache dtype not said'} cache"
        + ("" if isinstance(check, str) else f" ({check.kv_dtype})")
        + {True: ", prefix caching", False: ", no prefix caching", None: ""}[caching],
    }


def _ending(c: _Collected, loop: Loop) -> dict[str, Any]:
    """How a loop ended (its reason, "done", "out_of_memory", ...; steps and message), and what
    its cache layout costs in quality where that was measured."""
    f = c.run.loops[loop].finished
    finished = {"reason": f.reason, "steps": f.steps, "message": f.message} if f else None
    return {"finished": finished, "quality": c.quality.get(loop)}


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
    quality_bytes: int | None = None,
) -> dict[str, Any]:
    """Run both loops, cached first; return the summary. `EngineError` for a bad engine, a run
    that produced no step, or a record that cannot be written (`RecordError`); Ctrl-C ends the
    run with its record, if any, whole (`Interrupted`). `quality_bytes`: each loop's cost in
    quality on that many bytes of held-out text, where the engine measures it (default:
    QUALITY_BYTES when the run keeps a KV-cache trick, none without; 0: none)."""
    if quality_bytes is None:
        quality_bytes = 0 if settings.layout.is_plain else QUALITY_BYTES
    settings = _cached_first(settings)
    check_run(settings)  # a run that cannot start (no CUDA) is said before a file is made
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
                started = collected.run.started
                assert started is not None  # run_events sends it before any step
                progress(f"{event.loop}: {event.step + 1}/{started.tokens} tokens")
        if quality_bytes and isinstance(engine, MeasuresQuality):
            for loop in settings.loops:
                progress(f"{loop}: quality on {quality_bytes:,} bytes of held-out text")
                collected.quality[loop] = engine.measure_quality(loop, quality_bytes)
    except KeyboardInterrupt:
        steps = sum(collected.steps(loop) for loop in collected.run.loops)
        if recording and steps:
            for loop in settings.loops:
                if collected.run.loops[loop].finished is None:
                    done = collected.steps(loop)
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
    finished = [s.finished for s in collected.run.loops.values() if s.finished is not None]
    failed = [f.message or f"the {f.loop} loop failed" for f in finished if f.reason == "error"]
    if failed or not any(collected.steps(loop) for loop in collected.run.loops):
        messages = [f.message for f in finished if f.message]
        error = (failed or messages or ["the run produced no steps"])[0]
        if recording and any(collected.steps(loop) for loop in collected.run.loops):
            recording.commit()  # a server that died mid-run: what it measured before is kept
            raise EngineError(f"{error}; the steps before are recorded to {record}")
        if recording:
            recording.discard()
        raise EngineError(error)
    if recording:
        recording.commit()
    return summarize(collected, settings)


def run_sweep(
    settings: RunSettings,
    batches: list[int],
    *,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """One `run_bench` per batch size, in the order given: `{"sweep": [summary, ...]}`. Every
    size is checked (`check_run`) before the first run, so that a bad one costs no run."""
    runs = [replace(settings, batch=batch) for batch in batches]
    for run in runs:
        check_run(run)
    summaries: list[dict[str, Any]] = []
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
    `force`; its folder is made if missing (`runs/h100.jsonl` on a fresh checkout). A failed
    write (a full disk) or a run that fails discards the temporary file, and the folders it
    made, and leaves the target as it was."""

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
        self._made = [p for p in (parent, *parent.parents) if not os.path.lexists(p)]
        """The folders made for the record, deepest first: removed again if it is discarded."""
        try:
            parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".part")
        except OSError as exc:
            self._remove_made()
            raise self._error(exc) from None
        self._temp = Path(temp)
        self._out: IO[str] | None = os.fdopen(fd, "w", encoding="utf-8")
        self._writer: RecordWriter | None = None

    def _error(self, exc: OSError) -> RecordError:
        return RecordError(f"cannot write {self.path}: {exc.strerror or type(exc).__name__}")

    def start(self, settings: RunSettings) -> None:
        """The header line: the settings that ran, and when."""
        assert self._out is not None, "start() before commit() or discard()"
        self._recorded_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        try:
            self._writer = RecordWriter(self._out, settings, recorded_at=self._recorded_at)
        except OSError as exc:
            self.discard()
            raise self._error(exc) from None

    def write(self, event: Event) -> None:
        """One event; the run's start carries when it was recorded (`RunStarted.recorded_at`)."""
        assert self._writer is not None, "start() first"
        if isinstance(event, RunStarted):
            event = replace(event, recorded_at=self._recorded_at)
        try:
            self._writer.write(event)
        except OSError as exc:
            self.discard()
            raise self._error(exc) from None
        except EngineError as exc:  # a number JSON does not have
            self.discard()
            raise RecordError(f"--record {self.path}: {exc}") from None

    def commit(self) -> None:
        """Close the temporary file and move it onto the target (never over a file that
        appeared meanwhile, unless `force`)."""
        assert self._out is not None, "commit() once, and not after discard()"
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
        self._remove_made()

    def _remove_made(self) -> None:
        for folder in self._made:  # deepest first; one that is no longer empty stays
            with contextlib.suppress(OSError):
                folder.rmdir()


def _cached_first(settings: RunSettings) -> RunSettings:
    loops = tuple(loop for loop in ("cached", "uncached") if loop in settings.loops)
    return replace(settings, loops=loops)


def _collect(c: _Collected, event: Event) -> None:
    if isinstance(event, RunFailed):
        raise EngineError(event.message)
    c.run.apply(event)
    if isinstance(event, StepSample):
        c.add_text(event)
