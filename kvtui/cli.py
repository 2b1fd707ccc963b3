"""The `kvtui` command: argparse -> plain values -> the app or a headless command.

`kvtui` alone opens the Textual app (imported only then); `kvtui work`, `budget`, `models` and
`gpus` print the simulator's figures as tables or, with `--json`, as JSON. Bad input is one line on
stderr and exit status 2, never a traceback. Importing this module stays cheap: no torch, no
textual.

To add a subcommand: write `cmd_NAME(args) -> int`, and a `_add_NAME(subparsers)` that builds its
parser and calls `set_defaults(handler=cmd_NAME)`; list it in `build_parser`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from kvtui import __version__
from kvtui.engine.protocol import (
    DEFAULT_PROMPT,
    MAX_RUN_BATCH,
    MAX_TOKENS,
    EngineError,
    RunSettings,
)
from kvtui.format import (
    format_bandwidth,
    format_bytes,
    format_flops_rate,
    format_int,
    format_params,
    format_percent,
    format_ratio,
    parse_bytes,
    safe_text,
)
from kvtui.inputs import argv_text
from kvtui.sim.catalog import (
    MAX_SIZE,
    ConfigError,
    UnknownNameError,
    dtype_names,
    get_gpu,
    get_model,
    gpu_names,
    model_from_hf_config,
    model_names,
    normalize_dtype,
)
from kvtui.sim.memory import RUNTIME_RESERVE_BYTES, budget, kv_bytes_per_token
from kvtui.sim.work import cached_step_positions, work_summary

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
"""Ctrl-C, as a shell reports it (128 + SIGINT)."""

MAX_CONTEXT = MAX_SIZE
"""The longest context `work` and `budget` take: 16,777,216 tokens, as long as a config may state
(kvtui.sim.catalog.MAX_SIZE); past Llama 4 Scout's 10M, the longest published."""
MAX_BATCH = 65_536
"""The largest `budget --batch`: far past any one GPU's serving batch (vLLM's default is 256),
and with MAX_CONTEXT it keeps every figure of a budget an exact integer a float can hold."""
MAX_SEED = 2**63 - 1
"""The largest seed: torch's generator takes 64 bits."""
MAX_THREADS = 1024
TEMPERATURE_RANGE = (0.01, 100.0)
"""Below 0.01 the logits overflow float32 (use --greedy); above 100 every token is as likely."""
REPLAY_SPEED_RANGE = (0.01, 1000.0)
"""0, or this: a step never sleeps more than 100x its recorded (or roofline) time."""


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageErrors, so `main` reports them in one line."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}")


# --- argument types ------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (underscores and commas allowed: 10_000)."""
    try:
        value = int(str(text).replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}")
    return value


def _shown(text: str) -> str:
    shown = repr(text)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def utilization(text: str) -> float:
    """An argparse type: a share of a GPU's memory, above 0 and at most 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"expected a number above 0 and at most 1, not {_shown(text)}"
        )
    return value


MAX_KV_BUDGET = 2**50
"""The largest `--kv-budget`: 1 PiB, past any machine's memory; the engine takes storage only for
the blocks a run can use, so a budget larger than memory costs nothing by itself."""


def kv_budget(text: str) -> int:
    """An argparse type: a size in binary units (64MiB, 1.5GiB, 4096), from 1 byte to 1 PiB."""
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)[:120]) from None
    if not 1 <= value <= MAX_KV_BUDGET:
        raise argparse.ArgumentTypeError(
            f"expected a size from 1 B to {format_bytes(MAX_KV_BUDGET)}, not {_shown(text)}"
        )
    return value


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` (underscores and commas allowed)."""
    what = (
        f"a positive integer up to {high:,}" if low == 1 else f"an integer from {low:,} to {high:,}"
    )

    def parse(text: str) -> int:
        try:
            value = int(str(text).replace(",", ""))
        except ValueError:  # not a number, or more digits than int() converts
            raise argparse.ArgumentTypeError(f"expected {what}, not {_shown(text)}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what}, not {_shown(text)}")
        return value

    parse.__name__ = f"int_in({low}, {high})"
    return parse


MAX_SWEEP = 16
"""The most batch sizes one `bench --batch` sweeps: 1 to 256 in powers of two is 9."""


