"""A bounded load on a serving engine (`kvtui load URL`, and `f` on screen 3 with `vllm:`),
without a UI or torch: N requests at a time of P prompt tokens and T generated tokens (ignoring
end-of-sequence), to fill the server's KV cache in front of a room and make it wait and preempt.

It stops by itself: after `requests` requests (one wave of `concurrency` by default) or
`seconds` of wall time, whichever comes first; at the time limit (or a stop) the requests still
open are closed, which tells a vLLM server to abort them. Every bound is capped (MAX_*), and the
prompt and answer must fit the server's max_model_len, so one line refuses a load that cannot
run before any request is sent.

Prompts are token ids (the OpenAI API takes them as a list), drawn with a seeded generator from
the server's own tokenization of a passage of Austen, different in every request (so the prefix
cache does not share them) except for their first `shared_prefix_tokens`, which all requests
share (to show prefix-cache hits). Each request streams, and its time to first token is timed
on kvtui's clock.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtui.engines.roofline import PASSAGE
from kvtui.engines.vllm.client import (
    MAX_LINE_BYTES,
    Server,
    ServerError,
)
from kvtui.engines.vllm.engine import BYTES_PER_TOKEN, are_token_ids, first_choice, read_served
from kvtui.engines.vllm.limits import (
    DEFAULT_SECONDS,
    MAX_CONCURRENCY,
    MAX_NEW_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_REQUESTS,
    MAX_SECONDS,
)
from kvtui.engines.vllm.url import ServerURL
from kvtui.errors import EngineError
from kvtui.format import error_line

FILL_CONCURRENCY = 16
"""Requests at a time of the load `fill_plan` makes."""
FILL_WAVES = 2
"""Requests of the fill per request at a time: as one ends the next takes its place, so the cache
stays full for a while to see (one wave of 16 short requests took 1.3 s on the test server: a
blip between two polls) rather than filling once and draining."""
FILL_PROMPT_TOKENS = 64


@dataclass(frozen=True)
class LoadPlan:
    """What to put on the server."""

    url: ServerURL
    concurrency: int
    prompt_tokens: int
    max_tokens: int
    requests: int
    """Requests in all (each worker takes the next until they are done)."""
    seconds: float = DEFAULT_SECONDS
    """The wall-time limit."""
    shared_prefix_tokens: int = 0
    seed: int = 0

    def check(self) -> None:
        """`EngineError` for a bound out of its range (one line)."""
        for name, value, high in (
            ("concurrency", self.concurrency, MAX_CONCURRENCY),
            ("prompt tokens", self.prompt_tokens, MAX_PROMPT_TOKENS),
            ("max tokens", self.max_tokens, MAX_NEW_TOKENS),
            ("requests", self.requests, MAX_REQUESTS),
        ):
            if not 1 <= value <= high:
                raise EngineError(f"{name} must be from 1 to {high:,}, not {value:,}")
        if not 0 < self.seconds <= MAX_SECONDS:
            raise EngineError(f"the time limit must be above 0 and at most {MAX_SECONDS:,.0f} s")
        if not 0 <= self.shared_prefix_tokens <= self.prompt_tokens:
            raise EngineError("the shared prefix must be from 0 to the prompt's tokens")


def fill_plan(url: ServerURL, capacity_tokens: int, max_model_len: int | None) -> LoadPlan:
    """A load that asks for at least twice the server's KV cache: FILL_CONCURRENCY requests at
    a time (more when the cache holds more than that many full-length requests twice), each as
    long as max_model_len allows; FILL_WAVES of them in turn for each request at a time.

    Each request as long as the server takes, because how many sequences it runs at once is what
    /metrics does not say (max-num-seqs): N of them at once fill C tokens of cache only if N x
    the request's length passes C, so the longest requests fill wherever any load can (4
    sequences at once of half of max_model_len 1,024 never filled a cache of 1,920 tokens an
    engine; of the whole of it they do, and vLLM preempts). Where even that cannot fill,
    kvtui.run.pressure says why after."""
    longest = max_model_len or 4096
    prompt = max(1, min(FILL_PROMPT_TOKENS, longest // 4))
    n = min(MAX_CONCURRENCY, max(FILL_CONCURRENCY, -(-2 * capacity_tokens // longest)))
    requests = min(MAX_REQUESTS, n * FILL_WAVES)
    return LoadPlan(url, n, prompt, longest - prompt, requests, DEFAULT_SECONDS)


@dataclass
class LoadResult:
    """What a load did, by kvtui's clock."""

    plan: LoadPlan
    model: str = ""
    done: int = 0
    """Requests that streamed every token asked for."""
    failed: int = 0
    cut: int = 0
    """Requests closed unfinished at the time limit (or a stop)."""
    tokens: int = 0
    """Tokens streamed, every request's."""
    seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """The first few distinct reasons requests failed."""
    ended: str = "done"
    """Why it ended: "done", "time limit" or "stopped"."""

    def to_json(self) -> dict[str, Any]:
        p = self.plan
        return {
            "url": str(p.url),
            "model": self.model,
            "concurrency": p.concurrency,
            "prompt_tokens": p.prompt_tokens,
            "max_tokens": p.max_tokens,
            "requests": p.requests,
            "shared_prefix_tokens": p.shared_prefix_tokens,
            "done": self.done,
            "failed": self.failed,
            "cut": self.cut,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else None,
            "ttft_s_median": statistics.median(self.ttft_s) if self.ttft_s else None,
            "ttft_s_max": max(self.ttft_s) if self.ttft_s else None,
            "ended": self.ended,
            "errors": self.errors,
        }


