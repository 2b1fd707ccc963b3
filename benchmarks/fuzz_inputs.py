"""Hostile inputs, many of them: what kvtui does with each, counted by category.

    python benchmarks/fuzz_inputs.py [--examples 2000] [--seed 0] [--only records paths ...]
                                     [--out results.json]

The strategies are tests/test_hostile_inputs.py's and tests/hostile.py's (the suite runs a few
examples of the cheap ones); here each category gets its share of `--examples`, every input run
through `kvtui.cli.main` in this process, or through `python -m kvtui` where the process itself is
the input (its environment, its standard streams), or sent to a running `kvtui serve`, or typed
into the app in tmux:

- configs: `kvtui budget --config FILE` on config.json files of any field types and sizes;
- records: `kvtui bench --engine replay:FILE` on good records with fields, lines or bytes edited;
- record numbers: one numeric field of a record at an edge (0, 2^63, a subnormal, 1e308...);
- records in the app: such records, and ones whose strings hold markup, actions and control
  characters, replayed in the app (headless) on every screen;
- cli numbers: `--tokens`, `--seed`, `--temperature`, `--context`... given any text;
- paths: replay:, --model, --record, --config and the app's replay: given paths as people type
  them (~user, 300-byte names, trailing slashes, devices);
- safetensors: the app's check of a model folder whose model.safetensors has any header;
- model folders: `kvtui bench --model DIR` on a small Llama whose config, weights or tokenizer
  were edited (another model_type, a window of 0, a tensor dropped or reshaped...);
- environment: a kvtui command whose environment sets one variable to a hostile value;
- streams: commands with stdin, stdout or stderr closed, or full;
- serve http: raw requests to a running `kvtui serve` (malformed, huge, foreign Hosts);
- serve websocket: sessions sent malformed messages;
- app keys: the app in tmux (100x30), sent random keys, invalid UTF-8, key sequences whose numbers
  are past any character, mouse reports far off the screen and the command palette;
- presenter keys: the same, in presenter mode (`--present --lesson`);
- server lies (tests/hostile_server.py): a stand-in vLLM server on 127.0.0.1 that lies in every
  field and in how it sends it, put to `kvtui bench --engine vllm:URL` (--json, --record and the
  record replayed) and `kvtui load URL`, each in a process of its own: timed (a hang past 170 s,
  "slow" past 45 s), its peak RSS measured (a memory failure past 400 MiB), its folder checked
  for litter;
- server urls: `vllm:URL` and `kvtui load URL` given any URL (hosts loopback or invalid).

Not swept: a server's KV-cache events (an events endpoint, msgpack): kvtui reads none yet.

An input ends in exit 0 or exit 2 (with one line on stderr; kvtui load: exit 1 when requests
failed), or is "shown", "answered", "closed", "refused" or a session that ran or ended; anything
else is a failure: a traceback, a hang, another exit status, more than one line, a memory peak,
litter, or a security finding. Prints a table and the first example of
each failure; exits 1 if there was any.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/ holds the strategies

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from tests import hostile as sweep  # noqa: E402
from tests import hostile_server  # noqa: E402
from tests import test_hostile_inputs as hostile  # noqa: E402

OK = (
    "exit 0",
    "exit 2",
    "shown",
    "answered",
    "closed",
    "waits for the rest",
    "session ran",
    "session ended",
    "alive, quit with q",
    "python refused to start",
    "quit from the palette",
    hostile_server.FAILED_REQUESTS,
)


class Output:
    """stdout and stderr of one call, captured."""

    def __init__(self) -> None:
        self.out, self.err = io.StringIO(), io.StringIO()

    def read(self) -> tuple[str, str]:
        out, err = self.out.getvalue(), self.err.getvalue()
        self.out.seek(0), self.out.truncate()
        self.err.seek(0), self.err.truncate()
        return out, err


def sweep_category(
    strategy, try_one, examples: int, random_seed: int, describe=repr, workers: int = 1
) -> tuple[Counter, dict, float]:
    """Run `try_one` on `examples` values of `strategy`; the outcomes counted, the first value
    of each failure (as `describe` puts it), and the seconds taken. With `workers`, the values
    are drawn first and tried that many at a time (inputs that mostly wait: a run each)."""
    counts: Counter = Counter()
    first: dict = {}
    output = Output()
    if workers > 1:
        from concurrent.futures import ThreadPoolExecutor

        drawn: list = []
        sweep_category(strategy, lambda v, read: drawn.append(v) or "exit 0", examples, random_seed)
        started = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            results = pool.map(lambda v: try_one(v, None), drawn)
            for value, result in zip(drawn, results, strict=True):
                counts[result] += 1
                if not fine(result) and result not in first:
                    first[result] = describe(value)
        return counts, first, time.perf_counter() - started

    @seed(random_seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(value) -> None:
        with contextlib.redirect_stdout(output.out), contextlib.redirect_stderr(output.err):
            result = try_one(value, output.read)
        counts[result] += 1
        if not fine(result) and result not in first:
            first[result] = describe(value)

    started = time.perf_counter()
    run()
    return counts, first, time.perf_counter() - started


def fine(result: str) -> bool:
    """Whether an outcome is as it should be ("slow, exit 0" is: a stream may be waited for)."""
    return result.removeprefix("slow, ") in OK or result.startswith("refused")


TMUX = ["tmux", "-L", f"kvtui-sweep-{os.getpid()}"]
"""The sweep's own tmux server: its sessions come and go without touching anyone else's."""


def pane(session: str) -> str:
    """What the sweep's tmux `session` shows now, as text."""
    import subprocess

    return subprocess.run(
        [*TMUX, "capture-pane", "-p", "-t", session], capture_output=True, text=True, check=False
    ).stdout


