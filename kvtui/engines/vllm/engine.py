"""A running vLLM server as a decode engine (`vllm:URL`), without torch or a UI.

kvtui does not run the model here: the server does, and kvtui watches it through its
OpenAI-compatible API and its Prometheus `/metrics`, the way a person serving a model that
outgrew one GPU would. What is measured, and by whom, is said everywhere:

- the completion's tokens are streamed (`/v1/completions`, `stream`, `return_token_ids`,
  `ignore_eos`) and each is timed client-side, on kvtui's clock: the first from the request to
  its arrival (time to first token, HTTP and queueing included), each later one from the one
  before (a chunk of several tokens times its first; the rest arrived with it, 0 s);
- what a remote server's tensors hold cannot be observed from here: a step's positions computed,
  FLOPs and KV bytes are 0 in its `StepSample`, never the formula's figure under a measured
  caption (`RunStarted.served_by` says the run is a served one, and the screens show the
  server's own figures instead);
- `/metrics` is read once before the request (the baseline of what it changes, and so that
  kvtui's own poll does not delay its first token), then every POLL_INTERVAL_S (2 a second) by a
  thread of its own, while the completion streams and after it, until the run is stopped
  (`watch`), and once more when it has finished; each poll becomes a
  `ServerMetrics` event of the server's figures (kvtui.engines.vllm.metrics), or of why there are
  none (no answer, no such metrics);
- kvtui's own prediction of the server's KV cache comes from the model's `config.json`, when it
  can be found on this machine (the served path, or the Hugging Face cache for a hub name): its
  bytes per token, in `RunStarted` as every engine sends them (kvtui.run.serving compares).

Only the URL given is contacted (kvtui.engines.vllm.client). A server that goes away mid-run ends
the loop with an error that says so, after the tokens it did stream; the polls go on saying it does
not answer, and pick up again if it comes back.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from kvtui.engines.capabilities import SERVED
from kvtui.engines.protocol import (
    Loop,
    RunControl,
    RunFinished,
    RunSettings,
    RunStarted,
    ServerMetrics,
    StepSample,
)
from kvtui.engines.vllm.client import (
    MAX_JSON_BYTES,
    MAX_LINE_BYTES,
    STREAM_IDLE_S,
    Server,
    ServerError,
)
from kvtui.engines.vllm.metrics import MAX_METRICS_BYTES, MetricsError, server_metrics
from kvtui.engines.vllm.url import ServerURL
from kvtui.errors import EngineError
from kvtui.format import error_line
from kvtui.sim.catalog import ConfigError, ModelSpec, activation_dtype
from kvtui.sim.hf_config import model_from_hf_config
from kvtui.sim.memory import kv_bytes_per_token

POLL_INTERVAL_S = 0.5
"""How often /metrics is read: 2 a second, a few KB each (vLLM 0.32: about 60 KB)."""
WAIT_S = 0.25
"""How long the engine waits for the next token or poll before it lets its caller look up (to
see a stop)."""
MAX_PROMPT_TOKENS = 1_000_000
"""The longest tokenized prompt taken from a server."""
MAX_MODEL_LEN = 2**32
"""The longest max_model_len taken from a server (past it, as a length not said): past any
model's, and within what a record holds."""
LAST_POLL_S = 5.0
"""How long the last poll of each of a fleet's other replicas may take at the run's end (a
data-parallel server on a busy 2-core machine took more than 2 s to answer)."""
PATH_MAX = 4096
"""The longest served path looked for on this machine (Linux's PATH_MAX)."""
OPEN_DEADLINE_S = 15.0
"""The longest the questions before a run (what it serves, the prompt's tokens) take in all."""
SECONDS_PER_TOKEN = 2.0
"""How long a stream may take a token, on average, after its first: a stream whose every token
comes (each within the client's STREAM_IDLE_S) but slower than this ends with an error at
STREAM_IDLE_S + tokens x this, rather than never."""
BYTES_PER_TOKEN = 65_536
"""The most bytes a stream may send per token asked for (a vLLM chunk of one token is about 300
bytes): past them it is cut."""


