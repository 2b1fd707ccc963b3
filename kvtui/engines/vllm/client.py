"""Talking to a serving engine over HTTP, bounded, without a UI or a dependency: the URL a user
gives (`vllm:URL`, `kvtui load URL`) checked once, and JSON, text and a server-sent event stream
read from it with a timeout on every request and a cap on every byte count.

Only the URL given is contacted: `http.client` follows no redirect and uses no proxy from the
environment (urllib would do both), and every path is joined to the URL's own host and port.
Every failure is a `ServerError` of one line a person can read ("no answer from
http://127.0.0.1:8000: connection refused"), never a traceback.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvtui.errors import EngineError

REQUEST_TIMEOUT_S = 5.0
"""The longest kvtui waits for a connection or for any read of a plain request."""
STREAM_IDLE_S = 120.0
"""The longest a stream may send nothing: a request waiting for KV-cache room sends no byte until
it is scheduled, and on a full server that can take a while."""
MAX_JSON_BYTES = 4 * 2**20
"""The largest JSON answer read (a model list, a tokenized prompt)."""
MAX_LINE_BYTES = 2**20
"""The longest line of a stream read (a chunk of one or a few tokens is a few hundred bytes)."""


class ServerError(EngineError):
    """The server cannot be reached, or answered something kvtui cannot read: one line."""


@dataclass(frozen=True)
class ServerURL:
    """A server's base URL, checked: http or https, a host, a port (the scheme's by default), an
    optional path prefix (a proxy's), no credentials, query or fragment."""

    scheme: str
    host: str
    port: int
    prefix: str = ""
    """A path before the API's own (`/v1/...`), without its trailing slash."""

    @classmethod
    def parse(cls, text: str, what: str = "the server URL") -> ServerURL:
        """The URL `text`, or `EngineError` with one line saying what is wrong with it. A
        trailing `/v1` (the OpenAI client's base URL) is taken off."""
        shown = repr(text) if len(text) <= 60 else repr(text[:57] + "...")
        if any(ord(c) < 33 or ord(c) == 127 for c in text):
            raise EngineError(f"{what} {shown} holds spaces or control characters")
        try:
            parts = urlsplit(text)
            port = parts.port
        except ValueError as exc:
            raise EngineError(f"{what} {shown} is not a URL: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise EngineError(
                f"{what} {shown} must start with http:// or https://, e.g. http://127.0.0.1:8000"
            )
        if parts.username is not None or parts.password is not None:
            raise EngineError(f"{what} {shown} holds credentials; kvtui sends none")
        if not parts.hostname:
            raise EngineError(f"{what} {shown} has no host, e.g. http://127.0.0.1:8000")
        if parts.query or parts.fragment or text.endswith(("?", "#")):
            raise EngineError(f"{what} {shown} has a query or fragment; give the server's base URL")
        if port == 0:
            raise EngineError(f"{what} {shown}: port 0 is not a port")
        prefix = parts.path.rstrip("/")
        prefix = prefix.removesuffix("/v1")
        default = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, parts.hostname, port or default, prefix)

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.prefix}"


