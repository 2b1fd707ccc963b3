"""The `kvtui` command: argparse -> plain values -> the app or a headless command.

`kvtui` alone opens the Textual app (imported only then); `kvtui bench` runs both loops headless;
`kvtui serve` serves the app in a browser (kvtui.serve); `kvtui work`, `budget`, `models` and
`gpus` print the simulator's figures (kvtui.reports.sim); `kvtui export-hf` and `kvtui load` are for
watching a real vLLM server (kvtui.reports.served). The options and their types live in
kvtui.options. Bad input is one line on stderr and exit status 2, never a traceback; stdout that
closes or fills is said once. Importing this module stays cheap: no torch, no textual.

To add a subcommand: write `cmd_NAME(args) -> int`, and an `add_NAME(subparsers)` that builds its
parser and calls `set_defaults(handler=cmd_NAME)`; list it in `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from kvtui import __version__, collector
from kvtui.engines.protocol import DEFAULT_PROMPT
from kvtui.errors import EngineError
from kvtui.format import (
    safe_text,
)
from kvtui.inputs import argv_text
from kvtui.options import (
    DEFAULT_APP_TOKENS,
    LOOP_CHOICES,
    GivenOnce,
    Parser,
    UsageError,
    add_run_options,
    check_kv_events,
    int_in,
    output_path,
    quality_bytes,
    settings_from_args,
)
from kvtui.paths import HELDOUT_BYTES, cache_dir
from kvtui.reports.served import add_export_hf, add_load
from kvtui.reports.sim import add_budget, add_gpus, add_models, add_work, print_json
from kvtui.sim.catalog import (
    ConfigError,
    UnknownNameError,
)
from kvtui.sim.tricks import QUALITY_BYTES

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
"""128 + SIGTERM: a command SIGTERM ended after its own cleanup (`_terminate_as_interrupt`)."""
CLEAN_ON_TERMINATE = ("bench", "tricks", "export-hf", "load")
"""The commands that write a file whole or not at all, or hold requests open on a server: a
SIGTERM (`timeout`, a supervisor, a closed session) ends them as Ctrl-C does, through their own
cleanup (a record kept whole, no temporary file or folder left, the requests closed)."""
"""Ctrl-C, as a shell reports it (128 + SIGINT)."""


def cmd_app(args: argparse.Namespace) -> int:
    """`kvtui` with no subcommand: open the Textual app (imported only now). Its title card is
    on the terminal first, moving, while the app imports and draws its first frame (`TitleCard`):
    the better part of a second that was a blank terminal. Python's collector is held until the
    app's first frame (kvtui.collector)."""
    card = TitleCard() if has_terminal() else None
    try:
        collector.hold()
        from kvtui.engines.factory import check_engine

        settings = settings_from_args(args, default_tokens=DEFAULT_APP_TOKENS)
        check_kv_events(args.kv_events, settings)  # before the engine's checks ask the server
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

        if card is not None:
            card.stop()  # before the app draws: one writer on the terminal at a time
        code = run_app(
            settings,
            screen=args.screen,
            present=args.present,
            theme=args.theme,
            kv_events=args.kv_events,
        )
    finally:
        collector.release(freeze=False)  # where the app ended before its first frame
        if card is not None:
            card.close()
    return int(code or 0)


class TitleCard:
    """kvtui's title card (kvtui.bigtext.title_card, as presenter mode's first slide draws it)
    on the terminal where the app will draw, drawn before the app's imports and its waiting line
    turning while they run (the better part of a second, longer on a busy machine): a person, or
    a room, sees the title, moving, within moments of launch, then the app's first frame. Not for
    `kvtui serve`'s web driver, whose stream carries its own protocol, nor where stderr is no
    terminal."""

    SHOW = "\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J"
    """The terminal's alternate screen (where the app draws), cursor hidden, cleared."""
    LEAVE = "\x1b[?25h\x1b[?1049l"
    SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
    TURN_S = 0.1
    SMALLEST = (20, 5)
    """The fewest columns and rows the card is drawn in."""

    def __init__(self) -> None:
        import threading

        self.shown = "TEXTUAL_DRIVER" not in os.environ and sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        size = os.get_terminal_size(sys.stderr.fileno()) if self.shown else None
        if size is None or size.columns < self.SMALLEST[0] or size.lines < self.SMALLEST[1]:
            self.shown = False  # a terminal too small for it (or one that says 0x0): the app only
            return
        from kvtui.bigtext import kept_title_card

        self._width, self._row = size.columns, size.lines - 1
        lines = [
            f"\x1b[1m{line.text}\x1b[0m" if line.kind in ("title", "subtitle") else line.text
            for line in kept_title_card(size.columns, size.lines, cache_dir())
        ]
        sys.stderr.write(self.SHOW + "\r\n".join(lines))
        self._turn(0)
        self._thread = threading.Thread(target=self._spin, name="kvtui-title", daemon=True)
        self._thread.start()

    def _turn(self, frame: int) -> None:
        line = f"{self.SPINNER[frame % len(self.SPINNER)]} starting kvtui..."
        sys.stderr.write(f"\x1b[{self._row};1H\x1b[2K{line.center(self._width).rstrip()}")
        sys.stderr.flush()

    def _spin(self) -> None:
        frame = 0
        while not self._stop.wait(self.TURN_S):
            frame += 1
            self._turn(frame)

    def stop(self) -> None:
        """Stop the waiting line (the card stays until the app's first frame covers it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Stop, and leave the terminal as it was (the app leaves its screen so too; twice is
        harmless)."""
        self.stop()
        if self.shown:
            sys.stderr.write(self.LEAVE)
            sys.stderr.flush()


