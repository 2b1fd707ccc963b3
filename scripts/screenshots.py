"""Save SVG screenshots of the three screens (docs/) from a real run of the shipped model.

python scripts/screenshots.py                      # tiny engine, 120x36, after the run ends
python scripts/screenshots.py --engine sim:llama-3.1-8b@h100 --size 100x30
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from kvtui.app import make_app
from kvtui.engine.protocol import RunSettings


async def shoot(settings: RunSettings, size: tuple[int, int], out: Path, length: int) -> None:
    app = make_app(settings, screen=1, length=length)
    async with app.run_test(size=size) as pilot:
        while app.live.state not in ("done", "failed"):
            await asyncio.sleep(0.5)
        await pilot.pause(0.5)
        for screen in ("1", "2", "3"):
            await pilot.press(screen)
            await pilot.pause(0.5)
            app.save_screenshot(str(out / f"screen{screen}.svg"))
        await pilot.press("+", "+")  # screen 3: 24,000 -> 96,000 tokens, past capacity
        await pilot.pause(0.5)
        app.save_screenshot(str(out / "screen3-overflow.svg"))
    app.close_engine()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="tiny")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--size", default="120x36")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    args.out.mkdir(exist_ok=True)
    settings = RunSettings(engine=args.engine, tokens=args.tokens, seed=1, replay_speed=1.0)
    asyncio.run(shoot(settings, (width, height), args.out, args.length))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
