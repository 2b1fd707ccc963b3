"""What a batch buys on this CPU: `kvtui bench --batch 1,2,4,8,16` on the tiny model.

Each batch size is one bench run of the cached loop (`--uncached` adds the uncached one): B
sequences of the default prompt decoded together, one model call per step, their keys and values
in blocks of one KV pool. Per batch size it prints tokens per second of each sequence and of all
of them, the step time after the prefill (TPOT: one token of every sequence), time to first token,
and the arithmetic intensity kvtui.sim.work counts for the steps (FLOPs per byte read: the weights
once, every sequence's cache), and writes the whole sweep as JSON to benchmarks/results/.

The sweep runs `--repeats` times, the batch sizes in turn each time, and the table gives the median
of the repeats (the machine may be shared: a drift in its speed then spreads over every size).
Timings are figures to read, never asserted. The same runs from the command line:

    kvtui bench --engine tiny --device cpu --tokens 128 --batch 1,2,4,8,16 --json

    python benchmarks/batch_sweep.py                      # 128 tokens, cached, 3 repeats
    python benchmarks/batch_sweep.py --uncached --tokens 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kvtui from this checkout

from kvtui.engines.protocol import RunSettings  # noqa: E402
from kvtui.format import format_bytes  # noqa: E402
from kvtui.reports.bench import run_sweep  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def rows_of(sweeps: list[dict], loops: tuple[str, ...]) -> list[dict]:
    """One row per batch size: the median over the repeats of each measured figure; the counted
    ones (KV bytes, FLOPs per byte) are the same in every repeat."""
    rows = []
    for i, first in enumerate(sweeps[0]["sweep"]):
        runs = [sweep["sweep"][i] for sweep in sweeps]
        row = {
            "batch": first["batch"],
            "kv_bytes_filled": first["kv_bytes_filled"],
            "flops_per_byte": first["flops_per_byte"],
            "ridge_flops_per_byte": first["ridge_flops_per_byte"],
            "identical": all(run["identical"] for run in runs) if "uncached" in loops else None,
        }
        for loop in loops:
            for key in ("tokens_per_s_per_sequence", "tokens_per_s_total", "tpot_s", "ttft_s"):
                row[f"{loop}_{key}"] = median([run[loop][key] for run in runs])
        rows.append(row)
    return rows


def show(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def print_table(report: dict) -> None:
    rows, loops = report["rows"], report["loops"]
    base = rows[0]["cached_tokens_per_s_total"]
    print(
        f"tiny on the CPU ({report['cpu_capability']}, torch {report['torch_version']}, "
        f"{report['threads']} thread), {report['prompt_tokens']} prompt + {report['tokens']} "
        f"tokens per sequence, median of {report['repeats']} repeats"
    )
    load = report["load_average_1min"]
    print(f"  load average (1 min) {load['before']:.1f} before, {load['after']:.1f} after")
    header = ["batch", "tok/s/seq", "tok/s total", "x batch 1", "TPOT ms", "TTFT ms"]
    header += ["FLOPs/byte", "KV filled"]
    if "uncached" in loops:
        header += ["uncached tok/s total", "uncached TPOT ms"]
    table = [header]
    for r in rows:
        line = [
            str(r["batch"]),
            show(r["cached_tokens_per_s_per_sequence"], ",.1f"),
            show(r["cached_tokens_per_s_total"], ",.1f"),
            f"{r['cached_tokens_per_s_total'] / base:.2f}x" if base else "-",
            show(r["cached_tpot_s"], ".2f", 1e3),
            show(r["cached_ttft_s"], ".2f", 1e3),
            show(r["flops_per_byte"], ".2f"),
            format_bytes(r["kv_bytes_filled"]) if r["kv_bytes_filled"] is not None else "-",
        ]
        if "uncached" in loops:
            line += [
                show(r["uncached_tokens_per_s_total"], ",.1f"),
                show(r["uncached_tpot_s"], ".2f", 1e3),
            ]
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    ridge = rows[0]["ridge_flops_per_byte"]
    print(f"  ridge point: {report['ridge_source'] if ridge is None else f'{ridge:.0f}'}")
    if "uncached" in loops:
        same = all(r["identical"] for r in rows)
        print(f"  cached and uncached tokens: {'identical' if same else 'DIFFER'} at every size")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,2,4,8,16", help="batch sizes (default 1,2,4,8,16)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="sweeps run (default 3)")
    parser.add_argument("--uncached", action="store_true", help="run the uncached loop too")
    parser.add_argument(
        "--out",
        type=Path,
        help="the JSON file (default results/batch_sweep-DATE-CAPABILITY.json)",
    )
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    loops = ("cached", "uncached") if args.uncached else ("cached",)
    settings = RunSettings(  # bench's defaults: seeded top-k sampling, seed 0, one thread
        engine="tiny", device="cpu", tokens=args.tokens, loops=loops, threads=1
    )
    load_before = os.getloadavg()[0]
    sweeps = []
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}", file=sys.stderr, flush=True)
        sweeps.append(run_sweep(settings, batches))
    first = sweeps[0]["sweep"][0]
    capability = torch.backends.cpu.get_cpu_capability()
    report = {
        "date": datetime.date.today().isoformat(),
        "torch_version": torch.__version__,
        "cpu_capability": capability,
        "threads": first["threads"],
        "model": first["model"],
        "prompt_tokens": first["prompt_tokens"],
        "tokens": args.tokens,
        "loops": list(loops),
        "repeats": args.repeats,
        "ridge_source": first["ridge_source"],
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "command": "kvtui bench --engine tiny --device cpu --tokens "
        f"{args.tokens} --batch {args.batch} --json"
        + ("" if args.uncached else " (cached loop only)"),
        "rows": rows_of(sweeps, loops),
        "sweeps": sweeps,
    }
    for sweep in report["sweeps"]:  # the text is the prompt's continuation: not a figure
        for summary in sweep["sweep"]:
            summary.pop("token_ids", None)
    out = args.out or RESULTS / f"batch_sweep-{report['date']}-{capability.lower()}.json"
    out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print_table(report)
    print(f"  JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
