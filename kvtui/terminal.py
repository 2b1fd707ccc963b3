"""Where the app meets the terminal, guarded: what a terminal or an environment may send that
Textual itself does not survive, each guarded here, at kvtui's edge, until Textual's own fix.

- Bytes that are not UTF-8 (a terminal sending Alt as 8-bit meta; `tmux send-keys -H ff`) end
  Textual's Linux driver's input thread with a UnicodeDecodeError, and the app with it
  (textual#6456): `TolerantLinuxDriver` reads on past them.
- A key sequence whose number is past what a character can be (`ESC [ 1000000000000000000 A`, a
  cursor move of 10^18 rows; `ESC [ 1114112 u`) ends the same thread with an OverflowError or a
  ValueError from `chr()` in Textual's parser (`XTermParser._parse_extended_key`):
  `TolerantXTermParser` drops such a sequence, and the driver reads on.
- A page key in the command palette while its list has no height yet raises KeyError in
  `OptionList._move_page`, and a selection that reaches it twice dismisses it twice (popping
  another screen, or raising ScreenStackError): `CommandPalette` lets such keys do nothing.
- `TEXTUAL_DRIVER` naming no driver raised from deep in Textual: `driver_class` says so in a line.
- SIGINT, SIGTERM and SIGHUP, left to asyncio, ended the app with 0, as if it had succeeded:
  `ended_by_signals` ends it as `q` does, with the status a shell expects of that signal.

The reports for Textual, with minimal reproductions, are in docs/upstream/.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from textual import command, constants, events
from textual._xterm_parser import XTermParser
from textual.await_complete import AwaitComplete
from textual.binding import Binding
from textual.driver import Driver
from textual.drivers import linux_driver
from textual.drivers.linux_driver import LinuxDriver


class DriverError(Exception):
    """`TEXTUAL_DRIVER` names no Textual driver: one line for a person to read."""


def _replacing_decoder(encoding: str) -> Callable[[], codecs.IncrementalDecoder]:
    """`codecs.getincrementaldecoder`, making decoders that put U+FFFD for bytes the encoding
    has no character for, where the default raises."""
    return functools.partial(codecs.getincrementaldecoder(encoding), errors="replace")


DROPPED_KEY = "kvtui_dropped_sequence"
"""The key a sequence Textual's parser cannot take becomes: bound to nothing."""


class TolerantXTermParser(XTermParser):
    """Textual's parser of terminal input, dropping a key sequence whose numbers are out of any
    range (`ESC [ 1000000000000000000 A`): Textual's turns the number into a character with
    `chr()`, which raises OverflowError or ValueError, and that ends the input thread."""

    def _parse_extended_key(self, sequence: str) -> list[events.Key] | None:  # type: ignore[override]
        try:
            return super()._parse_extended_key(sequence)
        except (OverflowError, ValueError):
            # One key bound to nothing and typing nothing: the sequence is taken whole (no key
            # at all would have Textual read on and re-send its characters as keys: its digits
            # would switch screens).
            return [events.Key(DROPPED_KEY, None)]


class TolerantLinuxDriver(LinuxDriver):
    """Textual's Linux driver, reading on past bytes that are not UTF-8 and key sequences
    Textual's parser cannot take.

    Textual decodes the terminal's input strictly, so one such byte raises UnicodeDecodeError in
    its input thread, which ends the app (textual#6456). Its input thread makes its decoder with
    the module's `getincrementaldecoder`: here that makes one that puts U+FFFD instead (a key
    bound to nothing), the fix proposed upstream; and its parser with the module's
    `XTermParser`: here `TolerantXTermParser`. Should Textual stop making either so, the thread
    starts reading again after the error: what came in the same read is dropped."""

    def run_input_thread(self) -> None:
        linux_driver.getincrementaldecoder = _replacing_decoder  # type: ignore[attr-defined, assignment]
        linux_driver.XTermParser = TolerantXTermParser  # type: ignore[attr-defined]
        while True:
            try:
                super().run_input_thread()
            except (ValueError, OverflowError):  # UnicodeDecodeError is a ValueError
                continue
            return


