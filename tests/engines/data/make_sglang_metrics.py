"""How sglang-0.5.23-*.txt were written: SGLang 0.5.23's own metric collectors
(sglang/srt/observability/metrics_collector.py, from the wheel `pip download sglang==0.5.23
--no-deps`, unpacked) loaded with stand-ins for the modules that need CUDA, each process's figures
set as one busy moment, and the text written by prometheus_client in multiprocess mode, as
SGLang's /metrics is. Not a test (run by hand, with a Python that has prometheus_client):

    D=$(mktemp -d); run() { PROMETHEUS_MULTIPROC_DIR=$D python make_sglang_metrics.py WHEEL_DIR \\
        meta-llama/Llama-3.1-8B-Instruct "$@"; }
    run scheduler:0 && run tokenizer && run collect > busy.txt    # add scheduler:1 for tp2
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, multiprocess

WHEEL, MODEL, ROLE = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
"""The unpacked wheel (holding sglang/), the served name, and what this process is:
scheduler:TP_RANK, tokenizer, or collect (print every process's figures)."""


class Settings:
    """A stand-in for SGLang's runtime settings: the attributes given, None for the rest."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        return None


class DisaggregationMode(enum.Enum):
    NULL = "null"

    @staticmethod
    def to_engine_type(mode: Any) -> str:
        return "unified"


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2


def stub(name: str, folder: bool = False, **values: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(values)
    if folder:
        module.__path__ = [str(WHEEL / name.replace(".", "/"))]
    sys.modules[name] = module
    return module


def load(name: str) -> types.ModuleType:
    """A module of the wheel, from its file."""
    spec = importlib.util.spec_from_file_location(name, WHEEL / (name.replace(".", "/") + ".py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


for package in ("sglang", "sglang.srt", "sglang.srt.observability", "sglang.srt.disaggregation"):
    stub(package, folder=True)
stub("sglang.srt.model_executor", folder=True)
stub("sglang.srt.disaggregation.utils", DisaggregationMode=DisaggregationMode)
stub("sglang.srt.model_executor.forward_batch_info", ForwardMode=ForwardMode)
stub(
    "sglang.srt.runtime_context",
    exports_expert_balancedness_to_prometheus=lambda: False,
    get_context=Settings,
    get_disagg=lambda: Settings(disaggregation_mode=DisaggregationMode.NULL),
    get_observability=lambda: Settings(enable_metrics=True),
    get_parallel=lambda: Settings(tp_rank=0, pp_rank=0, moe_ep_rank=0),
    get_schedule=lambda: Settings(prefill_delayer_max_delay_passes=30),
    get_serving=lambda: Settings(served_model_name=MODEL),
)
stub("sglang.srt.server_args", ServerArgs=object)
stub("sglang.srt.utils", folder=True, get_bool_env_var=lambda name, default="false": False)
stub(
    "sglang.srt.utils.nvtx_utils",
    NVTX_SCHEDULER_ENABLED=False,
    profile_range=lambda *args, **kwargs: None,
    scheduler_nvtx_method=lambda *args, **kwargs: lambda method: method,
)
load("sglang.srt.utils.gauge_histogram")
load("sglang.srt.observability.utils")
load("sglang.srt.observability.scheduler_stage_metrics")
collectors = load("sglang.srt.observability.metrics_collector")

if ROLE.startswith("scheduler:"):
    labels = {
        "model_name": MODEL,
        "engine_type": "unified",
        "tp_rank": int(ROLE.removeprefix("scheduler:")),
        "pp_rank": 0,
        "moe_ep_rank": 0,
    }
    scheduler = collectors.SchedulerMetricsCollector(labels=labels, server_args=None)

    def gauge(metric: Any, value: float) -> None:
        metric.labels(**labels).set(value)

    # Llama 3.1 8B in bf16 on one 80 GB GPU: 128 KiB of KV a token, a pool of 441,792 tokens in
    # pages of 1 (SGLang's default), at one busy moment.
    total, used, evictable = 441_792, 137_216, 96_256
    scheduler.emit_constants(
        max_total_num_tokens=total,
        max_total_num_tokens_swa=None,
        weight_memory_usage_gb=14.99,
        kv_cache_memory_usage_gb=total * 131072 / 2**30,
        graph_memory_usage_gb={"decode": 0.42},
        max_running_requests_under_SLO=None,
        page_size=1,
        num_pages=total,
        context_len=131072,
        startup_available_gpu_memory_gb=78.65,
    )
    gauge(scheduler.num_running_reqs, 24)
    gauge(scheduler.num_queue_reqs, 7)
    gauge(scheduler.token_usage, used / total)
    gauge(scheduler.full_token_usage, used / total)
    gauge(scheduler.num_used_tokens, used)
    gauge(scheduler.kv_used_tokens, used)
    gauge(scheduler.kv_available_tokens, total - used - evictable)
    gauge(scheduler.kv_evictable_tokens, evictable)
    gauge(scheduler.cache_hit_rate, 0.4375)
    gauge(scheduler.gen_throughput, 1873.2)
    gauge(scheduler.num_retracted_reqs, 0)
    scheduler.num_retracted_reqs_total.labels(**labels).inc(3)
elif ROLE == "tokenizer":
    labels = {"model_name": MODEL, "engine_type": "unified"}
    tokenizer = collectors.TokenizerMetricsCollector(labels=labels)
    streamed = {**labels, "is_streaming": "true"}
    tokenizer.prompt_tokens_total.labels(**streamed).inc(512_000)
    tokenizer.generation_tokens_total.labels(**streamed).inc(96_000)
    tokenizer.cached_tokens_total.labels(**labels, cache_source="device").inc(224_000)
    tokenizer.num_requests_total.labels(**streamed).inc(400)
    for seconds in [0.08] * 300 + [0.35] * 100:
        tokenizer.histogram_time_to_first_token.labels(**streamed).observe(seconds)
    for _ in range(95_600):
        tokenizer.histogram_inter_token_latency.labels(**labels).observe(0.02)
else:  # as SGLang's /metrics does: every process's figures, from PROMETHEUS_MULTIPROC_DIR
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    sys.stdout.write(generate_latest(registry).decode())
