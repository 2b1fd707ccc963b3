"""A fleet of two real vLLM servers of different sizes (`vllm_server`: fp32, 40 blocks of 32;
`vllm_server_b`: bf16, data parallel 2, blocks of 64): both watched, a row each, `bench --json`'s
`servers`, a replica that does not answer beside one that does. Each replica's row is the
per-server reading (kvtui.run.serving), whatever it gives: asserted equal to a run on that server
alone, so that a fix to that reading flows into the fleet's rows."""

from __future__ import annotations

import pytest

from kvtui.app import make_app
from kvtui.cli import main
from kvtui.engines.protocol import RunSettings
from kvtui.reports.bench import run_bench
from kvtui.testing import NO_GPU_PROBE, screen_text, wait_for
from tests.ports import free_port

from .server import BLOCK_TOKENS, SECOND_BLOCK_TOKENS, VLLMServer

pytestmark = pytest.mark.vllm

TOKENS = 16


def settings(*servers: VLLMServer | str, tokens: int = TOKENS) -> RunSettings:
    urls = ",".join(s if isinstance(s, str) else s.url for s in servers)
    return RunSettings(engine=f"vllm:{urls}", tokens=tokens, greedy=True, loops=("cached",))


def closed_port() -> str:
    """A loopback URL nothing listens on (a replica gone)."""
    return f"http://127.0.0.1:{free_port()}"


def test_bench_gives_a_server_per_replica_each_as_its_own_reading(vllm_server, vllm_server_b):
    fleet = run_bench(settings(vllm_server, vllm_server_b))
    a, b = fleet["servers"]
    assert (a["replica"], a["url"], b["replica"], b["url"]) == (
        0,
        vllm_server.url,
        1,
        vllm_server_b.url,
    )
    assert a["capacity"]["block_tokens"] == BLOCK_TOKENS and a["capacity"]["agree"] is True
    assert b["capacity"]["block_tokens"] == SECOND_BLOCK_TOKENS
    assert a["model"] == b["model"] and a["polls"] >= 1 and b["polls"] >= 1
    assert a["error"] == b["error"] == ""
    alone = run_bench(settings(vllm_server_b))["server"]
    assert b["capacity"] == alone["capacity"]  # the fleet's row is the server's own reading
    assert {k: v for k, v in a.items() if k not in ("replica", "url")}.keys() == fleet[
        "server"
    ].keys()
    assert fleet["token_ids"] == run_bench(settings(vllm_server))["token_ids"]  # decode on A


async def test_the_app_draws_both_replicas_rows_and_totals(vllm_server, vllm_server_b):
    app = make_app(settings(vllm_server, vllm_server_b, tokens=64), 3, probe=NO_GPU_PROBE)
    async with app.run_test(size=(100, 30)) as pilot:

        def both() -> bool:
            text = screen_text(app)
            return "Sum of 2/2 answering" in text and f"x {SECOND_BLOCK_TOKENS} tokens" in text

        await wait_for(pilot, both, timeout=60)
        text = screen_text(app)
        assert f"x {BLOCK_TOKENS} tokens · kvtui 40: agree" in text
        assert "THE FLEET: 2 replicas" in text


async def test_a_replica_that_does_not_answer_leaves_the_other_watched(vllm_server):
    gone = closed_port()
    app = make_app(settings(vllm_server, gone, tokens=64), 3, probe=NO_GPU_PROBE)
    async with app.run_test(size=(100, 30)) as pilot:
        said = f"replica 2 ({gone.removeprefix('http://')}) stopped answering; the other 1"
        await wait_for(pilot, lambda: said in screen_text(app), timeout=60)
        text = screen_text(app)
        assert "Sum of 1/2 answering" in text and "NOT ANSWERING" not in text  # no figures yet
        assert f"2 {gone.removeprefix('http://')}: no answer from {gone}" in text


def test_kvtui_load_puts_a_load_on_both(vllm_server, vllm_server_b, capsys):
    argv = ["load", vllm_server.url, vllm_server_b.url, "--concurrency", "2"]
    code = main([*argv, "--prompt-tokens", "32", "--max-tokens", "8", "--seconds", "60", "--json"])
    data = __import__("json").loads(capsys.readouterr().out)
    assert [s["url"] for s in data["servers"]] == [vllm_server.url, vllm_server_b.url]
    assert code == (1 if any(s["failed"] for s in data["servers"]) else 0)
    assert all(s["done"] + s["cut"] + s["failed"] == 2 for s in data["servers"])
    assert data["servers"][0]["done"] == 2  # server A is the tests' own
