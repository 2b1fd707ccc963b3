"""Python's collector at launch (kvtui.collector): the launch holds it, the app's first frame
releases it (the launch's garbage collected once, the rest frozen), and nothing else is touched:
a launch that ends early resumes it, and an app nobody held freezes nothing."""

from __future__ import annotations

import gc
import weakref

import pytest

import kvtui.app
import kvtui.cli
from kvtui import collector
from kvtui.app import KVApp, make_app
from kvtui.cli import main

NO_GPU = {"probe": "null", "description": "no GPU"}


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


async def first_frame(monkeypatch) -> None:
    """Run the app headless until its first frame is drawn (Textual's `Ready` handled), then
    quit."""
    drawn = []
    on_ready = KVApp.on_ready
    monkeypatch.setattr(KVApp, "on_ready", lambda app: (on_ready(app), drawn.append(True)))
    app = make_app(autostart=False, probe=NO_GPU)
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(50):  # a pause is a round of the app's messages, not a time
            if drawn:
                break
            await pilot.pause()
    assert drawn, "the app never drew its first frame"


async def test_the_first_frame_releases_the_launch_hold(monkeypatch):
    collector.hold()
    assert not gc.isenabled()
    garbage = Cycle()
    gone = weakref.ref(garbage)
    del garbage
    assert gone() is not None  # held: nothing collects the cycle
    frozen_before = gc.get_freeze_count()

    await first_frame(monkeypatch)

    assert gc.isenabled()
    assert gone() is None  # collected once, before the freeze
    assert gc.get_freeze_count() > frozen_before  # what the launch built, out of later passes


async def test_an_app_nobody_held_freezes_nothing(monkeypatch):
    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    await first_frame(monkeypatch)
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen_before


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
