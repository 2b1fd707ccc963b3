"""A server that lies, against the door it comes in by (kvtui.engines.vllm.client, metrics,
engine, load): escape codes and line breaks in what it names, JSON nested past what Python
parses, numbers past any count, answers sent a byte at a time or forever, chunks of 400,000
token ids. Each is a line on screen or in a table, a value shown as unknown, or one line and
exit 2 (kvtui load: its requests counted as failed, exit 1), within the request's deadline, and
the app stays up. Stand-in servers (fake.py) on 127.0.0.1; the deadlines shortened to seconds."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvtui.app import make_app
from kvtui.cli import main
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunControl, RunFinished, RunSettings, StepSample
from kvtui.engines.vllm import client
from kvtui.engines.vllm.client import Server, ServerError
from kvtui.engines.vllm.metrics import server_metrics
from kvtui.engines.vllm.url import ServerURL
from kvtui.testing import NO_GPU_PROBE, screen_text, wait_for
from tests.ports import free_port

from .fake import METRICS, FakeVLLM

CONTROL = "\x1b]52;c;aGFja2Vk\x07\x1b]0;PWNED\x07\x9b31m\r\nspeedup: 999x (FAKE LINE)"
"""What a hostile server names things with: an OSC 52 (sets the clipboard), an OSC 0 (the
terminal's title), a C1 CSI, and a line break that starts a line of its own in a table."""


def settings(url: str, tokens: int = 8) -> RunSettings:
    return RunSettings(engine=f"vllm:{url}", tokens=tokens, greedy=True, loops=("cached",))


def within(seconds: float, work: Callable[[], Any]) -> Any:
    """`work()`'s result, or a failure saying it was still running after `seconds` (a hang)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds:g} s: no deadline held")
    if "error" in out:
        raise out["error"]
    return out["result"]


def run_engine(url: str, tokens: int = 8) -> list[Any]:
    """Every event of a `vllm:` run (no polls after it)."""
    engine = open_engine(settings(url, tokens))
    try:
        return list(run_events(engine, settings(url, tokens), RunControl()))
    finally:
        engine.close()


def one_line_exit_2(capsys: Any, argv: list[str], says: str) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err and says in err, err
    return err


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


# --- time: a deadline for the whole request ------------------------------------------------------


def test_an_answer_sent_a_byte_at_a_time_is_cut_at_its_deadline(serve):
    """Each byte comes well within a read's wait, so only a deadline for the whole request ends
    it (/v1/models, 160 bytes at 20 ms: 3 s; the deadline 1 s)."""
    server = serve(drip_s=0.02, drip_paths=("/v1/models",))
    started = time.monotonic()
    with pytest.raises(ServerError, match="no answer in time"):
        within(10, lambda: Server(ServerURL.parse(server.url), 1.0).json("/v1/models"))
    assert time.monotonic() - started < 2.0


def test_a_stream_of_keep_alives_without_a_token_ends(serve, monkeypatch):
    """SSE comments (`: keep-alive`) forever and no token: each arrives within a read's wait, so
    the stream waited forever; it ends STREAM_IDLE_S after the last token (here 1 s)."""
    monkeypatch.setattr(client, "STREAM_IDLE_S", 1.0)
    server = serve(chunk=lambda i: b": keep-alive\n\n", forever=True, token_delay_s=0.05)
    events = within(15, lambda: run_engine(server.url))
    finished = [e for e in events if isinstance(e, RunFinished)]
    assert finished[-1].reason == "error" and "sent no token for 1 s" in finished[-1].message


def test_a_stream_line_sent_a_byte_at_a_time_is_cut(serve, monkeypatch):
    """A line of the stream whose bytes come one by one: a line once begun must be whole within
    LINE_WAIT_S (here 0.5 s), where the stream waited as long as bytes came."""
    monkeypatch.setattr(client, "LINE_WAIT_S", 0.5)
    server = serve(drip_s=0.05, drip_paths=("/v1/completions",))
    events = within(15, lambda: run_engine(server.url))
    finished = [e for e in events if isinstance(e, RunFinished)]
    assert finished[-1].reason == "error"
    assert "sent a line too slowly (not whole within 0.5 s)" in finished[-1].message


def test_the_questions_before_a_run_share_one_deadline(serve, monkeypatch):
    """/version and /tokenize each sent a byte at a time: the questions before a run had a
    deadline each, so a server held a run's start for several; they now share one (here 2 s,
    OPEN_DEADLINE_S shortened), and the run starts without what did not come in time (the
    prompt then goes as text)."""
    from kvtui.engines.vllm import engine

    monkeypatch.setattr(engine, "OPEN_DEADLINE_S", 2.0, raising=False)
    server = serve(drip_s=0.05, drip_paths=("/version", "/tokenize"))
    started = time.monotonic()
    opened = within(30, lambda: open_engine(settings(server.url)))
    opened.close()
    assert time.monotonic() - started < 4
    assert opened.prompt_ids is None


def test_kvtui_load_obeys_its_seconds_whatever_the_stream_does(serve, capsys):
    """`kvtui load --seconds 1.5` on streams sent a byte at a time: it ends at its limit, the
    requests cut (http.client drops its socket on `Connection: close`, so closing the stream
    could not interrupt the read: it hung)."""
    server = serve(drip_s=0.2, drip_paths=("/v1/completions",))
    argv = ["load", server.url, "--concurrency", "2", "--prompt-tokens", "4", "--max-tokens"]
    started = time.monotonic()
    code = within(20, lambda: main([*argv, "8", "--seconds", "1.5", "--json"]))
    result = json.loads(capsys.readouterr().out)
    assert time.monotonic() - started < 6
    assert (code, result["ended"], result["failed"]) == (0, "time limit", 0)
    assert result["cut"] == 2


# --- bytes: kvtui stops reading at what it asked for --------------------------------------------


def test_a_stream_past_the_tokens_asked_for_is_not_read(serve):
    """A server streaming tokens forever, as fast as it can: the run ends at its 8 tokens."""
    server = serve(forever=True, token_delay_s=0)
    events = within(20, lambda: run_engine(server.url, tokens=8))
    steps = [e for e in events if isinstance(e, StepSample)]
    assert len(steps) == 8 and events[-1] == RunFinished("cached", "done", 8)


def test_chunks_of_400_000_token_ids_stop_at_the_tokens_asked_for(serve):
    """Each chunk 400,000 token ids (800 KB): the run keeps 8 of the first and reads no more,
    where every id became a step (memory past 1.5 GiB, and no end)."""
    fat = "data: " + json.dumps({"choices": [{"text": "x", "token_ids": [0] * 400_000}]})
    line = fat.replace(" ", "").replace("data:", "data: ").encode() + b"\n\n"
    server = serve(chunk=lambda i: line, forever=True, token_delay_s=0)
    events = within(30, lambda: run_engine(server.url, tokens=8))
    steps = [e for e in events if isinstance(e, StepSample)]
    assert len(steps) == 8 and isinstance(events[-1], RunFinished)
    assert events[-1].reason == "done"


def test_kvtui_load_counts_the_ids_of_a_fat_chunk(serve, capsys):
    """kvtui load on chunks of 400,000 ids: each request is done with its first chunk, where it
    counted such a chunk as one token and read on until the stream's bytes ran out (failed)."""
    fat = {"choices": [{"text": "x", "token_ids": [0] * 400_000}]}
    line = b"data: " + json.dumps(fat, separators=(",", ":")).encode() + b"\n\n"
    server = serve(chunk=lambda i: line, forever=True, token_delay_s=0)
    argv = ["load", server.url, "--concurrency", "2", "--prompt-tokens", "4", "--max-tokens"]
    assert within(30, lambda: main([*argv, "64", "--requests", "2", "--json"])) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["done"], result["failed"], result["tokens"]) == (2, 0, 128)


