"""Talking to a serving engine over HTTP, bounded, without a UI or a dependency: at the URL a user
gives (`vllm:URL`, `kvtui load URL`, checked once: kvtui.engines.vllm.url), JSON, text and a
server-sent event stream read from it, every request bounded in time and bytes whatever the
server does, and every string it says made safe where it enters.

Only the URL given is contacted: `http.client` follows no redirect and uses no proxy from the
environment (urllib would do both), and every path is joined to the URL's own host and port.
Every failure is a `ServerError` of one line a person can read ("no answer from
http://127.0.0.1:8000: connection refused"), never a traceback.

The bounds, each a constant below:

- time: each request has a deadline for the whole of it, kept by the socket itself (`_Clock`): a
  read waits at most READ_WAIT_S (a stream's, as below) and never past the deadline, so a server
  that sends one byte a second keeps no request alive past it. A plain request (JSON, text) is whole
  within REQUEST_DEADLINE_S. A stream's deadline moves on only with a token: the first must come
  within STREAM_IDLE_S (a request waits, sending nothing, while the server has no KV-cache room),
  and each later one within STREAM_IDLE_S of the one before (a keep-alive comment is no token); a
  line once begun must end within LINE_WAIT_S; and the caller gives the stream's end
  (`EventStream.until`). `EventStream.close()`, from any thread, shuts the socket under a read
  blocked in another (http.client drops its own reference on `Connection: close`; the clock keeps
  one);
- bytes: a plain answer of at most its caller's limit, a stream line of at most MAX_LINE_BYTES
  and a stream of at most its caller's `max_bytes`; JSON no deeper than Python parses, with no
  NaN or infinity (kvtui.inputs.parse_json);
- text: every string of an answer goes through `server_text` (kvtui.format.safe_text) as it is
  parsed: control characters (ESC, so no escape code; C1; CR) are written as escapes, and newlines
  too except in the fields that hold generated text (`TEXT_KEYS`). Rich markup in it is drawn as
  text by the screens (they never parse a server's words as markup).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvtui.engines.vllm.url import ServerURL
from kvtui.errors import EngineError
from kvtui.format import safe_text
from kvtui.inputs import parse_json

READ_WAIT_S = 5.0
"""The longest any one wait for the server may take (a connection, a read), but for the rest of a
stream's line once begun (LINE_WAIT_S) and a stream's next token (STREAM_IDLE_S)."""
LINE_WAIT_S = 30.0
"""The longest a line of a stream may take, from its first byte to its newline: a server that
drips one line's bytes is cut then, not STREAM_IDLE_S after its last token. A server writes a line
at once; what can hold the rest back is its event loop, on a machine it saturates (vLLM on two
cores, its requests 20 s from their first token, once took over 5 s)."""
REQUEST_DEADLINE_S = 10.0
"""The longest a plain request (a model list, /metrics, a tokenized prompt) may take, whole."""
STREAM_IDLE_S = 120.0
"""The longest a stream may go without a token: a request waiting for KV-cache room sends nothing
until it is scheduled, and on a full server that can take a while."""
MAX_JSON_BYTES = 4 * 2**20
"""The largest JSON answer read (a model list, a tokenized prompt)."""
MAX_LINE_BYTES = 2**20
"""The longest line of a stream read (a chunk of one or a few tokens is a few hundred bytes)."""
MAX_TEXT_CHARS = 4096
"""The longest string kept of an answer's fields (a token's text, a model's name, a reason): the
rest is cut, with "..." (the JSON itself is bounded by its bytes)."""
TEXT_KEYS = frozenset({"text", "prompt"})
"""The fields of an answer that hold generated text (a completion's, a detokenized prompt's):
their newlines and tabs are kept. Every other string is one line."""
_READ_CHUNK = 65536


class ServerError(EngineError):
    """The server cannot be reached, or answered something kvtui cannot read: one line."""


def server_text(value: str, *, lines: bool = False) -> str:
    """A string a server said, as kvtui keeps it: at most MAX_TEXT_CHARS, every control character
    written as an escape (kvtui.format.safe_text), newlines and tabs too unless `lines`."""
    if len(value) > MAX_TEXT_CHARS:
        value = value[: MAX_TEXT_CHARS - 3] + "..."
    return safe_text(value, one_line=not lines)


def _safe(data: Any) -> Any:
    """Parsed JSON with every string made safe (`server_text`), keys too: a field of TEXT_KEYS
    keeps its newlines. Iterative: a deep answer costs no recursion."""
    root: list[Any] = [data]
    stack: list[tuple[Any, Any, bool]] = [(root, 0, False)]
    while stack:
        parent, key, lines = stack.pop()
        value = parent[key]
        if isinstance(value, str):
            parent[key] = server_text(value, lines=lines)
        elif isinstance(value, list):
            stack.extend((value, i, lines) for i, v in enumerate(value) if _nested(v))
        elif isinstance(value, dict):
            safe = {server_text(k) if isinstance(k, str) else k: v for k, v in value.items()}
            value.clear()
            value.update(safe)
            stack.extend((value, k, k in TEXT_KEYS) for k in value)
    return root[0]


def _nested(value: Any) -> bool:
    return isinstance(value, str | list | dict)


def _json(data: bytes) -> Any:
    """JSON as RFC 8259 has it (kvtui.inputs.parse_json: no NaN, no infinity, no nesting past
    what Python parses), its strings made safe; ValueError if it is not."""
    return _safe(parse_json(data.decode("utf-8", errors="replace")))


class _Clock:
    """A request's deadline, kept by its socket: each of the socket's reads and writes waits at
    most `wait` and never past `deadline` (`time.monotonic`), which its owner may move on (a
    stream does, with each token). Holds the socket, so that `shut()` reaches it from any
    thread even after http.client dropped its own reference."""

    def __init__(self, deadline: float, wait: float = READ_WAIT_S) -> None:
        self.deadline, self.wait = deadline, wait
        self.sock: socket.socket | None = None

    @property
    def expired(self) -> bool:
        """Whether the deadline has passed (a read that timed out ended at it, or before)."""
        return time.monotonic() >= self.deadline - 0.005

    def arm(self, sock: socket.socket) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("past the request's deadline")
        sock.settimeout(min(self.wait, left))

    def shut(self) -> None:
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


_NO_DEADLINE = _Clock(math.inf)
"""The clock of a timed socket before its connection gives it its own (a TLS handshake)."""


class _TimedSocket(socket.socket):
    """A socket whose every read and write is bounded by its `_Clock`."""

    clock: _Clock = _NO_DEADLINE

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self.clock.arm(self)
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self.clock.arm(self)
        return super().recv(bufsize, flags)

    def sendall(self, data: Any, flags: int = 0) -> None:
        self.clock.arm(self)
        super().sendall(data, flags)


class _TimedSSLSocket(ssl.SSLSocket):
    """A TLS socket whose every read and write is bounded by its `_Clock`."""

    clock: _Clock = _NO_DEADLINE

    def recv_into(self, buffer: Any, nbytes: int | None = None, flags: int = 0) -> int:
        self.clock.arm(self)
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        self.clock.arm(self)
        return super().recv(buflen, flags)

    def sendall(self, data: Any, flags: int = 0) -> None:
        self.clock.arm(self)
        super().sendall(data, flags)


class _Connection(http.client.HTTPConnection):
    """An HTTP connection whose socket is a `_TimedSocket` of `clock`."""

    def __init__(self, host: str, port: int, clock: _Clock) -> None:
        super().__init__(
            host, port, timeout=min(READ_WAIT_S, clock.wait, max(0.01, clock.deadline - _now()))
        )
        self.clock = clock

    def connect(self) -> None:
        super().connect()
        plain = self.sock
        timed = _TimedSocket(fileno=plain.detach())
        timed.clock = self.clock
        self.sock = self.clock.sock = timed


class _TLSConnection(http.client.HTTPSConnection):
    """An HTTPS connection whose socket is a `_TimedSSLSocket` of `clock`."""

    def __init__(self, host: str, port: int, clock: _Clock) -> None:
        context = ssl.create_default_context()
        context.sslsocket_class = _TimedSSLSocket
        wait = min(READ_WAIT_S, clock.wait, max(0.01, clock.deadline - _now()))
        super().__init__(host, port, timeout=wait, context=context)
        self.clock = clock

    def connect(self) -> None:
        super().connect()
        sock = self.sock
        assert isinstance(sock, _TimedSSLSocket)  # the context's socket class
        sock.clock = self.clock
        self.clock.sock = sock


def _now() -> float:
    return time.monotonic()


class Server:
    """Requests to one server: JSON, text and a stream, each bounded in time and bytes."""

    def __init__(
        self, url: ServerURL, deadline_s: float = REQUEST_DEADLINE_S, *, until: float = math.inf
    ) -> None:
        self.url = url
        self.deadline_s = deadline_s
        self.until = until
        """A deadline (`time.monotonic`) every request of this server keeps as well as its
        own: the questions an engine asks before it runs, within one bound."""

    def _failed(self, exc: BaseException) -> ServerError:
        if isinstance(exc, socket.timeout | TimeoutError):
            why = "no answer in time"
        elif isinstance(exc, ConnectionRefusedError):
            why = "connection refused"
        elif isinstance(exc, socket.gaierror):
            why = f"unknown host {self.url.host}"
        elif isinstance(exc, ssl.SSLError):
            why = f"TLS: {exc.reason or exc}"
        elif isinstance(exc, http.client.IncompleteRead | http.client.RemoteDisconnected):
            why = "the connection closed mid-answer"
        elif isinstance(exc, http.client.HTTPException):
            why = f"not an HTTP answer ({type(exc).__name__})"
        elif isinstance(exc, OSError) and exc.strerror:
            why = exc.strerror.lower()
        else:
            why = str(exc) or type(exc).__name__
        return ServerError(f"no answer from {self.url}: {server_text(why)}")

    def _request(
        self, method: str, path: str, body: Any, clock: _Clock
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        url = self.url
        conn: http.client.HTTPConnection
        if url.scheme == "https":
            conn = _TLSConnection(url.host, url.port, clock)
        else:
            conn = _Connection(url.host, url.port, clock)
        headers = {"Accept": "*/*", "User-Agent": "kvtui"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, url.prefix + path, body=data, headers=headers)
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            conn.close()
            raise self._failed(exc) from None

    def _read(self, response: http.client.HTTPResponse, limit: int, path: str) -> bytes:
        data = response.read(limit + 1)  # each read of the socket is bounded by the clock
        if len(data) > limit:
            raise ServerError(f"{self.url}{path} answered more than {_size(limit)}")
        return data

    def _check(self, response: http.client.HTTPResponse, data: bytes, path: str) -> None:
        if 200 <= response.status < 300:
            return
        raise ServerError(
            f"{self.url}{path} answered HTTP {response.status}" + _error_message(data)
        )

    def _body(self, path: str, body: Any, limit: int) -> bytes:
        """A GET's (or, with a body, a POST's) answer, read whole (at most `limit` bytes, within
        the request's deadline) and checked."""
        clock = _Clock(min(self.until, _now() + self.deadline_s))
        conn, response = self._request("GET" if body is None else "POST", path, body, clock)
        try:
            data = self._read(response, limit, path)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise self._failed(exc) from None
        finally:
            conn.close()
            clock.shut()
        self._check(response, data, path)
        return data

    def text(self, path: str, limit: int) -> str:
        """A GET's body as text: UTF-8 (bad bytes replaced), its lines ended by newlines only,
        made safe (`server_text`, newlines kept)."""
        data = self._body(path, None, limit).decode("utf-8", errors="replace")
        return safe_text(data.replace("\r\n", "\n"))

    def json(self, path: str, body: Any = None, limit: int = MAX_JSON_BYTES) -> Any:
        """A GET's (or, with a body, a POST's) JSON answer, its strings made safe."""
        data = self._body(path, body, limit)
        try:
            return _json(data)
        except ValueError:
            raise ServerError(f"{self.url}{path} did not answer JSON") from None

    def stream(
        self, path: str, body: Any, *, until: float = math.inf, max_bytes: int = 2**30
    ) -> EventStream:
        """A POST whose answer is a stream of server-sent events (`data: ...` lines), read at
        most until `until` (`time.monotonic`) and `max_bytes` bytes (see the module's
        docstring for the stream's other bounds)."""
        until = min(until, self.until)
        # a request vLLM queues (no KV room, or --max-num-seqs running) may get nothing until it
        # is scheduled: its headers and first token may take STREAM_IDLE_S, not READ_WAIT_S (56
        # of 120 requests of a fill failed so at max-num-seqs 4); a line once begun LINE_WAIT_S
        clock = _Clock(min(until, _now() + STREAM_IDLE_S), wait=STREAM_IDLE_S)
        conn, response = self._request("POST", path, body, clock)
        clock.wait = READ_WAIT_S
        if not 200 <= response.status < 300:
            try:
                data = response.read(MAX_JSON_BYTES)
            except (OSError, http.client.HTTPException, ValueError):
                data = b""
            conn.close()
            clock.shut()
            self._check(response, data, path)
        return EventStream(self, conn, response, clock, until=until, max_bytes=max_bytes)


class EventStream:
    """The `data:` payloads of a server-sent event stream, parsed (their strings made safe), one
    at a time, until `[DONE]` or the end; `close()` (from any thread) ends it and closes the
    connection, which tells a vLLM server to abort the request. A payload carrying tokens
    (`progress()`, called by the reader) gives the stream STREAM_IDLE_S more, up to `until`."""

    def __init__(
        self,
        server: Server,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        clock: _Clock,
        *,
        until: float = math.inf,
        max_bytes: int = 2**30,
    ) -> None:
        self._server, self._conn, self._response, self._clock = server, conn, response, clock
        self.until, self.max_bytes = until, max_bytes
        self._closed = threading.Event()
        self._reading = False
        self._idle_until = clock.deadline
        self._late = ""
        """Why the stream's deadline, when it passes, passed: said in its error."""
        self.done = False
        """Whether the stream ended with its `[DONE]` (else the connection closed before)."""
        self.read_bytes = 0

    def progress(self) -> None:
        """A token came: the next may take STREAM_IDLE_S (never past `until`)."""
        self._idle_until = min(self.until, _now() + STREAM_IDLE_S)
        self._clock.deadline = self._idle_until

    def wind_down(self, seconds: float = READ_WAIT_S, extra_bytes: int = 65_536) -> None:
        """All that was asked for has come: what is left (a usage chunk, `[DONE]`) may take
        `seconds` and `extra_bytes` more, no more (a server streaming on is then cut)."""
        self.until = min(self.until, _now() + seconds)
        self._idle_until = min(self._idle_until, self.until)
        self.max_bytes = min(self.max_bytes, self.read_bytes + extra_bytes)

    def _lines(self) -> Iterator[bytes]:
        """The stream's lines, each whole within LINE_WAIT_S of its first byte, at most
        MAX_LINE_BYTES, all of them at most `max_bytes`, none read after the deadline."""
        pending = bytearray()
        began: float | None = None
        """When the line in `pending` began (None: between lines)."""
        while not self._closed.is_set():
            if began is None:  # between lines a read waits for the idle deadline, not a wait
                self._clock.deadline, self._clock.wait = self._idle_until, STREAM_IDLE_S
                self._late = (
                    "streamed past kvtui's time limit"
                    if self._idle_until >= self.until
                    else f"sent no token for {STREAM_IDLE_S:g} s"
                )
            else:
                self._clock.deadline = min(self._idle_until, began + LINE_WAIT_S)
                self._clock.wait = LINE_WAIT_S
                self._late = f"sent a line too slowly (not whole within {LINE_WAIT_S:g} s)"
            chunk = self._response.read1(_READ_CHUNK)
            if not chunk:
                return
            self.read_bytes += len(chunk)
            if self.read_bytes > self.max_bytes:
                raise ServerError(
                    f"{self._server.url} streamed more than {_size(self.max_bytes)} for what "
                    "kvtui asked"
                )
            start = len(pending)
            pending += chunk
            while (end := pending.find(b"\n", start)) >= 0:
                line = bytes(pending[:end])
                del pending[: end + 1]
                start, began = 0, None
                yield line
            if pending and began is None:
                began = _now()
            if len(pending) > MAX_LINE_BYTES:
                raise ServerError(
                    f"{self._server.url} streamed a line over {_size(MAX_LINE_BYTES)}"
                )

    def __iter__(self) -> Iterator[Any]:
        self._reading = True
        try:
            for line in self._lines():
                if len(line) > MAX_LINE_BYTES:
                    raise ServerError(
                        f"{self._server.url} streamed a line over {_size(MAX_LINE_BYTES)}"
                    )
                if not line.startswith(b"data:"):
                    continue  # a comment (`: keep-alive`), an event's name, a blank line
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    return
                try:
                    yield _json(payload)
                except ValueError:
                    raise ServerError(f"{self._server.url} streamed something not JSON") from None
        except ServerError:
            raise
        except Exception as exc:  # http.client, its socket shut under it by `close`: any error
            if self._closed.is_set():
                return
            if isinstance(exc, TimeoutError) and self._clock.expired:
                raise ServerError(f"{self._server.url} {self._late}") from None
            raise self._server._failed(exc) from None
        finally:
            self._closed.set()
            self._conn.close()
            self._clock.shut()

    def close(self) -> None:
        """End the stream now, from any thread: shut its socket (a read blocked in another
        thread returns), and close the connection unless a reader is at it (it closes it)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._clock.shut()
        if not self._reading:
            self._conn.close()


def _size(limit: int) -> str:
    return f"{limit // 2**20:,} MiB" if limit >= 2**20 else f"{limit:,} bytes"


def _error_message(data: bytes) -> str:
    """The reason in a server's error answer (OpenAI's `{"error": {"message": ...}}`, FastAPI's
    `{"detail": ...}`), as ": reason" on one line, or nothing."""
    try:
        body = _json(data)
    except ValueError:
        return ""
    message: Any = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        message = message or body.get("message") or body.get("detail")
    if not isinstance(message, str) or not message.strip():
        return ""
    line = " ".join(message.split())
    return ": " + (line if len(line) <= 200 else line[:197] + "...")
