"""Hostile inputs, many of them: what kvtui does with each, counted by category.

    python benchmarks/fuzz_inputs.py [--examples 2000] [--seed 0] [--out results.json]

The strategies are tests/test_hostile_inputs.py's (which runs 25 examples of each); here each
category gets `--examples` of them, every one run through `kvtui.cli.main` in this process:

- configs: `kvtui budget --config FILE` on config.json files of any field types and sizes;
- records: `kvtui bench --engine replay:FILE` on good records with fields, lines or bytes edited;
- cli numbers: `--tokens`, `--seed`, `--temperature`, `--context`... given any text;
- safetensors: the app's check of a model folder whose model.safetensors has any header.

An input ends in exit 0 or exit 2 (with one line on stderr); anything else is a failure: a
traceback (an exception out of `main`), a hang (over 10 s), another exit status, or more than one
line of stderr for a refusal. Prints a table and the first example of each failure; exits 1 if
there was any.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/ holds the strategies

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from tests import test_hostile_inputs as hostile  # noqa: E402

OK = ("exit 0", "exit 2")


class Output:
    """stdout and stderr of one call, captured."""

    def __init__(self) -> None:
        self.out, self.err = io.StringIO(), io.StringIO()

    def read(self) -> tuple[str, str]:
        out, err = self.out.getvalue(), self.err.getvalue()
        self.out.seek(0), self.out.truncate()
        self.err.seek(0), self.err.truncate()
        return out, err


def sweep(strategy, try_one, examples: int, random_seed: int) -> tuple[Counter, dict, float]:
    """Run `try_one` on `examples` values of `strategy`; the outcomes counted, the first value
    of each failure, and the seconds taken."""
    counts: Counter = Counter()
    first: dict = {}
    output = Output()

    @seed(random_seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(value) -> None:
        with contextlib.redirect_stdout(output.out), contextlib.redirect_stderr(output.err):
            result = try_one(value, output.read)
        counts[result] += 1
        if result not in OK:
            first.setdefault(result, value)

    started = time.perf_counter()
    run()
    return counts, first, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="inputs per category")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the counts as JSON here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        categories = {
            "configs": (hostile.configs, lambda v, read: hostile.try_config(folder, v, read)),
            "records": (hostile.records(), lambda v, read: hostile.try_record(folder, v, read)),
            "cli numbers": (hostile.cli_values, lambda v, read: hostile.try_cli(*v, read)),
            "safetensors": (
                hostile.safetensors_files(),
                lambda v, read: hostile.try_weights(folder, v, read),
            ),
        }
        results = {}
        for name, (strategy, try_one) in categories.items():
            counts, first, seconds = sweep(strategy, try_one, args.examples, args.seed)
            results[name] = {"counts": dict(counts), "first": first, "seconds": seconds}

    print(f"{args.examples:,} examples per category, seed {args.seed}\n")
    head = ("category", "inputs", "exit 0", "exit 2", "tracebacks", "hangs", "wrong exit", "lines")
    print("{:<12} {:>7} {:>7} {:>7} {:>11} {:>6} {:>11} {:>6}  {:>7}".format(*head, "seconds"))
    failed = False
    for name, result in results.items():
        c = result["counts"]
        tracebacks = sum(n for k, n in c.items() if k.startswith("traceback"))
        hangs = c.get("hang", 0)
        wrong = sum(n for k, n in c.items() if k.startswith("exit ") and k not in OK)
        lines = sum(n for k, n in c.items() if k.endswith("stderr lines"))
        failed = failed or bool(tracebacks or hangs or wrong or lines)
        row = (name, sum(c.values()), c.get("exit 0", 0), c.get("exit 2", 0))
        print(
            f"{row[0]:<12} {row[1]:>7,} {row[2]:>7,} {row[3]:>7,} {tracebacks:>11,} {hangs:>6,} "
            f"{wrong:>11,} {lines:>6,}  {result['seconds']:>7.1f}"
        )
    for name, result in results.items():
        for what, value in result["first"].items():
            print(f"\n{name}: {what}\n  first input: {repr(value)[:300]}")
    if args.out:
        summary = {
            name: {"counts": r["counts"], "seconds": r["seconds"]} for name, r in results.items()
        }
        args.out.write_text(json.dumps({"examples": args.examples, "seed": args.seed, **summary}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
