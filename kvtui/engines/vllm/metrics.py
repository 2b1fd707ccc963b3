"""A serving engine's Prometheus `/metrics`, read: the text format parsed, bounded, and each
quantity kvtui shows found under the names the releases of vLLM (and SGLang) give it. No torch,
no UI, no dependency: the text format is small enough to read here.

`parse_prometheus(text)` turns the text exposition format (version 0.0.4: `# HELP`, `# TYPE`,
`name{label="value",...} value [timestamp]`) into samples; `server_metrics(text, seconds)` turns
those into one `ServerMetrics` event (kvtui.engines.protocol), every figure the server's own,
saying which metric name it was read from (`found`). Metric names move between releases: for each
quantity, `NAMES` lists the names kvtui accepts, newest first, and the first present wins:

- vLLM 0.32 (the release kvtui is tested against, `tests/vllm/data/`): `vllm:kv_cache_usage_perc`,
  `vllm:cache_config_info` (labels `num_gpu_blocks`, `block_size`, `kv_cache_size_tokens`,
  `kv_cache_memory_bytes`, `cache_dtype`, `num_gpu_blocks_override`),
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:num_requests_waiting_by_reason`,
  `vllm:num_preemptions_total`, `vllm:prefix_cache_queries_total` / `_hits_total` (tokens),
  `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds` (histograms);
- older vLLM: `vllm:gpu_cache_usage_perc` (gone in 0.32), `vllm:gpu_prefix_cache_queries_total` /
  `_hits_total`, `vllm:time_per_output_token_seconds` (the inter-token histogram's older name);
- SGLang (tested against texts of SGLang 0.5.23's own collectors, `tests/engines/data/`; a real
  SGLang cannot run here: its wheel needs CUDA): `sglang:token_usage` (its running requests'
  share, prefix-cached slots not counted, as vLLM's), `sglang:max_total_num_tokens`,
  `sglang:num_pages` and `sglang:page_size` (its blocks), `sglang:kv_used_tokens`,
  `sglang:kv_evictable_tokens`, `sglang:kv_available_tokens` (0.5.x: the pool in tokens, held,
  cached, free), `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
  `sglang:num_retracted_requests_total` (its preemptions), `sglang:prompt_tokens_total` and
  `sglang:cached_tokens_total` (prompt tokens, and those found cached, counted as requests
  finish), `sglang:cache_hit_rate`, `sglang:time_to_first_token_seconds`,
  `sglang:inter_token_latency_seconds`.

Samples of one name are summed over their label sets (a data-parallel server reports one per
engine), but a figure said again is read once (`_series`: SGLang's TP ranks each report the same
pool; its per-priority series beside the total); a usage fraction is averaged. Not
`num_gpu_blocks`: vLLM gives every engine's sample the blocks of all its engines already, so it
is read once (`engines` says how many reported). A text larger than MAX_METRICS_BYTES or with
more than MAX_SAMPLES samples is refused, so a hostile server costs bounded memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvtui.engines.protocol import ServerMetrics
from kvtui.sim.pool import MAX_KV_BLOCK_TOKENS

MAX_METRICS_BYTES = 8 * 2**20
"""The largest /metrics text read: vLLM 0.32 serving one model writes about 60 KB."""
MAX_SAMPLES = 100_000
"""The most samples read from one text (vLLM 0.32: about 600)."""


class MetricsError(ValueError):
    """The text is not Prometheus's text format (or is past a bound): one line."""


