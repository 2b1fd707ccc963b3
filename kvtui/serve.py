"""`kvtui serve`: the app in a web browser, one app and one decode engine per tab.

Each browser tab that connects gets its own `python -m kvtui <the app options>` through
textual-serve (an optional extra: `pip install 'kvtui[serve]'`); the serving process itself never
imports torch. It listens on 127.0.0.1 unless `--host` says otherwise, and warns when it does,
because textual-serve has no authentication: whoever reaches the port opens a session. What it
adds instead: on the loopback it answers only requests addressed to the loopback, and a session's
websocket must come from the server's own page (no other site's page starts one). At most
`--max-sessions` tabs run at once (each is an app process and an engine process); one more gets a
page that says so. A closed tab ends its app, the app ends its engine, and whatever is still alive
after a short grace is killed, so no process outlives its tab.

The port is checked by binding it before anything starts, and the server then listens on that
very socket. Importing this module stays cheap: textual-serve and aiohttp (about 0.7 s to import)
are imported only when a server is built.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import html
import ipaddress
import json
import logging
import os
import re
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvtui.engines.protocol import RunSettings
from kvtui.errors import EngineError
from kvtui.format import error_line, safe_text
from kvtui.inputs import terminal_size
from kvtui.options import DEFAULT_APP_TOKENS, UsageError, add_run_options, int_in

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
PAGES = Path(__file__).parent / "templates"
DEFAULT_MAX_SESSIONS = 4
"""Tabs served at once; each one is an app process and a decode engine process."""
MAX_SESSIONS = 64
"""The most `--max-sessions` takes: 128 processes, each engine a few hundred MB (a room of
laptops, not a fleet)."""

STOP_GRACE_SECONDS = 3.0
"""How long a closed tab's app and engine get to exit by themselves before they are killed."""

INSTALL_HINT = "pip install 'kvtui[serve]'"


# --- the command line ----------------------------------------------------------------------------


def add_parser(subparsers: Any) -> None:
    """The `serve` subcommand: where to listen, how many tabs, and the app's own options."""
    p = subparsers.add_parser(
        "serve",
        help=f"the app in a web browser, one session per tab (needs {INSTALL_HINT})",
        description="Serve the kvtui app to web browsers: each tab runs its own app and engine.",
        epilog="There is no password: anyone who can reach the address can open a session.",
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"the address to listen on (default {DEFAULT_HOST}, this machine only)",
    )
    p.add_argument(
        "--port", type=int_in(1, 65535), default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}"
    )
    p.add_argument(
        "--max-sessions",
        type=int_in(1, MAX_SESSIONS),
        default=DEFAULT_MAX_SESSIONS,
        metavar="N",
        help=f"tabs served at once, each an app and an engine process (default "
        f"{DEFAULT_MAX_SESSIONS}, at most {MAX_SESSIONS})",
    )
    add_run_options(p.add_argument_group("app options (as for kvtui)"), app=True)
    p.set_defaults(handler=cmd_serve)


class _Recorder:
    """Stands in for an argument group and keeps the actions added to it."""

    def __init__(self) -> None:
        self.parser = argparse.ArgumentParser(add_help=False)
        self.actions: list[argparse.Action] = []

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = self.parser.add_argument(*args, **kwargs)
        self.actions.append(action)
        return action


APP_MAIN = "from kvtui.cli import main\nraise SystemExit(main())"
"""What each tab's process runs, once kvtui is imported: the app, its options after it."""


def app_argv(args: argparse.Namespace) -> list[str]:
    """`child_command` (isolated, `-I`, kvtui imported from this very package, not whichever is
    installed) with every app option that differs from its default, as given; paths made
    absolute, since each tab's app runs from the file system's root."""
    from kvtui.run.process import absolute_paths, child_command

    recorder = _Recorder()
    add_run_options(recorder, app=True)
    argv = child_command(APP_MAIN)
    for action in recorder.actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if action.dest == "engine":
            value = absolute_paths(RunSettings(engine=value)).engine
        elif action.dest == "model":
            value = os.path.abspath(os.path.expanduser(value))
        flag = action.option_strings[0]
        argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return argv


def app_command(args: argparse.Namespace) -> str:
    """The command line each tab runs, quoted for a shell (textual-serve takes a string)."""
    return shlex.join(app_argv(args))