@dataclass(frozen=True)
class Served:
    """What the server says it serves, and what kvtui found of the model on this machine."""

    url: ServerURL
    model: str
    """The served model's name (the `model` of every request)."""
    root: str
    """Where the server loaded it from (a path or a hub name)."""
    max_model_len: int | None
    version: str
    spec: ModelSpec | None
    """The model's shape from its config.json, where found here; None otherwise."""
    config_source: str
    """Where the config.json came from, or why there is none, in words."""


def find_config(root: str, model: str) -> tuple[Path | None, str]:
    """The config.json of a served model on this machine, and where it was found (or why not):
    the served path itself, else a Hugging Face cache snapshot of a hub name (HF_HUB_CACHE,
    HF_HOME/hub or ~/.cache/huggingface/hub). Nothing is downloaded. A name no path could have
    (past PATH_MAX, a NUL) is looked for nowhere; a path that cannot be looked at is said."""
    names = [n for n in dict.fromkeys((root, model)) if n and len(n) < PATH_MAX and "\0" not in n]
    try:
        return _find_config(names, model)
    except (OSError, RuntimeError) as exc:  # no permission, a name too long; ~user unknown
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        return None, f"no config.json for {model} on this machine ({why.lower()})"


def _find_config(names: list[str], model: str) -> tuple[Path | None, str]:
    for name in names:
        if name and Path(name).expanduser().is_dir():
            path = Path(name).expanduser() / "config.json"
            return (path, f"{path}") if path.is_file() else (None, f"{name} has no config.json")
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
    )
    for name in names:
        if name.count("/") == 1 and ".." not in name:
            snapshots = Path(hub) / ("models--" + name.replace("/", "--")) / "snapshots"
            found = sorted(snapshots.glob("*/config.json")) if snapshots.is_dir() else []
            if found:
                return found[-1], f"{found[-1]} (the Hugging Face cache)"
    return None, f"no config.json for {model} on this machine (a path, or the Hugging Face cache)"