def prompts(base: list[int], plan: LoadPlan) -> Callable[[int], list[int]]:
    """Request i's prompt: the shared prefix (the base ids in order), then ids drawn from the
    base with a generator seeded by (seed, i)."""
    prefix = [base[j % len(base)] for j in range(plan.shared_prefix_tokens)]
    rest = plan.prompt_tokens - len(prefix)

    def prompt(i: int) -> list[int]:
        rng = random.Random(plan.seed * MAX_REQUESTS + i)
        return prefix + rng.choices(base, k=rest)

    return prompt


def run_load(
    plan: LoadPlan,
    *,
    progress: Callable[[LoadResult, int], None] = lambda result, open_: None,
    stop: threading.Event | None = None,
) -> LoadResult:
    """Put `plan` on the server; return what happened. `EngineError` (one line) before any
    request when the plan is out of bounds, the server does not answer or the requests do not
    fit its max_model_len. `progress(result, open requests)` about once a second."""
    plan.check()
    start = time.monotonic()
    deadline = start + plan.seconds  # the questions before the load too: all within it
    served = read_served(plan.url, until=deadline)
    limit = served.max_model_len
    if limit is not None and plan.prompt_tokens + plan.max_tokens > limit:
        raise EngineError(
            f"{plan.prompt_tokens:,} prompt + {plan.max_tokens:,} tokens is past the server's "
            f"max_model_len of {limit:,}"
        )
    server = Server(plan.url, until=deadline)
    answer = server.json("/tokenize", {"model": served.model, "prompt": PASSAGE})
    base = answer.get("tokens") if isinstance(answer, dict) else None
    if not are_token_ids(base, MAX_PROMPT_TOKENS * 8):
        raise ServerError(f"{plan.url}/tokenize gave no token ids")
    prompt = prompts(base, plan)
    result = LoadResult(plan, served.model)
    stop = stop or threading.Event()
    lock = threading.Lock()
    streams: set[Any] = set()
    issued = 0

    def _note(error: str) -> None:
        if error not in result.errors and len(result.errors) < 3:
            result.errors.append(error)

    def _failed(error: str) -> None:
        with lock:
            result.failed += 1
            _note(error)

    def one(i: int) -> None:
        """Request i, streamed to its end (or closed at the time limit), counted: done, cut or
        failed, whatever the server answers (a failure of any kind is counted and noted)."""
        try:
            request(i)
        except Exception as exc:  # never a request that vanishes from the counts
            _failed(f"a request failed: {error_line(exc)}")

    def request(i: int) -> None:
        body = {
            "model": served.model,
            "prompt": prompt(i),
            "max_tokens": plan.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        t0, got, first = time.perf_counter(), 0, None
        try:  # no read outlives the time limit, nor reads past what was asked
            stream = server.stream(
                "/v1/completions",
                body,
                until=deadline,
                max_bytes=MAX_LINE_BYTES + plan.max_tokens * BYTES_PER_TOKEN,
            )
        except ServerError as exc:
            if not (stop.is_set() or time.monotonic() >= deadline):
                _failed(str(exc))
            else:
                with lock:
                    result.cut += 1
            return
        with lock:
            streams.add(stream)
        try:
            for chunk in stream:
                choice = first_choice(chunk)
                if choice is None or got >= plan.max_tokens:
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                ids = choice.get("token_ids")
                got += len(ids) if are_token_ids(ids, MAX_LINE_BYTES) else 1  # a line's worth
                stream.progress()
                if got >= plan.max_tokens:  # its [DONE] briefly, not a token more
                    stream.wind_down()
        except ServerError as exc:
            if got < plan.max_tokens and not (stop.is_set() or time.monotonic() >= deadline):
                _failed(str(exc))
                return
        finally:
            with lock:
                streams.discard(stream)
        with lock:
            result.tokens += min(got, plan.max_tokens)
            if first is not None:
                result.ttft_s.append(first)
            if got >= plan.max_tokens:
                result.done += 1
            elif stop.is_set() or time.monotonic() >= deadline:
                result.cut += 1
            else:
                result.failed += 1
                _note(f"a request ended after {got:,} of {plan.max_tokens:,} tokens")

    def worker() -> None:
        nonlocal issued
        while not stop.is_set() and time.monotonic() < deadline:
            with lock:
                if issued >= plan.requests:
                    return
                i, issued = issued, issued + 1
            one(i)

    def halt() -> None:
        """No new request, and every open stream closed: each worker then ends."""
        stop.set()
        with lock:
            for stream in list(streams):
                stream.close()

    threads = [
        threading.Thread(target=worker, name=f"kvtui-load-{n}", daemon=True)
        for n in range(plan.concurrency)
    ]
    for thread in threads:
        thread.start()
    try:
        while any(t.is_alive() for t in threads):
            if time.monotonic() >= deadline or stop.is_set():
                if not stop.is_set():
                    result.ended = "time limit"
                halt()
            for thread in threads:
                thread.join(timeout=1.0 / len(threads))
            with lock:
                result.seconds = time.monotonic() - start
                open_ = len(streams)
            progress(result, open_)
    except KeyboardInterrupt:
        result.ended = "stopped"
        halt()
        for thread in threads:
            thread.join(timeout=2.0)
    result.seconds = time.monotonic() - start
    if result.ended == "done" and result.cut:  # its requests met the limit before this loop did
        result.ended = "stopped" if stop.is_set() else "time limit"
    if result.ended == "done" and stop.is_set() and result.done < plan.requests:
        result.ended = "stopped"
    return result


def format_result(result: LoadResult) -> str:
    """A load's outcome in a few lines."""
    r, p = result.to_json(), result.plan
    lines = [
        f"{p.requests:,} requests to {p.url} ({r['model']}), {p.concurrency} at a time, "
        f"{p.prompt_tokens:,} prompt + {p.max_tokens:,} tokens each"
        + (f", the first {p.shared_prefix_tokens:,} shared" if p.shared_prefix_tokens else ""),
        f"  {r['done']:,} done, {r['cut']:,} cut short, {r['failed']:,} failed, in "
        f"{r['seconds']:.1f} s (ended: {r['ended']})",
        f"  {r['tokens']:,} tokens streamed"
        + (f", {r['tokens_per_s']:,.0f} a second" if r["tokens_per_s"] else ""),
    ]
    if r["ttft_s_median"] is not None:
        lines.append(
            f"  time to first token (kvtui's clock): median {r['ttft_s_median'] * 1e3:,.0f} ms, "
            f"longest {r['ttft_s_max'] * 1e3:,.0f} ms"
        )
    lines += [f"  {error}" for error in r["errors"]]
    return "\n".join(lines)