# --- listening ------------------------------------------------------------------------------------


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address `host` names; one clear UsageError.

    Bound as the server will use them (SO_REUSEADDR, IPv6 only on IPv6 sockets), so a port that
    passes here is the port that is served."""
    try:
        infos = socket.getaddrinfo(
            host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise UsageError(f"kvtui serve: cannot listen on {host!r}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    seen: set[tuple[Any, ...]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if address in seen:
                continue
            seen.add(address)
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise UsageError(_bind_error(host, port, exc)) from None
    return sockets


def _bind_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"kvtui serve: port {port} on {host} is in use; pick another with --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"kvtui serve: cannot listen on {host}: not an address of this machine"
    if exc.errno == errno.EACCES:
        return f"kvtui serve: not allowed to listen on port {port} (below 1024 needs root)"
    return f"kvtui serve: cannot listen on {host} port {port}: {exc.strerror or exc}"


def is_loopback(sockets: list[socket.socket]) -> bool:
    """True when every socket is bound to a loopback address (127.0.0.0/8, ::1)."""
    return all(
        ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback for sock in sockets
    )


def browser_url(host: str, port: int) -> str:
    """The address to open: a wildcard address is opened as localhost."""
    if host in ("0.0.0.0", "::", ""):
        host = "localhost"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


# --- the page beyond the limit --------------------------------------------------------------------


def busy_page(max_sessions: int) -> str:
    """The page a tab gets when every session is taken."""
    n = html.escape(str(max_sessions))
    sessions = "session is" if max_sessions == 1 else f"{n} sessions are"
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>kvtui: all sessions in use</title>
<style>body{{background:#0c181f;color:#eee;font:16px menlo,monospace;margin:15vh auto;
max-width:40em;line-height:1.5}} button{{font:inherit;padding:.5em 1.5em}}</style></head>
<body><h1>kvtui: all sessions in use</h1>
<p>This server's {sessions} in use. Each browser tab runs its own copy of kvtui, an app and a
decode engine, and the server allows {n} at once.</p>
<p>Close a kvtui tab, then reload this page.</p>
<button type="button" onclick="location.reload()">Reload</button></body></html>
"""


def same_origin(origin: str | None, host: str) -> bool:
    """Whether a websocket's Origin header is this server as the browser addressed it.

    Browsers let any page open a websocket to 127.0.0.1; they always send Origin, so a session
    asked for by another site's page is refused. A client with no Origin (not a browser) passes."""
    if origin is None:
        return True
    return urlsplit(origin).netloc.lower() == host.lower()


_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?")
"""A Host header as a browser sends one: a name or an address, and maybe a port; nothing else
(the page's URLs are built from it)."""


def valid_host(host: str | None) -> bool:
    """Whether a request's raw Host header is one: present, not empty, a name or address and
    maybe a port (an empty or missing Host is refused like a foreign one)."""
    return bool(host) and _HOST.fullmatch(host or "") is not None


def names_this_machine(host: str) -> bool:
    """Whether a Host header names the loopback (localhost, 127.0.0.1, [::1], with any port).

    A server on the loopback answers only to these: a page whose own name was pointed at
    127.0.0.1 (DNS rebinding) sends its own name, and is refused."""
    name = urlsplit(f"//{host}").hostname or ""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# --- process trees (Linux /proc; elsewhere the engines stop on their stdin's end) ----------------


@dataclass(frozen=True)
class ProcessId:
    """A process, told apart from a later one that reuses its pid by its start time."""

    pid: int
    start_ticks: int


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in clock ticks) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    return fields[0], int(fields[1]), int(fields[19])


def descendants(pid: int) -> list[ProcessId]:
    """Every process below `pid` (children, their children, ...), from /proc; [] without it."""
    try:
        entries = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    children: dict[int, list[ProcessId]] = {}
    for child in entries:
        stat = _stat(child)
        if stat is not None:
            children.setdefault(stat[1], []).append(ProcessId(child, stat[2]))
    found: list[ProcessId] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    return found


def is_running(process: ProcessId) -> bool:
    """Whether this very process is alive (a zombie has ended)."""
    stat = _stat(process.pid)
    return stat is not None and stat[0] != "Z" and stat[2] == process.start_ticks


def _kill(processes: list[ProcessId], sig: int) -> None:
    for process in processes:
        if is_running(process):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.pid, sig)


