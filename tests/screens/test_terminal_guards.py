"""The terminal side: what a terminal or an environment may send the app that Textual itself does
not survive (bytes that are not UTF-8, a page key in a command palette not yet laid out), a
driver or a torch setting named wrongly in the environment, and ctrl+c, which quits as q does."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading

import pytest
import textual.constants
from conftest import SETTINGS, build, wait_for
from textual import events
from textual.app import App
from textual.command import CommandList, CommandPalette

from kvtui.cli import main
from kvtui.screens.recompute import RecomputeScreen

SIZE = (100, 30)


class PtyApp:
    """The app (`python -m kvtui`) on a pseudo-terminal of 100x30, its output drained and kept."""

    def __init__(self) -> None:
        self.fd, child = pty.openpty()
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        command = [sys.executable, "-m", "kvtui", "--engine", SETTINGS.engine, "--tokens", "4096"]
        self.app = subprocess.Popen(
            command, stdin=child, stdout=child, stderr=child, start_new_session=True, close_fds=True
        )
        os.close(child)
        self.output = bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:  # drain the terminal, or the app blocks writing to it
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.output.extend(chunk)

    def shows(self, word: bytes, seconds: float, since: int = 0) -> bool:
        return wait_until(lambda: word in self.output[since:], seconds)

    def close(self) -> None:
        if self.app.poll() is None:
            self.app.kill()
            self.app.wait()
        self.reader.join(5)
        os.close(self.fd)


def test_bytes_that_are_not_utf8_and_ctrl_c_in_a_real_terminal():
    """As `tmux send-keys -H ff fe c0 af` (a terminal sending Alt as 8-bit meta): the app reads
    on, says nothing alarming, and then ctrl+c quits it as q does (exit 0, terminal restored)."""
    run = PtyApp()
    try:
        assert run.shows(b"running", 30), bytes(run.output[-400:])
        os.write(run.fd, b"\xff\xfe\xc0\xaf")
        shown = len(run.output)
        os.write(run.fd, b"2")  # still reading keys: screen 2's title appears
        assert run.shows(b"2 \xc2\xb7 ", 10, shown), bytes(run.output[-400:])
        os.write(run.fd, b"\x03")  # ctrl+c
        assert run.app.wait(10) == 0
    finally:
        run.close()
    assert b"Traceback" not in run.output and b"UnicodeDecodeError" not in run.output
    assert b"\x1b[?1049l" in run.output  # the main screen back


HOSTILE_INPUT = [
    b"\x1b[1000000000000000000A",  # a cursor move of 10^18 rows: OverflowError in chr()
    b"\x1b[1114112u",  # a key past the last character: ValueError in chr()
    b"\x1b[97;1;1000000000000000000u",  # a key's text past any character
    b"\x1b[<0;9999;9999M\x1b[<0;9999;9999m",  # a click far off the screen
    b"\x1b[<35;99999999999999999999;9999M",  # a mouse move past any int
    b"\x1b[200~" + b"x" * 100_000 + b"\x1b[201~",  # a 100 KB bracketed paste
]


def test_key_sequences_textual_cannot_parse_in_a_real_terminal():
    """What a terminal (or whatever writes to it) may send that Textual's parser does not survive:
    a key sequence whose number is past any character (OverflowError, ValueError from `chr()` in
    its input thread, which ended the app), a mouse report far off the screen and a 100 KB
    bracketed paste. The app reads on (a key press still switches screens) and shows no
    traceback."""
    run = PtyApp()
    try:
        assert run.shows(b"running", 30), bytes(run.output[-400:])
        for data in HOSTILE_INPUT:
            os.write(run.fd, data)
        shown = len(run.output)
        os.write(run.fd, b"2")
        assert run.shows(b"2 \xc2\xb7 ", 20, shown), bytes(run.output[-400:])
        os.write(run.fd, b"q")
        assert run.app.wait(10) == 0
    finally:
        run.close()
    assert b"Traceback" not in run.output and b"Error" not in run.output


def wait_until(condition, seconds: float) -> bool:
    done = threading.Event()
    for _ in range(int(seconds / 0.05)):
        if condition():
            return True
        done.wait(0.05)
    return bool(condition())


async def test_keys_that_reach_the_palette_at_the_wrong_moment_then_ctrl_c():
    """Each of Textual's palette faults, one app: a page key while its list has no height yet
    (KeyError in OptionList._move_page), in the palette and in the Theme command's; Enter typed
    twice before it closes (it dismissed itself twice: ScreenStackError, or the screen under it
    popped); its list-visibility watcher run as it goes (NoMatches). The app lives on, and then
    ctrl+c quits it as q does."""
    app = build(1, hold_at=10)
    async with app.run_test(size=SIZE) as pilot:
        for opened in ("ctrl+p", "theme"):
            if opened == "theme":
                app.search_themes()  # the palette's Theme command: a palette of its own
            else:
                await pilot.press("ctrl+p")
            await wait_for(pilot, lambda: app.screen.query(CommandList))
            commands = app.screen.query_one(CommandList)
            if opened == "ctrl+p":
                await pilot.press("e", "n", "g")
            await wait_for(pilot, lambda commands=commands: commands.option_count > 0)
            commands.styles.height = 0  # as before its first layout
            commands.highlighted = 0
            await pilot.pause()
            await pilot.press("pagedown", "pageup", "pagedown")
            assert app.is_running
            await pilot.press("escape")
        assert not CommandPalette.is_open(app)

        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: app.screen.query(CommandList))
        await pilot.press(*"theme")
        commands = app.screen.query_one(CommandList)
        await wait_for(pilot, lambda: commands.option_count > 0)
        for key in ("down", "enter", "enter", "enter", "pagedown"):
            app.post_message(events.Key(key, None))  # as a terminal delivers them: at once
        await pilot.pause()
        await pilot.pause()
        assert app.is_running
        for _ in range(4):  # the theme picker the selection opened, if it is open
            if CommandPalette.is_open(app):
                await pilot.press("escape")
        assert isinstance(app.screen, RecomputeScreen)  # nothing popped beyond the palettes

        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: app.screen.query(CommandList))
        palette = app.screen
        await palette.query_one(CommandList).remove()  # as while it is being removed
        palette._list_visible = not palette._list_visible
        await pilot.pause()
        assert app.is_running
        await pilot.press("escape")

        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not app.is_running)
    assert app.return_code == 0


def test_a_driver_named_wrongly_is_one_line(capsys, monkeypatch):
    import kvtui.cli

    monkeypatch.setattr(kvtui.cli, "has_terminal", lambda: True)
    monkeypatch.setattr(App, "run", lambda *a, **k: pytest.fail("the app ran"))
    for name in ("nosuch.module:X", "textual.drivers.linux_driver:Nope", "os:path", "garbage"):
        monkeypatch.setattr(textual.constants, "DRIVER", name)  # TEXTUAL_DRIVER, as read
        code = main(["--engine", SETTINGS.engine])
        out, err = capsys.readouterr()
        assert (code, out) == (2, ""), err
        assert err.count("\n") == 1 and "TEXTUAL_DRIVER" in err and "Traceback" not in err, err


def test_a_torch_that_does_not_import_is_one_line(capsys, monkeypatch):
    """torch refuses to import where the environment sets what it will not take (TORCH_LOGS=evil
    is a ValueError listing every valid setting; benchmarks/fuzz_inputs.py runs that one): the
    run is refused in one line, as any failure to import torch is."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises
    code = main(["bench", "--tokens", "2", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "torch does not import" in err, err


def test_the_textual_names_the_guards_rely_on():
    """kvtui.terminal replaces the decoder factory Textual's Linux driver reads input with, and
    overrides the palette's page action: were either renamed, a guard would silently stop."""
    from textual._xterm_parser import XTermParser
    from textual.drivers import linux_driver

    assert callable(linux_driver.getincrementaldecoder)
    assert linux_driver.XTermParser is XTermParser or issubclass(
        linux_driver.XTermParser, XTermParser
    )
    assert callable(XTermParser._parse_extended_key)
    for name in ("_action_command_list", "_watch__list_visible", "dismiss"):
        assert callable(getattr(CommandPalette, name)), name