def batch_list(text: str) -> list[int]:
    """An argparse type: batch sizes separated by commas (`1,2,4,8,16`), each from 1 to
    MAX_RUN_BATCH, each once, at most MAX_SWEEP of them; one size is a list of one."""
    items = str(text).split(",")
    what = f"batch sizes from 1 to {MAX_RUN_BATCH} separated by commas, e.g. 1,2,4,8,16"
    if len(items) > MAX_SWEEP:
        raise argparse.ArgumentTypeError(f"at most {MAX_SWEEP} batch sizes, not {len(items):,}")
    sizes = []
    for item in items:
        try:
            size = int(item.strip()) if item.strip().isdigit() else None
        except ValueError:  # more digits than int() converts
            size = None
        if size is None or not 1 <= size <= MAX_RUN_BATCH:
            raise argparse.ArgumentTypeError(f"expected {what}, not {_shown(text)}")
        if size in sizes:
            raise argparse.ArgumentTypeError(f"batch size {size} is given twice in {_shown(text)}")
        sizes.append(size)
    return sizes


def one_batch(text: str) -> int:
    """An argparse type: one batch size, from 1 to MAX_RUN_BATCH (not `int_in`, which would read
    `2,4` as 24)."""
    sizes = batch_list(text)
    if len(sizes) > 1:
        raise argparse.ArgumentTypeError(
            f"the app runs one batch size, not {_shown(text)} (kvtui bench --batch sweeps several)"
        )
    return sizes[0]


