"""The simulator's headless commands, without a UI: `kvtui work`, `budget`, `models` and `gpus`,
their parsers and handlers. Each prints a table or, with `--json`, JSON; bad input is one line on
stderr and exit status 2 (kvtui.options)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kvtui.format import (
    format_bandwidth,
    format_bytes,
    format_flops_rate,
    format_int,
    format_params,
    format_percent,
    format_ratio,
    safe_text,
)
from kvtui.options import MAX_BATCH, MAX_CONTEXT, UsageError, dtype_arg, int_in, utilization
from kvtui.sim.catalog import (
    activation_dtype,
    dtype_names,
    get_gpu,
    get_model,
    gpu_names,
    model_names,
)
from kvtui.sim.hf_config import model_from_hf_config
from kvtui.sim.memory import RUNTIME_RESERVE_BYTES, kv_bytes_per_token
from kvtui.sim.tricks import KV_CACHE_DTYPES, KVLayout
from kvtui.sim.work import cached_step_positions, work_summary

# --- output helpers ------------------------------------------------------------------------------


def print_json(data: Any) -> None:
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
        print_json(s.to_json())
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
    from kvtui.sim.budget import budget
    from kvtui.sim.parallel import kv_head_copies, tensor_parallel_problem
    from kvtui.sim.pool import kv_capacity

    spec = model_from_hf_config(args.config) if args.config else get_model(args.model)
    gpu = get_gpu(args.gpu)
    if args.kv_cache_dtype is not None:  # vLLM's flag: auto is the dtype the model computes in
        layout = KVLayout(cache_dtype=args.kv_cache_dtype)
        args.kv_dtype = layout.storage_dtype(activation_dtype(args.weights_dtype))
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
        print_json({**b.to_json(), **served})
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
    longest, memory = b.longest_context_tokens, b.max_context_tokens
    if longest is None:
        print("Longest context that fits: any (every layer's sliding window fits).")
    elif longest == 0:
        print("Longest context that fits: none, not even one token.")
    elif b.longest_context_limit == "positions":
        held = "any length" if memory is None else f"{format_int(memory)} tokens"
        print(
            f"Longest context that fits: {format_int(longest)} tokens, the model's own positions "
            f"(memory would hold {held})."
        )
    else:
        print(f"Longest context that fits: {format_int(longest)} tokens (memory binds).")
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
        print_json(
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
        print_json([gpu.to_json() for gpu in gpus])
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


def add_work(subparsers: Any) -> None:
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


def add_budget(subparsers: Any) -> None:
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
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-dtype", type=dtype_arg, default="bf16", help=f"KV cache: {dtypes}")
    kv.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="the KV cache as vLLM's flag says: auto (the dtype the model computes in: the "
        "weights', or bf16 beside 8-bit and 4-bit weights), fp8, or int8 (codes and an fp16 "
        "scale per token and head, counted)",
    )
    p.add_argument("--weights-dtype", type=dtype_arg, default="bf16", help=f"weights: {dtypes}")
    from kvtui.sim.parallel import MAX_TENSOR_PARALLEL
    from kvtui.sim.pool import DEFAULT_BLOCK_SIZE, DEFAULT_GPU_MEMORY_UTILIZATION

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


def add_models(subparsers: Any) -> None:
    p = subparsers.add_parser("models", help="the model catalog")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_models)


def add_gpus(subparsers: Any) -> None:
    p = subparsers.add_parser("gpus", help="the GPU catalog")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_gpus)
