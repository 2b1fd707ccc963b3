"""A server that lies, against the door it comes in by (kvtui.engines.vllm.client, metrics,
engine, load): escape codes and line breaks in what it names, JSON nested past what Python
parses, numbers past any count, answers sent a byte at a time or forever, chunks of 400,000
token ids. Each is a line on screen or in a table, a value shown as unknown, or one line and
exit 2 (kvtui load: its requests counted as failed, exit 1), within the request's deadline, and
the app stays up. Stand-in servers (fake.py) on 127.0.0.1; the deadlines shortened to seconds."""

from __future__ import annotations

from typing import Any

import pytest

from kvtui.app import make_app
from kvtui.engines.protocol import RunSettings
from kvtui.engines.vllm.metrics import server_metrics
from kvtui.testing import NO_GPU_PROBE, screen_text, wait_for

from .fake import METRICS, FakeVLLM


def settings(url: str, tokens: int = 8) -> RunSettings:
    return RunSettings(engine=f"vllm:{url}", tokens=tokens, greedy=True, loops=("cached",))


@pytest.fixture
def serve():
    """Start a stand-in server with these lies; every one started is closed after the test."""
    started: list[FakeVLLM] = []

    def start(**lies: Any) -> FakeVLLM:
        started.append(FakeVLLM(**lies).start())
        return started[-1]

    yield start
    for server in started:
        server.close()


# --- numbers past any count ----------------------------------------------------------------------


def test_metrics_past_any_count_are_unknown():
    """+Inf and 1e999 where a count goes (OverflowError), sums that overflow, a block size of 18
    digits (a ValueError on screen 3): each is None, shown as unknown."""
    text = "\n".join(
        [
            'vllm:num_requests_running{a="1"} +Inf',
            "vllm:num_requests_waiting 1e999",
            'vllm:num_preemptions_total{e="0"} 1.7e308',
            'vllm:num_preemptions_total{e="1"} 1.7e308',
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 1e300',
            "vllm:time_to_first_token_seconds_sum 1.7e308",
            "vllm:time_to_first_token_seconds_sum 1.7e308",
            "vllm:time_to_first_token_seconds_count 1e20",
            'vllm:cache_config_info{block_size="999999999999999999",num_gpu_blocks="9999999999'
            '99999999",kv_cache_memory_bytes="99999999999999999999"} 1',
        ]
    )
    m = server_metrics(text, 0.0)
    assert (m.requests_running, m.requests_waiting, m.preemptions) == (None, None, None)
    assert (m.kv_block_tokens, m.kv_blocks, m.kv_cache_memory_bytes) == (None, None, None)
    assert (m.ttft_seconds_sum, m.ttft_count, m.waiting_reasons) == (None, None, ())


def test_a_metrics_line_of_7_mib_costs_little_memory(tmp_path):
    """One 7 MiB line (a label value): the label regex held a backtracking point per character,
    1.2 GB of memory; the line is refused past MAX_LINE_CHARS, read in one pass (a subprocess:
    its peak RSS is its own)."""
    import subprocess
    import sys

    script = (
        "import resource\n"
        "from kvtui.engines.vllm.metrics import MetricsError, parse_prometheus\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "text = 'vllm:num_requests_running{model_name=\"' + 'a' * (7 * 2**20) + '\"} 1\\n'\n"
        "try:\n"
        "    parse_prometheus(text)\n"
        "except MetricsError as exc:\n"
        "    print(exc)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    said, grown = done.stdout.splitlines()
    assert "longer than 65,536 characters" in said, done.stderr
    assert int(grown) < 64, f"{grown} MiB more"


async def test_the_app_stays_up_on_a_block_size_of_18_digits(serve):
    metrics = METRICS.replace('block_size="32"', 'block_size="999999999999999999"')
    server = serve(metrics=metrics)
    app = make_app(settings(server.url, 16), 3, probe=NO_GPU_PROBE)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.live_run.state == "done", timeout=30)
        await pilot.pause()
        assert "reports no KV-cache blocks" in screen_text(app) and app.is_running