def test_kvtui_load_stops_at_its_max_tokens(serve, capsys):
    server = serve(forever=True, token_delay_s=0)
    argv = ["load", server.url, "--concurrency", "2", "--prompt-tokens", "4", "--max-tokens"]
    code = within(20, lambda: main([*argv, "16", "--requests", "4", "--json"]))
    result = json.loads(capsys.readouterr().out)
    assert (code, result["done"], result["tokens"]) == (0, 4, 64)


# --- JSON: nested, not an object, of the wrong types ---------------------------------------------

NESTED = b"[" * 100_000 + b"]" * 100_000


def test_nested_json_is_one_line(serve, capsys):
    """JSON nested past Python's recursion limit: RecursionError (a traceback) in `bench`,
    `load` and `serve`'s check; now "did not answer JSON" in one line."""
    server = serve(replies={"/v1/models": NESTED})
    for argv in (
        ["bench", "--engine", f"vllm:{server.url}"],
        ["load", server.url, "--concurrency", "1", "--prompt-tokens", "1", "--max-tokens", "1"],
        ["serve", "--port", str(free_port()), "--engine", f"vllm:{server.url}"],
    ):
        one_line_exit_2(capsys, argv, "/v1/models did not answer JSON")


def test_a_nested_chunk_ends_the_run_in_one_line(serve):
    server = serve(chunk=lambda i: b"data: " + NESTED + b"\n\n")
    finished = run_engine(server.url)[-1]
    assert finished.reason == "error" and "streamed something not JSON" in finished.message