@dataclass(frozen=True)
class Sample:
    """One line of a metric: its labels and value."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    value: float = 0.0


MAX_LINE_CHARS = 65_536
"""The longest line read (vLLM's longest, its cache config's, is about 400 characters)."""
MAX_LINES = 400_000
"""The most lines read, comments and blanks included (vLLM 0.32: about 1,000)."""

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\\n"}
"""A label value's escapes, unescaped: a backslash and a quote; an escaped newline stays the two
characters it was written as, so that a value is one line wherever it is shown."""


def _labels(line: str, position: int, number: int) -> tuple[dict[str, str], int]:
    """The labels of a sample line from `position` (just past its `{`) to its `}`, and the
    position past that: read by hand, in one pass (a regex with a repeated alternation, as this
    was, holds a backtracking point per character: 1.2 GB for a 7 MiB line)."""
    labels: dict[str, str] = {}
    end = len(line)

    def bad(why: str) -> MetricsError:
        return MetricsError(f"line {number}: malformed labels ({why})")

    while True:
        while position < end and line[position] in " \t":
            position += 1
        if position < end and line[position] == "}":
            return labels, position + 1
        match = _LABEL_NAME.match(line, position)
        if match is None:
            raise bad("no label name")
        name, position = match.group(), match.end()
        position = _past_equals(line, position, bad)
        pieces: list[str] = []
        quote = -1
        while True:
            if quote < position:  # else the quote found last time is still the next one
                quote = line.find('"', position)
            if quote < 0:
                raise bad("a value not closed")
            slash = line.find("\\", position, quote)
            if slash < 0:
                pieces.append(line[position:quote])
                position = quote + 1
                break
            pieces.append(line[position:slash])
            escaped = line[slash + 1 : slash + 2]
            pieces.append(_ESCAPES.get(escaped, "\\" + escaped))
            position = slash + 2
        labels[name] = "".join(pieces)
        while position < end and line[position] in " \t":
            position += 1
        if position < end and line[position] == ",":
            position += 1
        elif not (position < end and line[position] == "}"):
            raise bad("no comma or closing brace")


def _past_equals(line: str, position: int, bad: Callable[[str], MetricsError]) -> int:
    """The position past `=` and the opening quote of a label's value (spaces allowed)."""
    end = len(line)
    while position < end and line[position] in " \t":
        position += 1
    if position >= end or line[position] != "=":
        raise bad("no =")
    position += 1
    while position < end and line[position] in " \t":
        position += 1
    if position >= end or line[position] != '"':
        raise bad("a value not quoted")
    return position + 1


def _value(text: str, line: int) -> float:
    try:
        return float(text)  # also NaN, +Inf, -Inf, as the format has them
    except ValueError:
        raise MetricsError(f"line {line}: {text[:20]!r} is not a number") from None


def _sample(line: str, number: int) -> Sample:
    """One sample line: `name{label="value",...} value [timestamp]`."""
    match = _NAME.match(line)
    if match is None:
        raise MetricsError(f"line {number}: not a Prometheus sample")
    name, position = match.group(), match.end()
    labels: dict[str, str] = {}
    if line.startswith("{", position):
        labels, position = _labels(line, position + 1, number)
    rest = line[position:].split()
    if not 1 <= len(rest) <= 2 or (position < len(line) and line[position] not in " \t"):
        raise MetricsError(f"line {number}: not a Prometheus sample")
    if len(rest) == 2 and not rest[1].lstrip("-").isdigit():
        raise MetricsError(f"line {number}: {rest[1][:20]!r} is not a timestamp")
    return Sample(name, labels, _value(rest[0], number))


def _lines(text: str) -> Iterator[tuple[int, str]]:
    """(number, line) of a text, without a list of them all (a text of 8 MiB of newlines is 8
    million lines); `MetricsError` past MAX_LINES or for a line past MAX_LINE_CHARS."""
    start, number, end = 0, 0, len(text)
    while start < end:
        stop = text.find("\n", start)
        stop = end if stop < 0 else stop
        number += 1
        if number > MAX_LINES:
            raise MetricsError(f"more than {MAX_LINES:,} lines")
        if stop - start > MAX_LINE_CHARS:
            raise MetricsError(f"line {number}: longer than {MAX_LINE_CHARS:,} characters")
        yield number, text[start:stop]
        start = stop + 1


def parse_prometheus(text: str) -> dict[str, list[Sample]]:
    """Every sample of a text-format exposition, by metric name (as written on the sample line:
    a histogram's `_bucket`, `_sum` and `_count` apart); `MetricsError` for a line that is not
    a comment, a blank or a sample, or past MAX_METRICS_BYTES, MAX_LINES, MAX_LINE_CHARS or
    MAX_SAMPLES. Time and memory grow with the text's length, never faster."""
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsError(f"more than {MAX_METRICS_BYTES // 2**20} MiB of metrics")
    samples: dict[str, list[Sample]] = {}
    count = 0
    for number, line in _lines(text):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        count += 1
        if count > MAX_SAMPLES:
            raise MetricsError(f"more than {MAX_SAMPLES:,} samples")
        sample = _sample(line, number)
        samples.setdefault(sample.name, []).append(sample)
    return samples


# --- the quantities kvtui reads, by name ---------------------------------------------------------

