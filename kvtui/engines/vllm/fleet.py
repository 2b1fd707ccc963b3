"""A fleet of serving replicas (`vllm:URL1,URL2,...`), without a UI: the list of servers parsed
and checked where it enters, and a load put on each of them at once (`kvtui load URL1 URL2`).

A fleet is what operators run: data-parallel engines behind one API server, or several servers
behind a router. kvtui watches every replica's `/metrics` (kvtui.engines.vllm.engine polls each
on a thread of its own, each poll tagged with its replica's place in the list) and runs its own
decode on the first one only (`FLEET_DECODE`): a completion streams from one server.

The list is checked as a whole: each URL as `ServerURL` checks one, at most MAX_REPLICAS of them,
none given twice (the same scheme, host, port and path: two names for one server would be counted
twice in every total). A comma separates the URLs, so a comma in a URL's path must be written
`%2C`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtui.engines.vllm.url import ServerURL
from kvtui.errors import EngineError
from kvtui.format import safe_text

if TYPE_CHECKING:  # the load (and its HTTP client) only where one runs: the app's first frame
    from kvtui.engines.vllm.load import LoadPlan, LoadResult

MAX_REPLICAS = 8
"""The most servers one `vllm:` watches: each is a thread polling twice a second, and a row on
screen (vllm-htop's own view stops at a screenful of DP replicas)."""
FLEET_DECODE = 0
"""The replica kvtui's own decode streams from (the first given); the others are only watched."""


def parse_urls(text: str, what: str = "vllm:") -> tuple[ServerURL, ...]:
    """The servers of `URL1,URL2,...` (`what` says where they were given, e.g. "vllm:"), each
    checked as `ServerURL.parse` checks one; `EngineError`
    with one line for an empty item, more than MAX_REPLICAS, or a server given twice."""
    items = [item.strip() for item in text.split(",")]
    lead = f"{what} " if what else ""
    if len(items) > MAX_REPLICAS:
        raise EngineError(
            f"{lead}{len(items):,} servers given: a fleet is watched up to {MAX_REPLICAS}"
        )
    urls: list[ServerURL] = []
    for place, item in enumerate(items, 1):
        if not item:
            raise EngineError(
                f"{lead}server {place} of {len(items)} is empty: give URL1,URL2,... with no "
                "empty item, e.g. vllm:http://127.0.0.1:8000,http://127.0.0.1:8001"
            )
        label = (what or "the server URL") if len(items) == 1 else f"{lead}server {place}"
        url = ServerURL.parse(item, label)
        if url in urls:
            raise EngineError(
                f"{lead}{safe_text(str(url), one_line=True)} is given twice (servers "
                f"{urls.index(url) + 1} and {place}): each replica once, or its figures count twice"
            )
        urls.append(url)
    return tuple(urls)


def replica_name(urls: Sequence[ServerURL], replica: int) -> str:
    """How a replica is named on screen and in reports: its place (from 1) and its address."""
    if not 0 <= replica < len(urls):
        return f"replica {replica + 1}"
    return f"replica {replica + 1} ({urls[replica].netloc}{urls[replica].prefix})"


Progress = Callable[[ServerURL, "LoadResult", int], None]


def run_loads(plans: Sequence[LoadPlan], progress: Progress | None = None) -> list[LoadResult]:
    """Each plan run on its own server at the same time (a thread each, each bounded by its own
    plan); their results in the plans' order. A load that fails outright (its server refused the
    first request as a `EngineError`) is raised once every load has ended."""
    from kvtui.engines.vllm.load import run_load

    results: list[LoadResult | None] = [None] * len(plans)
    errors: list[EngineError | None] = [None] * len(plans)
    stop = threading.Event()

    def one(index: int, plan: LoadPlan) -> None:
        def said(result: LoadResult, open_requests: int) -> None:
            if progress is not None:
                progress(plan.url, result, open_requests)

        try:
            results[index] = run_load(plan, progress=said, stop=stop)
        except EngineError as exc:
            errors[index] = exc

    threads = [
        threading.Thread(target=one, args=(i, plan), name=f"kvtui-load-{i}", daemon=True)
        for i, plan in enumerate(plans)
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:  # an interrupt: every load stops (closing its streams), then it goes on
        stop.set()
        for thread in threads:
            thread.join(timeout=5.0)
        raise
    for plan, error in zip(plans, errors, strict=True):
        if error is not None:
            raise EngineError(f"{plan.url}: {error}")
    return [r for r in results if r is not None]
