"""Dead air: how long a person waits for the first token, at launch and after `l`. Not a test.

In a real terminal (a detached tmux session on a tmux server of its own), `python -m kvtui
--lesson` with the shipped model (`tiny`, cpu, 1 torch thread) is started, and its pane read each
time it writes (through one tmux control-mode client, not a process per poll) for

- the first thing drawn (kvtui's title card, before the app's imports), the app's first frame
  (the lesson title), and the first token (the token stream's "N tokens" under
  screen 1's stream), from the moment the command started (the pane's shell writes the time, then
  execs python);
- once the run is done and `--settle` seconds have passed (a person reading the screen), the key
  `l` (lesson mode off: the full prompt, a new engine process), and the time from that key to the
  new run's first token;
- the engine's own words while it starts, as the header shows them (each one once).

`--present` measures presenter mode instead (`python -m kvtui --present --lesson`): the time to
the title (the title slide's sentence on the pane: the card the command draws before the app
has imported, then the app's first frame) and to the first movement (the title slide's waiting
line showing a second frame of its spinner, or the engine's first figures), from the moment the
command started.

`--repo DIR` runs another checkout's kvtui with this Python (the one before a change, say), so a
before/after comparison is taken in one run, interleaved. The machine is shared: quote medians of
several repeats, and the CPU capability; with another checkout, the first frame's difference is
also taken launch by launch (its median: the machine's drift, often larger than the change,
cancels). `--floor` adds bare_textual.py's bare Textual app (screen 1's title, four `Digits`, a
footer), launched the same way between them: Textual's own start on this machine at that
moment, the floor under kvtui's first frame, with kvtui's lead over it launch by launch.
`--frame-only` quits at the first frame, for the many repeats that takes. Each
checkout's bytecode is compiled first, as `pip install` leaves it (where PYTHONDONTWRITEBYTECODE
is set, a launch would otherwise compile every module it imports, each time). Figures are
printed, never asserted.

    python benchmarks/first_token.py --repeats 3
    python benchmarks/first_token.py --frame-only --repeats 15 --repo /path/to/other/checkout
    python benchmarks/first_token.py --frame-only --repeats 30 --floor
    python benchmarks/first_token.py --repeats 3 --repo /path/to/other/checkout --json
    python benchmarks/first_token.py --present --repeats 5 --size 160x48
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import re
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

TITLE = "1 · Without a cache"
KEYS = ("first_drawn_s", "first_frame_s", "first_token_s", "after_l_first_token_s")
"""What `one` times: anything on the terminal (kvtui's title card), the app's first frame (screen
1's title), its first token, and `l` to the new run's first token."""
TOKENS = re.compile(r"─ ?\d[\d,]* tokens ─")
"""The token stream's subtitle once a token has arrived ("─ 1 tokens ─╯")."""
STARTING = re.compile(r"starting the engine[^│]*")
PRESENT_TITLE = "A model decodes beside this screen"
"""The title slide's sentence, in words on every size (the name and subtitle are large type)."""
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


class Pane:
    """A detached tmux session of one pane on a private tmux server, watched through one tmux
    control-mode client (`tmux -C attach`): tmux pushes a line when the pane writes, and the
    pane's text is read over that same connection only then. Polling it with a `tmux
    capture-pane` process every few milliseconds cost this 2-core machine a good part of a core,
    taken from the app it timed (the title card's time doubled). Closed on exit."""

    def __init__(self, command: str, size: tuple[int, int], cwd: Path) -> None:
        self.name = f"pane-{time.monotonic_ns()}"
        self.tmux = ["tmux", "-L", f"kvtui-first-token-{os.getpid()}-{self.name}"]
        width, height = size
        subprocess.run(
            [*self.tmux, "new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height)]
            + ["-c", str(cwd), command],
            check=True,
        )
        self.control = subprocess.Popen(
            [*self.tmux, "-C", "attach", "-t", self.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._buffer = b""
        self.wrote = True
        """Whether the pane has written since its text was last read (so: read it)."""

    def _line(self, timeout: float) -> bytes | None:
        """The control client's next line, or None if none came within `timeout` s."""
        assert self.control.stdout is not None
        end = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.control.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.control.stdout.fileno(), 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        if line.startswith(b"%output "):
            self.wrote = True
        return line

    def _command(self, command: str) -> list[bytes]:
        """Run a tmux command over the control connection; its output's lines."""
        assert self.control.stdin is not None
        self.control.stdin.write(command.encode() + b"\n")
        self.control.stdin.flush()
        out: list[bytes] | None = None
        while True:
            line = self._line(10.0)
            if line is None:
                return out or []
            if line.startswith(b"%begin ") and out is None:
                out = []
            elif line.startswith((b"%end ", b"%error ")) and out is not None:
                return out
            elif out is not None:
                out.append(line)

    def wait_for_output(self, timeout: float) -> None:
        """Until the pane writes (at once if it has since its text was last read)."""
        end = time.monotonic() + timeout
        while not self.wrote and time.monotonic() < end:
            self._line(end - time.monotonic())

    def idle(self, seconds: float) -> None:
        """Read what the control client says for `seconds` (a person reading the screen)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._line(end - time.monotonic())

    def text(self) -> str:
        self.wrote = False
        lines = self._command(f"capture-pane -p -t {self.name}")
        return "\n".join(line.decode("utf-8", "replace") for line in lines)

    def pid(self) -> int:
        """The pane's process: the shell, then the python it execs."""
        return int(self._command(f"display-message -p -t {self.name} '#{{pane_pid}}'")[0])

    def quit(self, timeout: float) -> None:
        """Press q, and wait until the app and every process it started (engines run in
        sessions of their own) have ended: the next launch must not share the CPU with them."""
        family = descendants(self.pid())
        self.keys("q")
        end = time.monotonic() + timeout
        while any(Path(f"/proc/{pid}").exists() for pid in family):
            if time.monotonic() > end:
                break
            self._line(0.05)

    def keys(self, *keys: str) -> None:
        self._command(f"send-keys -t {self.name} " + " ".join(keys))

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.control.stdin is not None
            self.control.stdin.close()
        subprocess.run([*self.tmux, "kill-server"], capture_output=True, check=False)
        self.control.wait(5)

    def __enter__(self) -> Pane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it, now (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    family, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    return family


def watch(pane: Pane, done, timeout: float, said: list[tuple[float, str]]) -> float | None:
    """time.time() when `done(text)` first holds, the pane's text read each time it writes;
    the engine's words seen on the way are added to `said` with the time.time() they were
    first seen (each once)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pane.wait_for_output(min(0.25, end - time.monotonic()))
        text = pane.text()
        for words in STARTING.findall(text):
            words = words.strip()
            if words and (not said or said[-1][1] != words):
                said.append((time.time(), words))
        if done(text):
            return time.time()
    return None


def one(
    repo: Path, size: tuple[int, int], settle: float, timeout: float, frame_only: bool = False
) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        start_file = Path(tmp) / "start"
        env = f"PYTHONPATH='{repo}'"
        command = (
            f"date +%s.%N > '{start_file}'; {env} exec '{sys.executable}' -m kvtui --lesson "
            "--engine tiny --device cpu"
        )
        said: list[tuple[float, str]] = []
        with Pane(command, size, repo) as pane:
            drawn = watch(pane, lambda t: bool(t.strip()), timeout, said)  # the title card
            frame = watch(pane, lambda t: TITLE in t, timeout, said)
            start = float(start_file.read_text())
            if frame_only:
                pane.quit(timeout)
                return {
                    "first_drawn_s": None if drawn is None else drawn - start,
                    "first_frame_s": None if frame is None else frame - start,
                }
            token = watch(pane, lambda t: TOKENS.search(t) is not None, timeout, said)
            watch(pane, lambda t: "✓ done" in t, timeout, said)
            pane.idle(settle)
            restart_said: list[tuple[float, str]] = []
            pane.keys("l")
            pressed = time.time()
            watch(pane, lambda t: TOKENS.search(t) is None, timeout, restart_said)
            again = watch(pane, lambda t: TOKENS.search(t) is not None, timeout, restart_said)
            pane.quit(timeout)
    return {
        "first_drawn_s": None if drawn is None else drawn - start,
        "first_frame_s": None if frame is None else frame - start,
        "first_token_s": None if token is None else token - start,
        "after_l_first_token_s": None if again is None else again - pressed,
        "said_at_launch": [f"{at - start:.1f} s {words}" for at, words in said],
        "said_after_l": [f"{at - pressed:.1f} s {words}" for at, words in restart_said],
    }


FLOOR = "Textual's floor (bare_textual.py)"


def one_floor(size: tuple[int, int], timeout: float) -> dict[str, object]:
    """bare_textual.py's app launched as `one` launches kvtui: its first frame (the same title)."""
    with tempfile.TemporaryDirectory() as tmp:
        start_file = Path(tmp) / "start"
        script = Path(__file__).with_name("bare_textual.py")
        command = f"date +%s.%N > '{start_file}'; exec '{sys.executable}' '{script}'"
        with Pane(command, size, REPO) as pane:
            frame = watch(pane, lambda t: TITLE in t, timeout, [])
            start = float(start_file.read_text())
            pane.quit(timeout)
    return {"first_drawn_s": None, "first_frame_s": None if frame is None else frame - start}


def one_present(repo: Path, size: tuple[int, int], timeout: float) -> dict[str, object]:
    """Presenter mode from launch: when the title shows, and when something first moves (a
    second frame of the waiting line's spinner, or the run's first figures on the title)."""
    with tempfile.TemporaryDirectory() as tmp:
        start_file = Path(tmp) / "start"
        env = f"PYTHONPATH='{repo}'"
        command = (
            f"date +%s.%N > '{start_file}'; {env} exec '{sys.executable}' -m kvtui --present "
            "--lesson --engine tiny --device cpu"
        )
        frames: set[str] = set()

        def moved(text: str) -> bool:
            frames.update(ch for ch in text if ch in SPINNER)
            return len(frames) >= 2 or " · step " in text

        said: list[tuple[float, str]] = []
        with Pane(command, size, repo) as pane:
            title = watch(pane, lambda t: PRESENT_TITLE in t, timeout, said)
            movement = watch(pane, moved, timeout, said)
            start = float(start_file.read_text())
            pane.quit(timeout)
    return {
        "title_s": None if title is None else title - start,
        "first_movement_s": None if movement is None else movement - start,
    }


def compile_checkouts(repos: list[Path]) -> None:
    """Each checkout's bytecode, as `pip install` leaves it: where PYTHONDONTWRITEBYTECODE is set
    (as here), a launch would otherwise compile every module it imports, each time, and a
    measure of the launch would measure the compiler."""
    for repo in repos:
        compileall.compile_dir(repo / "kvtui", quiet=1)


def median(values: list[object]) -> float | None:
    numbers = [v for v in values if isinstance(v, float)]
    return statistics.median(numbers) if numbers else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", default="80x24")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds between done and l")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--repo", type=Path, action="append", help="checkouts to compare")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--present", action="store_true", help="presenter mode: time to title, first movement"
    )
    parser.add_argument(
        "--floor", action="store_true", help="also launch a bare Textual app: Textual's own start"
    )
    parser.add_argument(
        "--frame-only",
        action="store_true",
        help="the title card and the first frame only (quit then): many repeats in little time",
    )
    args = parser.parse_args()
    width, height = (int(n) for n in args.size.split("x"))
    repos = [REPO, *(args.repo or [])]
    compile_checkouts(repos)
    if args.present:
        return present_main(args, repos, (width, height))
    runs: dict[str, list[dict[str, object]]] = {str(r): [] for r in repos}
    if args.floor:
        runs[FLOOR] = []
    for _ in range(args.repeats):
        for repo in repos:  # interleaved, so that the machine's drift hits each alike
            runs[str(repo)].append(
                one(repo, (width, height), args.settle, args.timeout, args.frame_only)
            )
        if args.floor:
            runs[FLOOR].append(one_floor((width, height), args.timeout))
    keys = KEYS[:2] if args.frame_only else KEYS
    import torch

    result = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "repeats": args.repeats,
        "size": args.size,
        "settle_s": args.settle,
        "checkouts": {
            repo: {key: median([r.get(key) for r in rows]) for key in keys}
            | {f"{key}_all": [r.get(key) for r in rows] for key in keys}
            | {
                "said_at_launch": rows[-1].get("said_at_launch", []),
                "said_after_l": rows[-1].get("said_after_l", []),
            }
            for repo, rows in runs.items()
        },
    }
    if len(runs) > 1:  # each launch against the one beside it: the machine's drift cancels
        first = next(iter(runs.values()))
        result["first_frame_paired_s"] = {
            name: median(
                [
                    a["first_frame_s"] - b["first_frame_s"]  # type: ignore[operator]
                    for a, b in zip(first, rows, strict=True)
                    if a["first_frame_s"] is not None and b["first_frame_s"] is not None
                ]
            )
            for name, rows in list(runs.items())[1:]
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"CPU {result['cpu_capability']}, {args.size}, median of {args.repeats}:")
    for repo, r in result["checkouts"].items():
        print(f"  {repo}")
        for key in keys:
            value, each = r[key], r[f"{key}_all"]
            shown = ", ".join("-" if v is None else f"{v:.2f}" for v in each)
            print(f"    {key:24} {'-' if value is None else f'{value:.2f} s'}  ({shown})")
        if not args.frame_only:
            print(f"    said at launch: {r['said_at_launch']}")
            print(f"    said after l:   {r['said_after_l']}")
    for repo, diff in result.get("first_frame_paired_s", {}).items():
        print(f"  first frame, this checkout less {repo}, launch by launch: median {diff:+.3f} s")
    return 0


def present_main(args: argparse.Namespace, repos: list[Path], size: tuple[int, int]) -> int:
    runs: dict[str, list[dict[str, object]]] = {str(r): [] for r in repos}
    for _ in range(args.repeats):
        for repo in repos:
            runs[str(repo)].append(one_present(repo, size, args.timeout))
    import torch

    keys = ("title_s", "first_movement_s")
    result = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "repeats": args.repeats,
        "size": args.size,
        "checkouts": {
            repo: {key: median([r[key] for r in rows]) for key in keys}
            | {f"{key}_all": [r[key] for r in rows] for key in keys}
            for repo, rows in runs.items()
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"CPU {result['cpu_capability']}, presenter mode, {args.size}, median of {args.repeats}:")
    for repo, r in result["checkouts"].items():
        print(f"  {repo}")
        for key in keys:
            value, each = r[key], r[f"{key}_all"]
            shown = ", ".join("-" if v is None else f"{v:.2f}" for v in each)
            print(f"    {key:18} {'-' if value is None else f'{value:.2f} s'}  ({shown})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
