"""`kvtui serve` without a browser: its checks (one line, exit 2), the command each tab runs, the
busy page, the refused cross-site websocket, and the ending of a process tree.

The browser tests (tests/browser) start a real server; these stop short of serving, by handing
`cmd_serve` a server that returns as soon as it is ready, or by driving the aiohttp app in
process.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from kvtui import serve
from kvtui.cli import build_parser, main
from kvtui.run.process import child_command
from kvtui.serve import APP_MAIN
from tests.ports import free_port

ENGINE = "sim:llama-3.1-8b@h100"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(capsys, *argv, says):
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1, err  # one line
    assert "Traceback" not in err
    assert says in err
    return err


class ReadyServer:
    """Stands in for the textual-serve server: says it is ready, then returns (no serving)."""

    def __init__(self, command, sockets, max_sessions, **page):
        self.command, self.sockets, self.max_sessions = command, sockets, max_sessions
        self.page = page
        self.addresses = []

    async def run(self, on_ready):
        self.addresses = [sock.getsockname() for sock in self.sockets]
        on_ready()


@pytest.fixture
def made(monkeypatch):
    """The servers `cmd_serve` made, none of which serves."""
    servers = []

    def make(*args, **page):
        servers.append(ReadyServer(*args, **page))
        return servers[-1]

    monkeypatch.setattr(serve, "make_server", make)
    return servers


# --- bad input: one line, exit 2 ------------------------------------------------------------------


@pytest.mark.parametrize("port", ["0", "70000", "-1", "http"])
def test_a_port_out_of_range_is_one_line(capsys, port):
    assert_usage_error(
        capsys, "serve", "--port", port, says="expected a positive integer up to 65,535"
    )


def test_a_port_in_use_is_one_line(capsys, made):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_usage_error(
            capsys, "serve", "--port", str(port), "--engine", ENGINE, says=f"port {port} on"
        )
    assert made == []


def test_an_address_not_of_this_machine_is_one_line(capsys, made):
    # 192.0.2.1 is reserved for documentation (RFC 5737): never an address of this machine.
    assert_usage_error(
        capsys, "serve", "--host", "192.0.2.1", "--engine", ENGINE, says="not an address of this"
    )


def test_without_the_extra_it_says_how_to_install_it(capsys, monkeypatch, made):
    monkeypatch.setitem(sys.modules, "textual_serve", None)
    monkeypatch.setitem(sys.modules, "textual_serve.server", None)
    assert_usage_error(capsys, "serve", "--engine", ENGINE, says="pip install 'kvtui[serve]'")


def test_max_sessions_is_capped(capsys, made):
    """`--max-sessions` past MAX_SESSIONS (two processes a tab) is refused in one line, where
    1 followed by 30 zeros was taken: no cap on the processes a server starts."""
    for many in ("1" + "0" * 30, "65"):
        argv = ["serve", "--port", str(free_port()), "--max-sessions", many, "--engine", ENGINE]
        assert_usage_error(
            capsys, *argv, says="argument --max-sessions: expected a positive integer up to 64"
        )
    assert made == []


def test_a_bad_engine_is_refused_before_serving(capsys, made):
    assert_usage_error(capsys, "serve", "--engine", "sim:nope@h100", says="unknown model 'nope'")
    assert made == []


# --- serving -------------------------------------------------------------------------------------


def test_loopback_by_default_prints_the_address_and_no_warning(capsys, made):
    port = free_port()
    code, out, err = run(capsys, "serve", "--port", str(port), "--engine", ENGINE)
    assert (code, err) == (0, "")
    assert f"open http://127.0.0.1:{port} in a browser (up to 4 tabs" in out
    [server] = made
    assert server.max_sessions == 4
    assert server.addresses == [("127.0.0.1", port)]


def test_any_other_address_warns_in_one_line(capsys, made):
    port = free_port()
    options = ["--host", "0.0.0.0", "--port", str(port), "--max-sessions", "2"]
    code, out, err = run(capsys, "serve", *options, "--engine", ENGINE)
    assert code == 0
    assert err.count("\n") == 1
    assert "warning: listening on 0.0.0.0: anyone who can reach it can open a session" in err
    assert f"open http://localhost:{port} in a browser (up to 2 tabs" in out


def test_each_tab_runs_the_app_with_the_options_given(made, capsys):
    prompt = 'It\'s a "truth"; $(rm -rf ~) `x`'
    options = ["--engine", ENGINE, "--tokens", "64", "--prompt", prompt, "--greedy"]
    options += ["--screen", "2", "--present", "--theme", "light"]
    code, _, _ = run(capsys, "serve", "--port", str(free_port()), "--max-sessions", "1", *options)
    assert code == 0
    argv = shlex.split(made[0].command)
    # isolated from the server's directory, this very kvtui, in kvtui's order, no defaults
    app = child_command(APP_MAIN)
    assert argv == [*app, *options] and app[:3] == [sys.executable, "-I", "-u"]
    served = build_parser().parse_args(argv[len(app) :])
    assert made[0].page["idea"].startswith("A model decodes")  # presenter mode's card
    assert made[0].page["body_class"] == "kvtui-light"
    given = build_parser().parse_args(["serve", *options])
    for name, value in vars(served).items():
        if name != "command":
            assert getattr(given, name) == value, name


def test_a_relative_replay_is_served_by_its_absolute_path(made, capsys, tmp_path, monkeypatch):
    """Each tab's app runs from the file system's root, so a relative path must not depend on
    the server's directory."""
    record = tmp_path / "run.jsonl"
    run(capsys, "bench", "--engine", ENGINE, "--tokens", "4", "--record", str(record))
    monkeypatch.chdir(tmp_path)
    code, _, _ = run(capsys, "serve", "--port", str(free_port()), "--engine", "replay:run.jsonl")
    assert code == 0
    argv = shlex.split(made[-1].command)
    assert argv[argv.index("--engine") + 1] == f"replay:{record}"


