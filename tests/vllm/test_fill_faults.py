"""A fill's requests that vLLM queues, and `kvtui load URL` with no other flag, against a
stand-in server (fake.py): a queued request gets no answer, or no first token, for longer than
a read's wait, yet is a request waiting its turn, not a failure (issue 32: 56 of 120 requests of
a fill at --max-num-seqs 4 failed "no answer in time"). No vLLM needed."""

from __future__ import annotations

import json
import threading

import pytest

from kvtui.cli import main
from kvtui.engines.vllm import client
from kvtui.engines.vllm.load import LoadPlan, run_load
from kvtui.engines.vllm.url import ServerURL

from .fake import FakeVLLM

QUEUED_S = 6.0
"""How long the stand-in keeps a request queued: past READ_WAIT_S (5 s), the longest a read
waited, so the test fails without the fix."""


def one_request(url: str, tokens: int) -> LoadPlan:
    return LoadPlan(ServerURL.parse(url), 1, 4, tokens, 1, seconds=60.0)


def test_a_request_queued_without_an_answer_past_a_reads_wait_is_not_failed():
    assert QUEUED_S > client.READ_WAIT_S
    hold = threading.Event()
    server = FakeVLLM(hold=hold).start()
    release = threading.Timer(QUEUED_S, hold.set)  # the server schedules it at last
    try:
        release.start()
        result = run_load(one_request(server.url, 3))
        assert (result.done, result.failed, result.errors) == (1, 0, [])
        assert result.ttft_s[0] >= QUEUED_S - 0.5
    finally:
        release.cancel()
        hold.set()
        server.close()


def test_a_stream_waiting_past_a_reads_wait_for_its_next_token_is_not_failed():
    """Headers at once, then each token QUEUED_S apart (vLLM preempted it and requeued it)."""
    server = FakeVLLM(token_delay_s=QUEUED_S).start()
    try:
        result = run_load(one_request(server.url, 2))
        assert (result.done, result.failed, result.errors) == (1, 0, [])
    finally:
        server.close()


@pytest.mark.parametrize("given", [["--concurrency", "4"], ["--prompt-tokens", "8"]])
def test_a_load_given_some_of_its_sizes_but_not_all_is_one_line(given, capsys):
    assert main(["load", "http://127.0.0.1:1", *given]) == 2
    err = capsys.readouterr().err
    assert "give all of --concurrency, --prompt-tokens and --max-tokens, or none" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_load_alone_is_sized_from_the_server_and_says_whether_it_filled(capsys):
    """The stand-in's /metrics: FIRST's text, mid-load (40 blocks of 32, 1,280 tokens) at
    max_model_len 512: the fill asks for twice that, and says what the polls saw."""
    server = FakeVLLM(token_delay_s=0.0).start()
    try:
        code = main(["load", server.url, "--seconds", "30"])
    finally:
        server.close()
    out = capsys.readouterr().out
    assert code == 0
    assert "32 requests to" in out and "16 at a time, 64 prompt + 448 tokens each" in out
    assert "32 done, 0 cut short, 0 failed" in out
    assert "vLLM's cache: peak" in out  # the stand-in's text says 100% and 9 waiting


def test_a_load_whose_polls_all_failed_says_so_not_that_it_was_too_short(capsys, monkeypatch):
    """On CI's busy machine every poll of /metrics during a 22 s fill missed its deadline, and
    the verdict read "no poll caught a request running (the load was shorter than a poll)"."""
    import kvtui.engines.vllm.fill as fill
    from kvtui.engines.protocol import ServerMetrics

    real, calls = fill.poll_metrics, []

    def slow(url, seconds, *, until=float("inf")):
        calls.append(seconds)
        if len(calls) == 1:  # the plan's own read of the capacity
            return real(url, seconds, until=until)
        return ServerMetrics(seconds, error=f"{url}/metrics: no answer in time")

    monkeypatch.setattr(fill, "poll_metrics", slow)
    server = FakeVLLM(token_delay_s=0.0).start()
    try:
        code = main(["load", server.url, "--seconds", "30", "--requests", "4"])
    finally:
        server.close()
    out = capsys.readouterr().out
    assert code == 0 and "4 done" in out, out
    assert "shorter than a poll" not in out, out
    assert "vLLM's cache: not seen while the load ran: " in out, out
    assert "polls of /metrics failed (the last: " in out and "no answer in time)" in out, out


def words(screen: str) -> str:
    """A screen's words in one line: its wrapped lines joined, the panels' borders dropped."""
    return " ".join(screen.replace("│", " ").split())


TINY_AUSTEN = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}
"""The exported tiny-austen's config.json (kvtui export-hf): fp32."""


async def test_screens_2_and_3_under_seconds_settings(tmp_path):
    """The stand-in answers SECOND's /metrics, captured mid-fill (bf16 served, 2 engines, 8
    running, 22 waiting "for capacity" beside a cache 41% full, no prefix caching) and its
    max_model_len of 256: screen 3 says the blocks per engine in the dtype they were served in,
    prefix caching off, and why the queue is not the cache's; screen 2's cards are filled or say
    why not, and its latency names this request and the server's clients apart."""
    from pathlib import Path

    from kvtui.app import make_app
    from kvtui.engines.protocol import RunSettings
    from kvtui.testing import NO_GPU_PROBE, screen_text, wait_for

    (tmp_path / "config.json").write_text(json.dumps(TINY_AUSTEN))
    models = {"object": "list", "data": [{"id": "m", "root": str(tmp_path), "max_model_len": 256}]}
    data = Path(__file__).parents[1] / "engines" / "data" / "vllm-0.32-dp2-bf16-busy.txt"
    server = FakeVLLM(models=models, metrics=data.read_text()).start()
    settings = RunSettings(engine=f"vllm:{server.url}", tokens=16, greedy=True, loops=("cached",))
    app = make_app(settings, 3, probe=NO_GPU_PROBE)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: "cannot fill" in screen_text(app), timeout=30)
            text = words(screen_text(app))
            assert "60 blocks of 64 tokens (2 DP engines x 30, 2.9 MiB each)" in text
            assert "30 blocks x 2 engines: agree" in text and "DISAGREE" not in text
            assert "served in bf16 or fp16 (2 B), not config.json's fp32" in text
            assert "22 waiting (for scheduling capacity: 22)" in text
            assert "prefix caching off · max_model_len 256 · max-num-seqs not exposed" in text
            assert "8 x max_model_len 256 = 2,048 tokens < 3,840: this cache cannot fill" in text
            await wait_for(pilot, lambda: app.live_run.state == "done", timeout=30)
            await pilot.press("2")
            await wait_for(pilot, lambda: "THIS REQUEST" in screen_text(app), timeout=10)
            text = words(screen_text(app))
            assert "This request, measured here" in text
            assert "The server, all clients (not comparable to one request)" in text
            assert "16" in text and "server caches" in text and "not over HTTP" in text
    finally:
        server.close()
