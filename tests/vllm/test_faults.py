"""`vllm:URL` and `kvtui load` when things go wrong, against a stand-in server (fake.py): a server
killed mid-run, one without /metrics, a URL that is not one, values out of bounds. Every fault is
one line (exit 2) or a line on screen, and the app stays up. No vLLM needed."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtui.app import make_app
from kvtui.cli import main
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunControl, RunFinished, RunSettings, ServerMetrics, StepSample
from kvtui.engines.vllm.load import FILL_WAVES, MAX_CONCURRENCY, fill_plan
from kvtui.engines.vllm.url import ServerURL
from kvtui.testing import NO_GPU_PROBE, drive, headless, screen_text, wait_for

from .fake import FakeVLLM


@pytest.fixture
def fake() -> Iterator[FakeVLLM]:
    server = FakeVLLM().start()
    yield server
    server.close()


def settings(url: str, tokens: int = 40) -> RunSettings:
    return RunSettings(engine=f"vllm:{url}", tokens=tokens, greedy=True, loops=("cached",))


def test_a_server_killed_mid_run_ends_the_loop_and_the_polls_say_so():
    server = FakeVLLM(die_after=12, token_delay_s=0.02).start()
    control = RunControl()
    engine = open_engine(settings(server.url))
    events = []
    try:
        for event in run_events(engine, settings(server.url), control, watch=True):
            events.append(event)
            ended = any(isinstance(e, RunFinished) for e in events)
            if ended and isinstance(event, ServerMetrics) and event.error:
                control.stop()
    finally:
        engine.close()
        server.close()
    steps = [e for e in events if isinstance(e, StepSample)]
    finished = [e for e in events if isinstance(e, RunFinished)]
    assert len(steps) == 12 and [s.token_id for s in steps[:3]] == [97, 98, 99]
    assert finished[-1].reason == "error"
    assert "stopped streaming after 12 of 40 tokens" in finished[-1].message
    errors = [e.error for e in events if isinstance(e, ServerMetrics) and e.error]
    assert errors and re.search(r"no answer from .*: connection (refused|reset)", errors[-1])
    assert all(s.positions_computed == 0 and s.kv_bytes == 0 for s in steps)  # not observed


async def test_the_app_stays_up_when_the_server_dies_and_says_so():
    server = FakeVLLM(die_after=20, token_delay_s=0.05).start()
    app = make_app(settings(server.url), 3, probe=NO_GPU_PROBE)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: "of 40 blocks in use" in screen_text(app), timeout=30)
            gone = lambda: re.search("connection (refused|reset)", screen_text(app))  # noqa: E731
            await wait_for(pilot, gone, timeout=30)
            # The polls and the stream see the server go each in its own time: wait for both.
            ended = "stopped streaming after 20 of 40 tokens"  # the header: failed
            await wait_for(pilot, lambda: ended in screen_text(app), timeout=30)
            assert "The figures below are its last" in screen_text(app)
            await pilot.press("2")
            await wait_for(
                pilot,
                lambda: "vLLM's own" in screen_text(app) or "vLLM's histograms" in screen_text(app),
                timeout=10,
            )
            await pilot.press("3")
            assert app.is_running
    finally:
        server.close()


async def test_a_server_without_metrics_gets_one_clear_line(tmp_path):
    server = FakeVLLM(metrics=None).start()
    app = make_app(settings(server.url), 3, probe=NO_GPU_PROBE)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(
                pilot, lambda: "has no /metrics (HTTP 404)" in screen_text(app), timeout=30
            )
            await wait_for(pilot, lambda: app.live_run.state == "done", timeout=30)
            await pilot.press("2")
            await wait_for(pilot, lambda: "has no /metrics" in screen_text(app), timeout=10)
            assert "This request, measured here (kvtui's clock" in screen_text(app)
    finally:
        server.close()


def test_bench_on_a_server_without_metrics_says_so(capsys):
    server = FakeVLLM(metrics=None).start()
    try:
        assert main(["bench", "--engine", f"vllm:{server.url}", "--tokens", "8", "--greedy"]) == 0
    finally:
        server.close()
    out = capsys.readouterr().out
    assert "has no /metrics (HTTP 404)" in out and "positions computed" not in out


LOAD = "load {url} --concurrency 1 --prompt-tokens 1 --max-tokens 1"
APP = "--engine vllm:{url}"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ("--engine vllm:", "needs the server's URL"),
        ("--engine vllm:ftp://127.0.0.1:1", "must start with http:// or https://"),
        ("--engine vllm:http://u:p@127.0.0.1:1", "holds credentials"),
        ("--engine vllm:http://127.0.0.1:1", "connection refused"),
        ("bench --engine vllm:http://127.0.0.1:1", "connection refused"),
        (f"{APP} --batch 2", "--batch applies to kvtui's own engines"),
        (f"{APP} --kv-budget 1MiB", "the server sized its own cache"),
        (f"{APP} --tokens 1000", "past the server's max_model_len of 512"),
        ("load gopher://x --concurrency 1 --prompt-tokens 1 --max-tokens 1", "must start with"),
        (LOAD.replace("--concurrency 1", "--concurrency 257"), "a positive integer up to 256"),
        (f"{LOAD} --seconds 0", "expected a number from 0.1 to 3600"),
        (f"{LOAD} --requests 10001", "up to 10,000"),
        (f"{LOAD} --shared-prefix 2", "at most --prompt-tokens"),
        (
            LOAD.replace("--prompt-tokens 1", "--prompt-tokens 512"),
            "past the server's max_model_len",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(fake, capsys, argv, says):
    assert main(argv.replace("{url}", fake.url).split()) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_server_that_is_not_openai_compatible_is_one_line(capsys):
    server = FakeVLLM(models={"hello": "world"}).start()
    try:
        assert main(["bench", "--engine", f"vllm:{server.url}"]) == 2
    finally:
        server.close()
    err = capsys.readouterr().err
    assert "lists no model: is it an OpenAI-compatible server?" in err and err.count("\n") == 1


def test_only_the_url_given_is_asked(fake):
    engine = open_engine(settings(fake.url, tokens=4))
    stop = RunControl()
    threading.Timer(1.2, stop.stop).start()  # two polls after the run
    list(run_events(engine, settings(fake.url, tokens=4), stop, watch=True))
    engine.close()
    paths = {request.split()[1] for request in fake.requests}
    assert paths == {"/v1/models", "/version", "/tokenize", "/v1/completions", "/metrics"}


def test_a_served_run_records_and_replays_with_its_servers_figures(fake, tmp_path, capsys):
    record = tmp_path / "served.jsonl"
    argv = ["bench", "--engine", f"vllm:{fake.url}", "--tokens", "8", "--greedy", "--json"]
    assert main([*argv, "--record", str(record)]) == 0
    live = json.loads(capsys.readouterr().out)
    assert main(["bench", "--engine", f"replay:{record}", "--replay-speed", "0", "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["token_ids"] == live["token_ids"] and replayed["served_by"]
    assert replayed["server"]["polls"] == live["server"]["polls"] >= 2
    assert replayed["server"]["capacity"] == live["server"]["capacity"]


def test_the_fill_plan_asks_for_twice_the_cache_within_max_model_len():
    url = ServerURL.parse("http://127.0.0.1:8000")
    small = fill_plan(url, 1280, 512)  # the test server: 40 blocks of 32
    # each request as long as max_model_len: it lasts past a poll, and fills with few at once
    assert (small.concurrency, small.prompt_tokens, small.max_tokens) == (16, 64, 448)
    assert small.concurrency * (small.prompt_tokens + small.max_tokens) >= 2 * 1280
    big = fill_plan(url, 500_000, 8192)  # a GPU's cache: requests as long as the model allows
    assert big.prompt_tokens + big.max_tokens == 8192 and big.concurrency == 123
    assert big.concurrency * 8192 >= 2 * 500_000
    assert small.requests == FILL_WAVES * 16 and big.requests == FILL_WAVES * big.concurrency
    huge = fill_plan(url, 10**9, 8192)
    assert huge.concurrency == MAX_CONCURRENCY  # bounded, whatever the cache


def test_a_quantized_models_cache_is_priced_in_the_dtype_it_computes_in(tmp_path):
    """A served AWQ model (4-bit weights, fp16 activations): vLLM's cache dtype auto keeps keys
    and values in 16 bits, so kvtui predicts 2 bytes an element (1,536 a token here), where it
    priced them in the weights' int4 (384) and so predicted four times the server's blocks."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "awq", "bits": 4},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    models = {"object": "list", "data": [{"id": "m", "root": str(tmp_path), "max_model_len": 512}]}
    server = FakeVLLM(models=models).start()
    try:
        engine = open_engine(settings(server.url))
        try:
            started = engine.started()
        finally:
            engine.close()
    finally:
        server.close()
    assert started.kv_bytes_per_token == 6 * 2 * 2 * 32 * 2 == 1536


