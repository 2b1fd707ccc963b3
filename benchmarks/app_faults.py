"""The app under faults, in a real terminal: one line per check, pass or fail, with what was seen.

Runs `kvtui` (the default engine, the shipped model, a 4,000-token run) in a detached tmux pane
at 100x30, once per check, and does to it what a machine or a user may do: SIGKILL the engine's
process, SIGSTOP and SIGCONT it, SIGINT and SIGTERM the app, a storm of resizes down to 20x5 and
back, 200 `r` and 200 `Right` in one burst. Every check then quits the app (or lets the signal
end it) and looks at what is left: the app's exit status, the terminal (`stty -g` the same as
before, tmux's pane flags: no alternate screen, cursor shown, no mouse reporting) and /proc (no
engine process left behind, none a zombie).

    python benchmarks/app_faults.py            # every check, about two minutes
    python benchmarks/app_faults.py --only sigterm burst-r
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SIZE = (100, 30)
ENGINE_MARK = "from kvtui.run.process import child_main"
"""In the engine's command line (kvtui.run.process's bootstrap): how its processes are found."""
PANE_FLAGS = {
    "alternate_on": "0",
    "cursor_flag": "1",
    "mouse_any_flag": "0",
    "mouse_all_flag": "0",
    "mouse_button_flag": "0",
    "mouse_standard_flag": "0",
    "mouse_sgr_flag": "0",
}
"""tmux's view of the terminal once the app has gone, as it was before the app started."""


class Failed(Exception):
    """A check saw something wrong: the message says what."""


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def proc_stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def engine_processes() -> dict[int, tuple[int, str]]:
    """Every kvtui engine process on the machine: pid -> (parent pid, state)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if ENGINE_MARK in command and (stat := proc_stat(int(entry.name))):
            found[int(entry.name)] = stat
    return found


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> object:
    """Poll `condition` until it returns something true; Failed after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise Failed(f"{what}: not within {timeout:g} s")
        time.sleep(0.05)
    return value


class Pane:
    """kvtui in a tmux pane, started by a shell that records the terminal's settings and the
    exit status, then stays so that the terminal can be looked at after the app has gone."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.session = f"kvtui-faults-{os.getpid()}-{name}"  # another run beside it keeps its own
        self.dir = workdir / name
        self.dir.mkdir()
        self.engines_seen: set[int] = set()
        app = shlex.join([sys.executable, "-m", "kvtui", "--tokens", "4000"])
        d = shlex.quote(str(self.dir))
        script = (
            f"stty -g > {d}/stty-before; {app}; echo $? > {d}/status; "
            f"stty -g > {d}/stty-after; exec sleep 3600"
        )
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)
        width, height = (str(n) for n in SIZE)
        tmux("new-session", "-d", "-s", self.session, "-x", width, "-y", height, script)
        self.pid = int(wait_until(self._app_pid, 30, "the app's process to start"))

    def _app_pid(self) -> int | None:
        shell = int(tmux("display", "-p", "-t", self.session, "#{pane_pid}").strip())
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or (stat := proc_stat(int(entry.name))) is None:
                continue
            with contextlib.suppress(OSError):
                if stat[0] == shell and b"kvtui" in (entry / "cmdline").read_bytes():
                    return int(entry.name)
        return None

    def screen(self) -> str:
        return tmux("capture-pane", "-p", "-t", self.session)

    def header(self) -> str:
        lines = self.screen().splitlines()
        return lines[0] if lines else ""

    def keys(self, *keys: str) -> None:
        tmux("send-keys", "-t", self.session, *keys)

    def alive(self) -> bool:
        stat = proc_stat(self.pid)
        return stat is not None and stat[1] != "Z"

    def engines(self) -> dict[int, str]:
        """The app's engine processes now: pid -> state (Z: a zombie, not reaped)."""
        mine = {pid: state for pid, (ppid, state) in engine_processes().items() if ppid == self.pid}
        self.engines_seen.update(mine)
        return mine

    def engine(self, timeout: float = 60) -> int:
        """The pid of the app's one live engine, once it is stepping."""
        wait_until(lambda: min(self.counts()) > 0, timeout, "the run to be stepping")
        live = wait_until(
            lambda: [p for p, s in self.engines().items() if s != "Z"], 10, "an engine process"
        )
        return live[0]

    def counts(self) -> tuple[int, int]:
        """(uncached, cached) steps done, from the header line."""
        found = re.search(r"uncached ([\d,]+), cached ([\d,]+)", self.header())
        if not found:
            return (-1, -1)
        return tuple(int(n.replace(",", "")) for n in found.groups())  # type: ignore[return-value]

    def quit(self) -> None:
        if self.alive():
            self.keys("q")
        wait_until(lambda: not self.alive(), 10, "the app to quit on q")

    def aftermath(self, expected_status: int) -> str:
        """What the app left behind once it has gone; Failed if anything is wrong."""
        status_file = self.dir / "status"
        wait_until(status_file.exists, 10, "the shell to record the exit status")
        status = int(status_file.read_text().strip() or -1)
        problems = []
        if status != expected_status:
            problems.append(f"exit status {status}, not {expected_status}")
        stty_after = self.dir / "stty-after"
        wait_until(stty_after.exists, 5, "the shell to record stty")
        if (self.dir / "stty-before").read_text() != stty_after.read_text():
            problems.append("stty settings differ from before the app")
        names = ",".join(f"#{{{name}}}" for name in PANE_FLAGS)
        shown = tmux("display", "-p", "-t", self.session, names).strip().split(",")
        flags = dict(zip(PANE_FLAGS, shown, strict=True))
        wrong = {k: v for k, v in flags.items() if v != PANE_FLAGS[k]}
        if wrong:
            problems.append(f"terminal left with {wrong}")
        left = [pid for pid in self.engines_seen if proc_stat(pid) is not None]
        if left:
            problems.append(f"engine processes left: {left}")
        if problems:
            raise Failed("; ".join(problems))
        return (
            f"exit {status}, stty restored, no alternate screen or mouse mode, "
            f"{len(self.engines_seen)} engine pid(s) seen, none left"
        )

    def close(self) -> None:
        """End the session; an app still running gets its SIGHUP, then SIGKILL after 5 s, and
        an engine of ours still running after that is killed too (a failed check says so)."""
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)
        with contextlib.suppress(Failed):
            wait_until(lambda: not self.alive(), 5, "the app to end on SIGHUP")
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        for pid in self.engines_seen:
            with contextlib.suppress(Failed):
                wait_until(lambda pid=pid: proc_stat(pid) is None, 5, "an engine to end")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# --- the checks: each returns the evidence, or raises Failed --------------------------------------


