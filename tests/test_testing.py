"""kvtui.testing, the public kit for driving kvtui headless, used end to end as a developer would:
a sim run driven to its end and read back, a record `kvtui bench` wrote replayed, the test hooks,
the refusal of torch engines and docs/testing.md's example, run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtui.cli import main
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunFailed, RunFinished, RunSettings, StepSample
from kvtui.format import format_int, format_ratio
from kvtui.sim.work import cached_cumulative, naive_cumulative
from kvtui.testing import ScriptedEngine, headless, refuse_torch

ROOT = Path(__file__).resolve().parent.parent
SIM = "sim:llama-3.1-8b@h100"


def lesson(tokens: int, engine: str = SIM) -> RunSettings:
    return RunSettings(engine=engine, tokens=tokens, lesson=True)


async def test_a_sim_run_at_80x24_shows_the_lessons_totals():
    """Screen 1's TOTAL after a lesson-mode run of n tokens (a one-token prompt) is the
    uncached loop's n(n+1)/2 positions, and screen 2 sets it beside the cached loop's n."""
    n = 40
    async with headless(lesson(n), size=(80, 24)) as run:
        assert run.app.size == (80, 24)
        assert await run.until_done() == "done"
        assert run.figure("total") == format_int(naive_cumulative(n)) == "820"
        assert run.figure("wasted") == format_int(naive_cumulative(n) - n)
        assert run.figure("length") == format_int(n)
        assert run.card("wasted").bad  # shown in the error colour
        text = run.text()
        assert len(text.splitlines()) == 24
        assert "820" in text and "1 · Without a cache" in text
        assert run.state == "done" and "✓ done" in text.splitlines()[0]

        await run.press("2")
        await run.settle()
        assert run.figure("without") == format_int(naive_cumulative(n))
        assert run.figure("with") == format_int(cached_cumulative(n)) == "40"
        assert run.figure("speedup") == format_ratio(naive_cumulative(n) / cached_cumulative(n))
        assert run.notifications == []
        with pytest.raises(LookupError, match="its cards: measured, speedup, with, without"):
            run.figure("total")  # a screen 1 card


async def test_keys_restart_the_run_with_a_new_engine():
    """`r` after a longer answer runs again: a second in-process engine, and the cards follow."""
    async with headless(lesson(8), size=(100, 30)) as run:
        assert await run.until_done() == "done"
        await run.press("right", "right", "r")
        assert await run.until_done() == "done"
        assert [e.settings.tokens for e in run.engines] == [8, 10]
        assert run.figure("total") == format_int(naive_cumulative(10))


async def test_from_settings_plays_what_the_engine_emits():
    """`from_settings` hands the app the very events the sim engine's run yields."""
    settings = lesson(12)
    engine = ScriptedEngine.from_settings(settings)
    engine.start()
    played = list(engine.events())
    assert played == list(run_events(open_engine(settings), settings))
    assert engine.sent == played and engine.ended and not engine.alive
    assert sum(e.positions_computed for e in played if _uncached(e)) == naive_cumulative(12)


def _uncached(event: object) -> bool:
    return isinstance(event, StepSample) and event.loop == "uncached"


async def test_a_record_from_kvtui_bench_replays(tmp_path, capsys):
    """A run recorded by `kvtui bench --record` plays back through `from_record` (the steps as
    recorded) and drives the app to the same figures the formulas give."""
    record, n = tmp_path / "run.jsonl", 24
    bench = ["bench", "--engine", SIM, "--tokens", str(n), "--lesson", "--record", str(record)]
    assert main(bench) == 0
    capsys.readouterr()
    engine = ScriptedEngine.from_record(record)
    assert engine.settings.tokens == n and engine.settings.lesson  # what ran, from the record
    async with headless(
        engine.settings, 1, size=(80, 24), engine=lambda s: ScriptedEngine.from_record(record)
    ) as run:
        assert await run.until_done() == "done"
        assert run.figure("total") == format_int(naive_cumulative(n)) == "300"
        assert run.figure("wasted") == "276"
    engine.start()
    steps = [e for e in engine.events() if _uncached(e)]
    assert [e.positions_computed for e in steps] == list(range(1, n + 1))
    # the same record as the app's own replay: engine
    async with headless(f"replay:{record}", 2) as run:
        assert await run.until_done() == "done"
        assert (run.figure("without"), run.figure("with")) == ("300", "24")


