"""What the screens' copy of the run costs: `LiveRun.snapshot()` on a long run, in the app's way.

Folds a `sim:` run (both loops, the fair schedule the app runs, as fast as the arithmetic goes)
into a `LiveRun` and takes a snapshot after every `--every` events, as the app does at most
RUN_UPDATES_PER_SECOND times a second; prints the time per snapshot at a few points of the run
and over all of it, and the time to fold the events beside it. A figure to read, not a goal
asserted: the machine is shared.

    python benchmarks/live_snapshot.py [--tokens 4000] [--every 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunSettings, StepSample
from kvtui.run.live import LiveRun


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="sim:llama-3.1-8b@h100")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--every", type=int, default=40, help="events between snapshots")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    settings = RunSettings(engine=args.engine, tokens=args.tokens, replay_speed=0)
    engine = open_engine(settings)
    try:
        events = list(run_events(engine, settings))
    finally:
        engine.close()
    live = LiveRun(settings)
    fold_s, snaps = 0.0, []  # (steps of both loops so far, seconds of one snapshot)
    for n, event in enumerate(events, 1):
        t0 = time.perf_counter()
        live.apply(event)
        fold_s += time.perf_counter() - t0
        if n % args.every == 0 or n == len(events):
            t0 = time.perf_counter()
            live.snapshot()
            snaps.append(
                (live.loop("cached").steps + live.loop("uncached").steps, time.perf_counter() - t0)
            )
    steps = sum(isinstance(e, StepSample) for e in events)
    points = {}
    for mark in (256, 1024, 4096, steps):
        near = [s for done, s in snaps if done <= mark][-5:]
        if near:
            points[mark] = statistics.median(near) * 1e3
    result = {
        "engine": args.engine,
        "steps": steps,
        "snapshots": len(snaps),
        "snapshot_ms_median": statistics.median(s for _, s in snaps) * 1e3,
        "snapshot_ms_max": max(s for _, s in snaps) * 1e3,
        "snapshot_ms_at_steps": points,
        "fold_us_per_event": fold_s / len(events) * 1e6,
    }
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print(f"{args.engine}: {steps:,} steps of both loops, a snapshot every {args.every} events")
    print(
        f"  snapshot: median {result['snapshot_ms_median']:.3f} ms, "
        f"max {result['snapshot_ms_max']:.3f} ms over {len(snaps):,} snapshots"
    )
    for mark, ms in points.items():
        print(f"  snapshot at {mark:,} steps: {ms:.3f} ms (median of the last 5 before)")
    print(f"  fold: {result['fold_us_per_event']:.1f} us an event")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
