"""The floor under kvtui's first frame: a bare Textual app (screen 1's title, four `Digits`, a
footer), whose start is Textual's own cost on this machine. Not a test.

`first_token.py --floor` launches it in a terminal beside kvtui, interleaved, and
`launch_instructions.py` counts its instructions headless; run alone, it is the app (q quits):

    python benchmarks/bare_textual.py
"""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.widgets import Digits, Footer, Static

TITLE = "1 · Without a cache, every step redoes the whole history"
"""Screen 1's title, which first_token.py waits for as the first frame."""


class Bare(App[None]):
    BINDINGS = [("q", "quit", "Quit")]

    def compose(self) -> ComposeResult:
        yield Static(TITLE)
        with Horizontal():
            for _ in range(4):
                yield Digits("24")
        yield Footer()


if __name__ == "__main__":
    Bare().run()
