"""The columns of numbers a run keeps, and their snapshots, without a UI.

A run's fold (kvtui.run.summary) keeps a few numbers a step, for up to MAX_TOKENS steps a loop,
and the screens read a snapshot of it up to RUN_UPDATES_PER_SECOND times a second while the fold
goes on. A `Column` is an array (8 bytes an item) that only ever grows at its end, so a snapshot
of it is a view of the items it holds now: the same array and a length, no copy. Appends after it
never change the items it shows (an array that outgrows its buffer moves them, values intact), so
the view stays as it was taken. The fold's own column appends and reads at the array's speed.

A `Series` is what a chart draws of one quantity: at most MAX_POINTS (step, value) points, every
other one dropped as it fills; its snapshot shares its lists until the next point (copy on write).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar, overload

N = TypeVar("N", int, float)

MAX_POINTS = 2048
"""Points kept per chart series; past it every other point is dropped (the stride doubles)."""


class Column(Sequence[N]):
    """A column of int (`"q"`) or float (`"d"`) numbers that only grows at its end (`append`),
    and read-only views of it as it was (`snapshot`)."""

    __slots__ = ("_items", "_n", "append")

    def __init__(self, typecode: str, items: Iterable[N] = ()) -> None:
        self._items: array[N] = array(typecode, items)
        self._n: int | None = None
        """The items a view shows (its column's first `_n`); None: all of them, a live column."""
        self.append: Callable[[N], None] = self._items.append
        """Add a number at the end (the array's own append; a view's refuses)."""

    def snapshot(self) -> Column[N]:
        """The column as it is now, read-only, sharing the items: no copy, whatever its length."""
        view: Column[N] = Column.__new__(Column)
        view._items, view._n, view.append = self._items, len(self), _read_only
        return view

    def __reduce__(self) -> tuple[type[Column[N]], tuple[str, list[N]]]:
        """A copy (copy, deepcopy, pickle) is a column of its own with the items shown: `append`
        is bound to this column's array, and must not be copied with it."""
        return Column, (self._items.typecode, self.tolist())

    def tolist(self) -> list[N]:
        return self._items[: len(self)].tolist()

    def __len__(self) -> int:
        n = self._n
        return len(self._items) if n is None else n

    @overload
    def __getitem__(self, index: int) -> N: ...

    @overload
    def __getitem__(self, index: slice) -> array[N]: ...

    def __getitem__(self, index: int | slice) -> N | array[N]:
        n = self._n
        if n is None:  # a live column: every item
            return self._items[index]
        if isinstance(index, int):
            if index < 0:
                index += n
            if 0 <= index < n:
                return self._items[index]
            raise IndexError("column index out of range")
        start, stop, step = index.indices(n)
        if step == 1:
            return self._items[start : max(start, stop)]
        return array(self._items.typecode, (self._items[i] for i in range(start, stop, step)))

    def __iter__(self) -> Iterator[N]:
        n = self._n
        return iter(self._items) if n is None else itertools.islice(self._items, n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Column):
            return self._items[: len(self)] == other._items[: len(other)]
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        return f"Column({self._items.typecode!r}, {self.tolist()!r})"


def _read_only(value: object) -> NoReturn:
    raise RuntimeError("a snapshot of a column is read-only: the fold appends to its own")


@dataclass
class Series:
    """One measured quantity per step, downsampled by a doubling stride to stay bounded."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    stride: int = 1
    _shared: bool = field(default=False, init=False, repr=False, compare=False)
    """A snapshot reads these lists too: the next point goes into copies of them."""

    def add(self, step: int, value: float) -> None:
        if step % self.stride:
            return
        if self._shared:  # copy on write: the snapshot keeps the lists as they were
            self.steps, self.values, self._shared = self.steps[:], self.values[:], False
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) > MAX_POINTS:
            self.stride *= 2
            kept = [i for i, s in enumerate(self.steps) if s % self.stride == 0]
            self.steps = [self.steps[i] for i in kept]
            self.values = [self.values[i] for i in kept]

    def snapshot(self) -> Series:
        """A copy that later points leave as it is, sharing the lists until the next point
        (copy on write: a series that no longer grows, a finished loop's, is never copied)."""
        copied = Series(self.steps, self.values, self.stride)
        copied._shared = self._shared = True
        return copied
