"""The one place numbers become text: bytes, seconds, ratios, counts and percentages.

Conventions, used everywhere in kvtui:
- memory sizes are binary (1 GiB = 2**30 bytes) and say so: "23.4 GiB". A GPU's "80 GB" on its
  datasheet is 80 GiB of memory, so both sides of a budget use the same unit;
- rates are decimal, as vendors state them: "3.35 TB/s", "989 TFLOP/s";
- one decimal place, dropped when it rounds to a whole number ("80 GiB", "23.4 GiB");
- text that came from a file or a model goes through `safe_text` before it reaches a terminal.
"""

from __future__ import annotations

import re

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DECIMAL_PREFIXES = ("", "k", "M", "G", "T", "P", "E")


def _one_decimal(value: float) -> str:
    if value == int(value) or round(value, 1) == round(value):
        return f"{round(value):,}"
    return f"{value:,.1f}"


def format_bytes(n: float) -> str:
    """Bytes in binary units: 25165824000 -> "23.4 GiB", 85899345920 -> "80 GiB"."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    unit = 0
    while value >= 1024 and unit < len(_BINARY_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{int(value):,} B"
    if round(value, 1) >= 1024 and unit < len(_BINARY_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{sign}{_one_decimal(value)} {_BINARY_UNITS[unit]}"


def _decimal(value: float, suffix: str) -> str:
    """Three significant figures with a decimal prefix: 3.35e12 -> "3.35 T" + suffix."""
    prefix = 0
    while abs(value) >= 1000 and prefix < len(_DECIMAL_PREFIXES) - 1:
        value /= 1000
        prefix += 1
    if abs(value) >= 100:
        text = f"{value:.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}".rstrip("0").rstrip(".")
    else:
        text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} {_DECIMAL_PREFIXES[prefix]}{suffix}"


def format_bandwidth(bytes_per_s: float) -> str:
    """A memory bandwidth, decimal: 3.35e12 -> "3.35 TB/s"."""
    return _decimal(bytes_per_s, "B/s")


def format_flops_rate(flops_per_s: float) -> str:
    """FLOP/s, decimal: 989.4e12 -> "989 TFLOP/s"."""
    return _decimal(flops_per_s, "FLOP/s")


def format_seconds(seconds: float) -> str:
    """A duration: 0.0123 -> "12.3 ms", 4.2e-5 -> "42.0 µs", 1.5 -> "1.50 s"."""
    if seconds >= 1:
        return f"{seconds:,.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} µs"


def format_ratio(ratio: float) -> str:
    """A work or speed ratio, one decimal unless whole: 16.5 -> "16.5x", 24.0 -> "24x",
    2048.5 -> "2,048.5x"."""
    return f"{_one_decimal(ratio)}x"


def format_rate(per_second: float) -> str:
    """A rate such as tokens per second: "1,023", "207", "12.4", "0.35"."""
    if per_second >= 100:
        return f"{per_second:,.0f}"
    return f"{per_second:.1f}" if per_second >= 1 else f"{per_second:.2f}"


def format_count(n: int, noun: str) -> str:
    """A count of things, with the noun in the singular or plural: "1 thread", "2 threads"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def format_tick(value: float) -> str:
    """A chart's tick label, short: 1200 -> "1.2k", 3_000_000 -> "3M", 0.5 -> "0.5"."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            text = f"{value / scale:.1f}".rstrip("0").rstrip(".")
            return text + suffix
    if value == int(value):
        return str(int(value))
    return f"{value:.2g}"


def format_int(n: int) -> str:
    """A whole number with thousands separators: 8390656 -> "8,390,656"."""
    return f"{n:,}"


def format_percent(fraction: float, digits: int = 0) -> str:
    """A fraction as a percentage: 0.29296875 -> "29%"."""
    return f"{fraction * 100:.{digits}f}%"


def format_params(n: int) -> str:
    """A parameter count: 8030261248 -> "8.03B", 124439808 -> "124M"."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            value = n / scale
            text = f"{value:.0f}" if value >= 100 else f"{value:.3g}"
            return f"{text}{suffix}"
    return str(n)


_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_text(text: str, *, one_line: bool = False) -> str:
    """Text from a file, a model or a command line, safe to print on a terminal: C0 control
    characters (ESC among them) but newline and tab, DEL, the C1 controls and lone surrogates are
    written as escapes ("\\x1b", "\\x9b", "\\udcff"), so that no part of it can move the cursor,
    retitle the window or fail to encode. `one_line` escapes newline and tab too."""
    return (_UNSAFE_LINE if one_line else _UNSAFE).sub(_escape, str(text))


def error_line(exc: BaseException, limit: int = 200) -> str:
    """An exception as one line a person can read: its type and its message with every run of
    white space (newlines too) one space, escaped (`safe_text`) and cut to `limit` characters."""
    words = " ".join(str(exc).split())
    text = safe_text(f"{type(exc).__name__}: {words}" if words else type(exc).__name__)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]iB|B)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A size as people write it, binary units: "64MiB", "1.5 GiB", "4096" (bytes) -> bytes,
    rounded down to a whole byte. ValueError for anything else (decimal "GB" included: kvtui's
    sizes are binary, and "1 GB" would be ambiguous)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"expected a size such as 64MiB or 1.5GiB (units B, KiB, MiB, GiB, TiB), not {text!r}"
        )
    number, unit = match.groups()
    whole, _, fraction = number.partition(".")
    scale = _SIZE_UNITS[(unit or "b").lower()]
    return int(whole) * scale + (int(fraction) * scale // 10 ** len(fraction) if fraction else 0)


def format_share(fraction: float) -> str:
    """A share of a whole, as much as a glance needs: 0.4123 -> "41%", 0.0237 -> "2.4%",
    0.0004 -> "<0.1%", 0 -> "0%"."""
    if fraction <= 0:
        return "0%"
    if fraction < 0.0005:
        return "<0.1%"
    if fraction < 0.0995:
        return f"{fraction * 100:.1f}%"
    return f"{fraction * 100:.0f}%"


def format_digits(n: int) -> str:
    """A whole number for large digits (kvtui's Digits have no comma): 8390656 -> "8 390 656"."""
    return f"{n:,}".replace(",", " ")
