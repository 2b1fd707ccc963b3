"""What the cache picture costs the decode: the cached step with the attention sent and without.
Not a test.

The engine keeps one layer's queries and keys during a step (a reference, no copy) and reads the
newest query's attention from them after the step's timing, at most 15 steps a second
(kvtui.engines.attention). This runs the shipped model's cached loop (`tiny`, cpu, one torch
thread) in one process, alternating three settings `--repeats` times:

- off: nothing kept, nothing read (`attention_per_second = 0`);
- on: as shipped (15 a second);
- every step: the attention read after every step (the worst case, beyond what is shipped);

and reports, per setting, the median step time as measured (the timed region: what screen 2
shows) and the wall time per token of the whole loop (the reads outside the timing included),
each as a ratio to off within the same round, then the median of those ratios.

    python benchmarks/attention_cost.py --tokens 512 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kvtui from this checkout

import torch  # noqa: E402

from kvtui.engines.attention import ATTENTION_PER_SECOND  # noqa: E402
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine  # noqa: E402
from kvtui.engines.protocol import RunSettings, StepSample

SETTINGS = {"off": 0.0, "on": ATTENTION_PER_SECOND, "every step": math.inf}


def one(engine, settings: RunSettings, per_second: float) -> dict[str, float]:
    engine.attention_per_second = per_second
    t0 = time.perf_counter()
    steps = [e for e in run_events(engine, settings) if isinstance(e, StepSample)]
    wall = time.perf_counter() - t0
    later = [s.step_seconds for s in steps[1:]]  # the first is the prefill
    return {
        "step_s": statistics.median(later),
        "wall_per_token_s": wall / len(steps),
        "sent": sum(s.attention is not None for s in steps),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    settings = RunSettings(engine="tiny", device="cpu", tokens=args.tokens, loops=("cached",))
    engine = open_engine(settings)
    one(engine, replace(settings, tokens=32), 0.0)  # warm up
    rounds = []
    for _ in range(args.repeats):
        rounds.append({name: one(engine, settings, rate) for name, rate in SETTINGS.items()})
    engine.close()
    result: dict[str, object] = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "tokens": args.tokens,
        "repeats": args.repeats,
    }
    for name in SETTINGS:
        result[name] = {
            "step_ms": 1000 * statistics.median(r[name]["step_s"] for r in rounds),
            "wall_per_token_ms": 1000
            * statistics.median(r[name]["wall_per_token_s"] for r in rounds),
            "step_vs_off": statistics.median(
                r[name]["step_s"] / r["off"]["step_s"] for r in rounds
            ),
            "wall_vs_off": statistics.median(
                r[name]["wall_per_token_s"] / r["off"]["wall_per_token_s"] for r in rounds
            ),
            "steps_sent": statistics.median(r[name]["sent"] for r in rounds),
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"CPU {result['cpu_capability']}, {args.tokens} tokens, cached loop, "
        f"median of {args.repeats}"
    )
    print(f"{'':12} {'step':>9} {'vs off':>7} {'wall/token':>11} {'vs off':>7} {'sent':>6}")
    for name in SETTINGS:
        r = result[name]
        assert isinstance(r, dict)
        print(
            f"{name:12} {r['step_ms']:8.3f}ms {r['step_vs_off']:7.3f} "
            f"{r['wall_per_token_ms']:9.3f}ms {r['wall_vs_off']:7.3f} {r['steps_sent']:6.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