def float_in(low: float, high: float, *, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number from `low` to `high` (or exactly 0, with `zero`)."""
    what = f"{'0 or ' if zero else ''}a number from {low:g} to {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, not {_shown(text)}") from None
        if not (low <= value <= high or zero and value == 0):
            raise argparse.ArgumentTypeError(f"expected {what}, not {_shown(text)}")
        return value

    parse.__name__ = f"float_in({low}, {high})"
    return parse


def dtype_arg(text: str) -> str:
    """An argparse type: a storage format (fp32, bf16, fp16, fp8, int4 or a torch spelling)."""
    try:
        return normalize_dtype(text)
    except UnknownNameError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --- output helpers ------------------------------------------------------------------------------


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, allow_nan=False))  # JSON has no NaN or Infinity


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    """Columns padded to fit; the columns in `right` are right-aligned (numbers)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _article(text: str) -> str:
    """ "a" or "an" before a number as it is read aloud: an 80 GiB GPU, an 11 GiB one, a 24."""
    digits = text.split()[0].replace(",", "").split(".")[0]
    spoken_vowel = digits.startswith("8") or (len(digits) % 3 == 2 and digits[:2] in {"11", "18"})
    return "an" if spoken_vowel else "a"


# --- subcommands ---------------------------------------------------------------------------------


def cmd_work(args: argparse.Namespace) -> int:
    """`kvtui work`: positions computed with and without a KV cache."""
    s = work_summary(args.length, args.prompt_tokens)
    if args.json:
        _print_json(s.to_json())
        return 0
    print(f"{format_int(s.length)} tokens generated after a {format_int(s.prompt)}-token prompt")
    print(
        _table(
            ["positions computed", "without cache", "with cache"],
            [
                [
                    "last step",
                    format_int(s.naive_last_step),
                    format_int(cached_step_positions(s.length, s.prompt)),
                ],
                ["total", format_int(s.naive_total), format_int(s.cached_total)],
                ["wasted (recomputed)", format_int(s.wasted), "0"],
            ],
            right={1, 2},
        )
    )
    print(f"Without a cache the model does {format_ratio(s.speedup)} the work.")
    return 0


def cmd_budget(args: argparse.Namespace) -> int:
    """`kvtui budget`: weights + KV cache + runtime reserve against one GPU (each of `--tp` GPUs
    the model is split over), and the KV cache a vLLM-style server would size on it."""
    from kvtui.sim.memory import kv_capacity, kv_head_copies, tensor_parallel_problem

    spec = model_from_hf_config(args.config) if args.config else get_model(args.model)
    gpu = get_gpu(args.gpu)
    problem = tensor_parallel_problem(spec, args.tp)
    if problem is not None:
        raise UsageError(f"kvtui budget: error: argument --tp: {problem}")
    b = budget(spec, gpu, args.context, args.batch, args.kv_dtype, args.weights_dtype, tp=args.tp)
    c = kv_capacity(
        spec,
        gpu,
        args.context,
        tp=args.tp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        kv_dtype=args.kv_dtype,
        weights_dtype=args.weights_dtype,
    )
    if args.json:
        served = {key: value for key, value in c.to_json().items() if key not in b.to_json()}
        _print_json({**b.to_json(), **served})
        return 0
    label = safe_text(b.model_label, one_line=True)  # a config's folder name
    where = f"the {b.gpu_label}" if b.tp == 1 else f"{b.tp}x the {b.gpu_label} (tensor parallel)"
    print(
        f"{label} on {where}: batch {b.batch} x {format_int(b.context_tokens)} "
        f"tokens, KV cache in {b.kv_dtype}, weights in {b.weights_dtype}"
    )
    per_token = f"{format_int(b.kv_bytes_per_token_per_gpu)} bytes/token"
    print(
        _table(
            ["" if b.tp == 1 else "each GPU", "bytes", "of VRAM"],
            [
                [
                    f"weights ({b.weights_dtype})",
                    format_bytes(b.weights_bytes_per_gpu),
                    format_percent(b.weights_bytes_per_gpu / b.vram_bytes),
                ],
                [
                    f"KV cache ({per_token})",
                    format_bytes(b.kv_bytes_per_gpu),
                    format_percent(b.kv_fraction_of_vram),
                ],
                [
                    "runtime reserve",
                    format_bytes(b.reserve_bytes),
                    format_percent(b.reserve_bytes / b.vram_bytes),
                ],
                ["total", format_bytes(b.used_bytes), format_percent(b.used_bytes / b.vram_bytes)],
                ["GPU memory", format_bytes(b.vram_bytes), ""],
            ],
            right={1, 2},
        )
    )
    verdict = "fits" if b.fits else "does NOT fit (overflow)"
    vram = format_bytes(b.vram_bytes)
    on = f"{_article(vram)} {vram} GPU" if b.tp == 1 else f"each {vram} GPU"
    print(
        f"{format_bytes(b.kv_bytes_per_gpu)} of KV on {on} is "
        f"{format_percent(b.kv_fraction_of_vram)}; the whole budget {verdict}."
    )
    if b.max_context_tokens is None:
        print("Longest context that fits: any (every layer's sliding window fits).")
    elif b.max_context_tokens == 0:
        print("Longest context that fits: none, not even one token.")
    else:
        print(f"Longest context that fits: {format_int(b.max_context_tokens)} tokens.")
    if b.tp > 1:
        if spec.is_mla:
            heads = "the whole MLA latent, which every GPU keeps"
        else:
            heads = f"{b.kv_heads_per_gpu} of the {spec.kv_heads} KV heads"
            copies = kv_head_copies(spec, b.tp)
            if copies > 1:
                heads += f", each kept on {copies} GPUs (fewer KV heads than GPUs)"
        print(
            f"Split over {b.tp} GPUs: each holds {format_bytes(b.weights_bytes_per_gpu)} of the "
            f"{format_bytes(b.weights_bytes)} of weights, and {heads}."
        )
    print(
        f"Served like vLLM (--gpu-memory-utilization {c.gpu_memory_utilization:g}, --block-size "
        f"{c.block_size}): {format_bytes(c.usable_bytes_per_gpu)} of each GPU, less "
        f"{format_bytes(b.weights_bytes_per_gpu)} of weights and the "
        f"{format_bytes(b.reserve_bytes)} reserve, leaves "
        f"{format_bytes(max(0, c.kv_bytes_available_per_gpu))} for the KV cache."
    )
    print(f"GPU KV cache size: {format_int(c.kv_capacity_tokens)} tokens")
    print(  # vLLM's own format, %.2fx
        f"Maximum concurrency for {format_int(c.context_tokens)} tokens per request: "
        f"{c.max_concurrency:,.2f}x"
    )
    if c.kv_blocks < c.blocks_per_request:
        print(
            f"vLLM would refuse to start: one request of {format_int(c.context_tokens)} tokens "
            "needs more KV cache than is left."
        )
    print(
        "A real server's figure is usually lower: it measures its own activation peak (kvtui "
        f"reserves {format_bytes(b.reserve_bytes)}), CUDA graphs and NCCL take memory, other "
        "processes on the GPU count against the same share, the driver reports a little under "
        "the label, and fragmentation wastes some."
    )
    for line in b.advice:
        print(f"- {safe_text(line, one_line=True)}")  # names a config's folder
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """`kvtui models`: the model catalog."""
    specs = [get_model(name) for name in model_names()]
    if args.json:
        _print_json(
            [
                {**spec.to_json(), "kv_bytes_per_token_bf16": kv_bytes_per_token(spec, "bf16")}
                for spec in specs
            ]
        )
        return 0
    rows = []
    for spec in specs:
        attention = f"{spec.heads}/{spec.kv_heads}"
        if spec.is_mla:
            attention += " MLA"
        if spec.sliding_window:
            attention += f" SWA {spec.sliding_window}x{len(spec.sliding_layers)}"
        rows.append(
            [
                spec.name,
                format_params(spec.params),
                str(spec.layers),
                attention,
                str(spec.head_dim),
                format_int(spec.max_context),
                format_bytes(kv_bytes_per_token(spec, "bf16")),
                spec.default_dtype,
            ]
        )
    headers = ["model", "params", "layers", "heads/kv", "head_dim", "context", "KV/token", "dtype"]
    print(_table(headers, rows, right={1, 2, 4, 5, 6}))
    print("KV/token in bf16, before any sliding window fills. Sources: assets/models.json.")
    return 0


def cmd_gpus(args: argparse.Namespace) -> int:
    """`kvtui gpus`: the GPU catalog."""
    gpus = [get_gpu(name) for name in gpu_names()]
    if args.json:
        _print_json([gpu.to_json() for gpu in gpus])
        return 0
    rows = [
        [
            gpu.name,
            gpu.display_name,
            format_bytes(gpu.memory_bytes),
            format_bandwidth(gpu.bandwidth_bytes_per_s),
            format_flops_rate(gpu.peak_bf16_flops),
            f"{gpu.ridge_flops_per_byte:.0f}",
        ]
        for gpu in gpus
    ]
    headers = ["gpu", "name", "memory", "bandwidth", "bf16 dense", "ridge FLOP/B"]
    print(_table(headers, rows, right={2, 3, 4, 5}))
    print("Vendor datasheet figures. Sources: assets/gpus.json.")
    return 0


def cmd_app(args: argparse.Namespace) -> int:
    """`kvtui` with no subcommand: open the Textual app (imported only now)."""
    from kvtui.engine.spec import check_engine

    settings = settings_from_args(args, default_tokens=DEFAULT_APP_TOKENS)
    try:
        check_engine(settings)
    except EngineError as exc:
        raise UsageError(f"kvtui: {exc}") from None
    if not has_terminal():
        raise UsageError(
            "kvtui: the app needs a terminal; for output to a file or a pipe use "
            "kvtui bench, work, budget, models or gpus (--json)"
        )
    from kvtui.app import run_app

    return int(run_app(settings, screen=args.screen) or 0)


def has_terminal() -> bool:
    """Whether the app has a terminal to draw on: stdin and stdout are one, or `kvtui serve`'s
    web driver (textual-serve sets TEXTUAL_DRIVER) stands in for it."""
    return "TEXTUAL_DRIVER" in os.environ or (sys.stdin.isatty() and sys.stdout.isatty())


DEFAULT_APP_TOKENS = 256
"""Tokens the app's run generates unless `--tokens` says otherwise."""
LESSON_TOKENS = 24
"""Tokens a `--lesson` run generates unless `--tokens` says otherwise: the lesson's example."""


# --- the parser ----------------------------------------------------------------------------------


def _add_work(subparsers: Any) -> None:
    p = subparsers.add_parser("work", help="positions computed with and without a KV cache")
    p.add_argument(
        "--length",
        type=int_in(1, MAX_CONTEXT),
        required=True,
        help=f"tokens generated (n), at most {MAX_CONTEXT:,}",
    )
    p.add_argument(
        "--prompt",
        dest="prompt_tokens",
        type=int_in(1, MAX_CONTEXT),
        default=1,
        metavar="P",
        help=f"prompt tokens before them (default 1, the lesson's; at most {MAX_CONTEXT:,})",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_work)


def _add_budget(subparsers: Any) -> None:
    p = subparsers.add_parser("budget", help="does a model's KV cache fit on a GPU?")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help=f"a catalog model: {', '.join(model_names())}")
    which.add_argument("--config", metavar="PATH", help="a Hugging Face config.json")
    p.add_argument("--gpu", required=True, help=f"a catalog GPU: {', '.join(gpu_names())}")
    p.add_argument(
        "--context",
        type=int_in(1, MAX_CONTEXT),
        required=True,
        help=f"tokens per sequence, at most {MAX_CONTEXT:,}",
    )
    p.add_argument(
        "--batch",
        type=int_in(1, MAX_BATCH),
        default=1,
        help=f"sequences held at once (default 1, at most {MAX_BATCH:,})",
    )
    dtypes = ", ".join(dtype_names())
    p.add_argument("--kv-dtype", type=dtype_arg, default="bf16", help=f"KV cache: {dtypes}")
    p.add_argument("--weights-dtype", type=dtype_arg, default="bf16", help=f"weights: {dtypes}")
    from kvtui.sim.memory import (
        DEFAULT_BLOCK_SIZE,
        DEFAULT_GPU_MEMORY_UTILIZATION,
        MAX_TENSOR_PARALLEL,
    )

    p.add_argument(
        "--tp",
        type=int_in(1, MAX_TENSOR_PARALLEL),
        default=1,
        metavar="N",
        help="tensor parallel: split the model over N GPUs of this kind, each holding its share "
        f"(default 1, at most {MAX_TENSOR_PARALLEL:,}; vLLM's rules on heads apply)",
    )

    p.add_argument(
        "--gpu-memory-utilization",
        type=utilization,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        metavar="U",
        help="the share of each GPU's memory a vLLM-style server takes, above 0 and at most 1 "
        f"(default {DEFAULT_GPU_MEMORY_UTILIZATION:g}, vLLM's long-standing default)",
    )
    p.add_argument(
        "--block-size",
        "--kv-block",  # the app's and bench's name for the same thing
        dest="block_size",
        type=int_in(1, MAX_CONTEXT),
        default=DEFAULT_BLOCK_SIZE,
        metavar="B",
        help=f"tokens per KV-cache block (default {DEFAULT_BLOCK_SIZE}, vLLM's)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_budget)
    p.epilog = (
        f"The runtime reserve is {format_bytes(RUNTIME_RESERVE_BYTES)}. The serving figures "
        "follow vLLM's start-up log: GPU KV cache size = whole blocks in (memory x utilization "
        "- weights - reserve) per GPU; maximum concurrency = blocks / blocks per request."
    )


def _add_models(subparsers: Any) -> None:
    p = subparsers.add_parser("models", help="the model catalog")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_models)


