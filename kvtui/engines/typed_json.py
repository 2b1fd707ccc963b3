"""JSON objects read into frozen dataclasses, strictly, without a UI: each field present checked
against its declared type (integers within 64 bits, floats finite, literals among their values,
nested dataclasses whole), ValueError naming the first that is not. Records that cross a pipe or
come from a file (kvtui.engines.protocol) are read this way, so a hostile one is one line.
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import fields, is_dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

INT64_MAX = 2**63 - 1
"""The largest integer a record may hold: every count and size of a run fits in 64 bits."""


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of a field's declared type (ints within 64 bits, floats finite)."""
    origin = get_origin(hint)
    if origin is Literal:
        return isinstance(value, str) and value in get_args(hint)
    if origin is Union or origin is types.UnionType:
        return any(_fits(value, arg) for arg in get_args(hint))
    if origin is tuple:
        item = get_args(hint)[0]
        return isinstance(value, list | tuple) and all(_fits(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return is_number(value) and isinstance(value, int) and abs(value) <= INT64_MAX
    if hint is float:
        if isinstance(value, int):
            return is_number(value) and abs(value) <= INT64_MAX
        return isinstance(value, float) and math.isfinite(value)
    return isinstance(value, hint) if isinstance(hint, type) else False


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def typed_fields(cls: type, data: Any, what: str) -> dict[str, Any]:
    """The init fields of the dataclass `cls` present in the dict `data`, each checked against
    its declared type; ValueError naming the first that is not of it. Other keys are ignored."""
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected a JSON object, not {type(data).__name__}")
    hints = _hints(cls)
    values = {}
    for f in fields(cls):
        if f.init and f.name in data:
            value = data[f.name]
            nested = _dataclass_in(hints[f.name])
            if nested is not None and isinstance(value, dict):
                values[f.name] = _nested(nested, value, f"{what}: {f.name}")
                continue
            if not _fits(value, hints[f.name]):
                shown = repr(value)
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                raise ValueError(f"{what}: {f.name} is {shown}, not {_type_name(hints[f.name])}")
            values[f.name] = value
    return values


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field holds (`Capabilities` of `Capabilities | None`), if any."""
    for arg in (hint, *get_args(hint)):
        if isinstance(arg, type) and is_dataclass(arg):
            return arg
    return None


def _nested(cls: type, data: dict[str, Any], what: str) -> Any:
    """A dataclass held in a field, from its JSON object: every field of it stated and of its
    declared type (ValueError naming the first that is missing or is not)."""
    values = typed_fields(cls, data, what)
    missing = [f.name for f in fields(cls) if f.init and f.name not in values]
    if missing:
        raise ValueError(f"{what}: {missing[0]} is missing")
    return cls(**values)


def _type_name(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is Literal:
        return " or ".join(repr(a) for a in get_args(hint))
    if origin is Union or origin is types.UnionType:
        return " or ".join(_type_name(a) for a in get_args(hint))
    if origin is tuple:
        return f"a list of {_type_name(get_args(hint)[0])}"
    if hint is type(None):
        return "null"
    if isinstance(hint, type) and is_dataclass(hint):
        return "an object"
    names = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
