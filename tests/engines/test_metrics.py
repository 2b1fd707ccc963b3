"""Reading a serving engine's /metrics (kvtui.engines.vllm.metrics) and folding its polls
(kvtui.run.serving), on texts captured from a real vLLM 0.32 server (tests/engines/data: the
shipped model exported and served on this project's CPU machine, during a `kvtui load`) and on
texts with older vLLM and SGLang names. No server, no torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtui.engines.protocol import RunStarted, ServerMetrics, event_from_json, to_json
from kvtui.engines.vllm.metrics import (
    MAX_METRICS_BYTES,
    MetricsError,
    parse_prometheus,
    server_metrics,
)
from kvtui.engines.vllm.url import ServerURL
from kvtui.errors import EngineError
from kvtui.run.serving import CapacityCheck, ServerWatch

DATA = Path(__file__).parent / "data"
BUSY = (DATA / "vllm-0.32-busy.txt").read_text()
"""vLLM 0.32 with `--kv-cache-memory-bytes 4000000 --block-size 32`, mid-load: 40 blocks, 9
requests waiting for room, 10 preemptions so far."""
OVERRIDE = (DATA / "vllm-0.32-blocks-override.txt").read_text()
"""vLLM 0.32 with VLLM_CPU_KVCACHE_SPACE=1 and `--num-gpu-blocks-override 10`, mid-load."""

OLDER = """\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:num_requests_running{model_name="m"} 2.0
vllm:num_requests_waiting{model_name="m"} 1.0
vllm:num_preemptions_total{model_name="m"} 4.0
vllm:gpu_prefix_cache_queries_total{model_name="m"} 300.0
vllm:gpu_prefix_cache_hits_total{model_name="m"} 96.0
vllm:time_per_output_token_seconds_count{model_name="m"} 10.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.5
vllm:time_to_first_token_seconds_count{model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.1
"""

SGLANG = """\
sglang:token_usage{model_name="m"} 0.5
sglang:num_running_reqs{model_name="m"} 3
sglang:num_queue_reqs{model_name="m"} 0
sglang:max_total_num_tokens{model_name="m"} 20000
sglang:cache_hit_rate{model_name="m"} 0.125
"""


def test_the_real_0_32_text_parses_whole():
    samples = parse_prometheus(BUSY)
    assert sum(len(v) for v in samples.values()) == 450
    info = samples["vllm:cache_config_info"][0]
    assert info.labels["num_gpu_blocks"] == "40" and info.labels["block_size"] == "32"
    assert len(samples["vllm:time_to_first_token_seconds_bucket"]) > 10


def test_every_quantity_of_0_32_is_found_under_its_0_32_name():
    m = server_metrics(BUSY, 1.5)
    assert m.error == ""
    assert dict(f.split("=", 1) for f in m.found) == {
        "kv_usage": "vllm:kv_cache_usage_perc",
        "cache_config": "vllm:cache_config_info",
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "waiting_by_reason": "vllm:num_requests_waiting_by_reason",
        "preemptions": "vllm:num_preemptions_total",
        "prefix_queries": "vllm:prefix_cache_queries_total",
        "prefix_hits": "vllm:prefix_cache_hits_total",
        "ttft": "vllm:time_to_first_token_seconds",
        "itl": "vllm:inter_token_latency_seconds",
    }
    assert (m.kv_blocks, m.kv_block_tokens, m.kv_capacity_tokens) == (40, 32, 1280)
    assert (m.kv_cache_memory_bytes, m.kv_cache_dtype, m.kv_blocks_override) == (
        4000000,
        "auto",
        None,
    )
    assert m.kv_usage == pytest.approx(35 / 39)
    assert (m.requests_waiting, m.waiting_reasons) == (9, ("capacity=9", "deferred=0"))
    assert m.preemptions == 10
    assert m.max_concurrency == 2.5
    assert m.ttft_count and m.ttft_seconds_sum and m.itl_count and m.itl_seconds_sum


def test_a_block_override_is_read():
    m = server_metrics(OVERRIDE, 0.0)
    assert (m.kv_blocks, m.kv_block_tokens, m.kv_blocks_override) == (10, 128, 10)
    assert m.kv_cache_memory_bytes == 2**30
    assert (m.requests_running, m.requests_waiting, m.kv_usage) == (3, 3, 1.0)


def test_older_vllm_names_are_found_and_named():
    m = server_metrics(OLDER, 0.0)
    found = dict(f.split("=", 1) for f in m.found)
    assert found["kv_usage"] == "vllm:gpu_cache_usage_perc"
    assert found["prefix_hits"] == "vllm:gpu_prefix_cache_hits_total"
    assert found["itl"] == "vllm:time_per_output_token_seconds"
    assert (m.kv_usage, m.requests_running, m.preemptions) == (0.25, 2, 4)
    assert (m.prefix_queries_tokens, m.prefix_hits_tokens) == (300, 96)
    assert (m.itl_count, m.itl_seconds_sum) == (10, 0.5)
    assert m.kv_blocks is None  # no cache_config_info in this text: no capacity


def test_sglang_names_are_mapped_the_same_way():
    m = server_metrics(SGLANG, 0.0)
    assert (m.kv_usage, m.requests_running, m.requests_waiting) == (0.5, 3, 0)
    assert (m.kv_capacity_tokens, m.prefix_hit_rate) == (20000, 0.125)


def test_a_text_without_any_of_the_names_says_so_in_one_line():
    m = server_metrics("process_cpu_seconds_total 12.5\n# a comment\n", 0.0)
    assert m.found == () and "none of the vLLM or SGLang metrics" in m.error


def test_samples_of_engines_are_summed_and_usage_averaged():
    text = (
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:kv_cache_usage_perc{engine="1"} 1.0\n'
        'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 3\n'
    )
    m = server_metrics(text, 0.0)
    assert (m.kv_usage, m.requests_running) == (0.75, 5)


def test_label_escapes_nan_and_timestamps():
    samples = parse_prometheus(
        'a{x="q\\"uote\\\\ and \\n", y="2",} NaN 1712345678\nb +Inf\nc -1.5e3\n'
    )
    # An escaped newline stays as it was written: a label value is one line wherever it shows.
    assert samples["a"][0].labels == {"x": 'q"uote\\ and \\n', "y": "2"}
    assert samples["b"][0].value == float("inf") and samples["c"][0].value == -1500.0
    m = server_metrics("vllm:kv_cache_usage_perc NaN\nvllm:num_requests_running -3\n", 0.0)
    assert m.kv_usage is None and m.requests_running is None  # not figures: left out


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>Not Found</body></html>",
        'vllm:kv_cache_usage_perc{engine="0" 0.5',
        "vllm:kv_cache_usage_perc half",
        "x" * (MAX_METRICS_BYTES + 1),
    ],
)
def test_what_is_not_the_text_format_is_refused(text):
    with pytest.raises(MetricsError):
        parse_prometheus(text)


def test_a_poll_round_trips_through_json():
    for m in (server_metrics(BUSY, 2.0), ServerMetrics(3.0, error="no answer")):
        assert event_from_json(to_json(m)) == m
    with pytest.raises(ValueError, match="preemptions is negative"):
        event_from_json({**to_json(server_metrics(BUSY, 2.0)), "preemptions": -1})


# --- the fold --------------------------------------------------------------------------------


def started(per_token: int = 3072, dtype: str = "fp32", source: str = "config.json") -> RunStarted:
    return RunStarted(
        engine="vllm:http://127.0.0.1:8000",
        model="m",
        device="vLLM",
        dtype=dtype,
        layers=6,
        kv_heads=2,
        head_dim=32,
        kv_bytes_per_token=per_token,
        weights_bytes=0,
        prompt_tokens=4,
        tokens=8,
        timing="measured",
        kv_pool_source=source,
        served_by="vLLM 0.32.0 at http://127.0.0.1:8000",
    )


def test_the_capacity_read_agrees_with_kvtuis_prediction():
    watch = ServerWatch()
    watch.add(server_metrics(BUSY, 0.0))
    check = watch.capacity(started())
    assert isinstance(check, CapacityCheck)
    assert check.predicted_blocks == 4000000 // (32 * 3072) == 40 == check.blocks
    assert check.agree and check.predicted_tokens == 1280 == check.tokens


def test_a_wrong_bytes_per_token_disagrees_and_an_override_is_said():
    watch = ServerWatch()
    watch.add(server_metrics(BUSY, 0.0))
    # three times the bytes a token: no element vLLM serves gives 40 blocks (twice them is
    # bf16 served, read back from the blocks: tests/run/test_served_settings.py)
    check = watch.capacity(started(per_token=9216, dtype="fp32"))
    assert isinstance(check, CapacityCheck) and check.agree is False and check.ratio == 40 / 13
    watch.add(server_metrics(OVERRIDE, 1.0))
    check = watch.capacity(started())
    assert isinstance(check, CapacityCheck)
    assert check.predicted_blocks == 2**30 // (128 * 3072) == 2730  # vLLM's own log: 2730
    assert check.override == 10 and check.agree is None


def test_an_fp8_cache_is_predicted_in_fp8():
    poll = server_metrics(BUSY.replace('cache_dtype="auto"', 'cache_dtype="fp8"'), 0.0)
    watch = ServerWatch()
    watch.add(poll)
    check = watch.capacity(started(per_token=3072, dtype="fp32"))
    assert isinstance(check, CapacityCheck)
    assert (check.kv_dtype, check.kv_bytes_per_token) == ("fp8", 768)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_vllms_named_fp8_caches_are_predicted_in_fp8(name):
    """vLLM's --kv-cache-dtype also takes fp8_e4m3 and fp8_e5m2 (a byte each, as fp8): its
    cache_config_info says so, and kvtui predicts their blocks, where it called them a KV dtype
    it does not know."""
    poll = server_metrics(BUSY.replace('cache_dtype="auto"', f'cache_dtype="{name}"'), 0.0)
    watch = ServerWatch()
    watch.add(poll)
    check = watch.capacity(started(per_token=3072, dtype="fp32"))
    assert isinstance(check, CapacityCheck)
    assert (check.kv_dtype, check.kv_bytes_per_token) == ("fp8", 768)


def test_no_prediction_without_the_model_config():
    watch = ServerWatch()
    watch.add(server_metrics(BUSY, 0.0))
    why = watch.capacity(started(per_token=0, source="no config.json for m on this machine"))
    assert isinstance(why, str) and "no config.json" in why


def test_changes_while_watched_and_the_servers_means():
    first = ServerMetrics(
        0.0,
        found=("x=y",),
        kv_usage=0.0,
        preemptions=5,
        prefix_queries_tokens=100,
        prefix_hits_tokens=0,
        ttft_seconds_sum=1.0,
        ttft_count=10,
        itl_seconds_sum=2.0,
        itl_count=100,
    )
    later = ServerMetrics(
        1.0,
        found=("x=y",),
        kv_usage=0.9,
        preemptions=12,
        prefix_queries_tokens=300,
        prefix_hits_tokens=96,
        ttft_seconds_sum=1.5,
        ttft_count=12,
        itl_seconds_sum=3.0,
        itl_count=200,
    )
    watch = ServerWatch()
    for poll in (first, later, ServerMetrics(2.0, error="no answer: connection refused")):
        watch.add(poll)
    assert (watch.preemptions_seen, watch.prefix_queries_seen, watch.prefix_hits_seen) == (
        7,
        200,
        96,
    )
    assert watch.ttft_mean_s == pytest.approx(0.25) and watch.itl_mean_s == pytest.approx(0.01)
    assert watch.peak_usage == 0.9 and watch.latest is later
    assert not watch.answering and watch.error_since == 2.0 and watch.failed == 1
    watch.add(later)
    assert watch.answering and watch.error == ""


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://host:21", "must start with http:// or https://"),
        ("http://user:secret@host:8000", "holds credentials"),
        ("http://:8000", "has no host"),
        ("http://host:99999", "is not a URL"),
        ("http://host:8000/?x=1", "query or fragment"),
        ("http://ho st:8000", "spaces or control characters"),
        ("127.0.0.1:8000", "must start with http"),
    ],
)
def test_a_bad_server_url_is_one_line(url, says):
    with pytest.raises(EngineError, match=says) as caught:
        ServerURL.parse(url)
    assert "\n" not in str(caught.value)


def test_a_good_server_url():
    assert str(ServerURL.parse("http://127.0.0.1:8000/v1/")) == "http://127.0.0.1:8000"
    assert str(ServerURL.parse("https://example.org/vllm")) == "https://example.org:443/vllm"
    assert ServerURL.parse("http://[::1]:8000").netloc == "[::1]:8000"