def _add_gpus(subparsers: Any) -> None:
    p = subparsers.add_parser("gpus", help="the GPU catalog")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_gpus)


def _add_run_options(group: Any, *, app: bool) -> None:
    """The options of a decode run, shared by the app and `kvtui bench`."""
    group.add_argument(
        "--engine",
        default="tiny",
        help="tiny (default), shape:MODEL, sim:MODEL@GPU, sim:MODEL@NxGPU or replay:FILE",
    )
    group.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the model runs (default auto)",
    )
    group.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face model directory (same as --engine hf:DIR; needs kvtui[hf])",
    )
    group.add_argument(
        "--tokens",
        *(["--length"] if app else []),
        dest="tokens",
        type=int_in(1, MAX_TOKENS),
        default=None,
        help="tokens to generate (the answer length; default 256, 24 with --lesson; at most "
        f"{MAX_TOKENS:,}, and prompt + tokens at most the model's positions)",
    )
    group.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    group.add_argument(
        "--seed",
        type=int_in(0, MAX_SEED),
        default=0,
        help="sampling seed (default 0; 0 to 2^63-1)",
    )
    group.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    group.add_argument(
        "--lesson",
        action="store_true",
        help="a one-token prompt (the prompt's first): the counts are then the lesson's exactly",
    )
    low, high = TEMPERATURE_RANGE
    group.add_argument(
        "--temperature",
        type=float_in(low, high),
        default=0.8,
        help=f"sampling temperature (default 0.8; {low:g} to {high:g})",
    )
    group.add_argument(
        "--top-k",
        type=int_in(1, MAX_SIZE),
        default=40,
        help=f"sample from the k likeliest (default 40; at most {MAX_SIZE:,})",
    )
    group.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS),
        default=1,
        help=f"torch threads in the engine (default 1; at most {MAX_THREADS:,})",
    )
    low, high = REPLAY_SPEED_RANGE
    group.add_argument(
        "--replay-speed",
        type=float_in(low, high, zero=True),
        default=1.0,
        help="replay:/sim: pace, 1 = recorded or roofline time, 0 = as fast as possible "
        f"(else {low:g} to {high:g})",
    )
    from kvtui.sim.memory import (
        CPU_KV_BUDGET_BYTES,
        DEFAULT_BLOCK_SIZE,
        DEFAULT_GPU_MEMORY_UTILIZATION,
        MAX_KV_BLOCK_TOKENS,
    )

    group.add_argument(
        "--kv-budget",
        type=kv_budget,
        default=None,
        metavar="SIZE",
        help="the KV cache's pool, e.g. 2MiB or 1.5GiB: the cached loop stops when it is full "
        f"(default: on a GPU its share, --gpu-memory-utilization; on a CPU "
        f"{format_bytes(CPU_KV_BUDGET_BYTES)}; kvtui's own engines, not hf:)",
    )
    group.add_argument(
        "--kv-block",
        "--block-size",  # vLLM's name, and `kvtui budget`'s
        dest="kv_block",
        type=int_in(1, MAX_KV_BLOCK_TOKENS),
        default=DEFAULT_BLOCK_SIZE,
        metavar="TOKENS",
        help=f"token slots per block of the KV pool (default {DEFAULT_BLOCK_SIZE}, vLLM's)",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=utilization,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        metavar="U",
        help="the share of the GPU's memory the engine fills, weights and KV pool "
        f"(default {DEFAULT_GPU_MEMORY_UTILIZATION:g}, as vLLM's flag)",
    )
    if app:
        group.add_argument(
            "--batch",
            type=one_batch,
            default=1,
            help="sequences decoded together, the same prompt in each, row r sampled with seed "
            f"SEED + r (default 1; at most {MAX_RUN_BATCH}; tiny, shape: and sim: only)",
        )
        group.add_argument(
            "--screen", type=int, choices=[1, 2, 3], default=1, help="the screen to open first"
        )
    else:
        group.add_argument(
            "--batch",
            dest="batches",
            type=batch_list,
            default=[1],
            metavar="B[,B...]",
            help="sequences decoded together, the same prompt in each, row r sampled with seed "
            f"SEED + r (default 1; each at most {MAX_RUN_BATCH}; tiny, shape: and sim: only); "
            'a comma list runs one bench per size, a sweep (JSON: {"sweep": [...]})',
        )


