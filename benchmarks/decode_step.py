"""Where a cached step's time goes on the CPU: the step's path, the weights' layout, the kernel.

Two tables, each timed interleaved over `--rounds` rounds (median and best, ms per step):

Whole steps of the shipped model at position `--position` (one token through the KV cache):

- `forward(token, position, use_cache=True)`, weights as trained (the module path);
- `decode(token, position)`, weights as trained (the one-token path: no module calls);
- `decode(token, position)`, weights stored transposed: what the engine runs on a CPU.

The step's matrix-vector products alone: each of the tiny model's 25 weights (13.6 MB of fp32)
times one vector, in the model's order, four ways (and the weight bytes streamed per second):

- `F.linear`, weights as trained: `(out, in)` rows, as `nn.Linear` stores them;
- `F.linear`, weights stored transposed, `(in, out)` in memory (`store_weights_transposed`);
- `torch.mv` on the transposed weights;
- `matvec`, what the cached step uses: `embedding_bag`'s weighted row sum on the transposed
  weights (FBGEMM, x86), else `F.linear`.

    python benchmarks/decode_step.py
    python benchmarks/decode_step.py --json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kvtui from this checkout

from kvtui.decoder import Transformer, matvec  # noqa: E402
from kvtui.engine.torch_engine import load_tiny  # noqa: E402


def time_per_step(run, steps: int) -> float:
    """Milliseconds per call of `run()` (one step, or one step's 25 products)."""
    for _ in range(5):
        run()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    return 1e3 * (time.perf_counter() - t0) / steps


def interleaved(ways: dict, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Median and best ms per step of every way, the ways taking turns round after round."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, run in ways.items():
            times[name].append(time_per_step(run, steps))
    return {
        name: {"ms_per_step_median": statistics.median(ms), "ms_per_step_best": min(ms)}
        for name, ms in times.items()
    }


def one_step(model: Transformer, position: int, use_forward: bool):
    """One cached step at `position`, again and again: the caches are rewound before each."""
    token = torch.tensor([[ord("e")]])

    def run() -> None:
        for cache in model.caches:
            cache.length = position
        if use_forward:
            model(token, start=position, use_cache=True)
        else:
            model.decode(token, position)

    return run


def print_table(title: str, rows: dict, extra: str = "") -> None:
    base = next(iter(rows.values()))["ms_per_step_median"]
    print(title)
    print(f"  {'way':52}{'ms/step':>9}{'best':>7}{'speed':>8}{extra:>7}".rstrip())
    for name, r in rows.items():
        line = (
            f"  {name:52}{r['ms_per_step_median']:>9.3f}{r['ms_per_step_best']:>7.3f}"
            f"{base / r['ms_per_step_median']:>7.2f}x"
        )
        if "gb_per_s_median" in r:
            line += f"{r['gb_per_s_median']:>7.1f}"
        print(line)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=100, help="steps timed per round")
    parser.add_argument("--position", type=int, default=300, help="cache length of the step")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model, _ = load_tiny(torch.device("cpu"), torch.float32)  # weights stored transposed
    as_trained = copy.deepcopy(model)
    for module in as_trained.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.contiguous(), requires_grad=False)
    prompt = torch.randint(0, 256, (1, args.position), generator=torch.Generator().manual_seed(0))
    for m in (model, as_trained):
        m.setup_caches(1, args.position + 1)
        m(prompt, start=0, use_cache=True)
    steps = interleaved(
        {
            "forward (module path), weights as trained": one_step(as_trained, args.position, True),
            "decode (one-token path), weights as trained": one_step(
                as_trained, args.position, False
            ),
            "decode, weights stored transposed (the engine)": one_step(model, args.position, False),
        },
        args.rounds,
        args.steps,
    )

    transposed = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows = [w.contiguous() for w in transposed]  # the same values, laid out as trained
    vectors = {w.shape[1]: torch.randn(1, 1, w.shape[1]) for w in rows}
    weight_bytes = sum(w.numel() * w.element_size() for w in rows)

    def linear_on(weights):
        return lambda: [F.linear(vectors[w.shape[1]], w) for w in weights]

    products = interleaved(
        {
            "F.linear, weights as trained": linear_on(rows),
            "F.linear, weights stored transposed": linear_on(transposed),
            "torch.mv, weights stored transposed": lambda: [
                torch.mv(w, vectors[w.shape[1]].view(-1)) for w in transposed
            ],
            "matvec (the engine)": lambda: [matvec(vectors[w.shape[1]], w) for w in transposed],
        },
        args.rounds,
        args.steps,
    )
    for r in products.values():
        r["gb_per_s_median"] = weight_bytes / r["ms_per_step_median"] / 1e6
    report = {
        "torch_version": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "position": args.position,
        "weights": len(rows),
        "weight_bytes": weight_bytes,
        "steps": steps,
        "matrix_vector_products": products,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"tiny model on the CPU, 1 thread, fp32, torch {torch.__version__} "
        f"({report['cpu_capability']}), median of {args.rounds} interleaved rounds"
    )
    print_table(f"A cached step at position {args.position}:", steps)
    print_table(
        f"Its {len(rows)} matrix-vector products alone ({weight_bytes / 1e6:.1f} MB of weights):",
        products,
        "GB/s",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
