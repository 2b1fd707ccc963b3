"""Every count screens 1 and 2 show agrees with every other after every step, on every engine
kvtui.testing runs: tiny (a run recorded here, played as it arrives live), `sim:` (modelled) and
`replay:` (the same recording replayed), at a few lengths.

The engine is held before each step; after it, the test reads both screens as a user would (the
header, the cards, the streams' borders, the cache picture's rows and its words) and checks that
two counts of one idea are the same count, or differ by the relation the screen states: tokens
generated (a stream's border, the header's step, ANSWER's "done"), positions a step computed
(PER STEP, the rows of the picture), rows the cache holds (= prompt + every token but the newest,
as the picture's line says) and the running totals (TOTAL, WITHOUT, WITH, what was saved).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

import kvtui.widgets.present_nodes as present_nodes
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import Event, RunSettings, RunStarted, StepSample
from kvtui.engines.replay import read_record
from kvtui.format import format_count, format_ratio
from kvtui.testing import HeadlessRun, ScriptedEngine, headless

SIZE = (100, 30)
TINY_TOKENS = 4


@pytest.fixture(scope="module")
def tiny_record(tmp_path_factory) -> Path:
    """A tiny run recorded here, as a user records one: `kvtui bench --record`."""
    path = tmp_path_factory.mktemp("record") / "tiny.jsonl"
    subprocess.run(
        [sys.executable, "-m", "kvtui", "bench", "--engine", "tiny"]
        + ["--tokens", str(TINY_TOKENS), "--record", str(path)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    return path


class Gate:
    """A run's events, each step held until the test lets it through (`step()`)."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events
        self.steps = sum(isinstance(e, StepSample) for e in events)
        self._let = threading.Semaphore(0)
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[Event]:
        for event in self.events:
            while isinstance(event, StepSample) and not self._let.acquire(timeout=0.05):
                if self._closed.is_set():
                    return
            yield event

    def step(self) -> None:
        self._let.release()

    def close(self) -> None:
        self._closed.set()


def events_of(settings: RunSettings) -> tuple[RunSettings, list[Event]]:
    """Every event of a `sim:` or `replay:` run, and the settings it ran (a replay's are the
    record's), made here as fast as the engine can."""
    source = open_engine(replace(settings, replay_speed=0))
    ran = getattr(source, "settings", settings)
    try:
        return ran, list(run_events(source, ran))
    finally:
        source.close()


def as_live(path: Path) -> tuple[RunSettings, list[Event]]:
    """The recorded tiny run as the engine sends it while it runs: no recording date, and
    attention with every third step only (as a faster engine, limited to 15 a second, sends
    it), so the picture's weights are often older than its rows."""
    header, events = read_record(path)
    live = []
    for e in events:
        if isinstance(e, RunStarted):
            e = replace(e, recorded_at="")
        elif isinstance(e, StepSample) and e.step % 3:
            e = replace(e, attention=None, attention_spans=None)
        live.append(e)
    return RunSettings(**{**header["settings"], "loops": tuple(header["settings"]["loops"])}), live


def number(text: str) -> int:
    return int(text.replace(",", ""))


@dataclass
class Seen:
    """What one screen showed."""

    text: str
    figures: dict[str, str]
    notes: dict[str, str]

    def find(self, pattern: str) -> list[tuple[str, ...]]:
        return re.findall(pattern, self.text)


async def look(run: HeadlessRun) -> Seen:
    await run.settle()
    ids = run.figures()
    return Seen(run.text(), ids, {i: run.card(i).note for i in ids})


def shown_steps(run: HeadlessRun) -> tuple[int, int]:
    live = run.app.screen.run
    return live.loop("uncached").steps, live.loop("cached").steps


def check_header(seen: Seen, u: int, c: int, total: int) -> None:
    header = seen.text.splitlines()[0]
    if u == c:
        assert f"step {u:,}/{total:,}" in header or f"{u:,}/{total:,}" in header, header
    else:  # each loop's count, in the order the run names its loops
        each = {f"uncached {u:,}, cached {c:,}", f"cached {c:,}, uncached {u:,}"}
        assert any(f"{said} of {total:,}" in header for said in each), header


def check_picture(seen: Seen, what: str, steps: int, prompt: int) -> int:
    """The picture's rows, its line relating them to the tokens, and its query agree; the
    stream's count is the picture's tokens. Returns the rows."""
    (title,) = seen.find(rf"{what}: (?:all )?([\d,]+) rows?")
    rows = number(title)
    (line,) = seen.find(r"(?:[\d,]+ rows? = )?([\d,]+) prompt \+ ([\d,]+) of ([\d,]+) tokens?")
    p, answer, tokens = map(number, line)
    assert (p, tokens) == (prompt, steps)  # the prompt's rows, and the stream's tokens
    assert rows == p + answer and answer == tokens - 1  # every token but the newest
    (query,) = seen.find(r"q ([\d,]+) reads ([\d,]+) keys?")
    assert (number(query[0]), number(query[1])) == (rows - 1, rows)
    return rows


