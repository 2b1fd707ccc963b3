"""Key to repaint while a run streams, in a real terminal: how long a key press takes to show.

Runs `kvtui` in tmux at 100x30 on a `sim:` engine streaming at the roofline's pace, presses
`right` (the answer length) and times until the screen shows the new length ("r runs N tokens"),
polling the pane every millisecond or so; then the same with `left`. Tmux's own round trip is
timed alone (a key the app ignores) and reported, so that the app's share can be read off.

    python benchmarks/key_latency.py [--presses 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time

SIZE = (100, 30)


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def wait_for(session: str, text: str, timeout: float = 10.0) -> float:
    """Seconds until the pane shows `text`."""
    t0 = time.perf_counter()
    while text not in tmux("capture-pane", "-p", "-t", session):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{text!r} never appeared")
        time.sleep(0.001)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presses", type=int, default=30)
    parser.add_argument("--screen", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not shutil.which("tmux"):
        print("needs tmux (apt-get install tmux)", file=sys.stderr)
        return 2
    session = "kvtui-latency"
    command = (
        f"{sys.executable} -m kvtui --engine sim:llama-3.1-8b@h100 --tokens 2048 "
        f"--replay-speed 0.25 --screen {args.screen}"
    )
    tmux("new-session", "-d", "-s", session, "-x", str(SIZE[0]), "-y", str(SIZE[1]), command)
    try:
        wait_for(session, "running", timeout=60)
        time.sleep(2)  # streaming
        tmux("send-keys", "-t", session, "Left")  # 1,920: from here on every length is pending
        length, ms = 1920, []
        wait_for(session, "r runs 1,920 tokens")
        for i in range(args.presses):
            key = "Left" if i % 2 == 0 else "Right"
            length += -128 if key == "Left" else 128
            shown = f"r runs {length:,} tokens"
            t0 = time.perf_counter()
            tmux("send-keys", "-t", session, key)
            wait_for(session, shown)
            ms.append((time.perf_counter() - t0) * 1e3)
        idle = []
        for _ in range(10):
            t0 = time.perf_counter()
            tmux("capture-pane", "-p", "-t", session)
            idle.append((time.perf_counter() - t0) * 1e3)
        still = "running" in tmux("capture-pane", "-p", "-t", session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    result = {
        "size": f"{SIZE[0]}x{SIZE[1]}",
        "screen": args.screen,
        "presses": args.presses,
        "key_to_repaint_ms_median": statistics.median(ms),
        "key_to_repaint_ms_p90": sorted(ms)[int(0.9 * len(ms))],
        "one_capture_ms_median": statistics.median(idle),
        "streaming_throughout": still,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"screen {args.screen} at {result['size']}, streaming: key to repaint "
            f"{result['key_to_repaint_ms_median']:.1f} ms median, "
            f"{result['key_to_repaint_ms_p90']:.1f} ms p90 over {args.presses} presses "
            f"(one tmux capture: {result['one_capture_ms_median']:.1f} ms)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
