"""Save an SVG screenshot of screen 3 watching a real vLLM server fill its KV cache and preempt.

python scripts/vllm_screenshot.py http://127.0.0.1:8000                 # docs/vllm-screen3.svg
python scripts/vllm_screenshot.py http://127.0.0.1:8000 --size 80x24 --out /tmp/80x24.svg

It opens the app on screen 3 with `--engine vllm:URL`, presses `f` (a load of twice the server's
KV cache, `kvtui load` in its own process) and saves the screen once the cache has been full,
the server has preempted requests and is still serving (at most two minutes), then prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from kvtui.app import make_app
from kvtui.engines.protocol import RunSettings
from kvtui.testing import NO_GPU_PROBE, screen_text


async def shoot(url: str, size: tuple[int, int], out: Path) -> None:
    settings = RunSettings(engine=f"vllm:{url}", tokens=64, greedy=True, loops=("cached",))
    app = make_app(settings, 3, probe=NO_GPU_PROBE)
    async with app.run_test(size=size) as pilot:
        deadline = time.monotonic() + 120
        while app.live_run.server is None or app.live_run.server.latest is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"no figures from {url} in two minutes")
            await pilot.pause(0.25)
        await pilot.pause(1.0)
        await pilot.press("f")
        while time.monotonic() < deadline:
            server = app.live_run.server
            latest = server.latest
            preempted = (server.preemptions_seen or 0) > 0
            if latest and preempted and server.peak_usage >= 0.9 and latest.requests_running:
                break
            await pilot.pause(0.1)
        await pilot.pause(0.3)
        app.save_screenshot(str(out))
        print(screen_text(app))
    app.close_engine()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url")
    parser.add_argument("--size", default="100x30")
    parser.add_argument("--out", type=Path, default=Path("docs/vllm-screen3.svg"))
    args = parser.parse_args()
    width, height = (int(n) for n in args.size.split("x"))
    asyncio.run(shoot(args.url, (width, height), args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