def _until(condition, timeout: float = 20.0) -> bool:
    """Whether `condition()` came true within `timeout` seconds (polled)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_run_closed_while_its_request_waits_for_an_answer_aborts_it():
    """The engine closed while its completion waits for the server's answer (a request queued
    behind a full KV cache): the connection closes as soon as the answer comes, which tells vLLM
    to abort it, where the stream was read to its end, the request running on the server."""
    hold = threading.Event()
    server = FakeVLLM(hold=hold, token_delay_s=0.01).start()
    try:
        engine = open_engine(settings(server.url, tokens=300))
        steps = engine.steps("cached")
        next(steps)  # the poll before the request
        reader = threading.Thread(target=lambda: list(steps), daemon=True)
        reader.start()
        assert _until(lambda: "POST /v1/completions" in server.requests)
        engine.close()
        hold.set()
        assert _until(lambda: bool(server.streamed))
        assert server.streamed[0] < 50  # of 300: it wrote into a closed connection
        reader.join(timeout=10)
        assert not reader.is_alive()
    finally:
        hold.set()
        server.close()


async def test_a_poll_without_the_usage_gauge_says_so_rather_than_draw_0_percent():
    """A server whose /metrics has the cache's size but not its usage: the panel says the usage
    is not in the poll, where it drew 0% as if the cache were empty."""
    from .fake import METRICS

    without = "\n".join(line for line in METRICS.splitlines() if "kv_cache_usage_perc" not in line)
    server = FakeVLLM(metrics=without + "\n").start()
    app = make_app(settings(server.url), 3, probe=NO_GPU_PROBE)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: "KV-cache usage: not in this poll" in screen_text(app))
            assert "blocks in use" not in screen_text(app)
    finally:
        server.close()


def _loads() -> list[int]:
    """This process's `kvtui load` children that still run (kvtui.run.process.LoadProcess)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(ppid) == os.getpid() and state != "Z" and b"main(['load'" in command:
            found.append(int(entry.name))
    return found