def test_every_app_option_is_an_option_of_serve():
    app = build_parser().parse_args([])
    served = build_parser().parse_args(["serve"])
    assert set(vars(app)) - {"command"} <= set(vars(served))


def test_the_serving_process_imports_neither_torch_nor_textual():
    script = textwrap.dedent(
        f"""
        import json, sys
        from kvtui import serve
        from kvtui.cli import main

        class Ready:
            def __init__(self, *args, **page): pass
            async def run(self, on_ready): on_ready()

        serve.make_server = Ready
        code = main(["serve", "--port", "{free_port()}"])  # the default engine, tiny (torch)
        print(json.dumps([code, sorted({{m.split(".")[0] for m in sys.modules}} &
                                       {{"torch", "textual"}})]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [0, []]


# --- the web app, in process ----------------------------------------------------------------------


async def test_beyond_the_limit_a_tab_gets_the_busy_page():
    pytest.importorskip("textual_serve")
    from aiohttp.test_utils import TestClient, TestServer

    server = serve.make_server("true", [], 0)  # no session free, ever
    async with TestClient(TestServer(await server._make_app())) as client:
        page = await client.get("/")
        assert page.status == 503
        assert "all sessions in use" in await page.text()

        # A page that loaded while a session was free is sent back to the busy page.
        websocket = await client.ws_connect("/ws")
        message = await websocket.receive_json(timeout=5)
        assert message == ["open_url", {"url": "/", "new_tab": False}]
        await websocket.close()


async def test_the_page_is_the_title_card_until_the_app_draws_and_asks_nothing_of_the_web():
    """kvtui's page (kvtui/templates): the title card, in the theme's colours, its spinner a CSS
    animation; the terminal and the closed dialog textual-serve's script needs; no web font."""
    pytest.importorskip("textual_serve")
    from aiohttp.test_utils import TestClient, TestServer

    server = serve.make_server("true", [], 1, name="kvtui", idea="Space", body_class="kvtui-light")
    async with TestClient(TestServer(await server._make_app())) as client:
        page = await (await client.get("/")).text()
    assert '<div class="kvtui-name">kvtui</div>' in page and "Space</div>" in page
    assert 'class="kvtui-light"' in page and "@keyframes kvtui-spin" in page
    assert 'id="terminal"' in page and "Session ended." in page
    assert "googleapis" not in page


async def test_a_websocket_from_another_site_is_refused():
    pytest.importorskip("textual_serve")
    from aiohttp import WSServerHandshakeError
    from aiohttp.test_utils import TestClient, TestServer

    server = serve.make_server("true", [], 1)
    async with TestClient(TestServer(await server._make_app())) as client:
        with pytest.raises(WSServerHandshakeError) as refused:
            await client.ws_connect("/ws", headers={"Origin": "http://example.com"})
        assert refused.value.status == 403
        assert server.sessions == set()


async def test_on_the_loopback_a_request_must_name_the_loopback():
    pytest.importorskip("textual_serve")
    from aiohttp.test_utils import TestClient, TestServer

    server = serve.make_server("true", [], 0)  # no sockets: as if on the loopback
    async with TestClient(TestServer(await server._make_app())) as client:
        assert (await client.get("/")).status == 503  # the busy page: the request got in
        rebound = await client.get("/", headers={"Host": "attacker.example:8000"})
        assert rebound.status == 421
        websocket = await client.get("/ws", headers={"Host": "attacker.example:8000"})
        assert websocket.status == 421


def test_names_this_machine():
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "127.0.0.2", "LOCALHOST"):
        assert serve.names_this_machine(host), host
    for host in ("attacker.example:8000", "10.0.0.1:8000", "localhost.attacker.example", ""):
        assert not serve.names_this_machine(host), host


