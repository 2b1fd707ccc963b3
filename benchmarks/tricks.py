"""The tricks that stretch the KV cache, measured on the shipped model: the table of `kvtui tricks`,
and their cost in quality on the WHOLE held-out Austen split (the tests and `kvtui tricks` score
a fixed slice of it), and a window's cost by position, past the model's 4,096 positions.

1. The table (kvtui.reports.tricks.run_table, as `kvtui tricks` prints it): under one 1 MiB KV pool,
   each trick's bytes per token (measured from the cache's tensors and by the formula), where the
   pool stopped it against its own C - P + 1, its quality on 1,024 held-out bytes, its speed.
2. Teacher-forced over the held-out split (the last 5% of each novel, 201,483 bytes, cut into
   windows of 4,096 bytes as the model was validated): nats per byte with each trick and without,
   the KL divergence of the next-token distributions, top-1 agreement; free-running, the first
   greedy token that differs, from the start of each of the first `--prompts` windows. Tricks:
   fp8, int8, 1 KV head (averaged); prefix caching on `--prefix-windows` windows (it changes no
   value: the check that it does not).
3. A window over `--long` bytes of one novel's held-out text (Mansfield Park's, 44 KB), one
   position at a time: nats per byte in buckets of `--bucket` positions, for a window of `--window`
   with 4 sinks and with none; the plain cache scored where it can go (the first 4,096).
4. Speed, with the layouts taking turns (`--speed-rounds` rounds of `--speed-steps` cached steps
   each, from position 44 on, the order alternating) so that a shared machine's drift falls on all
   alike: the median and the best ms per step of each, and their ratios to the plain cache's.
   The table's own speeds are each row's alone, at whatever moment it ran. `--only-speed` runs
   this part alone.

Needs Debian's r-cran-janeaustenr (`apt-get install r-cran-janeaustenr`). Long: about 20-40
minutes on one thread of a 2-core CPU; run it in the background:

    nohup python benchmarks/tricks.py --json benchmarks/results/tricks-DATE.json > tricks.log &
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kvtui from this checkout

from kvtui.engines.protocol import RunSettings  # noqa: E402
from kvtui.engines.quality import (  # noqa: E402
    forced_logits,
    greedy_tokens_of,
    nats_by_position,
    shared_prefix_logits,
    step_ms_in_turns,
)
from kvtui.gpu.load import load_tiny, ready_to_decode  # noqa: E402
from kvtui.gpu.tricks import average_kv_heads  # noqa: E402
from kvtui.reports.table import run_table, table_header
from kvtui.reports.tricks import format_tricks
from kvtui.sim.tricks import KVLayout  # noqa: E402
from kvtui.training.corpus import austen_novels, train_val_split  # noqa: E402

WINDOW_BYTES = 4096


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def held_out() -> tuple[str, str]:
    """The whole held-out split, and Mansfield Park's held-out part alone (the longest)."""
    novels = austen_novels()
    _, val = train_val_split(novels)
    _, mansfield = train_val_split({"mansfieldpark": novels["mansfieldpark"]})
    return val, mansfield


def ids_of(text: str) -> torch.Tensor:
    return torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)


def split_quality(model, trick_model, layout: KVLayout, windows, prompts: int, greedy: int):
    """Teacher-forced sums over every window, and the first greedy divergence from the start of
    each of the first `prompts` windows."""
    nll = nll_base = kl = agree = 0.0
    positions = 0
    for w in windows:
        base = F.log_softmax(forced_logits(model, w).float(), -1)
        if layout.prefix_caching:
            half = w.shape[1] // 2
            trick = F.log_softmax(shared_prefix_logits(trick_model, w, layout, half).float(), -1)
            base, targets = base[half - 1 :], w[0, half:]
        else:
            trick = F.log_softmax(forced_logits(trick_model, w, layout).float(), -1)
            targets = w[0, 1:]
        nll += -trick.gather(1, targets[:, None]).sum().item()
        nll_base += -base.gather(1, targets[:, None]).sum().item()
        kl += (base.exp() * (base - trick)).sum(-1).sum().item()
        agree += (base.argmax(-1) == trick.argmax(-1)).sum().item()
        positions += targets.numel()
    firsts = []
    for w in windows[:prompts]:
        prompt = w[:, :64]
        plain = greedy_tokens_of(model, prompt, greedy, None)
        tricked = greedy_tokens_of(trick_model, prompt, greedy, layout)
        firsts.append(
            next((i for i, (a, b) in enumerate(zip(plain, tricked, strict=True)) if a != b), None)
        )
    found = [f for f in firsts if f is not None]
    return {
        "nats_per_byte": nll / positions,
        "nats_per_byte_baseline": nll_base / positions,
        "kl": kl / positions,
        "top1_agreement": agree / positions,
        "first_divergence": firsts,
        "first_divergence_median": statistics.median(found) if found else None,
        "prompts_without_divergence": firsts.count(None),
        "greedy_tokens": greedy,
        "positions": positions,
        "windows": len(windows),
    }


