"""Screen 3's `]` then `r`: seconds from asking for a run with a new KV budget to its first step,
through the app's own engine owner (`kvtui.run.process.Engines`), three ways: a fresh child (no
spare: what a budget change cost when `r` came mid-run), a spare started ahead and ready, and the
last run's own child kept (its model loaded: the pool resized in place). Prints a table, or JSON
with --json. Needs torch.

    python benchmarks/budget_restart.py [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtui.engines.protocol import RunSettings, StepSample  # noqa: E402
from kvtui.run.process import Engines  # noqa: E402

TINY = RunSettings(engine="tiny", device="cpu", tokens=16, loops=("cached",))


def to_first_step(engines: Engines, settings: RunSettings) -> float:
    """Seconds from making the run's engine to its first step; the run is then read to its end."""
    t0 = time.monotonic()
    first: list[float] = []

    def report(events: list) -> None:
        if not first and any(isinstance(e, StepSample) for e in events):
            first.append(time.monotonic() - t0)

    engines.read(engines(settings), report, lambda: False)
    return first[0]


def spare_ready(engines: Engines) -> None:
    """Start a spare and wait until it has imported torch and readied the FLOP counter."""
    engines.prepare(TINY)
    spare = engines.spare
    assert spare is not None and spare.proc.stdout is not None
    for line in spare.proc.stdout:  # its progress: ready once the FLOP counter is
        if "FLOP counter" in line:
            break
    time.sleep(3)  # the counter's warm-up, which it says before doing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    budgets = [1 << 20, 512 << 10, 2 << 20]
    fresh, spare, kept = [], [], []
    for i in range(args.repeats):
        settings = replace(TINY, kv_budget_bytes=budgets[i % len(budgets)])
        engines = Engines()
        try:
            fresh.append(to_first_step(engines, settings))  # a new child, nothing ahead
            kept.append(to_first_step(engines, replace(settings, kv_budget_bytes=4 << 20)))
        finally:
            engines.close()
        engines = Engines()
        try:
            spare_ready(engines)
            spare.append(to_first_step(engines, settings))
        finally:
            engines.close()
        print(
            f"repeat {i + 1}: fresh {fresh[-1]:.2f} s, spare {spare[-1]:.2f} s, "
            f"kept {kept[-1]:.2f} s",
            file=sys.stderr,
        )
    result = {
        name: {"median_s": statistics.median(v), "runs_s": v}
        for name, v in (("fresh child", fresh), ("spare ready", spare), ("kept child", kept))
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("to the first step after a budget change (tiny, CPU):")
        for name, r in result.items():
            runs = ", ".join(f"{s:.2f}" for s in r["runs_s"])
            print(f"  {name:12} {r['median_s']:6.2f} s median  ({runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