def driver_class(chosen: type[Driver]) -> type[Driver]:
    """The driver kvtui runs: Textual's choice, tolerant of bad input where it is Linux's."""
    return TolerantLinuxDriver if chosen is LinuxDriver else chosen


def checked_driver(find: object) -> type[Driver]:
    """The driver `find()` (Textual's `App.get_driver_class`) returns, with `DriverError` when
    `TEXTUAL_DRIVER` names a module that does not import or something that is not a driver."""
    name = constants.DRIVER or ""  # TEXTUAL_DRIVER, as Textual read it when imported
    try:
        chosen = find()  # type: ignore[operator]
    except Exception as exc:  # import_module and getattr raise all kinds: one line, whichever
        raise DriverError(
            f"TEXTUAL_DRIVER={name!r} names no Textual driver ({type(exc).__name__}: {exc}); "
            "unset it to use this terminal"
        ) from None
    if not (isinstance(chosen, type) and issubclass(chosen, Driver)):
        raise DriverError(
            f"TEXTUAL_DRIVER={name!r} names {type(chosen).__name__} {chosen!r:.60}, not a "
            "Textual driver; unset it to use this terminal"
        )
    return driver_class(chosen)


class CommandPalette(command.CommandPalette):
    """Textual's command palette, where keys that reach it at the wrong moment do nothing:

    - a page key while its list has no height yet (Textual's `OptionList._move_page` pages from
      the lines it has laid out, and a list with no height has none: KeyError), or while it is
      being removed (no list left: NoMatches);
    - a second selection or Escape after it has dismissed itself (Enter typed twice): Textual's
      palette dismisses itself again, popping whatever screen is then on top, or raising
      ScreenStackError when only the app's own is left;
    - a change of its list's visibility while it is being removed (NoMatches)."""

    BINDINGS = [  # first, whichever widget has focus: the list's own page keys are unguarded
        Binding("pagedown", "command_list('page_down')", show=False, priority=True),
        Binding("pageup", "command_list('page_up')", show=False, priority=True),
    ]

    def _action_command_list(self, action: str) -> None:
        lists = self.query(command.CommandList)
        if not lists:
            return
        if action not in ("page_up", "page_down"):
            super()._action_command_list(action)
            return
        if not lists.first().scrollable_content_region:
            return
        with contextlib.suppress(KeyError, IndexError):  # lines not laid out yet, as above
            super()._action_command_list(action)

    def _watch__list_visible(self) -> None:
        if self.query(command.CommandList):  # else it is being removed: nothing to show
            super()._watch__list_visible()

    def dismiss(self, result: Any = None) -> AwaitComplete:
        if not self.is_active:  # dismissed already: not on top of the stack any more
            return AwaitComplete.nothing()
        return super().dismiss(result)


SIGNAL_GRACE_S = 2.0
"""After SIGINT, SIGTERM or SIGHUP, how long the app may take to end as `q` does before it is
ended."""


@contextlib.contextmanager
def ended_by_signals(
    exit_app: Callable[[int], object], close_now: Callable[[], object]
) -> Iterator[None]:
    """While in the block (the app running), SIGINT, SIGTERM and SIGHUP end the app as `q` does:
    `exit_app(code)` on the app's own loop, with the exit code a shell expects of that signal (130,
    143, 129). Should it not have ended SIGNAL_GRACE_S later (its terminal is gone, say, and the
    UI is stuck writing to it), `close_now()` (the engine's processes), then this process ends
    with that code. The handlers before are put back on leaving."""

    def leave(signum: int, frame: object) -> None:
        code = 128 + signum
        fallback = threading.Timer(SIGNAL_GRACE_S, hard_exit, args=(code,))
        fallback.daemon = True
        fallback.start()
        try:
            loop = asyncio.get_running_loop()  # the handler runs on the app's own thread
        except RuntimeError:
            raise SystemExit(code) from None
        loop.call_soon_threadsafe(exit_app, code)

    def hard_exit(code: int) -> None:
        close_now()
        os._exit(code)

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, leave) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
