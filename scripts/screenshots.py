"""Save SVG screenshots of the screens and presenter mode (docs/) from a real run of the shipped
model.

python scripts/screenshots.py                      # tiny engine, 120x36, after the run ends
python scripts/screenshots.py --engine sim:llama-3.1-8b@h100 --size 100x30
python scripts/screenshots.py --only 4 --size 100x30   # screen 4 once its table and race end
python scripts/screenshots.py --only present       # presenter mode, node 3, the lesson's run
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from kvtui.app import make_app
from kvtui.engines.protocol import RunSettings


async def shoot_tricks(settings: RunSettings, size: tuple[int, int], out: Path) -> None:
    """Screen 4 once its race and its table (measured in their own processes) have ended."""
    from kvtui.screens.tricks import TricksScreen

    app = make_app(settings, screen=4)
    async with app.run_test(size=size) as pilot:
        screen = app.screen
        assert isinstance(screen, TricksScreen)
        for _ in range(1200):  # at most ten minutes
            if screen.race and not screen.racing and (screen.table.done or screen.table.failed):
                break
            await asyncio.sleep(0.5)
        screen.redraw_now()
        await pilot.pause(0.5)
        app.save_screenshot(str(out / "screen4.svg"))
    app.close_engine()


async def shoot(settings: RunSettings, size: tuple[int, int], out: Path) -> None:
    app = make_app(settings, screen=1)
    async with app.run_test(size=size) as pilot:
        for _ in range(600):  # at most five minutes
            if app.live.state in ("done", "failed"):
                break
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


async def shoot_present(settings: RunSettings, size: tuple[int, int], out: Path) -> None:
    """Presenter mode on the lesson's run: node 3 with its three figures, once its pool (sized
    for the room) has filled, turned red and stopped the run at the predicted token."""
    from dataclasses import replace

    from kvtui.screens.present import PresentScreen

    app = make_app(replace(settings, lesson=True, tokens=24), present=True)
    async with app.run_test(size=size) as pilot:
        screen = app.screen
        assert isinstance(screen, PresentScreen)
        await pilot.press(*["space"] * 12)  # node 3 (its run sized for the room), all shown
        for _ in range(600):  # at most five minutes
            if app.live.settings.kv_budget_bytes and screen.slide().done:
                break
            await asyncio.sleep(0.5)
        screen.redraw_now()
        await pilot.pause(0.5)
        app.save_screenshot(str(out / "present.svg"))
    app.close_engine()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="tiny")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--lesson", action="store_true", help="a one-token prompt")
    parser.add_argument("--size", default="120x36")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument(
        "--only", choices=["1-3", "4", "present"], default=None, help="these screens only"
    )
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    args.out.mkdir(exist_ok=True)
    settings = RunSettings(
        engine=args.engine, tokens=args.tokens, seed=1, replay_speed=1.0, lesson=args.lesson
    )
    if args.only in (None, "1-3"):
        asyncio.run(shoot(settings, (width, height), args.out))
    if args.only in (None, "4"):
        asyncio.run(shoot_tricks(settings, (width, height), args.out))
    if args.only in (None, "present"):
        asyncio.run(shoot_present(settings, (width, height), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
