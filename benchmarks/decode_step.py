"""Where a cached step's time goes on the CPU: the step's path, the weights' layout, the kernel.

The cached loop's step is the model's one `forward` on one token, running flat over weights
gathered once per run. The weights are stored transposed on a CPU, and each linear layer
multiplies one vector by the kernel `choose_matvec` times fastest when the engine loads the model
(`ready_to_decode` -> `store_weights_transposed`). This script shows each of those choices and
what it is worth, on this machine, in three tables:

1. `choose_matvec` as the engine ran it on loading: per weight shape, each kernel's best time.
2. Whole cached steps of the shipped model at position `--position` (each step writes the same
   position again: the paged cache takes no new block for it): `forward(token, position,
   use_cache=True)` on the engine's layout and kernels, then with the weights as trained, and
   with each kernel.
3. The step's matrix-vector products alone: each of the tiny model's 25 weights (13.6 MB of fp32)
   times one vector, in the model's order, several ways (and the weight bytes streamed per
   second), once more through a module call per weight, as `forward` makes them.

Each way is timed over `--steps` calls per round, `--rounds` rounds, the ways taking turns;
median and best, ms per step. The machine may be shared: compare ways within one run.

    python benchmarks/decode_step.py
    python benchmarks/decode_step.py --json > benchmarks/results/decode_step-DATE.json
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

from kvtui.gpu.kernels import MATVEC_KERNELS, Linear, row_sum  # noqa: E402
from kvtui.gpu.load import load_tiny  # noqa: E402
from kvtui.gpu.model import Transformer  # noqa: E402


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


def with_kernel(model: Transformer, kernel) -> Transformer:
    """A copy of `model` whose every linear layer multiplies through `kernel`."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, Linear):
            module.matvec = kernel
    return model


def one_step(model: Transformer, position: int):
    """One cached step at `position`, again and again (the same slots written each time)."""
    token = torch.tensor([[ord("e")]])

    def run() -> None:
        model(token, start=position, use_cache=True)

    return run


def print_table(title: str, rows: dict, extra: str = "") -> None:
    base = next(iter(rows.values()))["ms_per_step_median"]
    print(title)
    print(f"  {'way':56}{'ms/step':>9}{'best':>7}{'speed':>8}{extra:>7}".rstrip())
    for name, r in rows.items():
        line = (
            f"  {name:56}{r['ms_per_step_median']:>9.3f}{r['ms_per_step_best']:>7.3f}"
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

    engine, _ = load_tiny(torch.device("cpu"), torch.float32)  # as the engine loads it
    as_trained = with_kernel(engine, F.linear)
    for module in as_trained.modules():
        if isinstance(module, Linear):
            module.weight = torch.nn.Parameter(module.weight.contiguous(), requires_grad=False)
    models = {"weights as trained, F.linear": as_trained}
    for name, kernel in MATVEC_KERNELS.items():
        models[f"weights stored transposed, {name}"] = with_kernel(engine, kernel)
    prompt = torch.randint(0, 256, (1, args.position), generator=torch.Generator().manual_seed(0))
    for m in (engine, *models.values()):
        m.setup_caches(1, args.position + 1)
        m(prompt, start=0, use_cache=True)
    steps = interleaved(
        {
            "forward (the engine's step), the engine's weights": one_step(engine, args.position),
            **{f"forward, {name}": one_step(m, args.position) for name, m in models.items()},
        },
        args.rounds,
        args.steps,
    )

    linears = [m for m in engine.modules() if isinstance(m, Linear)]
    transposed = [m.weight for m in linears]
    rows = [w.contiguous() for w in transposed]  # the same values, laid out as trained
    vectors = {w.shape[1]: torch.randn(1, 1, w.shape[1]) for w in rows}
    weight_bytes = sum(w.numel() * w.element_size() for w in rows)

    bound = [(m, m.bound()) for m in linears]

    def on(weights, kernel):
        return lambda: [kernel(vectors[w.shape[1]], w) for w in weights]

    def mv(x, w):
        return torch.mv(w, x.view(-1))

    product_ways = {
        "F.linear, weights as trained": on(rows, F.linear),
        "F.linear, weights stored transposed": on(transposed, F.linear),
        "torch.mv, weights stored transposed": on(transposed, mv),
        "row_sum (FBGEMM), weights stored transposed": on(transposed, row_sum),
        "the engine's choice, as forward calls it (Linear.bound)": lambda: [
            f(vectors[m.in_features]) for m, f in bound
        ],
        "the same, as module calls (as forward makes them)": lambda: [
            m(vectors[m.in_features]) for m in linears
        ],
    }
    if "row_sum" not in MATVEC_KERNELS:
        del product_ways["row_sum (FBGEMM), weights stored transposed"]
    products = interleaved(product_ways, args.rounds, args.steps)
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
        "choose_matvec": [
            {
                "shape": list(t.shape),
                "weights": t.weights,
                "timed": t.timed,
                "kernel": t.kernel,
                "us_per_pass": {k: 1e6 * s for k, s in t.seconds.items()},
            }
            for t in engine.matvec_timings
        ],
        "steps": steps,
        "matrix_vector_products": products,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"tiny model on the CPU, 1 thread, fp32, torch {torch.__version__}, "
        f"CPU capability {report['cpu_capability']}, median of {args.rounds} interleaved rounds"
    )
    print("choose_matvec on loading (best us per pass over the weights of a shape):")
    for t in report["choose_matvec"]:
        times = ", ".join(f"{k} {us:.0f}" for k, us in t["us_per_pass"].items())
        shape = "x".join(map(str, t["shape"]))
        print(f"  {shape:>9} x{t['timed']}: {times} -> {t['kernel']}")
    print_table(f"A cached step at position {args.position}:", steps)
    print_table(
        f"Its {len(rows)} matrix-vector products alone ({weight_bytes / 1e6:.1f} MB of weights):",
        products,
        "GB/s",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
