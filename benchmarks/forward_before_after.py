"""The plain cached step before and after a change to the model's forward, timed in one process.

`Transformer.forward` is the one path every loop runs; a change to it (the KV cache's tricks asked
it for the cache's rotary start and whether the cache rotates keys as it reads them) must not
slow the plain cache. This loads `kvtui/gpu/model.py` as it was at `--rev` (a git revision) beside
the one in this checkout, gives both the shipped weights, the same layout and the same one-vector
kernels, and times their plain cached steps in turns, `--rounds` rounds of `--steps` steps each
from position 44, so the machine's drift falls on both alike. Prints the median ms per step of
each and the ratio (after / before), which is the figure to quote, with the CPU capability.

    python benchmarks/forward_before_after.py --rev main
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # kvtui from this checkout

from kvtui.gpu.kernels import Linear  # noqa: E402
from kvtui.gpu.load import load_tiny, ready_to_decode  # noqa: E402


def model_at(rev: str):
    """kvtui/gpu/model.py as it was at `rev`, imported as a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:kvtui/gpu/model.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "model_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("model_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_before"] = module
    spec.loader.exec_module(module)
    return module


def ms_per_step(model, prompt: torch.Tensor, steps: int) -> float:
    P = prompt.shape[1]
    model.setup_caches(1, P + steps, block_tokens=16)
    with torch.inference_mode():
        model(prompt, 0, True, last_only=True)
        token = torch.tensor([[65]])
        t0 = time.perf_counter()
        for p in range(P, P + steps):
            model(token, p, True)
        seconds = time.perf_counter() - t0
    model.drop_caches()
    return 1e3 * seconds / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="main", help="the revision whose forward is 'before'")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--steps", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    after, _ = load_tiny(torch.device("cpu"), torch.float32)
    before = model_at(args.rev).Transformer(after.args)
    before.load_state_dict({k: v.contiguous() for k, v in after.state_dict().items()})
    before = ready_to_decode(before)
    linears = [[m for m in model.modules() if isinstance(m, Linear)] for model in (after, before)]
    for a, b in zip(*linears, strict=True):
        b.matvec = a.matvec  # the same kernels: only the forward differs
    prompt = torch.randint(0, 256, (1, 44), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = (("before", before), ("after", after))
        for name, model in order if r % 2 == 0 else order[::-1]:
            times[name].append(ms_per_step(model, prompt, args.steps))
    b, a = statistics.median(times["before"]), statistics.median(times["after"])
    ratios = sorted(x / y for x, y in zip(times["after"], times["before"], strict=True))
    print(
        f"CPU {torch.backends.cpu.get_cpu_capability()}, 1 thread: plain cached step "
        f"{b:.3f} ms before ({args.rev}), {a:.3f} ms after: after / before {a / b:.3f} "
        f"(median of {args.rounds} rounds of {args.steps} steps; per-round ratio quartiles "
        f"{ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
