"""The shape of the tiny model's step times over a long run on the CPU, cached and uncached.

The uncached step runs the whole sequence so far, so it grows with the position (linearly in the
projections and MLP, quadratically in attention); the cached step computes one position and grows
only by the attention over the cache. This script measures both over `--tokens` steps (default
2,048), fits straight lines (ms per position; for uncached also a quadratic) and reports the
first/last-quartile medians and the last-quartile ratio uncached/cached.

The cached loop runs once before the uncached run and `--cached-repeats - 1` times after it; each
cached position's time is the median over those runs, so a drift in the machine's load during the
long uncached run shows up in both. Prefill (step 0) is reported apart and left out of the fits.

    python benchmarks/step_shape.py --tokens 512             # a check: about half a minute
    python benchmarks/step_shape.py --json > /tmp/shape.json # 2,048 tokens: many minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kvtui from this checkout

from kvtui.engines.generate import encode_text, generate  # noqa: E402
from kvtui.engines.loops import Sampling  # noqa: E402
from kvtui.engines.protocol import DEFAULT_PROMPT  # noqa: E402
from kvtui.gpu.load import load_tiny  # noqa: E402

BINS = 8
"""Rows of the printed table: the run cut into this many equal spans of steps."""


def run_loop(model, prompt, n: int, cached: bool, progress) -> tuple[list[int], list[float], list]:
    """Positions, step seconds and token ids of one run."""
    positions, seconds, ids = [], [], []
    t0 = time.perf_counter()
    for step in generate(model, prompt, n, Sampling(greedy=True), cache=cached):
        positions.append(step.position)
        seconds.append(step.step_seconds)
        ids.append(step.token_id)
        if not cached and (step.index + 1) % 128 == 0:
            progress(
                f"uncached {step.index + 1}/{n}: {step.step_seconds * 1e3:.1f} ms a step, "
                f"{time.perf_counter() - t0:.0f} s so far"
            )
    return positions, seconds, ids


def quartile_medians(ms: np.ndarray) -> tuple[float, float]:
    q = max(1, len(ms) // 4)
    return float(np.median(ms[:q])), float(np.median(ms[-q:]))


def fit(x: np.ndarray, y: np.ndarray, degree: int) -> list[float]:
    """Least-squares polynomial coefficients, highest power first."""
    return [float(c) for c in np.polyfit(x, y, degree)]


def measure(tokens: int, cached_repeats: int, prompt_text: str, seed: int, progress) -> dict:
    model, meta = load_tiny(torch.device("cpu"), torch.float32, seed)
    prompt = encode_text(prompt_text)
    for cached in (True, False):  # warm up both loops
        run_loop(model, prompt, 8, cached, progress)

    cached_runs = []
    progress(f"cached run 1/{cached_repeats}")
    cached_runs.append(run_loop(model, prompt, tokens, True, progress))
    progress(f"uncached run ({tokens} steps)")
    t0 = time.perf_counter()
    u_pos, u_s, u_ids = run_loop(model, prompt, tokens, False, progress)
    uncached_total = time.perf_counter() - t0
    for r in range(1, cached_repeats):
        progress(f"cached run {r + 1}/{cached_repeats}")
        cached_runs.append(run_loop(model, prompt, tokens, True, progress))

    c_pos = cached_runs[0][0]
    c_s = [statistics.median(run[1][i] for run in cached_runs) for i in range(tokens)]
    identical = all(run[2] == u_ids for run in cached_runs)

    # Decode steps only: step 0 is the prefill (the prompt's P positions at once) on both loops.
    x = np.asarray(c_pos[1:], dtype=float)
    c_ms = np.asarray(c_s[1:]) * 1e3
    u_ms = np.asarray(u_s[1:]) * 1e3
    c_first, c_last = quartile_medians(c_ms)
    u_first, u_last = quartile_medians(u_ms)
    c_lin, u_lin, u_quad = fit(x, c_ms, 1), fit(x, u_ms, 1), fit(x, u_ms, 2)

    bins = []
    for chunk in np.array_split(np.arange(len(x)), min(BINS, len(x))):
        c_med, u_med = float(np.median(c_ms[chunk])), float(np.median(u_ms[chunk]))
        bins.append(
            {
                "positions": [int(x[chunk[0]]), int(x[chunk[-1]])],
                "cached_ms_median": c_med,
                "uncached_ms_median": u_med,
                "ratio": u_med / c_med,
            }
        )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "weights": meta.get("name", "tiny"),
        "prompt_tokens": prompt.shape[1],
        "tokens": tokens,
        "cached_repeats": cached_repeats,
        "identical": identical,
        "prefill_ms": {"cached": c_s[0] * 1e3, "uncached": u_s[0] * 1e3},
        "cached": {
            "slope_ms_per_position": c_lin[0],
            "intercept_ms": c_lin[1],
            "first_quartile_ms": c_first,
            "last_quartile_ms": c_last,
            "total_s_median": statistics.median(sum(run[1]) for run in cached_runs),
            "last_quartile_ms_per_run": [
                quartile_medians(np.asarray(run[1][1:]) * 1e3)[1] for run in cached_runs
            ],
        },
        "uncached": {
            "slope_ms_per_position": u_lin[0],
            "intercept_ms": u_lin[1],
            "quadratic_ms": {"a": u_quad[0], "b": u_quad[1], "c": u_quad[2]},
            "first_quartile_ms": u_first,
            "last_quartile_ms": u_last,
            "total_s": uncached_total,
        },
        "last_quartile_ratio_uncached_over_cached": u_last / c_last,
        "bins": bins,
    }


def print_report(r: dict) -> None:
    c, u = r["cached"], r["uncached"]
    print(
        f"step times of the tiny model ({r['weights']}), torch {r['torch_version']}, CPU, "
        f"{r['threads']} thread, fp32, {r['prompt_tokens']}-token prompt, {r['tokens']} tokens, "
        f"cached = median of {r['cached_repeats']} runs"
    )
    print(f"{'positions':>13}{'cached ms':>11}{'uncached ms':>13}{'ratio':>9}")
    for b in r["bins"]:
        lo, hi = b["positions"]
        print(
            f"{lo:>6}-{hi:<6}{b['cached_ms_median']:>11.2f}{b['uncached_ms_median']:>13.2f}"
            f"{b['ratio']:>8.1f}x"
        )
    print(
        f"cached:   {c['slope_ms_per_position'] * 1e3:.3f} us/position "
        f"(= {c['slope_ms_per_position']:.2e} ms), intercept {c['intercept_ms']:.2f} ms; "
        f"quartiles first {c['first_quartile_ms']:.2f} ms, last {c['last_quartile_ms']:.2f} ms; "
        f"run {c['total_s_median']:.1f} s"
    )
    q = u["quadratic_ms"]
    print(
        f"uncached: {u['slope_ms_per_position']:.4f} ms/position, intercept "
        f"{u['intercept_ms']:.2f} ms; "
        f"quadratic {q['a']:.3e} T^2 + {q['b']:.3e} T + {q['c']:.2f} ms; "
        f"quartiles first {u['first_quartile_ms']:.2f} ms, last {u['last_quartile_ms']:.2f} ms; "
        f"run {u['total_s']:.0f} s"
    )
    ratio = r["last_quartile_ratio_uncached_over_cached"]
    print(
        f"last-quartile ratio uncached/cached: {ratio:.1f}x; "
        f"prefill {r['prefill_ms']['cached']:.2f} ms; "
        f"cached and uncached ids {'identical' if r['identical'] else 'DIFFER'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens to generate (2048)")
    parser.add_argument("--cached-repeats", type=int, default=3, help="cached runs (median)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.tokens < 8 or args.cached_repeats < 1:
        parser.error("--tokens must be at least 8 and --cached-repeats at least 1")
    torch.set_num_threads(args.threads)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = measure(args.tokens, args.cached_repeats, args.prompt, args.seed, progress)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
