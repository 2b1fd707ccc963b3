"""Textual's Footer keeps every key it replaces: a minimal reproduction, and kvtui's way round it.

A bare Textual app (no kvtui) with three screens, each with a Footer, switched N times headless.
Each switch changes the screen's bindings, so the Footer recomposes its `FooterKey`s; each key
follows `Footer.compact` through `data_bind`, which leaves a `(key, callback)` watcher on the
Footer (`_watch` in textual/reactive.py). Textual drops a closed node's watcher only when the
watched value changes (`Reactive._check_watchers`), and `compact` never does: so every key ever
shown stays alive. Upstream: Textualize/textual#6666 (open at Textual 8.2.8).

Printed for the stock Footer and for `kvtui.widgets.footer.KeysFooter` (which sets `compact` to
itself after each recompose, so that Textual prunes): the FooterKeys alive and the process's RSS
growth after each fifth of the switches. A second, bounded, effect shows in the RSS of both:
`StylesCache.get_inner_outer` (textual/_styles_cache.py) is an `lru_cache(1024)` on a method, so
it holds up to 1,024 StylesCache objects of widgets long gone; it fills, then stays.

    python benchmarks/textual_footer_leak.py [--switches 300]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Label

from kvtui.widgets.footer import KeysFooter


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def live(type_name: str) -> int:
    gc.collect()
    return sum(type(o).__name__ == type_name for o in gc.get_objects())


def make_app(footer: type[Footer]) -> App:
    class Page(Screen):
        BINDINGS = [Binding("x", "app.bell", "Bell")]

        def compose(self) -> ComposeResult:
            yield Label(self.name or "")
            yield footer()

    class ThreeScreens(App):
        BINDINGS = [Binding("q", "quit", "Quit")]
        MODES = {name: (lambda name=name: Page(name=name)) for name in ("a", "b", "c")}

        def on_mount(self) -> None:
            self.switch_mode("a")

    return ThreeScreens()


async def measure(footer: type[Footer], switches: int) -> list[tuple[int, int, int]]:
    """(switches, FooterKeys alive, RSS growth KiB) after each fifth of the switches."""
    app = make_app(footer)
    rows = []
    async with app.run_test(size=(100, 30)) as pilot:
        for mode in "abc" * 10:  # warm up: every screen composed, caches filled once
            app.switch_mode(mode)
            await pilot.pause()
        start = rss_kib()
        for i in range(switches):
            app.switch_mode("abc"[i % 3])
            await pilot.pause()
            if (i + 1) % max(1, switches // 5) == 0:
                rows.append((i + 1, live("FooterKey"), rss_kib() - start))
    return rows


FOOTERS = {"stock": Footer, "kvtui": KeysFooter}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switches", type=int, default=300)
    parser.add_argument("--footer", choices=FOOTERS, help="measure this one only, in this process")
    args = parser.parse_args()
    os.environ.setdefault("TEXTUAL_ANIMATIONS", "none")
    if args.footer is None:  # each in a fresh process, so that one's freed heap is not the other's
        for name in FOOTERS:
            command = [sys.executable, __file__, "--switches", str(args.switches), "--footer", name]
            subprocess.run(command, check=True)
        return 0
    footer = FOOTERS[args.footer]
    print(f"{footer.__module__}.{footer.__name__}:", flush=True)
    for switches, keys, grown in asyncio.run(measure(footer, args.switches)):
        mib = grown / 1024
        print(f"  {switches:5} switches: {keys:5} FooterKeys alive, RSS +{mib:4.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