class Server:
    """Requests to one server: JSON, text and a stream, each bounded in time and bytes."""

    def __init__(self, url: ServerURL, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.url = url
        self.timeout = timeout

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.url.scheme == "https":
            context = ssl.create_default_context()
            return http.client.HTTPSConnection(
                self.url.host, self.url.port, timeout=timeout, context=context
            )
        return http.client.HTTPConnection(self.url.host, self.url.port, timeout=timeout)

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
        elif isinstance(exc, OSError) and exc.strerror:
            why = exc.strerror.lower()
        else:
            why = str(exc) or type(exc).__name__
        return ServerError(f"no answer from {self.url}: {why}")

    def _request(
        self, method: str, path: str, body: Any, timeout: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connection(timeout)
        headers = {"Accept": "*/*", "User-Agent": "kvtui"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, self.url.prefix + path, body=data, headers=headers)
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise self._failed(exc) from None

    def _read(self, response: http.client.HTTPResponse, limit: int, path: str) -> bytes:
        data = response.read(limit + 1)
        if len(data) > limit:
            raise ServerError(f"{self.url}{path} answered more than {limit // 2**20} MiB")
        return data

    def _check(self, response: http.client.HTTPResponse, data: bytes, path: str) -> None:
        if 200 <= response.status < 300:
            return
        raise ServerError(
            f"{self.url}{path} answered HTTP {response.status}" + _error_message(data)
        )

    def _body(self, path: str, body: Any, limit: int) -> bytes:
        """A GET's (or, with a body, a POST's) answer, read whole (at most `limit` bytes) and
        checked."""
        conn, response = self._request("GET" if body is None else "POST", path, body, self.timeout)
        try:
            data = self._read(response, limit, path)
        except (OSError, http.client.HTTPException) as exc:
            raise self._failed(exc) from None
        finally:
            conn.close()
        self._check(response, data, path)
        return data

    def text(self, path: str, limit: int) -> str:
        """A GET's body as text (UTF-8, bad bytes replaced)."""
        return self._body(path, None, limit).decode("utf-8", errors="replace")

    def json(self, path: str, body: Any = None, limit: int = MAX_JSON_BYTES) -> Any:
        """A GET's (or, with a body, a POST's) JSON answer."""
        data = self._body(path, body, limit)
        try:
            return json.loads(data)
        except ValueError:
            raise ServerError(f"{self.url}{path} did not answer JSON") from None

    def stream(self, path: str, body: Any, idle: float = STREAM_IDLE_S) -> EventStream:
        """A POST whose answer is a stream of server-sent events (`data: ...` lines)."""
        conn, response = self._request("POST", path, body, idle)
        if not 200 <= response.status < 300:
            try:
                data = response.read(MAX_JSON_BYTES)
            except (OSError, http.client.HTTPException):
                data = b""
            conn.close()
            self._check(response, data, path)
        return EventStream(self, conn, response)


class EventStream:
    """The `data:` payloads of a server-sent event stream, one at a time, until `[DONE]` or the
    end; `close()` (from any thread) ends it and closes the connection, which tells a vLLM
    server to abort the request."""

    def __init__(
        self, server: Server, conn: http.client.HTTPConnection, response: http.client.HTTPResponse
    ) -> None:
        self._server, self._conn, self._response = server, conn, response
        self._closed = threading.Event()
        self._reading = False
        self.done = False
        """Whether the stream ended with its `[DONE]` (else the connection closed before)."""

    def __iter__(self) -> Iterator[Any]:
        self._reading = True
        try:
            while not self._closed.is_set():
                line = self._response.readline(MAX_LINE_BYTES + 1)
                if not line:
                    return
                if len(line) > MAX_LINE_BYTES:
                    raise ServerError(f"{self._server.url} streamed a line over 1 MiB")
                text = line.decode("utf-8", errors="replace").strip()
                if not text.startswith("data:"):
                    continue
                payload = text[5:].strip()
                if payload == "[DONE]":
                    self.done = True
                    return
                try:
                    yield json.loads(payload)
                except ValueError:
                    raise ServerError(f"{self._server.url} streamed something not JSON") from None
        except ServerError:
            raise
        except Exception as exc:  # http.client, its socket shut under it by `close`: any error
            if self._closed.is_set():
                return
            raise self._server._failed(exc) from None
        finally:
            self._closed.set()
            self._conn.close()

    def close(self) -> None:
        """End the stream now, from any thread: shut its socket (a read blocked in another
        thread returns), and close the connection unless a reader is at it (it closes it)."""
        if self._closed.is_set():
            return
        self._closed.set()
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if not self._reading:
            self._conn.close()


def _error_message(data: bytes) -> str:
    """The reason in a server's error answer (OpenAI's `{"error": {"message": ...}}`, FastAPI's
    `{"detail": ...}`), as ": reason" on one line, or nothing."""
    try:
        body = json.loads(data)
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
