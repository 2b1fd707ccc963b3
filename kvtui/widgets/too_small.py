"""What a screen shows instead of itself when the terminal is too small for its layout."""

from __future__ import annotations

from textual.widgets import Static

MIN_WIDTH = 80
MIN_HEIGHT = 24


def too_small(width: int, height: int) -> bool:
    return width < MIN_WIDTH or height < MIN_HEIGHT


class TooSmall(Static):
    """A centred note saying how large the terminal needs to be."""

    DEFAULT_CSS = """
    TooSmall {
        display: none;
        width: 1fr;
        height: 1fr;
        content-align: center middle;
        text-align: center;
        color: $text;
    }
    """

    def show_size(self, width: int, height: int) -> None:
        self.update(
            f"kvtui needs a terminal of at least {MIN_WIDTH}x{MIN_HEIGHT}.\n"
            f"This one is {width}x{height}: make it larger (or the font smaller).\n\n"
            "q quits."
        )