async def end_processes(processes: list[ProcessId], grace: float) -> None:
    """Wait up to `grace` seconds for the processes to exit, then SIGTERM, then SIGKILL."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            _kill(processes, sig)
        deadline = time.monotonic() + (grace if sig is None else 1.0)
        while any(map(is_running, processes)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not any(map(is_running, processes)):
            return


# --- the server ----------------------------------------------------------------------------------


@dataclass(eq=False)
class Session:
    """One tab: its websocket and the app process textual-serve runs for it."""

    websocket: Any
    service: Any
    ended: asyncio.Event = field(default_factory=asyncio.Event)


def make_server(command: str, sockets: list[socket.socket], max_sessions: int, **page: str) -> Any:
    """A textual-serve Server for `command` on the bound `sockets`, with kvtui's limits; its page
    says `page`'s words (name, subtitle, idea; body_class: its colours) until the app draws.

    The classes are made here because textual-serve is an optional extra and slow to import."""
    import aiohttp_jinja2
    from aiohttp import WSCloseCode, web
    from textual_serve.app_service import AppService
    from textual_serve.server import Server, to_int

    from kvtui.run.process import CHILD_CWD

    class AppProcess(AppService):
        """textual-serve's app process, started without a shell in a session of its own (so a
        Ctrl+C meant for the server does not reach it), and ended with its whole tree."""

        async def _open_app_process(self, width: int = 80, height: int = 24) -> Any:
            self._process = process = await asyncio.create_subprocess_exec(
                *shlex.split(self.command),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._build_environment(width=width, height=height),
                cwd=CHILD_CWD,
                start_new_session=True,
            )
            self._stdin = process.stdin
            return process

        async def set_terminal_size(self, width: int, height: int) -> None:
            await super().set_terminal_size(*terminal_size(width, height))  # as the page says

        async def end(self, grace: float) -> None:
            """Ask the app to quit (it stops its engine), then kill whatever is left."""
            process = self._process
            if process is None:
                return
            deadline = time.monotonic() + grace
            stat = _stat(process.pid)
            tree = [ProcessId(process.pid, stat[2])] if stat else []
            tree += descendants(process.pid)  # its engine, while the app still holds it
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop(), grace)
            await end_processes(tree, max(0.2, deadline - time.monotonic()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), 1.0)

    class KvtuiServer(Server):
        """Serves `command`, one session per tab, at most `max_sessions` at once."""

        def __init__(self) -> None:
            # kvtui's page: textual-serve's, its intro the title card (large, moving), no web font
            super().__init__(command, title="kvtui", templates_path=str(PAGES))
            self.sockets = sockets
            self.max_sessions = max_sessions
            self.sessions: set[Session] = set()
            self.opened = 0
            """Sessions opened so far: each is named by its number in the log."""
            self.loopback = is_loopback(sockets)

        @web.middleware
        async def check_request(self, request: web.Request, handler: Any) -> web.StreamResponse:
            """A request must carry a Host header that is one (`valid_host`), and on the
            loopback one that names the loopback (`names_this_machine`); a folder of the static
            files is not listed (textual-serve serves them with a directory index)."""
            host = request.headers.get("Host")
            if not valid_host(host) or self.loopback and not names_this_machine(host or ""):
                raise web.HTTPMisdirectedRequest(text="kvtui serve: open it as 127.0.0.1")
            static = isinstance(request.match_info.route.resource, web.StaticResource)
            folder = self.statics_path / request.match_info.get("filename", "").lstrip("/")
            if static and folder.is_dir():
                raise web.HTTPNotFound()
            return await handler(request)

        async def _make_app(self) -> web.Application:
            app = await super()._make_app()
            app.middlewares.append(self.check_request)
            return app

        @property
        def full(self) -> bool:
            return len(self.sessions) >= self.max_sessions

        async def handle_index(self, request: web.Request) -> web.Response:
            """The terminal page, its URLs taken from the address the browser used."""
            if self.full:
                return web.Response(
                    text=busy_page(self.max_sessions), content_type="text/html", status=503
                )
            base = f"{request.scheme}://{request.host}"
            context = {
                "font_size": to_int(request.query.get("fontsize", "16"), 16),
                "app_websocket_url": "ws" + base.removeprefix("http") + "/ws",
                "config": {"static": {"url": f"{base}/static/"}},
                "application": {"name": self.title},
                "kvtui": {"name": self.title} | page,
            }
            return aiohttp_jinja2.render_template("app_index.html", request, context)

        async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
            """A tab's session: its app process for as long as the websocket is open."""
            if not same_origin(request.headers.get("Origin"), request.host):
                raise web.HTTPForbidden(text="kvtui serve: a page from another site")
            websocket = web.WebSocketResponse(heartbeat=15)
            await websocket.prepare(request)
            if self.full:  # the page loaded while a slot was free: send it to the busy page
                await websocket.send_str(json.dumps(["open_url", {"url": "/", "new_tab": False}]))
                await websocket.close(code=WSCloseCode.TRY_AGAIN_LATER, message=b"busy")
                return websocket
            self.opened += 1
            number, peer = self.opened, request.remote or "?"
            service = AppProcess(
                self.command,
                write_bytes=websocket.send_bytes,
                write_str=websocket.send_str,
                close=websocket.close,
                download_manager=self.download_manager,
            )
            session = Session(websocket, service)
            self.sessions.add(session)
            try:
                width = to_int(request.query.get("width", "80"), 80)
                height = to_int(request.query.get("height", "24"), 24)
                await service.start(*terminal_size(width, height))
                await self._process_messages(websocket, service)
            except asyncio.CancelledError:
                await websocket.close()
                raise
            except Exception as exc:  # a malformed message from the page: this session ends
                logging.getLogger(__name__).warning(
                    "session %d (%s) ended: a message kvtui serve cannot read (%s)",
                    number,
                    peer,
                    error_line(exc),
                )
            finally:
                try:
                    await asyncio.shield(service.end(STOP_GRACE_SECONDS))
                finally:
                    self.sessions.discard(session)
                    session.ended.set()
            return websocket

        async def on_startup(self, app: web.Application) -> None:
            """textual-serve prints a banner here; `run` prints the address once listening."""

        async def on_shutdown(self, app: web.Application) -> None:
            """Close every tab's websocket and wait for its processes to end."""
            sessions = list(self.sessions)
            for session in sessions:
                await session.websocket.close(
                    code=WSCloseCode.GOING_AWAY, message=b"kvtui serve stopped"
                )
            if sessions:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        asyncio.gather(*(s.ended.wait() for s in sessions)),
                        STOP_GRACE_SECONDS + 3,
                    )

        async def run(self, on_ready: Any) -> None:
            """Serve on the bound sockets until SIGINT or SIGTERM."""
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError):
                    loop.add_signal_handler(sig, stop.set)
            runner = web.AppRunner(await self._make_app(), access_log=None)
            await runner.setup()
            try:
                for sock in self.sockets:
                    await web.SockSite(runner, sock, shutdown_timeout=STOP_GRACE_SECONDS).start()
                on_ready()
                await stop.wait()
            finally:
                await runner.cleanup()

    return KvtuiServer()


