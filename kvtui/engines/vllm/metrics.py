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
- SGLang, mapped the same way but untested here: `sglang:token_usage`, `sglang:num_running_reqs`,
  `sglang:num_queue_reqs`, `sglang:max_total_num_tokens`, `sglang:cache_hit_rate`,
  `sglang:time_to_first_token_seconds`, `sglang:inter_token_latency_seconds`.

Samples of one name are summed over their label sets (a data-parallel server reports one per
engine); a usage fraction is averaged. A text larger than MAX_METRICS_BYTES or with more than
MAX_SAMPLES samples is refused, so a hostile server costs bounded memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtui.engines.protocol import ServerMetrics

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


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], value)


def _labels(text: str, line: int) -> dict[str, str]:
    labels: dict[str, str] = {}
    position = 0
    text = text.rstrip().rstrip(",")
    while position < len(text):
        match = _LABEL.match(text, position)
        if match is None:
            raise MetricsError(f"line {line}: malformed labels")
        labels[match.group(1)] = _unescape(match.group(2))
        position = match.end()
    return labels


def _value(text: str, line: int) -> float:
    try:
        return float(text)  # also NaN, +Inf, -Inf, as the format has them
    except ValueError:
        raise MetricsError(f"line {line}: {text[:20]!r} is not a number") from None


def parse_prometheus(text: str) -> dict[str, list[Sample]]:
    """Every sample of a text-format exposition, by metric name (as written on the sample line:
    a histogram's `_bucket`, `_sum` and `_count` apart); `MetricsError` for a line that is not
    a comment, a blank or a sample, or past MAX_METRICS_BYTES / MAX_SAMPLES."""
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsError(f"more than {MAX_METRICS_BYTES // 2**20} MiB of metrics")
    samples: dict[str, list[Sample]] = {}
    count = 0
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise MetricsError(f"line {number}: not a Prometheus sample")
        count += 1
        if count > MAX_SAMPLES:
            raise MetricsError(f"more than {MAX_SAMPLES:,} samples")
        name, labels, value = match.group(1), match.group(2), match.group(3)
        sample = Sample(name, _labels(labels, number) if labels else {}, _value(value, number))
        samples.setdefault(name, []).append(sample)
    return samples


# --- the quantities kvtui reads, by name ---------------------------------------------------------

NAMES: dict[str, tuple[str, ...]] = {
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "cache_config": ("vllm:cache_config_info",),
    "capacity_tokens": ("sglang:max_total_num_tokens",),
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "waiting_by_reason": ("vllm:num_requests_waiting_by_reason",),
    "preemptions": ("vllm:num_preemptions_total",),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
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


def _first(samples: dict[str, list[Sample]], quantity: str, suffix: str = "") -> str | None:
    return next((n for n in NAMES[quantity] if n + suffix in samples), None)


def _total(found: Iterable[Sample]) -> float | None:
    values = [s.value for s in found if math.isfinite(s.value) and s.value >= 0]
    return sum(values) if values else None


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)


def _int_label(labels: dict[str, str], key: str) -> int | None:
    text = labels.get(key, "")
    return int(text) if text.isdigit() and len(text) <= 18 else None


def _float_label(labels: dict[str, str], key: str) -> float | None:
    try:
        value = float(labels.get(key, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


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
        return samples[name + suffix]

    usage = [s.value for s in read("kv_usage") if math.isfinite(s.value) and s.value >= 0]
    if usage:
        values["kv_usage"] = min(1.0, sum(usage) / len(usage))
    info = read("cache_config")
    if info:
        labels = info[0].labels
        blocks = [_int_label(s.labels, "num_gpu_blocks") for s in info]
        if all(b is not None for b in blocks):
            values["kv_blocks"] = sum(b for b in blocks if b is not None)
        values["kv_block_tokens"] = _int_label(labels, "block_size")
        sizes = [_int_label(s.labels, "kv_cache_size_tokens") for s in info]
        if all(t is not None for t in sizes):
            values["kv_capacity_tokens"] = sum(t for t in sizes if t is not None)
        elif values.get("kv_blocks") is not None and values["kv_block_tokens"] is not None:
            values["kv_capacity_tokens"] = values["kv_blocks"] * values["kv_block_tokens"]  # type: ignore[operator]
        values["kv_cache_memory_bytes"] = _int_label(labels, "kv_cache_memory_bytes")
        values["kv_cache_dtype"] = labels.get("cache_dtype", "")[:40]
        values["kv_blocks_override"] = _int_label(labels, "num_gpu_blocks_override")
        values["max_concurrency"] = _float_label(labels, "kv_cache_max_concurrency")
    if "kv_capacity_tokens" not in values:
        values["kv_capacity_tokens"] = _count(_total(read("capacity_tokens")))
    values["requests_running"] = _count(_total(read("running")))
    values["requests_waiting"] = _count(_total(read("waiting")))
    reasons: dict[str, int] = {}
    for s in read("waiting_by_reason"):
        reason = s.labels.get("reason", "")[:40]
        if reason and math.isfinite(s.value) and s.value >= 0:
            reasons[reason] = reasons.get(reason, 0) + int(s.value)
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
        values[f"{quantity}_seconds_sum"] = _total(samples[name + "_sum"])
        values[f"{quantity}_count"] = _count(_total(samples[name + "_count"]))
    if not found:
        return ServerMetrics(
            seconds,
            error="the server's /metrics holds none of the vLLM or SGLang metrics kvtui reads",
        )
    return ServerMetrics(seconds, found=tuple(found), **values)  # type: ignore[arg-type]
