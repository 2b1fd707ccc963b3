"""A burst of `r` (300 presses in a few seconds, a key held down) restarts the run once it
settles, with at most one engine running and one ending at any moment: never a pile of engine
processes, each a model in memory, all ending at once."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from conftest import PROBE, SETTINGS, wait_for
from textual import events

from kvtui.app import make_app
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine

SIZE = (100, 30)
CLOSE_SECONDS = 0.2
"""How long an engine takes to end once told to (a real one: its process exiting)."""


class Engines:
    """Every engine made, and the most of them running, and ending, at any one moment."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.made: list[SlowEngine] = []
        self.most_running = self.most_ending = 0

    def count(self) -> None:
        with self.lock:
            running = sum(e.state == "running" for e in self.made)
            ending = sum(e.state == "ending" for e in self.made)
            self.most_running = max(self.most_running, running)
            self.most_ending = max(self.most_ending, ending)


class SlowEngine:
    """An engine handle whose run never ends by itself and which takes CLOSE_SECONDS to end."""

    def __init__(self, settings, engines: Engines) -> None:
        self.settings, self.engines = settings, engines
        self.state = "made"
        self._stopped = threading.Event()
        self._closed = threading.Event()
        with engines.lock:
            engines.made.append(self)

    def start(self) -> None:
        self.state = "running"
        self.engines.count()

    def events(self):
        source = replace(self.settings, replay_speed=0)
        yield next(iter(run_events(open_engine(source), source)))  # its start, then nothing
        self._stopped.wait(60)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def stop(self) -> None:
        if self.state == "running":
            self.state = "ending"
            self.engines.count()
        self._stopped.set()

    def close(self, timeout: float = 1.0) -> None:
        if self._closed.is_set():
            return
        self.stop()
        if self.state == "ending":
            time.sleep(CLOSE_SECONDS)  # the process takes this long to exit
        self._closed.set()
        self.state = "ended"
        self.engines.count()

    @property
    def alive(self) -> bool:
        return self.state in ("running", "ending")


async def test_300_presses_of_r_keep_one_engine_running_and_one_ending():
    engines = Engines()
    app = make_app(
        replace(SETTINGS, tokens=32),
        1,
        probe=PROBE,
        engine_factory=lambda s: SlowEngine(s, engines),
    )
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.live.state == "running")
        for press in range(300):  # held down: bursts of 10 keys, every 50 ms or so
            app.post_message(events.Key("r", "r"))
            if press % 10 == 9:
                await pilot.pause(0.05)
        await wait_for(pilot, lambda: [e.state for e in engines.made].count("running") == 1)
        await wait_for(pilot, lambda: all(e.state != "ending" for e in engines.made))
        await wait_for(pilot, lambda: app.live.state == "running")
        assert engines.most_running == 1 and engines.most_ending <= 1, (
            engines.most_running,
            engines.most_ending,
        )
        assert len(engines.made) < 300  # the burst was coalesced, not run press by press
        running = [e for e in engines.made if e.state == "running"]
        assert running == [engines.made[-1]]  # the last run asked for is the one that runs