def check_engine_killed(pane: Pane) -> str:
    engine = pane.engine()
    os.kill(engine, signal.SIGKILL)
    wait_until(lambda: "killed by signal 9" in pane.header(), 10, "the header to say signal 9")
    reaped = wait_until(lambda: engine not in pane.engines(), 5, "the killed engine to be reaped")
    said = pane.header().strip()[:60]
    if not pane.alive():
        raise Failed("the app died with its engine")
    pane.keys("r")
    second = pane.engine()
    if second == engine:
        raise Failed("r did not start a new engine")
    before = pane.counts()
    wait_until(lambda: pane.counts() > before, 10, "the new run to step")
    pane.quit()
    return f"header {said!r}; reaped: {bool(reaped)}; r started pid {second}; " + pane.aftermath(0)


def check_engine_stopped(pane: Pane) -> str:
    engine = pane.engine()
    os.kill(engine, signal.SIGSTOP)
    frozen = pane.counts()
    pane.keys("2")
    wait_until(lambda: "2 ·" in pane.screen(), 5, "screen 2 while the engine is stopped")
    pane.keys("1")
    wait_until(lambda: "1 ·" in pane.screen(), 5, "screen 1 while the engine is stopped")
    still = pane.counts()
    os.kill(engine, signal.SIGCONT)
    wait_until(lambda: pane.counts() > still, 15, "steps to resume after SIGCONT")
    resumed = pane.counts()
    os.kill(engine, signal.SIGSTOP)  # and quit while it is stopped: close() must not hang
    t0 = time.monotonic()
    pane.quit()
    quit_s = time.monotonic() - t0
    return (
        f"stopped at {frozen}, keys 2 and 1 answered while stopped ({still}), "
        f"stepping again after SIGCONT {resumed}; q with the engine stopped took {quit_s:.1f} s; "
        + pane.aftermath(0)
    )


def check_signal(signum: int) -> Callable[[Pane], str]:
    def check(pane: Pane) -> str:
        pane.engine()
        t0 = time.monotonic()
        os.kill(pane.pid, signum)
        wait_until(lambda: not pane.alive(), 10, f"the app to end on {signal.Signals(signum).name}")
        return f"ended in {time.monotonic() - t0:.1f} s; " + pane.aftermath(128 + signum)

    return check


