"""The commands for watching a real serving engine, without a UI: `kvtui export-hf DIR` (the
shipped model as a Hugging Face checkpoint a server can load) and `kvtui load URL` (a bounded
load on a server, to fill its KV cache). Their parsers and handlers; the work is in
kvtui.gpu.export (torch, imported only when exporting) and kvtui.engines.vllm.load (plain HTTP).
Bad input is one line on stderr and exit status 2 (kvtui.options)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtui.errors import EngineError
from kvtui.format import format_bytes, format_int, safe_text
from kvtui.options import UsageError, float_in, folder_path, int_in
from kvtui.reports.sim import print_json


def cmd_export_hf(args: argparse.Namespace) -> int:
    """`kvtui export-hf DIR`: write the shipped model as a `LlamaForCausalLM` checkpoint."""
    from kvtui.gpu.export import export_hf

    try:
        export = export_hf(args.directory, force=args.force)
    except EngineError as exc:
        raise UsageError(f"kvtui export-hf: {exc}") from None
    where = safe_text(str(export.directory), one_line=True)
    print(
        f"wrote {where}: a LlamaForCausalLM of {format_int(export.params)} parameters "
        f"({format_bytes(export.weights_bytes)} of float32 safetensors), a byte-level tokenizer "
        "(ids are bytes), no eos token"
    )
    print(f"  transformers: AutoModelForCausalLM.from_pretrained({str(export.directory)!r})")
    print(f"  kvtui:        kvtui --model {where}")
    print(
        f"  vLLM:         python -m vllm.entrypoints.openai.api_server --model {where} "
        "--dtype float32"
    )
    return 0


def add_export_hf(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export-hf",
        help="write the shipped model as a Hugging Face Llama checkpoint (for transformers, vLLM)",
        description="Write tiny-austen as a Hugging Face LlamaForCausalLM checkpoint: "
        "config.json, model.safetensors (float32) and a byte-level tokenizer whose ids are the "
        "bytes, so that transformers and vLLM run the model kvtui runs, with the same greedy ids.",
    )
    p.add_argument(
        "directory", type=folder_path, metavar="DIR", help="where to write it (made if new)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a DIR that is not empty (the export's own files are replaced)",
    )
    p.set_defaults(handler=cmd_export_hf)


def cmd_load(args: argparse.Namespace) -> int:
    """`kvtui load URL [URL...]`: a bounded load on a server, or the same on each server of a
    fleet at once; a summary, or `--json` (several: `{"servers": [...]}`). Exit status 1 when
    a request failed (the server refused it, or answered what is not a completion), 0 when each
    was done or cut at the time limit."""
    from kvtui.engines.vllm.fleet import parse_urls, run_loads
    from kvtui.engines.vllm.load import LoadPlan, format_result

    sized = (args.concurrency, args.prompt_tokens, args.max_tokens)
    if any(v is None for v in sized) and any(v is not None for v in sized):
        raise UsageError(
            "kvtui load: error: give all of --concurrency, --prompt-tokens and --max-tokens, or "
            "none (a fill sized from the server's own limits)"
        )
    try:
        urls = parse_urls(",".join(args.url), "")
        if args.concurrency is None:
            return fill_from_servers(urls, args)
        plans = [
            LoadPlan(
                url,
                concurrency=args.concurrency,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
                requests=args.requests or args.concurrency,
                seconds=args.seconds,
                shared_prefix_tokens=args.shared_prefix,
                seed=args.seed,
            )
            for url in urls
        ]
        plan = plans[0]
        if plan.shared_prefix_tokens > plan.prompt_tokens:
            raise UsageError(
                "kvtui load: error: argument --shared-prefix: at most --prompt-tokens "
                f"({plan.prompt_tokens:,}), not {plan.shared_prefix_tokens:,}"
            )
        tty = sys.stderr.isatty()

        def progress(url: Any, result: Any, open_requests: int) -> None:
            if tty:
                where = f"{url.netloc}: " if len(plans) > 1 else ""
                print(
                    f"\r{where}{result.done + result.failed + result.cut:,}/{plan.requests:,} "
                    f"requests done, {open_requests} open, {result.tokens:,} tokens, "
                    f"{result.seconds:.0f} s   ",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )

        try:
            results = run_loads(plans, progress=progress)
        finally:
            if tty:
                print("\r", end="", file=sys.stderr)
    except EngineError as exc:
        raise UsageError(f"kvtui load: {exc}") from None
    if args.json:
        data = [result.to_json() for result in results]
        print_json(data[0] if len(data) == 1 else {"servers": data})
    else:
        print(safe_text("\n".join(format_result(result) for result in results)))
    return 1 if any(result.failed for result in results) else 0


def fill_from_servers(urls: Any, args: argparse.Namespace) -> int:
    """`kvtui load URL [URL...]` alone: on each server at once, a fill sized from that server's
    limits (kvtui.engines.vllm.fill), its /metrics polled about once a second while it runs, and
    whether it filled the cache and made vLLM preempt, or why not (kvtui.run.pressure)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvtui.engines.vllm.load import format_result

    with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="kvtui-fill") as pool:
        fills = list(pool.map(lambda url: fill_from_server(url, args), urls))
    if args.json:
        data = [
            {**result.to_json(), "sized_from_server": True, "server": verdict}
            for result, verdict in fills
        ]
        print_json(data[0] if len(data) == 1 else {"servers": data})
    else:
        print(
            safe_text(
                "\n".join(
                    format_result(result) + "\n" + "\n".join(verdict) for result, verdict in fills
                )
            )
        )
    return 1 if any(result.failed for result, _ in fills) else 0