async def check_screen_1(run: HeadlessRun, total: int, prompt: int, totals: dict) -> Seen:
    """Screen 1's counts after the step shown; `totals` gains its TOTAL at this step."""
    u, c = shown_steps(run)
    one = await look(run)
    check_header(one, u, c, total)
    streams = one.find(r"([\d,]+ tokens?) ─╯")
    assert streams == [format_count(s, "token") for s in (u,) if s], one.text
    assert one.figures["length"] == f"{total:,}"
    assert one.notes["length"] == f"tokens, {u:,} done"
    if u:
        per_step, done = number(one.figures["per-step"]), number(one.figures["total"])
        assert per_step == check_picture(one, "No cache", u, prompt)  # one step, one count
        assert one.notes["total"] == f"{u:,} step" + "s" * (u != 1)
        totals[u] = done  # the running total: the last one and this step's
        assert done == totals.get(u - 1, 0) + per_step
        assert number(one.figures["wasted"]) == done - per_step
    return one


async def check_screen_2(run: HeadlessRun, total: int, prompt: int, totals: dict) -> Seen:
    """Screen 2's counts after the step shown, its totals screen 1's (`totals`) at the step."""
    u, c = shown_steps(run)
    two = await look(run)
    check_header(two, u, c, total)
    streams = two.find(r"([\d,]+ tokens?) ─╯")
    assert streams == [format_count(s, "token") for s in (u, c) if s], two.text
    n = min(u, c)
    if c:
        rows = check_picture(two, "KV cache", c, prompt)
    if n:
        without, with_cache = number(two.figures["without"]), number(two.figures["with"])
        assert two.notes["without"] == two.notes["with"] == f"steps 1-{n:,}"
        assert without == totals[n]  # screen 1's TOTAL at the same step
        assert with_cache == rows - (c - n)  # the cache's rows, n steps in
        assert two.figures["speedup"] == format_ratio(without / with_cache)
        assert f"{n:,} tokens" in two.find(r"identical(?: so far)?: ([\d,]+ tokens?)")
        (saved,) = two.find(r"Total: ([\d,]+) positions saved so far")
        assert number(saved) == without - with_cache
    return two


async def check_presenter(run: HeadlessRun, shown: dict[str, str], per_step: int) -> None:
    """Presenter mode's nodes 1 and 2, all shown, say the screens' counts (node 3 would size a
    pool for the room and run again: screen 3's and its helpers' own tests)."""
    await run.press("p", "space", "space", "space", "space")
    node1 = {f.label: f for f in (await run.until_shown()).figures}
    assert node1["PER STEP"].value == f"{per_step:,}"  # screen 1's at the last step
    assert node1["TOTAL"].value == shown["total"]
    assert number(node1["WASTED"].value) == number(shown["total"]) - per_step
    await run.press("space", "space", "space", "space")
    node2 = {f.label: f for f in (await run.until_shown()).figures}
    assert node2["WITH THE CACHE"].value == shown["with"]
    assert node2["WITH THE CACHE"].caption.endswith(f"positions, {shown['without']} without")
    assert node2["BY COUNT"].value == shown["speedup"]


async def check_run(settings: RunSettings, events: list[Event]) -> None:
    """The run on screen 1, then again on screen 2 (a screen is read where a user reads it, not
    switched to each step: on a small, busy CPU a switch costs about a second), then presenter
    mode's nodes 1 and 2."""
    started = next(e for e in events if isinstance(e, RunStarted))
    total, prompt = started.tokens, started.prompt_tokens
    totals: dict[int, int] = {}
    for screen, check in ((1, check_screen_1), (2, check_screen_2)):
        gate = Gate(events)

        def engine(s: RunSettings, gate: Gate = gate) -> ScriptedEngine:
            return ScriptedEngine(gate, settings=settings, on_close=gate.close)

        async with headless(settings, screen, size=SIZE, engine=engine) as run:
            await run.wait_for(lambda: run.app.screen.run.started is not None)
            await check(run, total, prompt, totals)  # before the first step
            for k in range(1, gate.steps + 1):
                gate.step()
                await run.wait_for(lambda k=k: sum(shown_steps(run)) == k)
                await check(run, total, prompt, totals)
            assert await run.until_done() == "done"
            last = await check(run, total, prompt, totals)
            if screen == 2:
                shown = {**last.figures, "total": f"{totals[total]:,}"}
                await check_presenter(run, shown, per_step=prompt + total - 1)


@pytest.fixture(autouse=True)
def quick_pace(monkeypatch):
    """Presenter mode's pace, short (its figures are the same; only how soon all are shown)."""
    monkeypatch.setattr(present_nodes, "PACE_S", 0.05)
    monkeypatch.setattr(present_nodes, "RACE_S", 0.05)


@pytest.mark.parametrize(("tokens", "lesson"), [(1, False), (4, False), (5, True)])
async def test_every_count_agrees_after_every_step_on_sim(tokens, lesson):
    await check_run(*events_of(RunSettings("sim:llama-3.1-8b@h100", tokens=tokens, lesson=lesson)))


async def test_every_count_agrees_after_every_step_on_tiny_and_its_replay(tiny_record):
    await check_run(*as_live(tiny_record))
    await check_run(*events_of(RunSettings(f"replay:{tiny_record}")))