def test_same_origin():
    assert serve.same_origin(None, "127.0.0.1:8000")
    assert serve.same_origin("http://127.0.0.1:8000", "127.0.0.1:8000")
    assert serve.same_origin("http://LOCALHOST:8000", "localhost:8000")
    assert not serve.same_origin("http://127.0.0.1:9000", "127.0.0.1:8000")
    assert not serve.same_origin("https://example.com", "127.0.0.1:8000")


# --- ending a session's processes -----------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    ("ignores", "ended_by"),
    [("", signal.SIGTERM), ("signal.signal(signal.SIGTERM, signal.SIG_IGN); ", signal.SIGKILL)],
    ids=["its stdin", "SIGTERM too"],
)
async def test_a_process_tree_is_ended_even_when_it_ignores(ignores, ended_by):
    """An "app" that started an "engine" in a session of its own, as kvtui's app does, and that
    neither would ever end on its own: both are ended, the app by the signal that it heeds
    (SIGTERM, or SIGKILL where it ignores SIGTERM)."""
    app = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, subprocess, sys, time; "
            + ignores
            + "subprocess.Popen([sys.executable, "
            "'-c', 'import time; time.sleep(10**6)'], start_new_session=True); "
            "print('ready', flush=True); time.sleep(10**6)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    tree = []
    try:
        assert app.stdout.readline() == "ready\n"
        tree = serve.descendants(app.pid)
        assert len(tree) == 1
        tree.append(serve.ProcessId(app.pid, serve._stat(app.pid)[2]))
        assert all(map(serve.is_running, tree))
        await serve.end_processes(tree, grace=0.2)
        assert not any(map(serve.is_running, tree))
        assert app.wait(5) == -ended_by
    finally:
        app.kill()
        app.wait(5)
        for process in tree:  # the engine, should the test fail before it is ended
            if serve.is_running(process):
                os.kill(process.pid, signal.SIGKILL)


# --- hostile traffic: one line per bad request, never a traceback ---------------------------------


async def raw_request(port: int, data: bytes) -> bytes:
    """The status line the server answers `data` with (b"" if it only closed the connection)."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(65536), 10)
    except ConnectionError:
        answer = b""
    finally:
        writer.close()
    return answer.split(b"\r\n")[0]


BAD_REQUESTS = {
    "100 KB header": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n",
    "10,000 headers": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    + b"".join(b"X%d: 1\r\n" % i for i in range(10_000))
    + b"\r\n",
    "1 MB URL": b"GET /" + b"a" * 1_000_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "invalid header bytes": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX: \x00\x01\xff\r\n\r\n",
    "smuggling": b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "no host": b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n",
}


@pytest.fixture
def served_log():
    """What the server would write to its terminal, through kvtui serve's own log handler."""
    import io
    import logging

    stream = io.StringIO()
    handler = serve.install_log(stream)
    yield stream
    logging.getLogger().removeHandler(handler)


async def test_each_bad_request_is_one_line_at_most(served_log):
    pytest.importorskip("textual_serve")
    from aiohttp.test_utils import TestClient, TestServer

    server = serve.make_server("true", [], 0)
    async with TestClient(TestServer(await server._make_app())) as client:
        for name, data in BAD_REQUESTS.items():
            before = served_log.getvalue()
            status = await raw_request(client.port, data)
            assert status == b"" or status.split()[1].startswith(b"4"), (name, status)
            said = served_log.getvalue()[len(before) :]
            assert said.count("\n") <= 1 and "Traceback" not in said, (name, said)


async def test_bad_requests_by_the_hundred_are_rate_limited(served_log):
    pytest.importorskip("textual_serve")
    from aiohttp.test_utils import TestClient, TestServer

    server = serve.make_server("true", [], 0)
    async with TestClient(TestServer(await server._make_app())) as client:
        for _ in range(100):
            await raw_request(client.port, BAD_REQUESTS["invalid header bytes"])
    lines = served_log.getvalue().splitlines()
    assert 1 <= len(lines) <= serve.LOG_BURST + 1, lines