def fill_from_server(url: Any, args: argparse.Namespace) -> tuple[Any, list[str]]:
    """One server's fill sized from its limits: its result, and the words of how it ended."""
    import dataclasses
    import time

    from kvtui.engines.vllm.fill import plan_from_server, poll_metrics
    from kvtui.engines.vllm.load import run_load
    from kvtui.run.pressure import fill_words
    from kvtui.run.serving import ServerWatch

    start = time.monotonic()
    plan, max_model_len = plan_from_server(url, until=start + args.seconds)
    plan = dataclasses.replace(
        plan, seconds=args.seconds, seed=args.seed, requests=args.requests or plan.requests
    )
    watch = ServerWatch()
    errors: list[str] = []

    def poll(deadline_s: float = FILL_POLL_S) -> None:
        polled = poll_metrics(url, time.monotonic() - start, until=time.monotonic() + deadline_s)
        if polled.error:
            errors.append(polled.error)
        watch.add(polled)

    poll()
    result = run_load(plan, progress=lambda result, open_requests: poll())
    poll()
    latest = watch.latest
    capacity = latest.kv_capacity_tokens if latest is not None else None
    words = list(fill_words(watch.seen_peak, watch.pressure, capacity, max_model_len))
    if not watch.pressure.peak_seen and errors:  # not a load too short: polls that failed
        words[0] = (
            f"vLLM's cache: not seen while the load ran: {len(errors):,} of {watch.polls:,} "
            f"polls of /metrics failed (the last: {errors[-1]})"
        )
    return result, words


FILL_POLL_S = 5.0
"""How long each of a fill's polls of /metrics may take (a server busy with the fill, on a busy
2-core machine, took more than 2 s)."""


def add_load(subparsers: Any) -> None:
    from kvtui.engines.vllm import limits

    p = subparsers.add_parser(
        "load",
        help="put a bounded load on a vLLM server, to fill its KV cache (stops by itself)",
        description="N requests at a time of P prompt tokens and T generated tokens each "
        "(end-of-sequence ignored), to a vLLM (OpenAI-compatible) server: it fills the server's "
        "KV cache, and past it requests wait and are preempted. Stops after --requests or "
        "--seconds, whichever comes first. Exit status 1 when a request failed.",
    )
    p.add_argument(
        "url",
        metavar="URL",
        nargs="+",
        help="the server, e.g. http://127.0.0.1:8000; several (a fleet's replicas, or URL1,URL2) "
        "each get the same load at the same time",
    )
    p.add_argument(
        "--concurrency",
        type=int_in(1, limits.MAX_CONCURRENCY),
        default=None,
        metavar="N",
        help=f"requests at a time (at most {limits.MAX_CONCURRENCY}); without it, --prompt-tokens "
        "and --max-tokens, a fill sized from the server's capacity and max_model_len",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int_in(1, limits.MAX_PROMPT_TOKENS),
        default=None,
        metavar="P",
        help=f"prompt tokens of each request (at most {limits.MAX_PROMPT_TOKENS:,})",
    )
    p.add_argument(
        "--max-tokens",
        type=int_in(1, limits.MAX_NEW_TOKENS),
        default=None,
        metavar="T",
        help=f"tokens each request generates, end-of-sequence ignored (at most "
        f"{limits.MAX_NEW_TOKENS:,}); P + T at most the server's max_model_len",
    )
    p.add_argument(
        "--requests",
        type=int_in(1, limits.MAX_REQUESTS),
        default=None,
        metavar="R",
        help=f"requests in all (default N, one wave; at most {limits.MAX_REQUESTS:,})",
    )
    p.add_argument(
        "--seconds",
        type=float_in(0.1, limits.MAX_SECONDS),
        default=limits.DEFAULT_SECONDS,
        metavar="S",
        help="wall-time limit: open requests are closed then (default "
        f"{limits.DEFAULT_SECONDS:g}, at most {limits.MAX_SECONDS:g})",
    )
    p.add_argument(
        "--shared-prefix",
        type=int_in(0, limits.MAX_PROMPT_TOKENS),
        default=0,
        metavar="TOKENS",
        help="prompt tokens every request shares at its start, for the prefix cache (default 0)",
    )
    p.add_argument(
        "--seed", type=int_in(0, 2**31 - 1), default=0, help="seed of the prompts (default 0)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_load)
