"""What sharing one engine between the two loops costs the cached loop's steps. Not a test.

The app's engine runs both loops in one thread, in turns (`run_events`'s fair schedule); `kvtui
bench` runs each loop to its end. A step that runs right after the other loop's finds its caches
holding the other loop's data and runs cold. This runs the shipped model (`tiny`, cpu, one torch
thread) in one process, with no UI, alternating `--repeats` times:

- sequential: the cached loop alone (as `kvtui bench` measures it), the baseline of its round;
- fair: both loops in turns of T seconds, for each T of `--turns` (by default 0, a turn of one
  step, as the schedule was, and TURN_SECONDS, as shipped);

and reports, per way, the cached loop's tokens/s (steps over the sum of their measured times) as
a ratio to the sequential run of the same round, the median over rounds; then, for turns of one
step, the cached steps' median time by how many cached steps ran since the last uncached one.

    python benchmarks/sharing_cost.py --repeats 5
    python benchmarks/sharing_cost.py --tokens 512 --turns 0 0.02 0.05 0.1 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kvtui from this checkout

import torch  # noqa: E402

from kvtui.engines.drive import TURN_SECONDS, Schedule, run_events
from kvtui.engines.factory import open_engine  # noqa: E402
from kvtui.engines.protocol import RunSettings, StepSample

SINCE_CAP = 10
"""Cached steps since the last uncached one are counted up to this (10 means 10 or more)."""


def cached_steps(tokens: int, schedule: Schedule, turn: float) -> list[tuple[float, int]]:
    """One run: each cached step's measured seconds, and the cached steps run since the last
    uncached step (1: right after one; SINCE_CAP for a run without one)."""
    both = schedule == "fair"
    loops = ("uncached", "cached") if both else ("cached",)
    settings = RunSettings(engine="tiny", device="cpu", threads=1, tokens=tokens, loops=loops)
    engine = open_engine(settings)
    steps, since = [], SINCE_CAP
    try:
        for event in run_events(engine, settings, schedule=schedule, turn_seconds=turn):
            if not isinstance(event, StepSample):
                continue
            if event.loop == "uncached":
                since = 0
            else:
                since = min(since + 1, SINCE_CAP)
                steps.append((event.step_seconds, since))
    finally:
        engine.close()
    return steps


def tokens_per_s(steps: list[tuple[float, int]]) -> float:
    return len(steps) / sum(seconds for seconds, _ in steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--turns", type=float, nargs="+", default=[0.0, TURN_SECONDS])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ratios: dict[float, list[float]] = {turn: [] for turn in args.turns}
    by_since: dict[int, list[float]] = defaultdict(list)
    alone: list[float] = []
    for _ in range(args.repeats):
        for turn in args.turns:
            baseline = tokens_per_s(cached_steps(args.tokens, "sequential", 0.0))
            shared = cached_steps(args.tokens, "fair", turn)
            ratios[turn].append(tokens_per_s(shared) / baseline)
            if turn == 0.0:
                for seconds, since in shared:
                    by_since[since].append(seconds)
            alone.append(baseline)
        print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    result = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "sequential_tokens_per_s": statistics.median(alone),
        "shared_vs_sequential": {
            str(turn): {"median": statistics.median(r), "each": r} for turn, r in ratios.items()
        },
        "step_ms_by_steps_since_uncached": {
            str(since): {"steps": len(v), "median_ms": 1000 * statistics.median(v)}
            for since, v in sorted(by_since.items())
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"CPU {result['cpu_capability']}, {args.tokens} tokens, tiny engine, 1 thread, "
        f"median of {args.repeats} rounds; cached loop alone "
        f"{result['sequential_tokens_per_s']:.0f} tok/s"
    )
    print("  the cached loop's tokens/s beside the uncached loop, over the loop alone:")
    for turn, r in ratios.items():
        what = "one step" if turn == 0 else f"{turn * 1000:.0f} ms"
        each = ", ".join(f"{x:.2f}" for x in r)
        print(f"    turns of {what:<9} {statistics.median(r):.3f}   ({each})")
    if by_since:
        print("  turns of one step: a cached step's median time, by cached steps since an uncached")
        for since, v in sorted(by_since.items()):
            mark = "+" if since == SINCE_CAP else " "
            print(f"    {since:>3}{mark}  {1000 * statistics.median(v):.3f} ms  ({len(v)} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