def speed(rounds: int, steps: int) -> dict:
    """Median and best ms per cached step of each layout, in turns, and their ratios to plain."""
    model, _ = load_tiny(torch.device("cpu"), torch.float32)
    mqa = ready_to_decode(average_kv_heads(model, 1))
    times = step_ms_in_turns(
        {
            "plain": (model, None),
            "fp8": (model, KVLayout(cache_dtype="fp8")),
            "int8": (model, KVLayout(cache_dtype="int8")),
            "window 124 + 4 sinks": (model, KVLayout(window=128, sinks=4)),
            "1 KV head": (mqa, None),
        },
        rounds=rounds,
        steps=steps,
    )
    plain, plain_best = statistics.median(times["plain"]), min(times["plain"])
    return {
        name: {
            "ms_per_step": statistics.median(t),
            "vs_plain": statistics.median(t) / plain,
            "best_ms_per_step": min(t),
            "best_vs_plain": min(t) / plain_best,
            "ms_per_step_each_round": t,
        }
        for name, t in times.items()
    } | {"rounds": rounds, "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="greedy prompts (window starts)")
    parser.add_argument("--greedy", type=int, default=256, help="greedy tokens per prompt")
    parser.add_argument("--prefix-windows", type=int, default=4)
    parser.add_argument("--long", type=int, default=16384, help="bytes the window runs over")
    parser.add_argument("--window", type=int, default=1024, help="positions a window keeps")
    parser.add_argument("--bucket", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=None, help="score only this many")
    parser.add_argument("--skip-table", action="store_true")
    parser.add_argument("--speed-rounds", type=int, default=21)
    parser.add_argument("--speed-steps", type=int, default=256)
    parser.add_argument("--only-speed", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.backends.cpu.get_cpu_capability()
    results: dict = {"cpu_capability": cpu, "torch": torch.__version__, "threads": 1}
    say(f"CPU {cpu}, torch {torch.__version__}, 1 thread")

    results["speed"] = speed(args.speed_rounds, args.speed_steps)
    for name, v in results["speed"].items():
        if isinstance(v, dict):
            say(
                f"speed {name}: {v['ms_per_step']:.3f} ms a step, {v['vs_plain']:.2f}x plain's "
                f"(best {v['best_ms_per_step']:.3f} ms, {v['best_vs_plain']:.2f}x)"
            )
    if args.only_speed:
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return 0

    if not args.skip_table:
        settings = RunSettings(engine="tiny", device="cpu")
        header = table_header(settings)
        rows = []
        for row in run_table(settings, progress=lambda line: None):
            say(f"table: {row['label']} done")
            rows.append(row)
        results["table"] = {**header, "rows": rows}
        print(format_tricks(header, rows), flush=True)

    val, mansfield = held_out()
    model, _ = load_tiny(torch.device("cpu"), torch.float32)
    mqa = ready_to_decode(average_kv_heads(model, 1))
    data = val.encode("utf-8")
    windows = [
        torch.tensor([list(data[i : i + WINDOW_BYTES])], dtype=torch.long)
        for i in range(0, len(data) - WINDOW_BYTES + 1, WINDOW_BYTES)
    ][: args.windows]
    say(f"held-out split: {len(data):,} bytes, {len(windows)} windows of {WINDOW_BYTES:,}")
    split = {}
    for key, trick_model, layout, some in [
        ("fp8", model, KVLayout(cache_dtype="fp8"), windows),
        ("int8", model, KVLayout(cache_dtype="int8"), windows),
        ("mqa", mqa, KVLayout(), windows),
        ("prefix", model, KVLayout(prefix_caching=True), windows[: args.prefix_windows]),
    ]:
        t0 = time.perf_counter()
        split[key] = split_quality(model, trick_model, layout, some, args.prompts, args.greedy)
        q = split[key]
        say(
            f"split {key}: {q['nats_per_byte']:.4f} vs {q['nats_per_byte_baseline']:.4f} "
            f"nats/byte, KL {q['kl']:.5f}, top-1 {q['top1_agreement']:.2%}, first greedy "
            f"differences {q['first_divergence']} ({time.perf_counter() - t0:.0f} s)"
        )
    results["split"] = split

    long_ids = ids_of(mansfield)[:, : args.long]
    n = long_ids.shape[1]
    say(f"window: {n:,} bytes of Mansfield Park's held-out text, buckets of {args.bucket:,}")
    plain = nats_by_position(
        forced_logits(model, long_ids[:, :WINDOW_BYTES]), long_ids, args.bucket
    )
    by_position = {"plain": plain, "bucket": args.bucket, "bytes": n, "window": args.window}
    for sinks in (4, 0):
        t0 = time.perf_counter()
        layout = KVLayout(window=args.window, sinks=sinks)
        logits = forced_logits(model, long_ids, layout)
        by_position[f"sinks_{sinks}"] = nats_by_position(logits, long_ids, args.bucket)
        say(
            f"window {args.window} with {sinks} sinks: "
            + ", ".join(f"{v:.3f}" for v in by_position[f"sinks_{sinks}"])
            + f" ({time.perf_counter() - t0:.0f} s)"
        )
    results["window_by_position"] = by_position
    say(
        "plain (first 4,096 only: RoPE has no angle past them): "
        + ", ".join(f"{v:.3f}" for v in plain)
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
