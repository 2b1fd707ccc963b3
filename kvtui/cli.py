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
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvtui import __version__
from kvtui.engine.protocol import DEFAULT_PROMPT, EngineError, RunSettings
from kvtui.format import (
    format_bandwidth,
    format_bytes,
    format_flops_rate,
    format_int,
    format_params,
    format_percent,
    format_ratio,
)
from kvtui.sim.catalog import (
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
    """An argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}")
    return value


def dtype_arg(text: str) -> str:
    """An argparse type: a storage format (fp32, bf16, fp16, fp8, int4 or a torch spelling)."""
    try:
        return normalize_dtype(text)
    except UnknownNameError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --- output helpers ------------------------------------------------------------------------------


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


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
    """`kvtui budget`: weights + KV cache + runtime reserve against one GPU."""
    spec = model_from_hf_config(args.config) if args.config else get_model(args.model)
    gpu = get_gpu(args.gpu)
    b = budget(spec, gpu, args.context, args.batch, args.kv_dtype, args.weights_dtype)
    if args.json:
        _print_json(b.to_json())
        return 0
    print(
        f"{b.model_label} on the {b.gpu_label}: batch {b.batch} x {format_int(b.context_tokens)} "
        f"tokens, KV cache in {b.kv_dtype}, weights in {b.weights_dtype}"
    )
    per_token = f"{format_int(b.kv_bytes_per_token)} bytes/token"
    print(
        _table(
            ["", "bytes", "of VRAM"],
            [
                [
                    f"weights ({b.weights_dtype})",
                    format_bytes(b.weights_bytes),
                    format_percent(b.weights_bytes / b.vram_bytes),
                ],
                [
                    f"KV cache ({per_token})",
                    format_bytes(b.kv_bytes),
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
    print(
        f"{format_bytes(b.kv_bytes)} of KV on {_article(vram)} {vram} GPU is "
        f"{format_percent(b.kv_fraction_of_vram)}; the whole budget {verdict}."
    )
    if b.max_context_tokens is None:
        print("Longest context that fits: any (every layer's sliding window fits).")
    elif b.max_context_tokens == 0:
        print("Longest context that fits: none, not even one token.")
    else:
        print(f"Longest context that fits: {format_int(b.max_context_tokens)} tokens.")
    for line in b.advice:
        print(f"- {line}")
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
    from kvtui.app import run_app

    return int(run_app(settings, screen=args.screen, length=args.length) or 0)


DEFAULT_APP_TOKENS = 256
"""Tokens the app's run generates unless `--tokens` says otherwise."""


# --- the parser ----------------------------------------------------------------------------------


def _add_work(subparsers: Any) -> None:
    p = subparsers.add_parser("work", help="positions computed with and without a KV cache")
    p.add_argument("--length", type=positive_int, required=True, help="tokens generated (n)")
    p.add_argument(
        "--prompt",
        dest="prompt_tokens",
        type=positive_int,
        default=1,
        metavar="P",
        help="prompt tokens before them (default 1: the lesson's figures)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_work)


def _add_budget(subparsers: Any) -> None:
    p = subparsers.add_parser("budget", help="does a model's KV cache fit on a GPU?")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help=f"a catalog model: {', '.join(model_names())}")
    which.add_argument("--config", metavar="PATH", help="a Hugging Face config.json")
    p.add_argument("--gpu", required=True, help=f"a catalog GPU: {', '.join(gpu_names())}")
    p.add_argument("--context", type=positive_int, required=True, help="tokens per sequence")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences held at once")
    dtypes = ", ".join(dtype_names())
    p.add_argument("--kv-dtype", type=dtype_arg, default="bf16", help=f"KV cache: {dtypes}")
    p.add_argument("--weights-dtype", type=dtype_arg, default="bf16", help=f"weights: {dtypes}")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_budget)
    p.epilog = f"The runtime reserve is {format_bytes(RUNTIME_RESERVE_BYTES)}."


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
        "--engine", default="tiny", help="tiny (default), shape:MODEL, sim:MODEL@GPU or replay:FILE"
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
    group.add_argument("--tokens", type=positive_int, default=None, help="tokens to generate")
    group.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    group.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    group.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    group.add_argument(
        "--temperature", type=positive_float, default=0.8, help="sampling temperature (default 0.8)"
    )
    group.add_argument(
        "--top-k", type=positive_int, default=40, help="sample from the k likeliest (default 40)"
    )
    group.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads in the engine (default 1)"
    )
    group.add_argument(
        "--replay-speed",
        type=float,
        default=1.0,
        help="replay:/sim: pace, 1 = recorded or roofline time, 0 = as fast as possible",
    )
    if app:
        group.add_argument(
            "--screen", type=int, choices=[1, 2, 3], default=1, help="the screen to open first"
        )
        group.add_argument(
            "--length", type=positive_int, default=24, help="answer length on screen 1 (default 24)"
        )


def settings_from_args(args: argparse.Namespace, default_tokens: int) -> RunSettings:
    """The plain, picklable settings of a run, from the parsed options."""
    return RunSettings(
        engine=f"hf:{args.model}" if args.model else args.engine,
        device=args.device,
        tokens=args.tokens or default_tokens,
        prompt=args.prompt,
        seed=args.seed,
        greedy=args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        threads=args.threads,
        replay_speed=args.replay_speed,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    """Both loops on one prompt, measured; a table, or `--json`."""
    from kvtui.engine.bench import format_table, run_bench

    settings = settings_from_args(args, default_tokens=256)
    progress = (
        (lambda line: print(f"\r{line}   ", end="", file=sys.stderr, flush=True))
        if sys.stderr.isatty()
        else (lambda line: None)
    )
    try:
        result = run_bench(settings, record=args.record, progress=progress)
    except EngineError as exc:
        raise UsageError(f"kvtui bench: {exc}") from None
    except OSError as exc:
        raise UsageError(f"kvtui bench: cannot write {args.record}: {exc.strerror}") from None
    if sys.stderr.isatty():
        print("\r", end="", file=sys.stderr)
    if args.json:
        _print_json(result)
    else:
        print(format_table(result))
    if args.record:
        print(
            f"recorded to {args.record}; replay with --engine replay:{args.record}", file=sys.stderr
        )
    return 0


def _add_bench(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="measure the cached and uncached loops on one prompt")
    _add_run_options(p, app=False)
    p.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="write every step as JSON lines, for replay:FILE",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_bench)


SUBCOMMANDS: list[Callable[[Any], None]] = [
    _add_work,
    _add_budget,
    _add_models,
    _add_gpus,
    _add_bench,
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status is returned, not raised."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        handler = getattr(args, "handler", None) or cmd_app
        return handler(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except (UnknownNameError, ConfigError) as exc:
        print(f"kvtui: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `kvtui bench | head`: the reader left, nothing more to say
        sys.stdout = None
        return 0
    except SystemExit as exc:  # --help and --version print and exit 0
        return exc.code if isinstance(exc.code, int) else 0
