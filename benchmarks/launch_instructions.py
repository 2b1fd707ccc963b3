"""The launch's work to the app's first frame, in instructions: a count that does not drift with
the machine. Not a test.

This 2-core VM runs the same launch 0.44 s one minute and 0.65 s the next (first_token.py), so a
change worth 20 ms hides in the noise. Valgrind's callgrind counts the instructions a process
runs, the same on every run: here the path of `kvtui --lesson --engine tiny --device cpu` up to
its first frame (the command line read and checked, the title card, the app imported, then
screen 1 composed, styled and drawn headless), stopped at each of those three points, for this
checkout and any other (`--repo`), beside Python starting alone and bare_textual.py's bare
Textual app (a title, four `Digits`, a footer): the floor under kvtui's first frame. Counts are
printed in millions; none is asserted. Each run takes about half a minute under callgrind (two
at a time).

    python benchmarks/launch_instructions.py
    python benchmarks/launch_instructions.py --repo /path/to/other/checkout --json

Needs valgrind (Debian's `valgrind`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from first_token import compile_checkouts  # this folder's: the script's own folder is on sys.path

REPO = Path(__file__).resolve().parent.parent

PATH = """
import asyncio, sys
stop = int(sys.argv[1])
import kvtui.cli as cli
args = cli.build_parser().parse_args(["--lesson", "--engine", "tiny", "--device", "cpu"])
try:  # as cmd_app does: Python's collector held to the first frame (a checkout before, not)
    from kvtui import collector
    collector.hold()
except ImportError:
    pass
settings = cli.settings_from_args(args, default_tokens=cli.DEFAULT_APP_TOKENS)
from kvtui.engines.factory import check_engine
check_engine(settings)
try:
    from kvtui.bigtext import kept_title_card
    from kvtui.paths import cache_dir
    kept_title_card(80, 24, cache_dir())
except ImportError:  # a checkout before the card was kept
    from kvtui.bigtext import title_card
    title_card(80, 24)
if stop == 1:
    raise SystemExit
from kvtui.app import make_app
if stop == 2:
    raise SystemExit

async def main():
    app = make_app(settings, autostart=False, probe={"probe": "null", "description": "no GPU"})
    async with app.run_test(size=(80, 24)):
        pass

asyncio.run(main())
"""
"""kvtui's launch, headless, stopped after the command line and card (1), the app's import (2)
or its first frame (3). The probe is given: the app probes the device after its first frame."""

BARE = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from bare_textual import Bare

async def main():
    async with Bare().run_test(size=(80, 24)):
        pass

asyncio.run(main())
"""
"""The bare Textual app of bare_textual.py (its folder the first argument), headless."""

PHASES = ("command line and card", "the app imported", "first frame")


def instructions(code: str, *args: str, path: Path | None = None) -> int:
    """The instructions `python -c code args` runs, counted by callgrind."""
    python = os.path.realpath(sys.executable)  # not a shim: callgrind follows no exec
    env = {**os.environ, "PYTHONPATH": str(path) if path else ""}
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", python, "-c", code]
        + list(args),
        capture_output=True,
        text=True,
        env=env,
        cwd=path or REPO,
        timeout=1200,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"callgrind failed: {done.stderr[-1000:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, action="append", help="checkouts to compare")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("launch_instructions.py: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    repos = [REPO, *(args.repo or [])]
    compile_checkouts(repos)
    jobs = {
        ("python", 0): ("pass", (), None),
        ("bare Textual", 0): (BARE, (str(Path(__file__).parent),), None),
    }
    for repo in repos:
        for stop in (1, 2, 3):
            jobs[(str(repo), stop)] = (PATH, (str(stop),), repo)
    with ThreadPoolExecutor(2) as pool:
        counts = dict(
            zip(
                jobs,
                pool.map(lambda job: instructions(job[0], *job[1], path=job[2]), jobs.values()),
                strict=True,
            )
        )
    result = {
        "python_alone": counts[("python", 0)],
        "bare_textual_first_frame": counts[("bare Textual", 0)],
        "checkouts": {
            str(repo): {phase: counts[(str(repo), i + 1)] for i, phase in enumerate(PHASES)}
            for repo in repos
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    m = 1e6
    print("instructions (millions) to the first frame, headless, 80x24:")
    print(f"  Python starting alone       {result['python_alone'] / m:8.0f}")
    print(f"  a bare Textual app's frame  {result['bare_textual_first_frame'] / m:8.0f}")
    for repo, phases in result["checkouts"].items():
        print(f"  {repo}")
        last = result["python_alone"]
        for phase, count in phases.items():
            print(f"    {phase:25} {count / m:8.0f}  (+{(count - last) / m:.0f})")
            last = count
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