@pytest.mark.parametrize("choices", [5, {"text": "x"}, [5], "x", None])
def test_kvtui_load_counts_chunks_of_the_wrong_type_as_failed(serve, capsys, choices):
    """`choices` an int, an object, a list of numbers: TypeError and KeyError in the load's
    workers, which then died and the requests vanished ("0 done, 0 failed", exit 0). Each
    request is now counted as failed, and the exit status says so."""
    chunk = b"data: " + json.dumps({"choices": choices}).encode() + b"\n\n"
    server = serve(chunk=lambda i: chunk)
    argv = ["load", server.url, "--concurrency", "2", "--prompt-tokens", "4", "--max-tokens"]
    assert main([*argv, "4", "--requests", "3", "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert (result["done"], result["failed"], result["cut"]) == (0, 3, 0)
    assert "a request ended after 0 of 4 tokens" in result["errors"]


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


def test_a_record_from_a_server_of_huge_numbers_replays(serve, tmp_path, capsys):
    """What kvtui writes, it reads back: a max_model_len of 10^30 and counts past 64 bits were
    recorded as they came, and the replay refused its own record ("line 2: corrupt")."""
    models = {"data": [{"id": "m", "root": "m", "max_model_len": 10**30}]}
    huge = "vllm:num_preemptions_total 1e300\nvllm:num_requests_running 99999999999999999999\n"
    server = serve(models=models, metrics=METRICS + huge)
    record = tmp_path / "huge.jsonl"
    bench = ["bench", "--engine", f"vllm:{server.url}", "--tokens", "4", "--json"]
    assert main([*bench, "--record", str(record)]) == 0
    capsys.readouterr()
    assert main(["bench", "--engine", f"replay:{record}", "--replay-speed", "0", "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["server"]["requests_running"] is None


# --- what it says: escape codes, line breaks ------------------------------------------------------


def _lying_names() -> dict[str, Any]:
    metrics = METRICS.replace('cache_dtype="auto"', 'cache_dtype="\x1b]0;T\x07[/]"')
    metrics = metrics.replace('reason="capacity"', 'reason="\x1b]52;c;aGk=\x07[b]x"')
    models = {"data": [{"id": CONTROL, "root": CONTROL, "max_model_len": 512}]}
    return {"models": models, "metrics": metrics}


def test_bench_prints_no_escape_code_nor_a_line_of_the_servers(serve, capsys):
    """A model id holding an OSC 52 and `\\r\\n`: bench's table printed the escape codes raw and
    "speedup: 999x (FAKE LINE)" as a line of its own."""
    server = serve(
        **_lying_names(),
        chunk=lambda i: b'data: {"choices": [{"text": "\\u001b[2J\\r\\n", "token_ids": [7]}]}\n\n',
    )
    assert main(["bench", "--engine", f"vllm:{server.url}", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x9b\x07\r"), repr(out[:300])
    assert not any(line.lstrip().startswith("speedup: 999x") for line in out.splitlines())
    assert "\\x1b]52;c;aGFja2Vk\\x07" in out  # shown, as text


async def test_the_app_draws_no_escape_code_of_the_servers(serve):
    """Screen 3 drew a /metrics label's OSC 52 (a waiting reason) raw: it set the clipboard."""
    server = serve(**_lying_names())
    app = make_app(settings(server.url, 16), 3, probe=NO_GPU_PROBE)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: "waiting" in screen_text(app), timeout=30)
        for key in ("3", "2", "1", "3"):
            await pilot.press(key)
            await pilot.pause()
            shown = screen_text(app)
            assert not any(ord(c) < 32 and c != "\n" or 0x7F <= ord(c) < 0xA0 for c in shown)
        assert "(\\x1b]52;c;aGk" in screen_text(app)  # the reason, as text
        assert app.is_running


# --- URLs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    ["ü..invalid", "ü" * 70 + ".invalid", "a" * 64 + ".example", "\udcff.example"],
    ids=["empty label", "70 u-umlauts", "64 letters", "not utf-8"],
)
def test_a_host_that_is_not_a_host_name_is_one_line(capsys, host):
    """UnicodeError from the IDNA codec as the request was made (a traceback)."""
    one_line_exit_2(capsys, ["bench", "--engine", f"vllm:http://{host}:1"], "not a valid host name")


def test_a_path_that_is_not_utf8_is_sent_percent_encoded(serve, capsys):
    """Bytes that were not UTF-8 in the URL's path (as argv holds them): UnicodeEncodeError as
    the request was made; they go percent-encoded, and the server's 404 is one line."""
    server = serve()
    one_line_exit_2(capsys, ["bench", "--engine", f"vllm:{server.url}/\udcff\u00e9"], "HTTP 404")
    assert "GET /%FF%C3%A9/v1/models" in server.requests
    assert str(ServerURL.parse("http://h:1/a b".replace(" ", "%20"))) == "http://h:1/a%20b"


def test_a_root_path_of_100_kb_is_looked_for_nowhere(serve):
    """A `root` of 100 KB from /v1/models: ENAMETOOLONG while looking for its config.json."""
    models = {"data": [{"id": "m", "root": "/" + "a" * 100_000, "max_model_len": 512}]}
    server = serve(models=models)
    assert run_engine(server.url, tokens=2)[-1] == RunFinished("cached", "done", 2)


# --- a record of a run the server ended ----------------------------------------------------------


def test_a_server_dying_mid_run_leaves_a_record_of_what_was_measured(serve, tmp_path, capsys):
    """`--record` of a run whose server died after 5 tokens: the record was discarded, with all
    that was measured; now it is kept (and replays), and the one line says where."""
    from kvtui.engines.replay import read_record

    server = serve(die_after=5, token_delay_s=0.01)
    record = tmp_path / "died.jsonl"
    argv = ["bench", "--engine", f"vllm:{server.url}", "--tokens", "20", "--record", str(record)]
    err = one_line_exit_2(capsys, argv, "stopped streaming after 5 of 20 tokens")
    assert f"the steps before are recorded to {record}" in err
    _, events = read_record(record)
    assert len([e for e in events if isinstance(e, StepSample)]) == 5
    assert [e.reason for e in events if isinstance(e, RunFinished)] == ["error"]


def test_sigterm_during_a_record_keeps_it_whole_and_leaves_no_part_file(serve, tmp_path):
    """SIGTERM (a `timeout`, a closed session) during `bench --record`: Python's default ended the
    process at once, leaving `.died.jsonl.*.part` and no record; now it ends as Ctrl-C does,
    through the record's own cleanup (exit 143)."""
    import signal
    import subprocess
    import sys

    from kvtui.engines.replay import read_record

    server = serve(token_delay_s=0.05)
    record = tmp_path / "cut.jsonl"
    argv = ["bench", "--engine", f"vllm:{server.url}", "--tokens", "400", "--record", str(record)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtui", *argv], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while "POST /v1/completions" not in server.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # some tokens streamed
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.jsonl"]
    _, events = read_record(record)
    assert [e.reason for e in events if isinstance(e, RunFinished)] == ["cancelled"]