def test_from_record_refuses_a_file_that_is_not_one(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    with pytest.raises(ValueError, match="not a kvtui record"):
        ScriptedEngine.from_record(bad)


@pytest.mark.parametrize("engine", ["tiny", "shape:llama-3.2-1b", "hf:/models/llama"])
async def test_torch_engines_are_refused_with_the_way_round(engine):
    settings = RunSettings(engine=engine, tokens=8)
    for refuse in (refuse_torch, ScriptedEngine.from_settings):
        with pytest.raises(ValueError, match=r"torch engine.*kvtui bench --engine .* --record"):
            refuse(settings)
    with pytest.raises(ValueError, match="replay"):
        async with headless(settings):
            pass


async def test_scripted_events_pause_hold_and_fail():
    """A list of events for every run; `hold_at` stalls it (so `until_done` times out, bounded),
    and a run that fails shows as failed, with the app's notification."""
    events = list(run_events(open_engine(lesson(6)), lesson(6)))
    held = [ScriptedEngine(events, settings=lesson(6), hold_at=10)]
    async with headless(lesson(6), engine=lambda s: held[-1]) as run:
        await run.wait_for(lambda: run.state == "running")
        await run.press("space")
        assert run.engine is held[0] and held[0].paused_calls == 1
        await run.press("space")
        with pytest.raises(AssertionError, match="timed out after 0.5 s"):
            await run.until_done(timeout=0.5)
        assert len(held[0].sent) == 10 and held[0].alive
    assert not held[0].alive  # the app closed it on leaving

    failed = [events[0], RunFailed("the device fell off the bus")]
    async with headless(lesson(6), engine=failed) as run:
        assert await run.until_done() == "failed"
        assert any("fell off the bus" in words for words in run.notifications)


async def test_a_run_that_stops_short_reads_as_failed():
    """A script that ends before its loops finish is an engine that exited early."""
    events = list(run_events(open_engine(lesson(6)), lesson(6)))
    cut = [e for e in events if not isinstance(e, RunFinished)][:5]
    async with headless(lesson(6), engine=cut) as run:
        assert await run.until_done() == "failed"
        assert any("exited before finishing" in words for words in run.notifications)


def test_the_docs_example_passes_in_a_fresh_folder(tmp_path):
    """docs/testing.md's example, copied into a folder of its own and run by pytest as a new
    user would: no configuration of kvtui's (its asyncio_mode = "auto"), so pytest-asyncio's
    default strict mode, where an unmarked async test fails ("async def functions are not
    natively supported"). The example must pass there as written."""
    page = (ROOT / "docs" / "testing.md").read_text()
    section = page.split("# Driving kvtui headless", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    (tmp_path / "test_example.py").write_text(code.group(1))
    (tmp_path / "pytest.ini").write_text("")  # its own rootdir and (empty) configuration
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT)  # the kvtui under test, as `pip install kvtui` would give
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "asyncio_mode=strict",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


def test_the_figure_ids_the_screens_have_are_all_documented():
    """Every stat card's id on screens 1 to 3 (the `id=` of each StatCard in kvtui/screens) is
    in docs/testing.md's table of figure ids."""
    page = (ROOT / "docs" / "testing.md").read_text()
    table = page.split("## The figure ids", 1)[1]
    documented = set(re.findall(r"^\| \d \| `([a-z-]+)` \|", table, re.MULTILINE))
    sources = "".join(p.read_text() for p in (ROOT / "kvtui" / "screens").glob("*.py"))
    ids = set(re.findall(r'StatCard\([^)]*id="([a-z-]+)"', sources))
    assert ids and ids == documented
    assert {"total", "per-step", "wasted", "without", "with", "speedup"} <= documented