# --- the log: one line per event, never a traceback, rate-limited --------------------------------

LOG_BURST = 10
"""Lines the server's log may write at once; then LOG_LINES_PER_SECOND more each second."""
LOG_LINES_PER_SECOND = 0.5


class OneLineLog(logging.StreamHandler):  # type: ignore[type-arg]
    """The server's log on its terminal: each record one line, `kvtui serve: what happened:
    ExceptionType: its first line`, never a traceback (aiohttp logs every malformed request with
    one, about 30 lines); at most LOG_BURST lines at once and LOG_LINES_PER_SECOND after, so that
    no client can flood the presenter's terminal; the lines left out are counted on the next."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._tokens, self._at, self._left_out = float(LOG_BURST), time.monotonic(), 0

    def format(self, record: logging.LogRecord) -> str:
        words = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            words += f": {error_line(record.exc_info[1])}"
        return safe_text(f"kvtui serve: {words}", one_line=True)[:400]

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        self._tokens = min(LOG_BURST, self._tokens + (now - self._at) * LOG_LINES_PER_SECOND)
        self._at = now
        if self._tokens < 1:
            self._left_out += 1
            return
        self._tokens -= 1
        if self._left_out:
            record = logging.makeLogRecord(record.__dict__)
            record.msg = f"{record.getMessage()} ({self._left_out:,} more lines left out)"
            record.args, self._left_out = None, 0
        super().emit(record)


def install_log(stream: Any) -> logging.Handler:
    """The server's log (`OneLineLog` on `stream`) as the root logger's: warnings and errors of
    kvtui, aiohttp (a bad request) and asyncio alike. Returns the handler."""
    handler = OneLineLog(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    return handler


def cmd_serve(args: argparse.Namespace) -> int:
    """`kvtui serve`: check everything that can be checked, then serve until Ctrl+C."""
    try:
        import textual_serve.server  # noqa: F401
    except ImportError:
        raise UsageError(f"kvtui serve: needs textual-serve: {INSTALL_HINT}") from None
    from kvtui.engines.factory import check_engine
    from kvtui.options import settings_from_args

    try:
        check_engine(settings_from_args(args, default_tokens=DEFAULT_APP_TOKENS))
    except EngineError as exc:
        raise UsageError(f"kvtui serve: {exc}") from None
    sockets = bind_sockets(args.host, args.port)
    if not is_loopback(sockets):
        print(
            f"kvtui serve: warning: listening on {args.host}: anyone who can reach it can open "
            "a session (there is no password)",
            file=sys.stderr,
        )
    command = app_command(args)
    from kvtui.bigtext import IDEA, SUBTITLE, TITLE

    words = {"name": TITLE, "subtitle": SUBTITLE, "idea": IDEA if args.present else ""}
    light = {"body_class": "kvtui-light"} if args.theme == "light" else {}
    server = make_server(command, sockets, args.max_sessions, **words, **light)
    install_log(sys.stderr)

    def on_ready() -> None:
        url = browser_url(args.host, args.port)
        print(
            f"kvtui serve: open {url} in a browser (up to {args.max_sessions} tabs at once; "
            "Ctrl+C stops)",
            flush=True,
        )

    try:
        asyncio.run(server.run(on_ready))
    except OSError as exc:
        raise UsageError(_bind_error(args.host, args.port, exc)) from None
    finally:
        for sock in sockets:
            sock.close()
    return 0