NAMES: dict[str, tuple[str, ...]] = {
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "cache_config": ("vllm:cache_config_info",),
    "capacity_tokens": ("sglang:max_total_num_tokens",),
    "pages": ("sglang:num_pages",),
    "page_tokens": ("sglang:page_size",),
    "used_tokens": ("sglang:kv_used_tokens",),
    "evictable_tokens": ("sglang:kv_evictable_tokens",),
    "free_tokens": ("sglang:kv_available_tokens",),
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "waiting_by_reason": ("vllm:num_requests_waiting_by_reason",),
    "preemptions": ("vllm:num_preemptions_total", "sglang:num_retracted_requests_total"),
    "prefix_queries": (
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
        "sglang:prompt_tokens_total",
    ),
    "prefix_hits": (
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_total",
        "sglang:cached_tokens_total",
    ),
    "prefix_hit_rate": ("sglang:cache_hit_rate",),
    "ttft": ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    "itl": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "sglang:inter_token_latency_seconds",
        "sglang:time_per_output_token_seconds",
    ),
}
"""For each quantity, the metric names kvtui accepts, newest first (histograms by their family
name: `_sum` and `_count` are read)."""

_HISTOGRAMS = ("ttft", "itl")


RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank", "pid")
"""Labels under which one figure is said again, not a new one: SGLang's tensor, pipeline and expert
parallel ranks each report their scheduler's same pool and queue (with
--enable-metrics-for-all-schedulers), and prometheus_client's multiprocess mode adds a `pid`."""


def _series(found: list[Sample]) -> list[Sample]:
    """One sample per figure: a series SGLang breaks down by priority (its `priority` label set,
    beside the total under `priority=""`) left out, and of the samples that differ only in
    RANK_LABELS the largest kept (never their sum: a TP-2 server has one pool, said twice).
    Samples that differ in other labels (vLLM's `engine` of a data-parallel server, SGLang's
    `dp_rank`) stay apart, to be summed."""
    kept: dict[tuple[tuple[str, str], ...], Sample] = {}
    apart: list[Sample] = []  # no rank label: each its own figure, as ever
    for sample in found:
        if sample.labels.get("priority", ""):
            continue
        if not any(label in sample.labels for label in RANK_LABELS):
            apart.append(sample)
            continue
        key = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in RANK_LABELS))
        if key not in kept or sample.value > kept[key].value:
            kept[key] = sample
    return apart + list(kept.values())


def _first(samples: dict[str, list[Sample]], quantity: str, suffix: str = "") -> str | None:
    return next((n for n in NAMES[quantity] if n + suffix in samples), None)


MAX_COUNT = 2**53
"""The largest count kvtui takes from a server (requests, preemptions, tokens, blocks): every
integer a float holds exactly; a larger one is shown as unknown."""
MAX_MEMORY_BYTES = 2**60
"""The largest KV-cache memory taken from a server (an exbibyte)."""


def _total(found: Iterable[Sample]) -> float | None:
    """The sum of the finite, non-negative values; None without one, or if it overflows."""
    values = [s.value for s in found if math.isfinite(s.value) and s.value >= 0]
    total = sum(values) if values else None  # past the largest float: inf
    return total if total is not None and math.isfinite(total) else None


def _count(value: float | None, high: int = MAX_COUNT) -> int | None:
    """A count from a float: None for none, or past `high` (+Inf, 1e999 and 1e300 included)."""
    return int(value) if value is not None and 0 <= value <= high else None


def _int_label(labels: dict[str, str], key: str, high: int = MAX_COUNT) -> int | None:
    """A label holding a whole number from 0 to `high`, or None (a block size of 18 digits)."""
    text = labels.get(key, "")
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        return None
    value = int(text)
    return value if value <= high else None


def _sum(values: list[int | None], high: int = MAX_COUNT) -> int | None:
    """The sum of labels, each present, at most `high`; None otherwise."""
    if not values or any(v is None for v in values):
        return None
    total = sum(v for v in values if v is not None)
    return total if total <= high else None


