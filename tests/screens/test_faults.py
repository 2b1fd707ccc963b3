"""The app under faults: screen switches by the hundred, bursts of keys, resize storms, an engine
process killed or stopped, signals to the app. (`benchmarks/app_faults.py` does the same in tmux,
with the real model, and also looks at the terminal it leaves.)"""

from __future__ import annotations

import fcntl
import gc
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import PROBE, SETTINGS, build, notifications, screen_text, wait_for
from fakes import FakeEngine
from textual import events
from textual.geometry import Size

from kvtui.app import make_app
from kvtui.run.process import EngineProcess
from kvtui.screens.cache import CacheScreen
from kvtui.screens.recompute import RecomputeScreen

SIZE = (100, 30)
SLOW_SIM = replace(SETTINGS, tokens=4096, replay_speed=1.0)
"""A sim run in a real engine process, at the roofline's pace: it is still running when a test
ends."""


async def test_switching_screens_keeps_no_more_footer_keys_than_it_shows():
    # Textual's Footer keeps every FooterKey it replaces (textual#6666): ~300 KB a switch.
    def live_keys() -> int:
        gc.collect()
        return sum(type(o).__name__ == "FooterKey" for o in gc.get_objects())

    app = build(1, hold_at=10)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2", "3", "4", "1")  # every screen's footer built once
        await pilot.pause()
        built = live_keys()
        assert built > len(app.screen.query("FooterKey"))  # more than one screen's
        for _ in range(3):
            await pilot.press("2", "3", "4", "1")
        await pilot.press("2")
        await pilot.pause()
        assert live_keys() == built
        assert "r Run" in screen_text(app).splitlines()[-1]  # the new keys are there


async def test_a_burst_of_r_leaves_one_engine_running():
    app = build(1, hold_at=10)
    seen = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await wait_for(pilot, lambda: app.live.state == "running")
        for _ in range(200):  # as a terminal delivers them: all at once, no frame between
            app.post_message(events.Key("r", "r"))
        # restarts wait for an ending engine to end (test_restart_burst.py): the last one runs
        await wait_for(pilot, lambda: sum(isinstance(m, events.Key) for m in seen) >= 200)
        await wait_for(pilot, lambda: app.live.state == "running")
        await wait_for(pilot, lambda: [e for e in FakeEngine.instances if e.alive] == [app.engine])
        assert len(FakeEngine.instances) < 201
        await wait_for(pilot, lambda: [w.group for w in app.workers if w.is_running] == ["decode"])
        assert app.live.run_tokens == 32


async def test_a_resize_storm_ends_on_the_layout_of_the_last_size():
    app = build(1, hold_at=10)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.live.state == "running")
        sizes = [(20, 5), (80, 24), (33, 7), SIZE]
        for width, height in sizes * 30:  # as a terminal posts them: no frame between
            app.post_message(events.Resize(Size(width, height), Size(width, height)))
        for size in sizes * 2:  # and with frames between
            await pilot.resize_terminal(*size)
        await pilot.resize_terminal(20, 5)
        assert app.screen.has_class("-too-small")
        assert "20x5" in str(app.screen.query_one("TooSmall").render())
        await pilot.resize_terminal(*SIZE)
        assert not app.screen.has_class("-too-small")
        app.screen.redraw_now()
        assert "running" in screen_text(app).splitlines()[0]
        await pilot.press("2")
        assert isinstance(app.screen, CacheScreen)


def _gone(pid: int) -> bool:
    """True once a process has exited and been reaped (or is only a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def test_a_killed_engine_process_is_reported_and_r_starts_another():
    app = make_app(SLOW_SIM, 1, probe=PROBE, engine_factory=EngineProcess)
    seen = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await wait_for(pilot, lambda: app.live.loop("cached").steps > 0)
        first = app.engine.pid
        os.kill(first, signal.SIGKILL)
        # the screens' copy (live_run), which the header draws: it follows `live` a message later
        await wait_for(pilot, lambda: app.live_run.state == "failed")
        app.screen.redraw_now()
        assert "killed by signal 9" in screen_text(app).splitlines()[0]
        assert any("signal 9" in m and "Press r" in m for m in notifications(seen))
        assert app.is_running
        await pilot.press("r")
        await wait_for(pilot, lambda: app.live.loop("cached").steps > 0)
        second = app.engine.pid
        assert second != first
        await pilot.press("q")
    assert _gone(first) and _gone(second)


async def test_a_stopped_engine_process_neither_freezes_the_keys_nor_blocks_quitting():
    app = make_app(SLOW_SIM, 1, probe=PROBE, engine_factory=EngineProcess)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.live.loop("cached").steps > 0)
        engine = app.engine
        os.kill(engine.pid, signal.SIGSTOP)
        await pilot.press("2")
        assert isinstance(app.screen, CacheScreen)
        await pilot.press("1")
        assert isinstance(app.screen, RecomputeScreen)
        await pilot.press("q")  # with the child still stopped: close() ends it by force
    assert _gone(engine.pid)
    assert engine.returncode == -signal.SIGKILL


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_ends_the_app_as_q_does_with_the_shells_status(signum):
    """In a real (pseudo) terminal: the app leaves the alternate screen, shows the cursor,
    closes its engine's process and exits with 128 + the signal."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    command = [sys.executable, "-m", "kvtui", "--engine", SLOW_SIM.engine, "--tokens", "4096"]
    app = subprocess.Popen(
        command, stdin=child, stdout=child, stderr=child, start_new_session=True, close_fds=True
    )
    os.close(child)
    output = bytearray()
    up = threading.Event()

    def read() -> None:  # drain the terminal, or the app blocks writing to it
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:
                return
            if not chunk:
                return
            output.extend(chunk)
            if b"running" in output:
                up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert up.wait(30), bytes(output[-400:])
        engines = _children(app.pid)
        assert len(engines) == 1
        shown = len(output)
        app.send_signal(signum)
        assert app.wait(10) == 128 + signum
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
    reader.join(5)
    os.close(main)
    after = bytes(output[shown:])
    assert b"\x1b[?1049l" in after and b"\x1b[?25h" in after  # main screen back, cursor shown
    assert b"Traceback" not in after
    assert all(_gone(pid) for pid in engines)