def check_resize_storm(pane: Pane) -> str:
    pane.engine()
    sizes = [(20, 5), (40, 10), (80, 24), (20, 5), (100, 30), (33, 7)] * 20
    for width, height in sizes:
        tmux("resize-window", "-t", pane.session, "-x", str(width), "-y", str(height))
    tmux("resize-window", "-t", pane.session, "-x", "20", "-y", "5")
    wait_until(lambda: "needs a" in pane.screen(), 5, "the too-small note at 20x5")
    tmux("resize-window", "-t", pane.session, "-x", str(SIZE[0]), "-y", str(SIZE[1]))
    wait_until(lambda: "1 ·" in pane.screen(), 5, "the lesson back at 100x30")
    before = pane.counts()
    after = wait_until(lambda: pane.counts() > before and pane.counts(), 10, "more steps")
    pane.quit()
    return (
        f"{len(sizes)} resizes, 20x5 showed the too-small note, 100x30 the lesson again, "
        f"steps {before} -> {after}; " + pane.aftermath(0)
    )


def check_burst(key: str) -> Callable[[Pane], str]:
    def check(pane: Pane) -> str:
        first = pane.engine()
        pane.keys(*[key] * 200, "2")  # keys are handled in order: screen 2 shows when all are
        most, t0 = 0, time.monotonic()
        while "2 ·" not in pane.screen():
            most = max(most, len([p for p, s in pane.engines().items() if s != "Z"]))
            if time.monotonic() - t0 > 30:
                raise Failed(f"200 {key!r} and 2 not handled within 30 s")
            time.sleep(0.02)
        handled_s = time.monotonic() - t0
        now = pane.engine()
        if key == "r":
            wait_until(lambda: first not in pane.engines(), 5, "the first engine to be reaped")
        live = [p for p, s in pane.engines().items() if s != "Z"]
        zombies = [p for p, s in pane.engines().items() if s == "Z"]
        if not pane.alive() or len(live) != 1 or zombies:
            raise Failed(f"after 200 {key!r}: app alive {pane.alive()}, engines {pane.engines()}")
        note = re.search(r"r runs ([\d,]+) tokens", pane.screen())
        if key == "r" and now == first:
            raise Failed("200 r did not restart the run")
        if key == "Right" and (now != first or not note or int(note[1].replace(",", "")) < 4000):
            raise Failed(f"after 200 Right: {note and note[0]!r}, engine {first} -> {now}")
        pane.quit()
        return (
            f"handled in {handled_s:.1f} s"
            + (f", {note[0]!r}" if note else "")
            + f"; engines alive at once: at most {max(most, 1)}, then 1 running "
            f"({'a new' if now != first else 'the same'} pid); " + pane.aftermath(0)
        )

    return check


def check_app_killed(pane: Pane) -> str:
    """SIGKILL cannot be caught: the app cannot restore the terminal or close its engine, so
    the engine must notice by itself (its stdin reaches EOF) and end."""
    engine = pane.engine()
    os.kill(pane.pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_until(lambda: proc_stat(engine) is None, 10, "the orphaned engine to end by itself")
    return f"the orphaned engine ended {time.monotonic() - t0:.1f} s after the app was killed"


CHECKS: dict[str, Callable[[Pane], str]] = {
    "engine-sigkill": check_engine_killed,
    "engine-sigstop": check_engine_stopped,
    "sigint": check_signal(signal.SIGINT),
    "sigterm": check_signal(signal.SIGTERM),
    "resize-storm": check_resize_storm,
    "burst-r": check_burst("r"),
    "burst-right": check_burst("Right"),
    "app-sigkill": check_app_killed,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run these checks only")
    args = parser.parse_args()
    if not shutil.which("tmux"):
        print("needs tmux (apt-get install tmux)", file=sys.stderr)
        return 2
    before = set(engine_processes())
    failed = 0
    with tempfile.TemporaryDirectory(prefix="kvtui-faults-") as workdir:
        for name in args.only or CHECKS:
            pane = None
            try:
                pane = Pane(name, Path(workdir))
                line = f"pass  {name}: {CHECKS[name](pane)}"
            except (Failed, subprocess.CalledProcessError) as exc:
                failed += 1
                line = f"FAIL  {name}: {exc}"
                if pane is not None:
                    line += f" | screen: {pane.screen().strip().splitlines()[:1]}"
            finally:
                if pane is not None:
                    pane.close()
            print(line, flush=True)
    orphans = set(engine_processes()) - before
    print(
        ("FAIL" if orphans else "pass")
        + f"  orphans: engine processes started here and still running: {sorted(orphans) or 0}"
    )
    return 1 if failed or orphans else 0


if __name__ == "__main__":
    raise SystemExit(main())
