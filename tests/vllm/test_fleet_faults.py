"""A fleet (`vllm:URL1,URL2`) against stand-in servers (fake.py): every replica polled and its
polls tagged, one replica going away leaving the others watched and named on screen 3, `bench
--json`'s `servers`, `kvtui load` on several servers. No vLLM needed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from kvtui.app import make_app
from kvtui.cli import main
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunControl, RunFinished, RunSettings, ServerMetrics
from kvtui.testing import NO_GPU_PROBE, screen_text, wait_for

from .fake import METRICS, FakeVLLM

FLEET_METRICS = METRICS.replace("/tmp/kvtui-vllm/tiny-austen-hf", "fake-model")
"""The captured vLLM 0.32 text, saying it serves what the stand-in's /v1/models says."""
IDLE_METRICS = re.sub(
    r"^(vllm:(kv_cache_usage_perc|num_requests_running|num_requests_waiting\w*)\{.*\}) .*$",
    r"\1 0.0",
    FLEET_METRICS,
    flags=re.MULTILINE,
)
"""The same server idle: none of its KV cache in use, no request running or waiting."""


@pytest.fixture
def two() -> Iterator[tuple[FakeVLLM, FakeVLLM]]:
    a = FakeVLLM(metrics=FLEET_METRICS, token_delay_s=0.05).start()
    b = FakeVLLM(metrics=IDLE_METRICS).start()
    yield a, b
    a.close()
    b.close()


def fleet(a: FakeVLLM, b: FakeVLLM, tokens: int = 40) -> RunSettings:
    return RunSettings(
        engine=f"vllm:{a.url},{b.url}", tokens=tokens, greedy=True, loops=("cached",)
    )


def test_the_idle_text_is_the_busy_one_at_rest():
    from kvtui.engines.vllm.metrics import server_metrics

    idle, busy = server_metrics(IDLE_METRICS, 0.0), server_metrics(FLEET_METRICS, 0.0)
    assert (idle.kv_usage, idle.requests_running, idle.requests_waiting) == (0.0, 0, 0)
    assert (busy.requests_waiting, busy.model, idle.kv_blocks) == (9, "fake-model", 40)


def test_every_replica_is_polled_the_decode_on_the_first_and_one_gone_leaves_the_other(two):
    a, b = two
    settings = fleet(a, b)
    engine = open_engine(settings)
    control = RunControl()
    polls: list[ServerMetrics] = []
    try:
        for event in run_events(engine, settings, control, watch=True):
            if isinstance(event, ServerMetrics):
                polls.append(event)
                if event.replica == 1 and not event.error and not b.killed.is_set():
                    b.kill()  # replica 2 goes away once it has answered
                gone = [p for p in polls if p.replica == 1 and p.error]
                if gone and any(p.replica == 0 and p.seconds > gone[0].seconds for p in polls):
                    control.stop()  # replica 1 answered after replica 2 went
    finally:
        engine.close()
    assert [r for r in a.requests if r.startswith("POST /v1/completions")] != []
    assert not any(r.startswith("POST /v1/completions") for r in b.requests)  # watched only
    first_gone = next(p for p in polls if p.replica == 1 and p.error)
    assert "connection refused" in first_gone.error or "no answer" in first_gone.error
    later = [p for p in polls if p.replica == 0 and p.seconds > first_gone.seconds]
    assert later and all(not p.error and p.kv_usage is not None for p in later)
    assert {p.model for p in polls if not p.error} == {"fake-model"}


async def test_screen_3_draws_a_row_per_replica_and_names_the_one_gone(two):
    a, b = two
    app = make_app(fleet(a, b, tokens=400), 3, probe=NO_GPU_PROBE)
    async with app.run_test(size=(100, 30)) as pilot:
        port_a, port_b = a.url.rsplit(":", 1)[1], b.url.rsplit(":", 1)[1]

        def drawn() -> bool:
            text = screen_text(app)
            return f"2 127.0.0.1:{port_b}" in text and "Sum of 2/2 answering" in text

        await wait_for(pilot, drawn, timeout=30)
        text = screen_text(app)
        assert "THE FLEET: 2 replicas" in text and f"1 127.0.0.1:{port_a} decode" in text
        assert "Skewed: replica 1 queues 9 (KV 90%) while replica 2 idles (KV 0%)" in text
        b.kill()
        gone = f"replica 2 (127.0.0.1:{port_b}) stopped answering; the other 1 still watched"
        await wait_for(pilot, lambda: gone in screen_text(app), timeout=30)
        assert "Sum of 1/2 answering" in screen_text(app)


def test_bench_json_gives_servers_each_shaped_like_server(two, capsys):
    a, b = two
    argv = ["bench", "--engine", f"vllm:{a.url},{b.url}", "--tokens", "8", "--greedy", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    servers = data["servers"]
    assert [s["replica"] for s in servers] == [0, 1]
    assert [s["url"] for s in servers] == [a.url, b.url]
    assert servers[1]["polls"] >= 1 and servers[1]["kv_usage"] == 0.0
    assert servers[0]["kv_usage"] == pytest.approx(0.897, abs=1e-3)
    first = {k: v for k, v in servers[0].items() if k not in ("replica", "url")}
    assert set(first) == set(data["server"]) and first["capacity"] == data["server"]["capacity"]


def test_bench_json_of_one_server_has_servers_of_one(two, capsys):
    a, _ = two
    argv = ["bench", "--engine", f"vllm:{a.url}", "--tokens", "4", "--greedy", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["servers"]) == 1 and data["servers"][0]["url"] == a.url


def test_kvtui_load_puts_the_same_load_on_every_server(two, capsys):
    a, b = two
    argv = ["load", a.url, b.url, "--concurrency", "2", "--prompt-tokens", "4"]
    assert main([*argv, "--max-tokens", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["url"] for s in data["servers"]] == [a.url, b.url]
    assert [s["done"] for s in data["servers"]] == [2, 2]
    assert main([*argv, "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert f"2 requests to {a.url}" in out and f"2 requests to {b.url}" in out


def test_a_load_on_a_fleet_with_one_server_gone_says_which(two, capsys):
    a, b = two
    b.kill()
    code = main(["load", a.url, b.url, "--concurrency", "1", "--prompt-tokens", "4",
                 "--max-tokens", "2"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{b.url}: no answer from {b.url}" in err


def test_a_run_that_ends_is_finished_whatever_the_watched_replicas_do(two):
    a, b = two
    b.kill()  # gone before the run: the run still starts on replica 1
    settings = fleet(a, b, tokens=5)
    engine = open_engine(settings)
    try:
        events = list(run_events(engine, settings, RunControl()))
    finally:
        engine.close()
    finished = [e for e in events if isinstance(e, RunFinished)]
    assert finished and finished[-1].reason == "done"
    assert any(isinstance(e, ServerMetrics) and e.replica == 1 and e.error for e in events)


def test_bench_s_table_has_a_line_per_other_replica(two, capsys):
    a, b = two
    argv = ["bench", "--engine", f"vllm:{a.url},{b.url}", "--tokens", "4", "--greedy"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "a fleet of 2 replicas; the decode ran on replica 1, every one watched:" in out
    assert f"replica 2 ({b.url}): KV cache (no prediction: no config.json for fake-model" in out
    assert "usage peak 0%, preemptions while watched: 0" in out
