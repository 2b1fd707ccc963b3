"""Screen tests: the app over a fake engine (events from a list, no process)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TEXTUAL_ANIMATIONS", "none")
sys.path.insert(0, str(Path(__file__).parent))

from fakes import FakeEngine  # noqa: E402

from kvtui.app import KVApp, make_app  # noqa: E402
from kvtui.engine.protocol import RunSettings  # noqa: E402

PROBE = {"description": "CPU, no GPU: NVML library not found (libnvidia-ml.so.1)", "name": None}
SETTINGS = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=32, seed=0)


def build(screen: int = 1, length: int = 24, **engine_options) -> KVApp:
    """The app on a screen, with a deterministic fake engine and a fixed probe."""
    return make_app(
        SETTINGS,
        screen,
        length,
        probe=PROBE,
        engine_factory=lambda settings: FakeEngine(settings, **engine_options),
    )


def screen_text(app: KVApp) -> str:
    """What the terminal shows right now, as plain text: one line per row.

    Read from the screen's compositor (the same strips a terminal receives), so a line that is
    clipped by its container or pushed off the screen is missing here too."""
    strips = app.screen._compositor.render_strips()
    return "\n".join(strip.text for strip in strips)


@pytest.fixture(autouse=True)
def _forget_engines():
    FakeEngine.instances.clear()
    yield
    for engine in FakeEngine.instances:
        engine.close()