def settings_from_args(args: argparse.Namespace, default_tokens: int) -> RunSettings:
    """The plain, picklable settings of a run, from the parsed options."""
    return RunSettings(
        engine=f"hf:{args.model}" if args.model else args.engine,
        device=args.device,
        tokens=args.tokens or (LESSON_TOKENS if args.lesson else default_tokens),
        prompt=argv_text(args.prompt),  # bytes that were not UTF-8 become U+FFFD
        seed=args.seed,
        greedy=args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        threads=args.threads,
        replay_speed=args.replay_speed,
        lesson=args.lesson,
        kv_budget_bytes=args.kv_budget,
        kv_block_tokens=args.kv_block,
        gpu_memory_utilization=args.gpu_memory_utilization,
        batch=getattr(args, "batch", 1),  # bench's --batch is a list (`batches`): one run each
    )


def cmd_bench(args: argparse.Namespace) -> int:
    """Both loops on one prompt, measured; a table, or `--json`. `--batch` with several sizes
    runs one bench per size: a line each, or `{"sweep": [summary, ...]}`."""
    from kvtui.engine.bench import format_sweep, format_table, run_bench, run_sweep

    batches = args.batches
    settings = settings_from_args(args, default_tokens=256)
    if len(batches) > 1 and args.record:
        raise UsageError("kvtui bench: error: --record records one run: give --batch one size")
    progress = (
        (lambda line: print(f"\r{line}   ", end="", file=sys.stderr, flush=True))
        if sys.stderr.isatty()
        else (lambda line: None)
    )
    try:
        if len(batches) == 1:
            settings = replace(settings, batch=batches[0])
            result = run_bench(settings, record=args.record, force=args.force, progress=progress)
        else:
            result = run_sweep(settings, batches, progress=progress)
    except EngineError as exc:
        raise UsageError(f"kvtui bench: {exc}") from None
    finally:
        if sys.stderr.isatty():
            print("\r", end="", file=sys.stderr)
    if args.json:
        _print_json(result)
    else:
        print(format_sweep(result) if "sweep" in result else format_table(result))
    if args.record:
        record = safe_text(str(args.record), one_line=True)
        _say(f"recorded to {record}; replay with --engine replay:{record}")
    return 0


