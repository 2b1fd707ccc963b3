"""A stand-in for a vLLM server, for the faults a real one will not show on cue: a server that
dies mid-stream, one without /metrics, one that answers garbage. The real behaviour is tested
against a real vLLM (test_real_server.py); this answers the same routes the same way (its
/metrics is a text captured from vLLM 0.32), from a thread of the test's process."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

METRICS = (Path(__file__).parents[1] / "engines" / "data" / "vllm-0.32-busy.txt").read_text()


class _QuietServer(ThreadingHTTPServer):
    """A server that says nothing of a client that went away mid-answer (as kvtui does when it
    has what it asked for): socketserver prints each such error's traceback on stderr."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class FakeVLLM:
    """A fake server on a free loopback port: `url`, `start()`, `kill()` (the listening socket
    and every open stream closed at once, as a killed server's), `close()`.

    `metrics`: the /metrics text, or None for a 404. `models`: the /v1/models answer.
    `die_after`: the server dies (`kill`) after streaming this many tokens. `token_delay_s`:
    the pause between streamed tokens. `hold`: a completion's answer waits for it to be set
    (a request queued behind a full KV cache); `streamed` counts the tokens each completion
    wrote before it ended or its client went away.

    To lie (tests/vllm/test_hostile_server.py): `replies` maps a path to the raw bytes answered
    for it, whatever was asked (a 200, no Content-Length: the body ends as the connection
    closes); `chunk(i)` is the bytes of the stream's i-th event, in place of a token's
    `data: {...}` line; `forever` streams past `max_tokens`, until the client goes; `drip_s`
    sends every answer a byte at a time, this long apart."""

    def __init__(
        self,
        *,
        metrics: str | None = METRICS,
        models: Any = None,
        die_after: int | None = None,
        token_delay_s: float = 0.01,
        max_model_len: int = 512,
        hold: threading.Event | None = None,
        replies: dict[str, bytes] | None = None,
        chunk: Callable[[int], bytes] | None = None,
        forever: bool = False,
        drip_s: float = 0.0,
        drip_paths: tuple[str, ...] = (),
    ) -> None:
        self.metrics, self.die_after, self.token_delay_s = metrics, die_after, token_delay_s
        self.hold = hold
        self.replies, self.chunk, self.forever, self.drip_s = replies or {}, chunk, forever, drip_s
        self.drip_paths = drip_paths
        self.streamed: list[int] = []
        self.models = models or {
            "object": "list",
            "data": [{"id": "fake-model", "root": "fake-model", "max_model_len": max_model_len}],
        }
        self.requests: list[str] = []
        self.killed = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _write(self, data: bytes) -> None:
                if fake.killed.is_set():  # a closed server's handlers stop writing
                    raise ConnectionAbortedError("the server was closed")
                if not fake.drip_s or fake.drip_paths and self.path not in fake.drip_paths:
                    self.wfile.write(data)
                    return
                for i in range(len(data)):
                    if fake.killed.is_set():
                        raise ConnectionAbortedError("the server was closed")
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
                    time.sleep(fake.drip_s)

            def _json(self, body: Any, status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self._write(data)

            def _lie(self) -> bool:
                """Answer the raw bytes `replies` holds for this path, if any."""
                data = fake.replies.get(self.path)
                if data is None:
                    return False
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                with contextlib.suppress(OSError):
                    self._write(data)
                self.close_connection = True
                return True

            def _body(self) -> Any:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def do_GET(self) -> None:  # noqa: N802
                fake.requests.append(f"GET {self.path}")
                if self._lie():
                    return
                if self.path == "/v1/models":
                    self._json(fake.models)
                elif self.path == "/version":
                    self._json({"version": "0.32.0"})
                elif self.path == "/metrics" and fake.metrics is not None:
                    data = fake.metrics.encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self._write(data)
                else:
                    self._json({"detail": "Not Found"}, 404)

            def do_POST(self) -> None:  # noqa: N802
                fake.requests.append(f"POST {self.path}")
                body = self._body()
                if self._lie():
                    return
                if self.path == "/tokenize":
                    self._json({"tokens": list(body["prompt"].encode()), "max_model_len": 512})
                elif self.path == "/detokenize":
                    self._json({"prompt": bytes(body["tokens"]).decode("utf-8", "replace")})
                elif self.path == "/v1/completions":
                    self._stream(body)
                else:
                    self._json({"detail": "Not Found"}, 404)

            def _stream(self, body: dict[str, Any]) -> None:
                if fake.hold is not None:
                    fake.hold.wait(timeout=30)
                sent = 0
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    i = 0
                    while fake.forever or i < int(body["max_tokens"]):
                        if fake.die_after is not None and i >= fake.die_after:
                            fake.kill()
                            return
                        if fake.chunk is not None:
                            self._write(fake.chunk(i))
                        else:
                            token = 97 + i % 26
                            chunk = {"choices": [{"text": chr(token), "token_ids": [token]}]}
                            self._write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        sent, i = sent + 1, i + 1
                        if fake.token_delay_s:
                            time.sleep(fake.token_delay_s)
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except OSError:  # the client went away: a server aborts the request
                    pass
                finally:
                    fake.streamed.append(sent)
                    self.close_connection = True

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def start(self) -> FakeVLLM:
        self._thread.start()
        return self

    def kill(self) -> None:
        """Die at once: stop listening and drop the connections, as a killed process would."""
        if self.killed.is_set():
            return
        self.killed.set()
        self._server.socket.close()  # connections are refused from now on
        threading.Thread(target=self._server.shutdown, daemon=True).start()

    def close(self) -> None:
        self.kill()
        self._thread.join(timeout=5)
