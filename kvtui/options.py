"""The command line's values, without a UI: argparse types that refuse a bad value in one line
(exit 2, never a traceback), the run options the app, `kvtui bench` and `kvtui serve` share, and
the plain `RunSettings` they become. Cheap to import: no torch, no textual."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NoReturn

from kvtui.engines.factory import parse_engine
from kvtui.engines.protocol import (
    DEFAULT_PROMPT,
    LOOPS,
    MAX_RUN_BATCH,
    MAX_TOKENS,
    Loop,
    RunSettings,
)
from kvtui.errors import EngineError
from kvtui.format import (
    format_bytes,
    parse_bytes,
)
from kvtui.inputs import InputError, argv_text, output_file, user_path
from kvtui.paths import HELDOUT_BYTES
from kvtui.sim.catalog import UnknownNameError, normalize_dtype
from kvtui.sim.hf_config import MAX_SIZE

MAX_CONTEXT = MAX_SIZE
"""The longest context `work` and `budget` take: 16,777,216 tokens, as long as a config may state
(kvtui.sim.hf_config.MAX_SIZE); past Llama 4 Scout's 10M, the longest published."""
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
THEMES = {"dark": "textual-dark", "light": "textual-light"}
"""`--theme`'s choices and the Textual themes they open with: the two whose rendered contrast
kvtui's tests measure (tests/screens/test_contrast.py)."""


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageErrors, so `main` reports them in one line."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}")

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        """argparse's, without its silence when the write fails: `--help` into a full disk or a
        closed stdout is then one line and exit 2 (kvtui.cli.main), not exit 0."""
        if message:
            (file or sys.stderr).write(message)


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


def quality_bytes(text: str) -> int:
    """An argparse type: bytes of held-out text a quality is measured on (`--quality-bytes`):
    0 (none) or 2 to all of it (one byte has no next byte to predict)."""
    try:
        value = int_in(0, HELDOUT_BYTES)(text)
    except argparse.ArgumentTypeError:
        value = 1
    if value == 1:
        what = f"0 (none) or an integer from 2 to {HELDOUT_BYTES:,}"
        raise argparse.ArgumentTypeError(f"expected {what}, not {_shown(text)}")
    return value


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


