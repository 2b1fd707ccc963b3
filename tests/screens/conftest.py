"""Screen tests: the app over a fake engine (events from a list, no process)."""

from __future__ import annotations

import html
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("TEXTUAL_ANIMATIONS", "none")
sys.path.insert(0, str(Path(__file__).parent))

from fakes import FakeEngine  # noqa: E402
from textual.notifications import Notify  # noqa: E402

from kvtui.app import KVApp, make_app  # noqa: E402
from kvtui.engine.protocol import RunSettings  # noqa: E402

PROBE = {
    "description": "CPU, no GPU: NVML library not found (libnvidia-ml.so.1)",
    "label": "CPU, no GPU",
    "name": None,
}
SETTINGS = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=32, seed=0)


def build(screen: int = 1, tokens: int = 32, *, lesson: bool = False, **engine_options) -> KVApp:
    """The app on a screen, with a deterministic fake engine and a fixed probe."""
    return make_app(
        replace(SETTINGS, tokens=tokens, lesson=lesson),
        screen,
        probe=PROBE,
        engine_factory=lambda settings: FakeEngine(settings, **engine_options),
    )


_SVG_TEXT = re.compile(
    r'<text class="[^"]*" x="([\d.]+)" y="[\d.]+" textLength="[\d.]+" '
    r'clip-path="url\(#[\w-]*line-(\d+)\)">([^<]*)</text>'
)
_CELL_WIDTH = 12.2
"""Width of one terminal cell in Textual's SVG screenshots."""


def screen_text(app: KVApp) -> str:
    """What the terminal shows right now, as plain text: one line per row.

    Read from the app's own screenshot (`App.export_screenshot`, the same cells a terminal
    receives), so a line that is clipped by its container or pushed off the screen is missing
    here too."""
    width, height = app.size
    rows = [[" "] * width for _ in range(height)]
    for x, line, text in _SVG_TEXT.findall(app.export_screenshot()):
        row, column = rows[int(line)], round(float(x) / _CELL_WIDTH)
        for offset, char in enumerate(html.unescape(text).replace("\xa0", " ")):
            if 0 <= column + offset < width:
                row[column + offset] = char
    return "\n".join("".join(row).rstrip() for row in rows)


def notifications(messages: list) -> list[str]:
    """The text of every notification among the messages a test's `message_hook` saw."""
    return [m.notification.message for m in messages if isinstance(m, Notify)]


async def wait_for(pilot, condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Let the app run until `condition()` holds; fail the test after `timeout` seconds (a
    bound for a loaded machine, not a goal: it returns as soon as the condition holds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {condition}")
        await pilot.pause(0.01)


@pytest.fixture(autouse=True)
def _forget_engines():
    FakeEngine.instances.clear()
    yield
    for engine in FakeEngine.instances:
        engine.close()
