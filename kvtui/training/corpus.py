"""Jane Austen's six novels from an R lazy-load database, without R.

Debian's `r-cran-janeaustenr` (MIT; the novels themselves are public domain, from Project
Gutenberg) ships the texts as `data/Rdata.rdb` + `Rdata.rdx`: an R lazy-load database. The `.rdx`
is a gzip-compressed R serialization of an index (variable name -> offset and length in the
`.rdb`); each `.rdb` entry is a 4-byte big-endian uncompressed length followed by a zlib stream
holding one serialized R object. Each novel is a character vector, one element per line.

Only the parts of R's XDR serialization format that these files use are read: see R's
`src/main/serialize.c` ("R Internals", section 1.8 "Serialization Formats").
"""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

#: Where Debian installs the package's data.
DEBIAN_DATA_DIR = Path("/usr/lib/R/site-library/janeaustenr/data")

#: The six novels in publication order, by their names in the R package.
NOVELS = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)

# SEXP types (R Internals, 1.1.1) and serialization pseudo-types (serialize.c).
_SYMSXP, _LISTSXP, _CHARSXP, _LGLSXP, _INTSXP, _REALSXP, _STRSXP, _VECSXP = (
    1,
    2,
    9,
    10,
    13,
    14,
    16,
    19,
)
_REFSXP, _NILVALUE_SXP, _GLOBALENV_SXP, _EMPTYENV_SXP, _BASEENV_SXP = 255, 254, 253, 242, 241
_MISSINGARG_SXP, _BASENAMESPACE_SXP = 251, 247


class RDataError(ValueError):
    """The file is not an R serialization this reader understands."""


@dataclass
class _Reader:
    data: bytes
    pos: int = 0

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def bytes(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        if len(out) != n:
            raise RDataError("truncated R serialization")
        self.pos += n
        return out


def unserialize(blob: bytes) -> object:
    """One R object from XDR serialization bytes (`X\\n` header): lists, strings, numbers."""
    r = _Reader(blob)
    if r.bytes(2) != b"X\n":
        raise RDataError("not an XDR R serialization (expected 'X\\n')")
    version = r.int()
    r.int()  # R version that wrote it
    r.int()  # minimal R version to read it
    if version == 3:
        r.bytes(r.int())  # native encoding, e.g. UTF-8
    elif version != 2:
        raise RDataError(f"unsupported R serialization version {version}")
    refs: list[object] = []
    return _item(r, refs)


def _item(r: _Reader, refs: list[object]) -> object:
    flags = r.int()
    kind = flags & 0xFF
    has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
    if kind in (
        _NILVALUE_SXP,
        _GLOBALENV_SXP,
        _EMPTYENV_SXP,
        _BASEENV_SXP,
        _MISSINGARG_SXP,
        _BASENAMESPACE_SXP,
    ):
        return None
    if kind == _REFSXP:
        index = flags >> 8 or r.int()
        return refs[index - 1]
    if kind == _SYMSXP:
        name = _item(r, refs)
        refs.append(name)
        return name
    if kind == _CHARSXP:
        n = r.int()
        return None if n == -1 else r.bytes(n).decode("utf-8", errors="replace")
    if kind == _LISTSXP:
        if has_attr:
            _item(r, refs)  # a pairlist's own attributes: not needed here
        tag = _item(r, refs) if has_tag else None
        car = _item(r, refs)
        cdr = _item(r, refs)
        pairs = [(tag, car)]
        if isinstance(cdr, _Pairlist):
            pairs.extend(cdr.pairs)
        return _Pairlist(pairs)
    if kind in (_STRSXP, _VECSXP):
        values = [_item(r, refs) for _ in range(r.int())]
    elif kind in (_INTSXP, _LGLSXP):
        n = r.int()
        values = list(struct.unpack_from(f">{n}i", r.bytes(4 * n)))
    elif kind == _REALSXP:
        n = r.int()
        values = list(struct.unpack_from(f">{n}d", r.bytes(8 * n)))
    else:
        raise RDataError(f"unsupported R object type {kind}")
    if has_attr:
        attrs = _item(r, refs)
        names = attrs.get("names") if isinstance(attrs, _Pairlist) else None
        if names is not None and len(names) == len(values):
            return dict(zip(names, values, strict=True))
    return values


@dataclass
class _Pairlist:
    pairs: list[tuple[object, object]]

    def get(self, key: str) -> object:
        return next((value for tag, value in self.pairs if tag == key), None)


def read_lazyload(data_dir: Path) -> dict[str, object]:
    """Every object in an R lazy-load database (`Rdata.rdx` + `Rdata.rdb`), by name."""
    try:
        index = unserialize(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
        rdb = (data_dir / "Rdata.rdb").read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise RDataError(f"cannot read the R database in {data_dir}: {exc}") from exc
    if not isinstance(index, dict) or not isinstance(index.get("variables"), dict):
        raise RDataError("the .rdx index has no 'variables' table")
    objects = {}
    for name, (offset, length) in index["variables"].items():
        chunk = rdb[offset : offset + length]
        objects[name] = unserialize(zlib.decompress(chunk[4:]))
    return objects


def austen_novels(data_dir: Path = DEBIAN_DATA_DIR) -> dict[str, str]:
    """The six novels as text, one string each, in publication order."""
    objects = read_lazyload(data_dir)
    missing = [name for name in NOVELS if name not in objects]
    if missing:
        raise RDataError(f"novels missing from {data_dir}: {', '.join(missing)}")
    return {name: "\n".join(line or "" for line in objects[name]) + "\n" for name in NOVELS}


def train_val_split(novels: dict[str, str], val_fraction: float = 0.05) -> tuple[str, str]:
    """Training and validation text: the last `val_fraction` of each novel is held out."""
    train, val = [], []
    for text in novels.values():
        cut = int(len(text) * (1 - val_fraction))
        cut = text.rfind("\n", 0, cut) + 1 or cut  # split on a line boundary
        train.append(text[:cut])
        val.append(text[cut:])
    return "".join(train), "".join(val)