async def test_f_on_screen_3_puts_a_load_on_the_server_and_says_how_it_ended():
    """`f` shows on screen 3 only with a served run's server, puts a load of twice its cache on it
    (`kvtui load`, a process of its own) and says how the load ended; quitting ends a load that
    still runs."""
    server = FakeVLLM(token_delay_s=0.001).start()
    app = make_app(settings(server.url, tokens=8), 3, probe=NO_GPU_PROBE)
    try:
        async with drive(app, (100, 30)) as run:
            await run.wait_for(lambda: "blocks in use" in run.text(), timeout=30)
            await run.wait_for(lambda: "f Fill" in run.text().splitlines()[-1], timeout=10)
            await run.press("f")
            await run.wait_for(lambda: any("kvtui load:" in n for n in run.notifications))
            ended = lambda: [n for n in run.notifications if "requests done" in n]  # noqa: E731
            await run.wait_for(ended, timeout=60)
            assert f"of {FILL_WAVES * 16} requests done" in ended()[0]  # twice 40 blocks of 32
            assert _loads() == []
            completions = sum(r == "POST /v1/completions" for r in server.requests)
            assert completions > 1  # the run's own, and the load's
            await run.press("f")  # again, once the first has ended
            started = lambda: [n for n in run.notifications if "kvtui load:" in n]  # noqa: E731
            await run.wait_for(lambda: len(started()) == 2)
            assert len(_loads()) == 1
            await run.press("q")
        assert _loads() == []  # quitting ended it
    finally:
        server.close()


async def test_f_is_not_a_key_without_a_server_to_fill():
    async with headless(RunSettings("sim:llama-3.1-8b@h100", tokens=8), 3, size=(100, 30)) as run:
        await run.until_done()
        assert "Fill" not in run.text().splitlines()[-1]
        await run.press("f")
        assert not any("load" in n for n in run.notifications) and _loads() == []
