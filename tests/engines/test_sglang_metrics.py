"""SGLang's /metrics read as vLLM's are (kvtui.engines.vllm.metrics), on texts of SGLang 0.5.23's
own collectors (tests/engines/data/sglang-0.5.23-*.txt, how they were made in their first lines:
a real SGLang cannot run here, its wheel needs CUDA). No server, no torch."""

from __future__ import annotations

from pathlib import Path

from kvtui.engines.vllm.metrics import parse_prometheus, server_metrics
from kvtui.run.serving import ServerWatch

DATA = Path(__file__).parent / "data"
BUSY = (DATA / "sglang-0.5.23-busy.txt").read_text()
"""One scheduler of Llama 3.1 8B in bf16: a pool of 441,792 tokens in pages of 1, 137,216 held by
24 running requests, 96,256 prefix-cached, 208,320 free; 7 queued; 3 retracted so far; 512,000
prompt tokens of which 224,000 were found cached."""
TP2 = (DATA / "sglang-0.5.23-tp2.txt").read_text()
"""The same moment, tensor parallel 2, both ranks' schedulers reporting (the same pool twice)."""


def test_the_texts_are_the_release_s_names_and_help_lines():
    assert "SGLang 0.5.23" in BUSY.splitlines()[0]
    for line in (
        "# HELP sglang:kv_used_tokens Number of actively used token slots in the KV cache pool.",
        "# HELP sglang:kv_available_tokens Number of free token slots in the KV cache pool.",
        "# HELP sglang:kv_evictable_tokens Number of evictable (radix-cached) token slots in the "
        "KV cache pool.",
        "# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.",
    ):
        assert line in BUSY.splitlines()
    samples = parse_prometheus(TP2)
    assert {s.labels["tp_rank"] for s in samples["sglang:kv_used_tokens"]} == {"0", "1"}


def test_sglang_0_5_23_is_read_quantity_by_quantity():
    m = server_metrics(BUSY, 1.0)
    assert m.error == "" and m.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert (m.kv_capacity_tokens, m.kv_blocks, m.kv_block_tokens) == (441_792, 441_792, 1)
    assert (m.kv_used_tokens, m.kv_evictable_tokens, m.kv_free_tokens) == (137_216, 96_256, 208_320)
    assert m.kv_usage == 137_216 / 441_792  # token_usage: held slots only, cached ones free
    assert (m.requests_running, m.requests_waiting, m.preemptions) == (24, 7, 3)
    assert (m.prefix_queries_tokens, m.prefix_hits_tokens) == (512_000, 224_000)
    assert m.prefix_hit_rate == 0.4375
    assert (m.ttft_count, m.itl_count) == (400, 95_600)
    assert m.ttft_seconds_sum is not None and abs(m.ttft_seconds_sum / 400 - 0.1475) < 1e-9
    assert "used_tokens=sglang:kv_used_tokens" in m.found
    assert "preemptions=sglang:num_retracted_requests_total" in m.found


def test_a_tensor_parallel_server_s_one_pool_is_not_counted_twice():
    one, two = server_metrics(BUSY, 1.0), server_metrics(TP2, 1.0)
    for name in (
        "kv_capacity_tokens",
        "kv_blocks",
        "kv_used_tokens",
        "kv_evictable_tokens",
        "kv_free_tokens",
        "requests_running",
        "requests_waiting",
        "preemptions",
        "kv_usage",
    ):
        assert getattr(two, name) == getattr(one, name), name


def test_a_priority_breakdown_is_not_added_to_its_total():
    base = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    text = (
        f'sglang:num_running_reqs{{{base},priority=""}} 3.0\n'
        f'sglang:num_running_reqs{{{base},priority="10"}} 2.0\n'
        f'sglang:num_running_reqs{{{base},priority="20"}} 1.0\n'
    )
    assert server_metrics(text, 0.0).requests_running == 3


def test_data_parallel_ranks_are_still_summed():
    text = (
        'sglang:max_total_num_tokens{dp_rank="0",tp_rank="0"} 1000\n'
        'sglang:max_total_num_tokens{dp_rank="1",tp_rank="1"} 1000\n'
        'sglang:num_running_reqs{dp_rank="0",tp_rank="0"} 2\n'
        'sglang:num_running_reqs{dp_rank="1",tp_rank="1"} 5\n'
    )
    m = server_metrics(text, 0.0)
    assert (m.kv_capacity_tokens, m.requests_running) == (2000, 7)


def test_an_sglang_server_s_polls_fold_like_vllm_s():
    watch = ServerWatch()
    before = server_metrics(BUSY, 1.0)
    retracted = 'sglang:num_retracted_requests_total{model_name="m"} 5.0\n'
    after = server_metrics(
        BUSY.replace("sglang:num_retracted_requests_total{", "x{") + retracted, 2.0
    )
    watch.add(before)
    watch.add(after)
    assert watch.preemptions_seen == 2
    assert watch.prefix_queries_seen == 0  # no request finished between the two


def test_bench_json_says_sglang_s_pool_in_tokens():
    from kvtui.reports.bench import served_summary
    from kvtui.run.summary import RunSummary

    run = RunSummary()
    run.apply(server_metrics(BUSY, 1.0))
    summary = served_summary(run)
    assert (summary["kv_used_tokens"], summary["kv_evictable_tokens"]) == (137_216, 96_256)
    assert summary["kv_free_tokens"] == 208_320 and summary["requests_waiting"] == 7
