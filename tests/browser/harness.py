"""`kvtui serve` in a real browser: a server in a subprocess, headless Chromium through Playwright.

Debian's `chromium` is driven through `executable_path` (Playwright's own browser download is not
needed). The terminal on the page is xterm.js drawing on a canvas, so its text is read from the
terminal's buffer (`buffer.active.getLine(y).translateToString()`, xterm's public API). The page
keeps its Terminal in a private field; a setter installed before the page's script runs (HOOK)
hands it to `window.__kvtuiTerm`. Every wait polls a condition against a deadline.

Each server runs with a tag in its environment that its apps and engines inherit, so the tests
find exactly the processes of their own sessions in /proc, whatever else runs on the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.ports import free_port

CHROMIUM = os.environ.get("KVTUI_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ENGINE = "sim:llama-3.1-8b@h100"
TAG_VARIABLE = "KVTUI_SERVE_TEST_TAG"

HOOK = """
Object.defineProperty(Object.prototype, "terminal", {
  configurable: true,
  set(value) {
    Object.defineProperty(this, "terminal", {
      value, writable: true, configurable: true, enumerable: true,
    });
    if (value && value.buffer && typeof value.write === "function") window.__kvtuiTerm = value;
  },
});
"""
READ_TERMINAL = """() => {
  const term = window.__kvtuiTerm;
  if (!term) return "";
  const buffer = term.buffer.active, rows = [];
  for (let y = 0; y < buffer.length; y++) {
    const line = buffer.getLine(y);
    rows.push(line ? line.translateToString(true) : "");
  }
  return rows.join("\\n");
}"""


def wait_for(condition: Callable[[], Any], timeout: float, what: str | Callable[[], str]) -> Any:
    """Poll `condition` until it returns something true; fail after `timeout` seconds, saying
    `what` was waited for (a callable is asked then, to describe the state at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what() if callable(what) else what}")
        time.sleep(0.1)


# --- processes ------------------------------------------------------------------------------------


def tagged_processes(tag: str) -> dict[int, tuple[int, str]]:
    """Live (not zombie) processes whose environment carries the tag: pid -> (ppid, command)."""
    found = {}
    needle = f"{TAG_VARIABLE}={tag}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
            state, ppid = Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()[:2]
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            command = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
            found[int(name)] = (int(ppid), command)
    return found


@dataclass
class ServeProcess:
    """`python -m kvtui serve` in a subprocess, with the lines it printed."""

    process: subprocess.Popen[str]
    tag: str
    lines: list[str] = field(default_factory=list)
    url: str = ""

    def sessions(self) -> dict[int, tuple[int, str]]:
        """The apps and engines this server started (itself left out): pid -> (ppid, command)."""
        found = tagged_processes(self.tag)
        found.pop(self.process.pid, None)
        return found

    def apps(self) -> set[int]:
        """The apps: the server's own children (each app's engine is the app's child)."""
        return {pid for pid, (ppid, _) in self.sessions().items() if ppid == self.process.pid}

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self, timeout: float = 15) -> int:
        """Ctrl+C, as a person stops it; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise AssertionError(f"kvtui serve did not stop on SIGINT:\n{self.output()}") from None


def start_server(*options: str) -> ServeProcess:
    """Start `kvtui serve` on a free loopback port; return once it says where to connect."""
    tag = uuid.uuid4().hex
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtui", "serve", "--port", str(free_port()), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, TAG_VARIABLE: tag, "TEXTUAL_ANIMATIONS": "none"},
    )
    server = ServeProcess(process, tag)

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            server.lines.append(line.rstrip("\n"))
            print("kvtui serve |", line, end="")  # captured with the test that is running

    threading.Thread(target=read, daemon=True).start()

    def address() -> str:
        if process.poll() is not None:
            raise AssertionError(f"kvtui serve exited {process.returncode}:\n{server.output()}")
        for line in server.lines:
            if " open http://" in line:
                return line.split(" open ", 1)[1].split()[0]
        return ""

    try:
        server.url = wait_for(address, 30, "kvtui serve to print its address")
    except BaseException:
        process.kill()
        process.wait(5)
        raise
    return server


# --- the browser ----------------------------------------------------------------------------------


class TerminalPage:
    """A browser tab on a `kvtui serve` page, read and typed into as a person would."""

    def __init__(self, page: Any, url: str) -> None:
        self.page = page
        self.url = url
        origin = url.rstrip("/")
        # Nothing leaves the machine: the page's web font request is refused at once.
        page.route(
            "**/*",
            lambda route: (
                route.continue_() if route.request.url.startswith(origin) else route.abort()
            ),
        )
        page.add_init_script(HOOK)

    def open(self) -> TerminalPage:
        self.page.goto(self.url, wait_until="domcontentloaded", timeout=30_000)
        return self

    def text(self) -> str:
        return self.page.evaluate(READ_TERMINAL)

    def wait_for_text(self, *needles: str, timeout: float = 30) -> str:
        """The terminal's text once it shows every one of `needles`."""
        return wait_for(
            lambda: (text := self.text()) and all(n in text for n in needles) and text,
            timeout,
            lambda: f"the terminal to show {needles!r}; it shows:\n{self.text()}",
        )

    def press(self, key: str) -> None:
        """Focus the terminal as a click would, then press the key."""
        self.page.locator(".xterm-helper-textarea").focus()
        self.page.keyboard.press(key)

    def session_ended(self) -> bool:
        """Whether the page shows textual-serve's "Session ended." dialog."""
        return self.page.locator(".closed-dialog").is_visible()
