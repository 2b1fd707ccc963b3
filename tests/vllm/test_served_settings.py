"""Right under every setting users run (issue 32), against the two real vLLM 0.32 servers
(tests/vllm/conftest.py): SECOND serves the fp32 export in bfloat16 on two data-parallel engines
with blocks of 64, at most 4 sequences at once, a model length of 1,024 and no prefix caching;
FIRST serves it as config.json says. The capacity agrees under each, read per engine and in the
served dtype; a fill sized from the server's own limits fills FIRST and preempts, and makes
SECOND preempt under its max-num-seqs (why a cache cannot fill: tests/run/test_served_settings.py
and tests/vllm/test_fill_faults.py); bench reports the served layout. Tensor and pipeline
parallel need several GPUs: tests/run/test_served_settings.py checks them on captured texts
changed."""

from __future__ import annotations

import re

import pytest

from kvtui.cli import main
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunSettings
from kvtui.reports.bench import run_bench
from kvtui.run.serving import CapacityCheck, ServerWatch
from kvtui.widgets.served import served_dtype_words

from .server import (
    SECOND_BLOCK_TOKENS,
    SECOND_KV_CACHE_BYTES,
    SECOND_MAX_MODEL_LEN,
    VLLMServer,
)

pytestmark = pytest.mark.vllm

BF16_BYTES_PER_TOKEN = 2 * 6 * 2 * 32 * 2
"""tiny-austen's keys and values a token in bfloat16: 2 x 6 layers x 2 KV heads x 32 x 2 B."""
ENGINES = 2


def served(server: VLLMServer, tokens: int = 8) -> RunSettings:
    return RunSettings(engine=f"vllm:{server.url}", tokens=tokens, greedy=True, loops=("cached",))


def check_of(server: VLLMServer) -> tuple[CapacityCheck, object]:
    engine = open_engine(served(server))
    try:
        started, m = engine.started(), engine.poll()
    finally:
        engine.close()
    watch = ServerWatch()
    watch.add(m)
    check = watch.capacity(started)
    assert isinstance(check, CapacityCheck), check
    return check, m


def test_second_agrees_per_engine_in_the_dtype_it_serves(vllm_server_b):
    """kvtui predicted 15 blocks an engine from config.json's fp32 and summed vLLM's total
    again; the blocks say bf16, each engine holds its own 30 and vLLM's 60 are their total."""
    check, m = check_of(vllm_server_b)
    each = SECOND_KV_CACHE_BYTES // (SECOND_BLOCK_TOKENS * BF16_BYTES_PER_TOKEN)
    assert (m.engines, check.blocks, check.blocks_per_engine) == (ENGINES, ENGINES * each, each)
    assert check.predicted_blocks == check.blocks and check.agree is True
    assert (check.kv_dtype, check.kv_bytes_per_token) == ("bf16", BF16_BYTES_PER_TOKEN)
    assert "served in bf16 or fp16 (2 B)" in served_dtype_words(check)
    assert m.prefix_caching is False and m.kv_capacity_tokens == ENGINES * each * 64


def test_first_agrees_in_config_jsons_dtype_with_prefix_caching_on(vllm_server):
    check, m = check_of(vllm_server)
    assert check.agree is True and check.kv_dtype == "fp32" and check.engines == 1
    assert served_dtype_words(check) == "" and m.prefix_caching is True


def test_a_fill_alone_on_second_preempts_under_its_max_num_seqs(vllm_server_b, capsys):
    """4 sequences at once an engine: requests of half max_model_len (512 tokens: 2,048 of an
    engine's 1,920 only when all four are at their end) rarely filled it; requests as long as
    max_model_len do, and vLLM preempts (the limit, inferred where the cache stays below full:
    tests/run/test_served_settings.py)."""
    args = ["load", vllm_server_b.url, "--seconds", "150", "--requests", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert " 0 failed" in out, out
    assert f"{SECOND_MAX_MODEL_LEN - 64} tokens each" in out, out
    preempted = re.search(r"(\d+) preemptions while watched", out)
    assert preempted is not None and int(preempted.group(1)) > 0, out
    assert "vLLM does not say which requests" in out, out
    assert "(full" in out and "not full" not in out, out


def test_a_fill_alone_on_first_fills_it_and_vllm_preempts(vllm_server, capsys):
    assert main(["load", vllm_server.url, "--seconds", "150"]) == 0
    out = capsys.readouterr().out
    assert " 0 failed" in out and "(full" in out and "not full" not in out, out
    assert "vLLM does not say which requests" in out, out


def test_bench_reports_the_layout_second_serves(vllm_server_b):
    """`kv_layout` said kvtui's own cache dtype ("auto") beside a server's: it is the server's
    now, with the dtype its blocks are kept in."""
    report = run_bench(served(vllm_server_b))
    layout, capacity = report["kv_layout"], report["server"]["capacity"]
    assert layout["kv_cache_dtype"] == "auto" and layout["kv_cache_dtype_served"] == "bf16"
    assert layout["enable_prefix_caching"] is False
    assert layout["kv_block_tokens"] == SECOND_BLOCK_TOKENS
    assert (capacity["engines"], capacity["agree"], capacity["config_dtype"]) == (2, True, "fp32")
    assert report["server"]["max_model_len"] == SECOND_MAX_MODEL_LEN