async def test_a_malformed_message_ends_its_session_in_one_line(served_log, monkeypatch):
    pytest.importorskip("textual_serve")
    monkeypatch.setattr(serve, "STOP_GRACE_SECONDS", 0.2)  # the "app" below never quits itself
    from aiohttp.test_utils import TestClient, TestServer

    alive = shlex.join([sys.executable, "-c", "import time; time.sleep(60)"])
    server = serve.make_server(alive, [], 4)
    async with TestClient(TestServer(await server._make_app())) as client:
        for message in ("not json", '["stdin"]', '["resize", {}]'):
            websocket = await client.ws_connect("/ws")
            await websocket.send_str(message)
            await websocket.receive(timeout=10)  # the session ends: its websocket closes
            await websocket.close()
        for _ in range(100):  # the sessions' processes have ended
            if not server.sessions:
                break
            await asyncio.sleep(0.05)
        assert server.sessions == set()
    lines = served_log.getvalue().splitlines()
    assert len(lines) == 3 and "Traceback" not in served_log.getvalue(), lines
    assert all(line.startswith("kvtui serve: session ") for line in lines), lines


SIZE_REPORTER = """
import os, sys, json
out = open(sys.argv[1], "w")
print(json.dumps(["start", os.environ["COLUMNS"], os.environ["ROWS"]]), file=out, flush=True)
while (kind := sys.stdin.buffer.read(1)) == b"M":  # textual-serve's meta packets
    size = int.from_bytes(sys.stdin.buffer.read(4), "big")
    print(sys.stdin.buffer.read(size).decode(), file=out, flush=True)
"""
"""An app that writes the size its process starts with, then each meta packet it is sent."""


async def test_a_page_says_no_size_the_app_could_not_draw(tmp_path, served_log):
    """A page's terminal size (its URL's, then each resize) reaches the app within 1..1,000
    columns by 1..500 rows: 0 is never laid out (the app never drew, never released its launch's
    hold on the collector), and 4,000 x 4,000 took the app minutes a frame; what is no integer
    ends the session in one line."""
    pytest.importorskip("textual_serve")
    from aiohttp.test_utils import TestClient, TestServer

    said = tmp_path / "said"
    command = shlex.join([sys.executable, "-c", SIZE_REPORTER, str(said)])
    server = serve.make_server(command, [], 4)
    async with TestClient(TestServer(await server._make_app())) as client:
        websocket = await client.ws_connect("/ws?width=0&height=99999")
        await websocket.send_str(json.dumps(["resize", {"width": 10**9, "height": -3}]))
        for _ in range(200):  # the app has read the resize
            if said.exists() and '"resize"' in said.read_text():
                break
            await asyncio.sleep(0.05)
        await websocket.send_str(json.dumps(["resize", {"width": "80", "height": 24}]))
        await websocket.receive(timeout=10)  # the last one ends the session: its websocket closes
        await websocket.close()
    lines = [json.loads(line) for line in said.read_text().splitlines()]
    assert lines[0] == ["start", "1", "500"]
    resizes = [line for line in lines[1:] if line.get("type") == "resize"]
    assert resizes == [{"type": "resize", "width": 1000, "height": 1}]
    logged = served_log.getvalue()
    assert "a terminal size of '80' x 24 cells" in logged and "Traceback" not in logged


async def test_the_static_folder_is_not_listed():
    pytest.importorskip("textual_serve")
    from aiohttp.test_utils import TestClient, TestServer

    server = serve.make_server("true", [], 0)
    async with TestClient(TestServer(await server._make_app())) as client:
        for folder in ("/static/", "/static/js", "/static/js/", "/static/css/"):
            assert (await client.get(folder)).status == 404, folder
        assert (await client.get("/static/js/textual.js")).status == 200


async def test_an_empty_or_missing_host_is_refused_like_a_foreign_one():
    pytest.importorskip("textual_serve")
    from aiohttp.test_utils import TestClient, TestServer

    server = serve.make_server("true", [], 0)
    async with TestClient(TestServer(await server._make_app())) as client:
        empty = b"GET / HTTP/1.1\r\nHost:\r\nConnection: close\r\n\r\n"
        missing = b"GET / HTTP/1.0\r\n\r\n"
        for data in (empty, missing):
            assert (await raw_request(client.port, data)).split()[1] == b"421", data