def has_terminal() -> bool:
    """Whether the app has a terminal to draw on: stdin, stdout and stderr (where Textual's
    Linux driver draws) are one, or `kvtui serve`'s web driver (textual-serve sets
    TEXTUAL_DRIVER) stands in for it."""
    streams = (sys.stdin, sys.stdout, sys.stderr)
    return "TEXTUAL_DRIVER" in os.environ or all(s is not None and s.isatty() for s in streams)


# --- the parser ----------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    """Both loops on one prompt, measured; a table, or `--json`. `--batch` with several sizes
    runs one bench per size: a line each, or `{"sweep": [summary, ...]}`."""
    from kvtui.reports.bench import run_bench, run_sweep
    from kvtui.reports.bench_text import format_sweep, format_table

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
            result = run_bench(
                settings,
                record=args.record,
                force=args.force,
                progress=progress,
                quality_bytes=args.quality_bytes,
            )
        else:
            result = run_sweep(settings, batches, progress=progress)
    except EngineError as exc:
        raise UsageError(f"kvtui bench: {exc}") from None
    finally:
        if sys.stderr.isatty():
            print("\r", end="", file=sys.stderr)
    if args.json:
        print_json(result)
    else:
        print(format_sweep(result) if "sweep" in result else format_table(result))
    if args.record:
        record = safe_text(str(args.record), one_line=True)
        _say(f"recorded to {record}; replay with --engine replay:{record}")
    return 0


def _add_bench(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="measure the cached and uncached loops on one prompt")
    add_run_options(p, app=False)
    p.add_argument(
        "--loops",
        choices=list(LOOP_CHOICES),
        default="both",
        help="which loops run (default both; the uncached loop cannot go past the model's "
        "positions, and at 16,384 tokens it would take hours)",
    )
    p.add_argument(
        "--record",
        type=output_path,
        metavar="FILE",
        help="write every step as JSON lines, for replay:FILE (written whole when the run ends, "
        "Ctrl-C included; never over an existing file without --force, never through a link)",
    )
    p.add_argument("--force", action="store_true", help="let --record replace an existing file")
    p.add_argument(
        "--quality-bytes",
        type=quality_bytes,
        default=None,
        metavar="N",
        help="measure what each loop's KV cache costs in quality on N bytes of held-out Austen "
        f"(tiny only; default {QUALITY_BYTES:,} with a KV-cache trick, else none; 0: none; at "
        f"most {HELDOUT_BYTES:,})",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_bench)


def cmd_tricks(args: argparse.Namespace) -> int:
    """Every trick that stretches the KV cache, run on one model under one budget: a table, or
    `--json`."""
    from kvtui.engines.protocol import RunSettings
    from kvtui.reports.table import TABLE_TOKENS, run_table, table_header
    from kvtui.reports.tricks import format_tricks

    settings = RunSettings(
        engine=args.engine,
        device=args.device,
        tokens=args.tokens or TABLE_TOKENS,
        prompt=argv_text(args.prompt),
        threads=args.threads,
        kv_budget_bytes=args.kv_budget,
        kv_block_tokens=args.kv_block,
        replay_speed=0,
    )
    progress = (
        (lambda line: print(f"\r{line[:76]:<76}", end="", file=sys.stderr, flush=True))
        if sys.stderr.isatty()
        else (lambda line: None)
    )
    try:
        header = table_header(settings)
        by_key = {  # a row comes again once its speed is timed in turns
            row["key"]: row
            for row in run_table(settings, quality_bytes=args.quality_bytes, progress=progress)
        }
        rows = list(by_key.values())
    except EngineError as exc:
        raise UsageError(f"kvtui tricks: {exc}") from None
    finally:
        if sys.stderr.isatty():
            print("\r" + " " * 78 + "\r", end="", file=sys.stderr)
    if args.json:
        print_json({**header, "rows": rows})
    else:
        print(format_tricks(header, rows))
    return 0


def _add_tricks(subparsers: Any) -> None:
    from kvtui.options import MAX_THREADS, kv_budget
    from kvtui.sim.pool import DEFAULT_BLOCK_SIZE, MAX_KV_BLOCK_TOKENS

    p = subparsers.add_parser(
        "tricks", help="the tricks that stretch the KV cache, each measured on the live model"
    )
    p.add_argument(
        "--engine",
        default="tiny",
        action=GivenOnce,
        help="tiny (default), shape:MODEL or sim:MODEL@GPU",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--tokens",
        type=int_in(1, 2**18),
        default=None,
        help="tokens each row asks for (default 768: past where fp8 stops on the default pool)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--threads", type=int_in(1, MAX_THREADS), default=1)
    p.add_argument(
        "--kv-budget",
        type=kv_budget,
        default=None,
        metavar="SIZE",
        help="the KV pool every row shares (default: the power of two that holds 160 tokens "
        "of the plain cache; 512 KiB for tiny)",
    )
    p.add_argument(
        "--kv-block",
        "--block-size",
        dest="kv_block",
        type=int_in(1, MAX_KV_BLOCK_TOKENS),
        default=DEFAULT_BLOCK_SIZE,
        metavar="TOKENS",
    )
    p.add_argument(
        "--quality-bytes",
        type=quality_bytes,
        default=QUALITY_BYTES,
        metavar="N",
        help=f"held-out bytes each trick's quality is measured on (default {QUALITY_BYTES:,}; "
        "0: none)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_tricks)


def _add_serve(subparsers: Any) -> None:
    from kvtui.serve import add_parser  # its parser and handler; textual-serve only when serving

    add_parser(subparsers)


SUBCOMMANDS: list[Callable[[Any], None]] = [
    add_work,
    add_budget,
    add_models,
    add_gpus,
    _add_bench,
    _add_tricks,
    _add_serve,
    add_export_hf,
    add_load,
]
"""Builders of the subcommands' parsers, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: app options at the top level, then one parser per subcommand."""
    parser = Parser(
        prog="kvtui",
        description="See, and measure, why LLM decoding needs a KV cache.",
        epilog="With no subcommand, kvtui opens the app.",
    )
    parser.add_argument("--version", action="version", version=f"kvtui {__version__}")
    add_run_options(parser.add_argument_group("app options (no subcommand)"), app=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
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


class _ClosedOutput(io.TextIOBase):
    """Standard output the shell closed (`>&-`): what is printed cannot be given, so writing
    fails as a closed descriptor does (one line, exit 2), rather than vanishing with exit 0."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")


def _reopen_closed_streams() -> None:
    """A standard stream the shell closed (`<&-`, `>&-`, `2>&-`) is opened on /dev/null, so that
    no file kvtui opens later takes its descriptor (a record would receive what a library writes
    to stderr); then stdin reads nothing, stderr's lines go nowhere, and stdout refuses what is
    printed (`_ClosedOutput`)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # the lowest free descriptor: fd itself unless a lower one is closed
                os.dup2(null, fd)
                os.close(null)
    if sys.stdin is None:
        sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 - for the process's life
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    if sys.stdout is None:
        sys.stdout = _ClosedOutput()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status is returned, not raised. Bad input, and output
    that cannot be written, are one line on stderr (control characters escaped) and exit 2."""
    _reopen_closed_streams()
    if hasattr(sys.stdout, "reconfigure"):  # a character the terminal cannot show is escaped
        with contextlib.suppress(ValueError, io.UnsupportedOperation):
            sys.stdout.reconfigure(errors="backslashreplace")
    parser = build_parser()
    terminated: list[int] = []
    try:
        args = parser.parse_args(argv)
        handler = getattr(args, "handler", None) or cmd_app
        with _terminate_as_interrupt(args.command in CLEAN_ON_TERMINATE, terminated):
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
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
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
        except BrokenPipeError:
            _abandon_stdout()
        except _OutputError as error:
            _abandon_stdout()
            _say(f"kvtui: error: cannot write the output: {error}")
            return EXIT_USAGE
        return exc.code if isinstance(exc.code, int) else 0


@contextlib.contextmanager
def _terminate_as_interrupt(enabled: bool, terminated: list[int]) -> Iterator[None]:
    """While it holds (and `enabled`), SIGTERM raises KeyboardInterrupt in the main thread, as
    Ctrl-C does, so that the command's own cleanup runs (Python's default ends the process at
    once: a record's `.part` file or an export's scratch folder stayed behind); `terminated`
    gets the signal's number."""

    def interrupt(signum: int, frame: Any) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt("terminated")

    try:
        before = signal.signal(signal.SIGTERM, interrupt) if enabled else None
    except ValueError:  # not the main thread (a test calling main): left as it is
        before = None
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EBADF, errno.EIO, errno.EFBIG, errno.EDQUOT}
"""What print() raises when stdout is a full disk, a closed descriptor or a lost terminal."""