def output_path(text: str) -> Path:
    """An argparse type: a file to write (kvtui.inputs.output_file), one line if it cannot be."""
    try:
        return output_file(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def folder_path(text: str) -> Path:
    """An argparse type: a folder to write, as a person typed it (kvtui.inputs.user_path), not
    empty: `Path("")` is the current folder, which an empty argument (`DIR=` unset) never means."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names no folder (. is this one)")
    try:
        return user_path(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def dtype_arg(text: str) -> str:
    """An argparse type: a storage format (fp32, bf16, fp16, fp8, int4 or a torch spelling)."""
    try:
        return normalize_dtype(text)
    except UnknownNameError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class GivenOnce(argparse.Action):
    """An option that may be given once: a second one is an error (argparse's own `store` lets
    the last win, silently), and says how to give several servers instead."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        seen = f"_{self.dest}_given"
        if getattr(namespace, seen, None) is not None:
            parser.error(
                f"argument {option_string}: given twice ({str(getattr(namespace, seen))[:60]!r}, "
                f"then {str(values)[:60]!r}); give it once (several vLLM servers: "
                "vllm:URL1,URL2,...)"
            )
        setattr(namespace, seen, values)
        setattr(namespace, self.dest, values)


DEFAULT_APP_TOKENS = 256
"""Tokens the app's run generates unless `--tokens` says otherwise."""
LESSON_TOKENS = 24
"""Tokens a `--lesson` run generates unless `--tokens` says otherwise: the lesson's example."""


def add_run_options(group: Any, *, app: bool) -> None:
    """The options of a decode run, shared by the app and `kvtui bench`."""
    group.add_argument(
        "--engine",
        default="tiny",
        action=GivenOnce,
        help="tiny (default), shape:MODEL, sim:MODEL@GPU, sim:MODEL@NxGPU, replay:FILE or "
        "vllm:URL (a running vLLM server, watched; vllm:URL1,URL2,... a fleet of replicas, "
        "the decode on the first)",
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
    from kvtui.sim.pool import (
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
    add_layout_options(group)
    if app:
        group.add_argument(
            "--kv-events",
            type=kv_events_endpoint,
            default=None,
            metavar="ENDPOINT",
            help="with --engine vllm:URL: tcp://HOST:PORT, where the server publishes its KV cache "
            "events (its --kv-events-config endpoint; kvtui binds it), and ,replay=tcp://HOST:PORT "
            "its replay_endpoint, if it has one; screen 2 draws its prefix cache from them (needs "
            "kvtui[vllm])",
        )
        group.add_argument(
            "--batch",
            type=one_batch,
            default=1,
            help="sequences decoded together, the same prompt in each, row r sampled with seed "
            f"SEED + r (default 1; at most {MAX_RUN_BATCH}; tiny, shape: and sim: only)",
        )
        group.add_argument(
            "--screen", type=int, choices=[1, 2, 3, 4], default=1, help="the screen to open first"
        )
        group.add_argument(
            "--present",
            action="store_true",
            help="presenter mode: the lesson one idea at a time, large figures (p toggles it)",
        )
        group.add_argument(
            "--theme",
            choices=list(THEMES),
            default="dark",
            help="the colours to open with (default dark; light for a projector in a bright "
            "room); the palette's Theme command changes them while the app runs",
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


def add_layout_options(group: Any) -> None:
    """How the cached loop keeps its KV cache: the tricks that stretch it (kvtui.sim.tricks),
    by vLLM's flag names where vLLM has one."""
    from kvtui.sim.tricks import KV_CACHE_DTYPES

    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="what the KV cache stores: auto (the model's dtype), fp8 (e4m3, vLLM's scale of 1) "
        "or int8 (a scale per token and head); kvtui's own engines",
    )
    group.add_argument(
        "--kv-window",
        type=int_in(1, MAX_TOKENS),
        default=None,
        metavar="W",
        help="keep W positions per sequence, the first --kv-sinks and the latest (StreamingLLM): "
        "blocks out of the window go back to the pool; with --loops cached a run goes past the "
        "model's positions",
    )
    group.add_argument(
        "--kv-sinks",
        type=int_in(0, MAX_TOKENS),
        default=0,
        metavar="S",
        help="the first S positions a --kv-window always keeps (default 0; StreamingLLM used 4)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="a batch's sequences share the full blocks of their prompt (vLLM's flag): hashed "
        "blocks held once, the last prompt block computed by each",
    )
    group.add_argument(
        "--kv-heads",
        type=int_in(1, 1024),
        default=None,
        metavar="N",
        help="average the model's key/value heads into N without retraining (1: multi-query "
        "attention); N must divide them",
    )


def kv_events_endpoint(text: str) -> str:
    """--kv-events: a tcp://HOST:PORT to bind, the server's replay socket and its data-parallel
    ranks where given (kvtui.engines.vllm.events.parse_events), as kvtui writes them."""
    from kvtui.engines.vllm.events import EventsError, events_text, parse_events

    try:
        return events_text(*parse_events(argv_text(text)))
    except EventsError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv-events ")) from None


def check_kv_events(endpoint: str | None, settings: RunSettings) -> None:
    """--kv-events beside a served engine, with pyzmq and msgpack here and the endpoint free to
    bind: else one line (UsageError)."""
    if endpoint is None:
        return
    try:
        served = parse_engine(settings.engine).can.served
    except EngineError:
        served = False
    if not served:
        raise UsageError(
            "kvtui: --kv-events is for a server's events: give it beside --engine vllm:URL"
        )
    from kvtui.engines.vllm.events import EventsError, check_bind, parse_events, require_libraries

    try:
        require_libraries()
        first, _, ranks = parse_events(endpoint)
        for rank in range(ranks):
            check_bind(first.for_rank(rank))
    except EventsError as exc:
        raise UsageError(f"kvtui: {exc}") from None


def settings_from_args(args: argparse.Namespace, default_tokens: int) -> RunSettings:
    """The plain, picklable settings of a run, from the parsed options. A `vllm:` server's run
    has one loop, the cached one: a server keeps its KV cache."""
    engine = f"hf:{args.model}" if args.model else args.engine
    try:
        served = parse_engine(str(engine)).can.served
    except EngineError:  # refused with its own words when the run is checked
        served = False
    return RunSettings(
        engine=engine,
        loops=("cached",) if served else LOOP_CHOICES[getattr(args, "loops", "both")],
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
        kv_cache_dtype=args.kv_cache_dtype,
        kv_window=args.kv_window,
        kv_sinks=args.kv_sinks,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_heads=args.kv_heads,
    )


LOOP_CHOICES: dict[str, tuple[Loop, ...]] = {
    "both": LOOPS,
    "cached": ("cached",),
    "uncached": ("uncached",),
}
"""`kvtui bench --loops`: which loops run."""