def _float_label(labels: dict[str, str], key: str) -> float | None:
    try:
        value = float(labels.get(key, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


MAX_MODEL_CHARS = 200
"""The longest model name taken from a `model_name` label."""


def _model_name(samples: dict[str, list[Sample]], found: list[str]) -> str:
    """The `model_name` label of the first quantity found (vLLM and SGLang put it on every
    sample), at most MAX_MODEL_CHARS; "" where it is not said."""
    for entry in found:
        name = entry.partition("=")[2]
        for suffix in ("", "_count"):
            for sample in samples.get(name + suffix, ()):
                model = sample.labels.get("model_name", "")
                if model:
                    return model[:MAX_MODEL_CHARS]
    return ""


def server_metrics(text: str, seconds: float) -> ServerMetrics:
    """One poll's figures, from a /metrics text read `seconds` after the run started: every
    quantity of NAMES found (None where none of its names is), and `found`, which name each was
    read from. A text with none of them is a `ServerMetrics` whose `error` says so in one line;
    `MetricsError` for a text that is not Prometheus's format."""
    samples = parse_prometheus(text)
    found: list[str] = []
    values: dict[str, object] = {}

    def read(quantity: str, suffix: str = "") -> list[Sample]:
        name = _first(samples, quantity, suffix)
        if name is None:
            return []
        found.append(f"{quantity}={name}")
        return _series(samples[name + suffix])

    usage = [s.value for s in read("kv_usage") if math.isfinite(s.value) and s.value >= 0]
    if usage:
        values["kv_usage"] = min(1.0, sum(usage) / len(usage))
    info = read("cache_config")
    if info:
        labels = info[0].labels
        # vLLM sums num_gpu_blocks over its data-parallel engines itself and labels every
        # engine's sample with that total; kv_cache_size_tokens and kv_cache_memory_bytes are
        # each engine's own (vllm/v1/engine/core_client.py): the blocks are read once, the
        # token slots summed
        engines = len({s.labels.get("engine", "") for s in info})
        values["engines"] = engines
        counts = [_int_label(s.labels, "num_gpu_blocks") for s in info]
        blocks = None if any(c is None for c in counts) else max(c or 0 for c in counts)
        caching = labels.get("enable_prefix_caching")
        values["prefix_caching"] = {"True": True, "False": False}.get(caching or "")
        block_tokens = _int_label(labels, "block_size", MAX_KV_BLOCK_TOKENS) or None
        values["kv_blocks"] = blocks
        values["kv_block_tokens"] = block_tokens
        sizes = _sum([_int_label(s.labels, "kv_cache_size_tokens") for s in info])
        if sizes is None and blocks is not None and block_tokens is not None:
            sizes = _count(blocks * block_tokens)
        if sizes is not None:
            values["kv_capacity_tokens"] = sizes
        values["kv_cache_memory_bytes"] = _int_label(
            labels, "kv_cache_memory_bytes", MAX_MEMORY_BYTES
        )
        values["kv_cache_dtype"] = labels.get("cache_dtype", "")[:40]
        values["kv_blocks_override"] = _int_label(labels, "num_gpu_blocks_override")
        values["max_concurrency"] = _float_label(labels, "kv_cache_max_concurrency")
    if "kv_capacity_tokens" not in values:
        values["kv_capacity_tokens"] = _count(_total(read("capacity_tokens")))
    pages, page_tokens = read("pages"), read("page_tokens")
    if "kv_blocks" not in values and pages and page_tokens:  # SGLang: its pages are blocks
        values["kv_blocks"] = _count(_total(pages))
        values["kv_block_tokens"] = _count(_total(page_tokens[:1]), MAX_KV_BLOCK_TOKENS) or None
    values["kv_used_tokens"] = _count(_total(read("used_tokens")))
    values["kv_evictable_tokens"] = _count(_total(read("evictable_tokens")))
    values["kv_free_tokens"] = _count(_total(read("free_tokens")))
    values["requests_running"] = _count(_total(read("running")))
    values["requests_waiting"] = _count(_total(read("waiting")))
    reasons: dict[str, int] = {}
    for s in read("waiting_by_reason"):
        reason = s.labels.get("reason", "")[:40]
        waiting = _count(s.value)
        if reason and waiting is not None:
            reasons[reason] = min(MAX_COUNT, reasons.get(reason, 0) + waiting)
    values["waiting_reasons"] = tuple(f"{r}={n}" for r, n in sorted(reasons.items()))
    values["preemptions"] = _count(_total(read("preemptions")))
    values["prefix_queries_tokens"] = _count(_total(read("prefix_queries")))
    values["prefix_hits_tokens"] = _count(_total(read("prefix_hits")))
    rate = _total(read("prefix_hit_rate"))
    values["prefix_hit_rate"] = None if rate is None else min(1.0, rate)
    for quantity in _HISTOGRAMS:
        name = _first(samples, quantity, "_count")
        if name is None or name + "_sum" not in samples:
            continue
        found.append(f"{quantity}={name}")
        values[f"{quantity}_seconds_sum"] = _total(_series(samples[name + "_sum"]))
        values[f"{quantity}_count"] = _count(_total(_series(samples[name + "_count"])))
    values["model"] = _model_name(samples, found)
    if not found:
        return ServerMetrics(
            seconds,
            error="the server's /metrics holds none of the vLLM or SGLang metrics kvtui reads",
        )
    return ServerMetrics(seconds, found=tuple(found), **values)  # type: ignore[arg-type]