def app_keys(
    runs: int, keys: int, random_seed: int, options: tuple[str, ...] = ()
) -> tuple[Counter, dict, float]:
    """The app in tmux at 100x30, sent `keys` random keys per run (letters, arrows, page keys,
    the palette, bytes that are not UTF-8), then q: "alive, quit with q" when it was still up,
    quit with exit 0, left no engine and showed no traceback."""
    import random
    import shlex
    import shutil
    import subprocess

    counts: Counter = Counter()
    first: dict = {}
    started = time.perf_counter()
    if not shutil.which("tmux"):
        counts["no tmux"] += runs
        return counts, first, 0.0
    rng = random.Random(random_seed)
    named = [
        "r",
        "q",
        "1",
        "2",
        "3",
        "space",
        "Left",
        "Right",
        "PageDown",
        "PageUp",
        "Up",
        "Down",
        "Enter",
        "Escape",
        "Tab",
        "BSpace",
        "C-p",
        "?",
        "t",
        "l",
        "c",
        "v",
        "m",
        "g",
        "k",
        "b",
        "n",
        "[",
        "]",
        "\\",
        "+",
        "-",
        "e",
        "a",
        "x",
        "Home",
        "End",
        "F1",
        "C-l",
    ]
    hexes = [
        "ff",
        "fe",
        "c0 af",
        "e1",
        "80",
        "ed a0 80",
        "f8 88 80 80 80",
        "1b 5b 39 39 39 39 7e",
        " ".join(f"{b:02x}" for b in b"\x1b[1000000000000000000A"),  # a cursor move of 10^18
        " ".join(f"{b:02x}" for b in b"\x1b[1114112u"),  # a key past the last character
        " ".join(f"{b:02x}" for b in b"\x1b[<0;9999;9999M"),  # a click far off the screen
        " ".join(f"{b:02x}" for b in b"\x1b[<35;99999999999999999999;1M"),
    ]
    for run in range(runs):
        session = f"robust-sweep-{os.getpid()}-{run}"
        with tempfile.TemporaryDirectory() as scratch:
            status_file = Path(scratch) / "status"
            app = shlex.join(
                [
                    sys.executable,
                    "-m",
                    "kvtui",
                    "--engine",
                    "sim:llama-3.1-8b@h100",
                    "--tokens",
                    "4096",
                    *options,
                ]
            )
            # In the scratch folder, with it as home: a Screenshot the keys choose lands there.
            here = shlex.quote(scratch)
            status = shlex.quote(str(status_file))
            script = f"cd {here} && HOME={here} {app}; echo $? > {status}; sleep 600"
            subprocess.run(
                [*TMUX, "new-session", "-d", "-s", session, "-x", "100", "-y", "30", script],
                check=True,
            )
            sent = []
            last_seen, last_enter, last_alive, alive_at = "", 0, "", 0
            try:
                time.sleep(3)
                for _ in range(keys):
                    if rng.random() < 0.08:
                        code = rng.choice(hexes)
                        subprocess.run(
                            [*TMUX, "send-keys", "-t", session, "-H", *code.split()], check=False
                        )
                        sent.append(f"hex {code}")
                        continue
                    key = rng.choice(named)
                    if key == "q":
                        key = "r"  # q would end the run early: it is tested at the end
                    if len(sent) % 10 == 0 and not status_file.exists():  # the app, as last seen
                        shown = pane(session)
                        if "Quit" in shown or "Close" in shown:
                            last_alive, alive_at = shown, len(sent)
                    if key == "Enter" and not status_file.exists():  # what Enter may choose
                        last_seen = pane(session)
                        last_enter = len(sent)
                    subprocess.run([*TMUX, "send-keys", "-t", session, key], check=False)
                    sent.append(key)
                time.sleep(2)
                screen = pane(session)
                alive = not status_file.exists()
                deadline = time.monotonic() + 20
                while not status_file.exists() and time.monotonic() < deadline:
                    # Escape closes one palette, help or quiz a press (a q typed into a palette's
                    # search is text); q then quits. Apart: Escape and q at once are alt+q.
                    subprocess.run([*TMUX, "send-keys", "-t", session, "Escape"], check=False)
                    time.sleep(0.3)
                    subprocess.run([*TMUX, "send-keys", "-t", session, "q"], check=False)
                    time.sleep(1.0)
                status = status_file.read_text().strip() if status_file.exists() else "none"
                after = pane(session)
            finally:
                subprocess.run([*TMUX, "kill-session", "-t", session], check=False)
            if "Traceback" in screen + after or "Error" in screen:
                result = "traceback on screen"
            elif not alive and "Quit the application" in last_seen:
                result = "quit from the palette"  # the random keys chose its Quit command
                before = " ".join(sent[max(0, last_enter - 20) : last_enter])
                first.setdefault(result, f"{before}\n{last_seen}")
            elif not alive:
                result = f"app ended by itself (exit {status})"
                since = " ".join(sent[alive_at:])[:300]
                first.setdefault(result, f"last seen up, then: {since}\n{last_alive}")
            elif status != "0":
                result = "hang" if status == "none" else f"exit {status}"
            else:
                result = "alive, quit with q"
            counts[result] += 1
            if result not in OK:
                first.setdefault(result, " ".join(sent)[-200:] + "\n" + after)
    subprocess.run([*TMUX, "kill-server"], capture_output=True, check=False)
    return counts, first, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="inputs per cheap category")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="run these categories only")
    parser.add_argument("--out", type=Path, help="also write the counts as JSON here")
    args = parser.parse_args()
    n = args.examples

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        served: dict = {}

        def server():
            if "server" not in served:
                served["server"] = sweep.Served(
                    folder, "--engine", "sim:gpt2@t4", "--tokens", "64", "--max-sessions", "8"
                )
            return served["server"]

        # name: (strategy, try_one(value, read_output), examples)
        categories = {
            "configs": (hostile.configs, lambda v, read: hostile.try_config(folder, v, read), n),
            "records": (hostile.records(), lambda v, read: hostile.try_record(folder, v, read), n),
            "record numbers": (
                sweep.record_numbers(),
                lambda v, read: hostile.try_record(folder, v, read),
                n // 2,
            ),
            "records in app": (
                sweep.record_numbers() | sweep.records_with_text(),
                lambda v, read: sweep.try_record_in_app(folder, v, read),
                max(20, n // 25),
            ),
            "cli numbers": (hostile.cli_values, lambda v, read: hostile.try_cli(*v, read), n),
            "paths": (sweep.paths, lambda v, read: sweep.try_path(folder, v, read), n // 4),
            "safetensors": (
                hostile.safetensors_files(),
                lambda v, read: hostile.try_weights(folder, v, read),
                n,
            ),
            "model folders": (
                sweep.model_folders,
                lambda v, read: sweep.try_model_folder(folder, v, read),
                max(20, n // 25),
            ),
            "environment": (
                sweep.environments,
                lambda v, read: sweep.try_environment(v),
                max(20, n // 25),
            ),
            "streams": (
                sweep.streams,
                lambda v, read: sweep.try_streams(folder, v),
                max(20, n // 40),
            ),
            "serve http": (
                sweep.http_requests,
                lambda v, read: sweep.try_http(server(), v),
                n // 4,
            ),
            "serve websocket": (
                sweep.websocket_messages,
                lambda v, read: sweep.try_websocket(server(), v),
                max(20, n // 40),
            ),
            "server lies": (
                hostile_server.server_lies(),
                lambda v, read: hostile_server.try_server(folder, v),
                max(30, n // 2),
            ),
            "server urls": (
                hostile_server.server_urls(),
                lambda v, read: hostile_server.try_url(v, read),
                n,
            ),
        }
        described = {"server lies": hostile_server.shown}
        chosen = args.only or [*categories, "app keys", "presenter keys"]
        results = {}
        try:
            for name in chosen:
                if name == "app keys":
                    counts, first, seconds = app_keys(max(4, n // 125), 500, args.seed)
                elif name == "presenter keys":
                    counts, first, seconds = app_keys(
                        max(4, n // 250), 500, args.seed + 1, ("--present", "--lesson")
                    )
                else:
                    strategy, try_one, examples = categories[name]
                    counts, first, seconds = sweep_category(
                        strategy,
                        try_one,
                        examples,
                        args.seed,
                        described.get(name, repr),
                        workers=4 if name == "server lies" else 1,
                    )
                results[name] = {"counts": dict(counts), "first": first, "seconds": seconds}
                print(f"{name}: {dict(counts)} ({seconds:.0f} s)", file=sys.stderr, flush=True)
        finally:
            if "server" in served:
                log = served["server"].lines()
                served["server"].close()
                results.setdefault("serve log", {"lines": len(log), "last": log[-5:]})

    print(f"{n:,} examples per cheap category, seed {args.seed}\n")
    head = ("category", "inputs", "fine", "tracebacks", "hangs", "wrong exit", "lines")
    head += ("memory", "litter", "security", "slow")
    print(
        "{:<16} {:>7} {:>7} {:>11} {:>6} {:>11} {:>6} {:>7} {:>7} {:>9} {:>5}  {:>7}".format(
            *head, "seconds"
        )
    )
    failed = False
    for name, result in results.items():
        if "counts" not in result:
            continue
        c = result["counts"]
        tracebacks = sum(v for k, v in c.items() if "traceback" in k)
        hangs = sum(v for k, v in c.items() if k in ("hang", "hang on quit"))
        security = sum(v for k, v in c.items() if k.startswith("security"))
        lines = sum(v for k, v in c.items() if k.endswith("lines"))
        memory = sum(v for k, v in c.items() if k.startswith("memory"))
        litter = sum(v for k, v in c.items() if k.startswith("litter"))
        slow = sum(v for k, v in c.items() if k.startswith("slow") and fine(k))
        ok = sum(v for k, v in c.items() if fine(k))
        wrong = sum(c.values()) - ok - tracebacks - hangs - security - lines - memory - litter
        failed = failed or bool(tracebacks or hangs or wrong or lines or security or memory)
        failed = failed or bool(litter)
        print(
            f"{name:<16} {sum(c.values()):>7,} {ok:>7,} {tracebacks:>11,} {hangs:>6,} "
            f"{wrong:>11,} {lines:>6,} {memory:>7,} {litter:>7,} {security:>9,} {slow:>5,}  "
            f"{result['seconds']:>7.1f}"
        )
    for name, result in results.items():
        if "counts" in result:
            print(
                f"\n{name}: " + ", ".join(f"{k} {v:,}" for k, v in sorted(result["counts"].items()))
            )
    for name, result in results.items():
        for what, value in result.get("first", {}).items():
            print(f"\n{name}: {what}\n  first input: {str(value)[:400]}")
    if "serve log" in results:
        print(f"\nkvtui serve wrote {results['serve log']['lines']:,} lines in all; the last:")
        for line in results["serve log"]["last"]:
            print(f"  {line[:160]}")
    if args.out:
        summary = {
            name: {"counts": r["counts"], "seconds": r["seconds"], "first": r["first"]}
            for name, r in results.items()
            if "counts" in r
        }
        args.out.write_text(json.dumps({"examples": n, "seed": args.seed, **summary}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