def read_served(url: ServerURL, *, until: float = math.inf) -> Served:
    """Ask the server what it serves (`/v1/models`, `/version`: each within the client's
    REQUEST_DEADLINE_S, both by `until`) and look for the model's config here; `ServerError`
    with one line when it does not answer as an OpenAI-compatible server."""
    server = Server(url, until=until)
    models = server.json("/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise ServerError(f"{url}/v1/models lists no model: is it an OpenAI-compatible server?")
    card = data[0]
    model = card.get("id")
    if not isinstance(model, str) or not model or len(model) > 1000:
        raise ServerError(f"{url}/v1/models gives no model id")
    root = card.get("root") if isinstance(card.get("root"), str) else model
    limit = card.get("max_model_len")
    if not (type(limit) is int and 0 < limit <= MAX_MODEL_LEN):
        limit = None  # not said, or past any model: unknown
    try:
        version = server.json("/version").get("version", "")
    except (ServerError, AttributeError):
        version = ""
    version = version if isinstance(version, str) and len(version) < 40 else ""
    path, source = find_config(str(root), model)
    spec = None
    if path is not None:
        try:
            spec = model_from_hf_config(path)
        except ConfigError as exc:
            source = f"{path} cannot be read ({exc})"
    return Served(url, model, str(root), limit, version, spec, source)


def _error_of(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, EngineError) else error_line(exc)


class _Poller(threading.Thread):
    """Reads one server's /metrics every POLL_INTERVAL_S into a queue until stopped, each poll
    tagged with the server's place in the fleet (`replica`)."""

    def __init__(
        self, server: Server, out: queue.Queue[object], opened: float, replica: int = 0
    ) -> None:
        super().__init__(name=f"kvtui-vllm-metrics-{replica}", daemon=True)
        self.server, self.out, self.opened, self.replica = server, out, opened, replica
        self.stopped = threading.Event()

    def poll(self) -> ServerMetrics:
        try:
            text = self.server.text("/metrics", MAX_METRICS_BYTES)
            polled = server_metrics(text, time.monotonic() - self.opened)
            return dataclasses.replace(polled, replica=self.replica)
        except ServerError as exc:
            error = str(exc)
            if "HTTP 404" in error:
                error = (
                    f"{self.server.url} has no /metrics (HTTP 404): only kvtui's own "
                    "client-side timings can be shown"
                )
        except MetricsError as exc:
            error = f"{self.server.url}/metrics is not Prometheus's text format ({exc})"
        except Exception as exc:  # the poll's failure is a poll's line, never the thread's end
            error = f"{self.server.url}/metrics cannot be read ({_error_of(exc)})"
        seconds = max(0.0, time.monotonic() - self.opened)
        return ServerMetrics(seconds, error=error, replica=self.replica)

    def run(self) -> None:
        while not self.stopped.wait(POLL_INTERVAL_S):
            self.out.put(self.poll())


@dataclass
class _Token:
    ids: list[int]
    text: str
    at: float


@dataclass
class _Ended:
    error: str = ""


@dataclass
class VLLMEngine:
    """A vLLM server behind the engine protocol (see the module's docstring)."""

    settings: RunSettings
    served: Served
    prompt_ids: list[int] | None
    """The prompt as the server tokenized it (None: the server has no /tokenize; the text is
    sent and its length is not known before the answer)."""
    prompt_text: str
    replicas: tuple[ServerURL, ...] = ()
    """The fleet's other servers (`vllm:URL1,URL2,...`), watched only: the decode streams from
    `served`'s, replica 0 (kvtui.engines.vllm.fleet)."""
    _events: queue.Queue[object] = field(default_factory=queue.Queue, init=False)
    _poller: _Poller | None = field(default=None, init=False)
    _watchers: list[_Poller] = field(default_factory=list, init=False)
    """The pollers of `replicas`, started with `_poller`."""
    _stream: Any = field(default=None, init=False)
    _stream_closed: bool = field(default=False, init=False)
    """Set by `_close_stream`: a stream that opens after it is closed at once."""
    _opened: float = field(default_factory=time.monotonic, init=False)

    @classmethod
    def open(
        cls, settings: RunSettings, url: ServerURL, replicas: tuple[ServerURL, ...] = ()
    ) -> VLLMEngine:
        """The engine for the server at `url` (and the fleet's other `replicas`, watched only:
        one that does not answer is said in its polls, never a reason not to start);
        `EngineError` (one line) when `url` does not answer as a vLLM server, or the run does
        not fit its model."""
        if settings.batch != 1:
            raise EngineError("vllm: streams one completion; kvtui load puts many on the server")
        until = time.monotonic() + OPEN_DEADLINE_S
        served = read_served(url, until=until)
        server = Server(url, until=until)
        text = settings.prompt or "\n"
        try:
            answer = server.json("/tokenize", {"model": served.model, "prompt": text})
            ids = answer.get("tokens") if isinstance(answer, dict) else None
            if not are_token_ids(ids, MAX_PROMPT_TOKENS):
                raise ServerError(f"{url}/tokenize gave no token ids")
        except ServerError:
            ids = None
        if ids is not None and settings.lesson:
            ids = ids[:1]
            text = _detokenize(server, served.model, ids) or ""
        prompt = len(ids) if ids is not None else 0
        limit = served.max_model_len
        if limit is not None and prompt + settings.tokens > limit:
            fits = f" (--tokens {limit - prompt:,} at most)" if limit > prompt else ""
            raise EngineError(
                f"{prompt:,} prompt + {settings.tokens:,} tokens is past the server's "
                f"max_model_len of {limit:,}{fits}"
            )
        return cls(settings, served, ids, text, replicas)

    # --- the protocol ----------------------------------------------------------------------

    def started(self) -> RunStarted:
        s, served, spec = self.settings, self.served, self.served.spec
        # The dtype it computes, and keeps an `auto` cache, in: bf16 beside 4-bit or 8-bit weights.
        dtype = activation_dtype(spec.default_dtype) if spec is not None else ""
        per_token = kv_bytes_per_token(spec, dtype) if spec is not None and dtype else 0
        version = f"vLLM {served.version}" if served.version else "vLLM"
        return RunStarted(
            engine=s.engine,
            model=served.model,
            device=f"{version} at {served.url}",
            dtype=dtype or "unknown",
            layers=spec.layers if spec else 0,
            kv_heads=spec.kv_heads if spec else 0,
            head_dim=spec.head_dim if spec else 0,
            kv_bytes_per_token=per_token,
            weights_bytes=0,
            prompt_tokens=len(self.prompt_ids) if self.prompt_ids is not None else 0,
            tokens=s.tokens,
            timing="measured",
            threads=0,
            max_positions=served.max_model_len,
            trained_positions=spec.max_context if spec else None,
            prompt_text=self.prompt_text,
            kv_pool_source=served.config_source,
            served_by=f"{version} at {served.url}",
            can=SERVED,
        )

    def steps(self, loop: Loop) -> Generator[StepSample | RunFinished | ServerMetrics, None, None]:
        if loop == "uncached":  # a server keeps its KV cache: there is no uncached loop to watch
            yield RunFinished("uncached", "done", 0)
            return
        yield self.poll()  # the figures before the request: what it changes is measured from here
        self._start_polling()
        t0 = time.perf_counter()
        threading.Thread(target=self._read_stream, name="kvtui-vllm-stream", daemon=True).start()
        step, last = 0, t0
        prompt = len(self.prompt_ids) if self.prompt_ids is not None else 0
        try:
            while True:
                try:
                    item = self._events.get(timeout=WAIT_S)
                except queue.Empty:
                    continue
                if isinstance(item, ServerMetrics):
                    yield item
                elif isinstance(item, _Token):
                    for i, token in enumerate(item.ids):
                        seconds = item.at - last if i == 0 else 0.0
                        yield _sample(
                            step, prompt + step, token, item.text if i == 0 else "", seconds
                        )
                        step += 1
                    last = item.at
                elif isinstance(item, _Ended):
                    if self._poller is not None:  # the figures with this request finished
                        yield self._poller.poll()
                    yield from self._last_polls()
                    if item.error:
                        yield RunFinished("cached", "error", step, item.error)
                    else:
                        yield RunFinished("cached", "done", step)
                    return
        finally:
            self._close_stream()

    def _last_polls(self) -> Iterator[ServerMetrics]:
        """The fleet's other replicas' figures at the run's end, each within LAST_POLL_S (so
        that a run shorter than a poll has them; a replica gone costs that much, once)."""
        for replica, url in enumerate(self.replicas, 1):
            server = Server(url, until=time.monotonic() + LAST_POLL_S)
            yield _Poller(server, self._events, self._opened, replica).poll()

    def poll(self) -> ServerMetrics:
        """The server's figures now: one read of its /metrics, on this thread."""
        return _Poller(Server(self.served.url), self._events, self._opened).poll()

    def watch(self, control: RunControl) -> Iterator[ServerMetrics]:
        """The server's polls after the run's loops have ended, until the run is stopped."""
        self._start_polling()
        while not control.stopped:
            control.wait_while_paused()
            try:
                item = self._events.get(timeout=WAIT_S)
            except queue.Empty:
                continue
            if isinstance(item, ServerMetrics):
                yield item

    def close(self) -> None:
        self._close_stream()
        for poller in [self._poller, *self._watchers]:
            if poller is not None:
                poller.stopped.set()

    # --- the threads -----------------------------------------------------------------------

    def _start_polling(self) -> None:
        if self._poller is None:
            self._poller = _Poller(Server(self.served.url), self._events, self._opened)
            self._poller.start()
            for replica, url in enumerate(self.replicas, 1):
                watcher = _Poller(Server(url), self._events, self._opened, replica)
                self._watchers.append(watcher)
                watcher.start()

    def request(self) -> dict[str, Any]:
        """The completion request: greedy (temperature 0), or kvtui's sampling settings with
        its seed; never stopped by an end-of-sequence token."""
        s = self.settings
        body: dict[str, Any] = {
            "model": self.served.model,
            "prompt": self.prompt_ids if self.prompt_ids is not None else self.prompt_text,
            "max_tokens": s.tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "ignore_eos": True,
        }
        if s.greedy:
            body["temperature"] = 0.0
        else:
            body |= {"temperature": s.temperature, "top_k": s.top_k, "seed": s.seed}
        return body

    def _read_stream(self) -> None:
        """Stream the completion into the queue: each chunk's ids and text with its arrival
        time, then how it ended. Reading stops at the tokens asked for, whatever the server
        sends past them (the ids of a chunk past them are dropped), and at the stream's bounds
        (SECONDS_PER_TOKEN, BYTES_PER_TOKEN, and the client's)."""
        streamed = 0
        url = self.served.url
        asked = self.settings.tokens
        until = time.monotonic() + STREAM_IDLE_S + asked * SECONDS_PER_TOKEN
        try:
            stream = self._stream = Server(url).stream(
                "/v1/completions",
                self.request(),
                until=until,
                max_bytes=MAX_LINE_BYTES + asked * BYTES_PER_TOKEN,
            )
            if self._stream_closed:  # closed while the server had not answered: abort it
                stream.close()
            for chunk in stream:
                at = time.perf_counter()
                choice = first_choice(chunk)
                if choice is None or streamed >= asked:  # past what was asked: not kept
                    continue
                ids = choice.get("token_ids")
                text = choice.get("text") if isinstance(choice.get("text"), str) else ""
                if not are_token_ids(ids, MAX_PROMPT_TOKENS):
                    ids = [0] if text else []  # a server without return_token_ids
                if ids:
                    stream.progress()
                    ids = ids[: asked - streamed]
                    streamed += len(ids)
                    self._events.put(_Token(list(ids), str(text), at))
                if streamed >= asked:  # the rest (its [DONE]) briefly, not a token more
                    stream.wind_down()
            if streamed < self.settings.tokens:
                how = "ended the stream" if stream.done else "stopped streaming"
                self._events.put(
                    _Ended(
                        f"the vLLM server at {url} {how} after {streamed:,} of "
                        f"{self.settings.tokens:,} tokens"
                    )
                )
            else:
                self._events.put(_Ended())
        except ServerError as exc:
            if streamed >= asked:  # cut after all it was asked for: a server that streams on
                self._events.put(_Ended())
            elif streamed:  # the same words as a stream cut short without an error, and why
                self._events.put(
                    _Ended(
                        f"the vLLM server at {url} stopped streaming after {streamed:,} of "
                        f"{self.settings.tokens:,} tokens ({exc})"
                    )
                )
            else:
                self._events.put(_Ended(f"the vLLM server's completion failed: {exc}"))
        except Exception as exc:  # a thread's failure becomes the loop's, in one line
            self._events.put(_Ended(f"reading the stream failed: {_error_of(exc)}"))

    def _close_stream(self) -> None:
        self._stream_closed = True  # before reading `_stream`: see `_read_stream`
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


def _sample(step: int, position: int, token: int, text: str, seconds: float) -> StepSample:
    """A streamed token as a step: its id and text, its client-side time; no positions, FLOPs
    or KV bytes (a remote server's, not observable here)."""
    return StepSample(
        loop="cached",
        step=step,
        position=position,
        token_id=token,
        text=text,
        positions_computed=0,
        flops=0,
        bytes_read=0,
        step_seconds=max(0.0, seconds),
        kv_bytes=0,
    )


def first_choice(chunk: Any) -> dict[str, Any] | None:
    """A completion chunk's first choice, if it has one as the API says (`choices`, a list of
    objects): None for anything else (a list of numbers, a number, an object)."""
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def are_token_ids(ids: Any, limit: int) -> TypeGuard[list[int]]:
    """Whether `ids` is a non-empty list of at most `limit` token ids (non-negative integers
    within 64 bits)."""
    return (
        isinstance(ids, list)
        and 0 < len(ids) <= limit
        and all(type(i) is int and 0 <= i < 2**63 for i in ids)
    )


def _detokenize(server: Server, model: str, ids: list[int]) -> str | None:
    try:
        answer = server.json("/detokenize", {"model": model, "tokens": ids}, MAX_JSON_BYTES)
    except ServerError:
        return None
    text = answer.get("prompt") if isinstance(answer, dict) else None
    return text if isinstance(text, str) else None
