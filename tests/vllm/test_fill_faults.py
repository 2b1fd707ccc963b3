"""A fill's requests that vLLM queues, and `kvtui load URL` with no other flag, against a
stand-in server (fake.py): a queued request gets no answer, or no first token, for longer than
a read's wait, yet is a request waiting its turn, not a failure (issue 32: 56 of 120 requests of
a fill at --max-num-seqs 4 failed "no answer in time"). No vLLM needed."""

from __future__ import annotations

import threading

import pytest

from kvtui.cli import main
from kvtui.engines.vllm import client
from kvtui.engines.vllm.client import ServerURL
from kvtui.engines.vllm.load import LoadPlan, run_load

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
    assert "64 requests to" in out and "16 at a time, 64 prompt + 192 tokens each" in out
    assert "64 done, 0 cut short, 0 failed" in out
    assert "vLLM's cache: peak" in out  # the stand-in's text says 100% and 9 waiting
