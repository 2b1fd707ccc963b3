"""Python's cyclic garbage collector at launch: held until the app's first frame.

A launch allocates tens of thousands of objects (modules, classes, the app's widgets and styles)
and frees almost none, so each pass the collector makes over them on the way to the first frame
finds next to nothing, and is time before it: 0.037-0.044 s of passes at 80x24 here, one of
them over every object (timed with `gc.callbacks`: benchmarks/README.md). `kvtui`'s launch
(kvtui.cli) holds the collector, and the app releases it once its first frame is drawn: the
launch's garbage is collected once, what is left (mostly what lives as long as the app) is
frozen out of the collector's later passes (`gc.freeze`; a frozen object is still freed when
nothing refers to it), and the collector resumes. A launch that ends before its first frame only
resumes it.

The hold is this module's alone: where kvtui did not take it (a test, `kvtui.testing`, a program
that turned the collector off itself), `release` does nothing.
"""

from __future__ import annotations

import gc

_held = False
"""Whether `hold` turned the collector off (and `release` has not yet turned it on)."""


def hold() -> None:
    """No collector passes from now until `release` (where it is on now)."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release(*, freeze: bool) -> None:
    """End `hold`'s hold, if there is one. With `freeze` (at the first frame), collect once and
    freeze what is left, then resume; without (a launch that ended before it), only resume."""
    global _held
    if not _held:
        return
    _held = False
    if freeze:
        gc.collect()
        gc.freeze()
    gc.enable()
