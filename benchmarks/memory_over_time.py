"""Memory over time: the RSS of the UI process and of the engine's process during a long run.

Runs `kvtui` (the default engine, the shipped model) in a detached tmux pane at 100x30 with a
4,000-token run, presses a key now and then as a presenter would (screens 1, 2, 3, the length),
restarts the run with `r` whenever it is done, and reads both processes' resident memory from
/proc at 1, 5 and 10 minutes (and every `--every` seconds in the JSON).

    python benchmarks/memory_over_time.py                 # ten minutes
    python benchmarks/memory_over_time.py --minutes 2 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SESSION = "kvtui-memory"
KEYS = ["1", "Right", "2", "Left", "3", "1"]


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--every", type=float, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    command = f"exec {sys.executable} -m kvtui --tokens 4000"
    subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", "100", "-y", "30", command])
    samples = []
    try:
        time.sleep(3)
        pane_pid = int(
            subprocess.run(
                ["tmux", "list-panes", "-t", SESSION, "-F", "#{pane_pid}"],
                capture_output=True,
                text=True,
            ).stdout.split()[0]
        )
        started, next_key, n = time.monotonic(), 0.0, 0
        while (elapsed := time.monotonic() - started) < args.minutes * 60:
            if elapsed >= next_key:
                pane = subprocess.run(
                    ["tmux", "capture-pane", "-p", "-t", SESSION], capture_output=True, text=True
                ).stdout
                key = "r" if "done" in pane.splitlines()[0] else KEYS[n % len(KEYS)]
                subprocess.run(["tmux", "send-keys", "-t", SESSION, key])
                n, next_key = n + 1, elapsed + 5
            engines = children(pane_pid)
            samples.append(
                {
                    "seconds": round(elapsed),
                    "ui_rss_kib": rss_kib(pane_pid),
                    "engine_rss_kib": rss_kib(engines[0]) if engines else None,
                }
            )
            time.sleep(args.every)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)

    def at(minute: float) -> dict:
        return min(samples, key=lambda s: abs(s["seconds"] - minute * 60))

    marks = [m for m in (1, 5, 10) if m <= args.minutes] or [args.minutes]
    if args.json:
        print(json.dumps({"samples": samples, "keys_pressed": n}, indent=2))
        return 0
    print(f"kvtui, tiny engine, 4,000-token runs restarted when done; {n} key presses")
    for minute in marks:
        s = at(minute)
        print(
            f"  {minute:>4} min: UI {s['ui_rss_kib'] / 1024:7.1f} MiB, "
            f"engine {(s['engine_rss_kib'] or 0) / 1024:7.1f} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