def _add_bench(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="measure the cached and uncached loops on one prompt")
    _add_run_options(p, app=False)
    p.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="write every step as JSON lines, for replay:FILE (written whole when the run ends, "
        "Ctrl-C included; never over an existing file without --force, never through a link)",
    )
    p.add_argument("--force", action="store_true", help="let --record replace an existing file")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_bench)


def _add_serve(subparsers: Any) -> None:
    from kvtui.serve import add_parser  # its parser and handler; textual-serve only when serving

    add_parser(subparsers)


SUBCOMMANDS: list[Callable[[Any], None]] = [
    _add_work,
    _add_budget,
    _add_models,
    _add_gpus,
    _add_bench,
    _add_serve,
]
"""Builders of the subcommands' parsers, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: app options at the top level, then one parser per subcommand."""
    parser = _Parser(
        prog="kvtui",
        description="See, and measure, why LLM decoding needs a KV cache.",
        epilog="With no subcommand, kvtui opens the app.",
    )
    parser.add_argument("--version", action="version", version=f"kvtui {__version__}")
    _add_run_options(parser.add_argument_group("app options (no subcommand)"), app=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def _say(line: str) -> None:
    """One line on stderr, where a closed or full stderr is not worth a traceback."""
    with contextlib.suppress(OSError, ValueError):
        print(safe_text(line, one_line=True), file=sys.stderr)


class _OutputError(Exception):
    """Writing to stdout failed (a full disk, a closed descriptor): one line, exit status 2."""


def _flush_stdout() -> None:
    if sys.stdout is None:  # started with stdout closed: what was printed went nowhere
        return
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as exc:
        raise _OutputError(getattr(exc, "strerror", None) or str(exc)) from None


def _abandon_stdout() -> None:
    """Point stdout's descriptor at /dev/null, so that the interpreter's own last flush of what
    is still buffered succeeds, rather than printing "Exception ignored" and exiting 120."""
    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status is returned, not raised. Bad input, and output
    that cannot be written, are one line on stderr (control characters escaped) and exit 2."""
    if hasattr(sys.stdout, "reconfigure"):  # a character the terminal cannot show is escaped
        with contextlib.suppress(ValueError, io.UnsupportedOperation):
            sys.stdout.reconfigure(errors="backslashreplace")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        handler = getattr(args, "handler", None) or cmd_app
        code = handler(args)
        _flush_stdout()
        return code
    except UsageError as exc:
        _say(str(exc))
        return EXIT_USAGE
    except (UnknownNameError, ConfigError) as exc:
        _say(f"kvtui: error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        _say(f"kvtui: {exc}" if str(exc) else "kvtui: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `kvtui bench | head`: the reader left, nothing more to say
        _abandon_stdout()
        return 0
    except _OutputError as exc:
        _abandon_stdout()
        _say(f"kvtui: error: cannot write the output: {exc}")
        return EXIT_USAGE
    except OSError as exc:
        if exc.errno not in _OUTPUT_ERRNOS:
            raise
        _abandon_stdout()  # print() found stdout full or gone mid-way
        _say(f"kvtui: error: cannot write the output: {exc.strerror}")
        return EXIT_USAGE
    except SystemExit as exc:  # --help and --version print and exit 0
        try:
            _flush_stdout()
        except (_OutputError, BrokenPipeError):
            _abandon_stdout()
        return exc.code if isinstance(exc.code, int) else 0


_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EBADF, errno.EIO, errno.EFBIG, errno.EDQUOT}
"""What print() raises when stdout is a full disk, a closed descriptor or a lost terminal."""
