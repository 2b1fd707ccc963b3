"""Screen tests: the app over a fake engine (events from a list, no process), read through
kvtui.testing, the same public kit a developer driving kvtui headless uses."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("TEXTUAL_ANIMATIONS", "none")
sys.path.insert(0, str(Path(__file__).parent))

from fakes import FakeEngine  # noqa: E402

from kvtui.app import KVApp, make_app  # noqa: E402
from kvtui.engines.protocol import RunSettings  # noqa: E402
from kvtui.testing import NO_GPU_PROBE, screen_text, wait_for  # noqa: E402, F401
from kvtui.testing import notifications_in as notifications  # noqa: E402, F401

PROBE = dict(NO_GPU_PROBE)
SETTINGS = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=32, seed=0)


def build(screen: int = 1, tokens: int = 32, *, lesson: bool = False, **engine_options) -> KVApp:
    """The app on a screen, with a deterministic fake engine and a fixed probe."""
    return make_app(
        replace(SETTINGS, tokens=tokens, lesson=lesson),
        screen,
        probe=PROBE,
        engine_factory=lambda settings: FakeEngine(settings, **engine_options),
    )


@pytest.fixture(autouse=True)
def _forget_engines():
    FakeEngine.instances.clear()
    yield
    for engine in FakeEngine.instances:
        engine.close()
