"""Where the shipped data lives: `assets/` in a checkout, `kvtui/assets/` in an installed wheel."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def assets_dir() -> Path:
    """The folder holding the catalogs and the shipped weights."""
    for candidate in (_PACKAGE_DIR / "assets", _PACKAGE_DIR.parent / "assets"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"kvtui's assets folder is missing (looked in {_PACKAGE_DIR / 'assets'} and "
        f"{_PACKAGE_DIR.parent / 'assets'}); reinstall kvtui"
    )


def asset_path(name: str) -> Path:
    """The path of one shipped file, by name."""
    return assets_dir() / name


def cache_dir() -> Path:
    """Where kvtui keeps what it can make again (the title cards of kvtui.bigtext's
    `kept_title_card`): $XDG_CACHE_HOME/kvtui where that is an absolute path, else
    ~/.cache/kvtui."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtui"


TINY_NAME = "tiny-austen"
"""The shipped model's name: the default engine `tiny` runs it, and the catalog lists its shape."""
TINY_WEIGHTS = f"{TINY_NAME}.safetensors"
"""The shipped model's file in assets/ (kvtui.gpu.load reads it)."""
HELDOUT_TEXT = "austen-heldout.txt"
"""4,024 bytes of held-out Austen in assets/ (its origin: assets/austen-heldout.md), on which a
KV-cache trick's cost in quality is measured when the whole held-out split is not installed."""
HELDOUT_BYTES = 4024
"""Its size: the most `--quality-bytes` takes."""
