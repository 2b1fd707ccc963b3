"""Python's collector at launch (kvtui.collector): the launch holds it, the app's first frame
releases it (the launch's garbage collected once, the rest frozen), and nothing else is touched:
a launch that ends early resumes it, and an app nobody held freezes nothing. The device probe
starts at that same first frame."""

from __future__ import annotations

import gc
import weakref

import pytest

import kvtui.app
import kvtui.cli
import kvtui.gpu.probe
from kvtui import collector
from kvtui.app import make_app
from kvtui.cli import main

NO_GPU = {"probe": "null", "description": "no GPU"}
OPENINGS = {"screen 1": {}, "screen 2": {"screen": 2}, "screen 3": {"screen": 3}}
OPENINGS["presenter mode"] = {"present": True}


@pytest.fixture(autouse=True)
def collector_as_found():
    """Each test leaves the collector on and nothing frozen, whatever it asserted."""
    yield
    collector.release(freeze=False)
    gc.unfreeze()
    gc.enable()


class Cycle:
    def __init__(self) -> None:
        self.me = self


async def first_frame(monkeypatch, until=lambda app: True, **options) -> kvtui.app.KVApp:
    """Run the app headless until its first frame is drawn and the app has released the
    collector (as it does then, held or not), and `until(app)` holds; then quit. The app."""
    released = []
    release = collector.release
    monkeypatch.setattr(collector, "release", lambda **k: (release(**k), released.append(k)))
    app = make_app(autostart=False, **({"probe": NO_GPU} | options))
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(100):  # a pause is a round of the app's messages, not a time
            if released and until(app):
                break
            await pilot.pause()
    assert released == [{"freeze": True}], "the app's first frame did not release the collector"
    return app


@pytest.mark.parametrize("options", OPENINGS.values(), ids=OPENINGS.keys())
async def test_the_first_frame_releases_the_launch_hold(monkeypatch, options):
    collector.hold()
    assert not gc.isenabled()
    garbage = Cycle()
    gone = weakref.ref(garbage)
    del garbage
    assert gone() is not None  # held: nothing collects the cycle
    frozen_before = gc.get_freeze_count()

    await first_frame(monkeypatch, **options)

    assert gc.isenabled()
    assert gone() is None  # collected once, before the freeze
    assert gc.get_freeze_count() > frozen_before  # what the launch built, out of later passes


async def test_an_app_nobody_held_freezes_nothing(monkeypatch):
    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    await first_frame(monkeypatch)
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen_before


@pytest.mark.parametrize(
    "probe, said",
    [(lambda: {"description": "a GPU of the test's"}, "a GPU of the test's"), (None, None)],
    ids=["answers", "fails"],
)
async def test_the_device_is_probed_at_the_first_frame(monkeypatch, probe, said):
    def failing() -> dict:
        raise RuntimeError("no NVML here")

    monkeypatch.setattr(kvtui.gpu.probe, "probe_summary", probe or failing)
    app = await first_frame(monkeypatch, until=lambda app: app.live.probe is not None, probe=None)
    assert app.live.device_description == (said or "device unknown (the probe failed)")


def test_a_collector_turned_off_elsewhere_is_left_off():
    gc.disable()
    collector.hold()
    collector.release(freeze=True)
    assert not gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_the_launch_holds_the_collector_while_the_app_opens(monkeypatch):
    monkeypatch.setattr(kvtui.cli, "has_terminal", lambda: True)
    seen = []
    monkeypatch.setattr(kvtui.app, "run_app", lambda settings, **k: seen.append(gc.isenabled()))
    assert main(["--lesson", "--engine", "sim:llama-3.1-8b@h100"]) == 0
    assert seen == [False]  # held while the app imported and opened
    assert gc.isenabled()  # and on again when the app ended without a first frame
    assert gc.get_freeze_count() == 0


def test_a_launch_refused_before_the_app_resumes_the_collector(capsys):
    assert main(["--engine", "nope"]) == 2
    assert "unknown engine 'nope'" in capsys.readouterr().err
    assert gc.isenabled()
