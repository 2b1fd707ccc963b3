"""Reading what a user hands kvtui, bounded: one clear line when it is refused. No torch, no UI.

Every file kvtui reads on a user's say-so (a replay record, a config.json, the weights of a model
folder) comes through here, and is refused with an `InputError` rather than read when it

- is not a regular file: a FIFO, `/dev/zero` or a terminal would block a read or never end, so the
  file is opened without blocking and checked with `fstat` before a byte is read;
- is larger than the cap its reader states: nothing is read past it;
- is not valid UTF-8 JSON, nests deeper than the interpreter can parse, or holds `NaN` or
  `Infinity` (not JSON, though Python's parser takes them).

`model_weights` names the safetensors files of a Hugging Face model folder, exactly the ones
transformers would load, each inside the folder and with a header that checks out; a folder with
only pickled weights (`pytorch_model.bin`, `*.pt`) is refused before anything loads them.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Generator
from pathlib import Path, PurePosixPath
from typing import IO, Any

KIB, MIB = 2**10, 2**20


class InputError(ValueError):
    """A file or value kvtui will not read: one line for a person to read."""


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def open_regular(path: Path) -> IO[bytes]:
    """`path` opened for reading in binary, if it is a regular file (symlinks followed).

    Opened without blocking (a FIFO with no writer would block `open` itself), then checked
    through the open descriptor, so what is checked is what is read."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InputError(f"cannot read {path}: {_reason(exc)}") from None
    except ValueError:  # an embedded NUL
        raise InputError(f"{path!r} is not a file name") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"cannot read {path}: a {_kind(mode)}, not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _size(f: IO[bytes]) -> int:
    return os.fstat(f.fileno()).st_size


def _too_big(path: Path, limit: int) -> InputError:
    return InputError(f"{path} is larger than the {limit // MIB:,} MiB kvtui reads")


def read_bytes(path: Path, limit: int) -> bytes:
    """A regular file's bytes, refused if over `limit` (checked before reading, and while)."""
    with open_regular(path) as f:
        if _size(f) > limit:
            raise _too_big(path, limit)
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise InputError(f"cannot read {path}: {_reason(exc)}") from None
    if len(data) > limit:  # it grew after the check
        raise _too_big(path, limit)
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: str | bytes) -> Any:
    """JSON as RFC 8259 has it: no NaN or Infinity, no number that overflows to infinity, no
    integer too long to convert. ValueError (with the parser's reason) otherwise, also for
    nesting deeper than the interpreter's recursion limit."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")  # UnicodeDecodeError is a ValueError
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    _check_finite(data)
    return data


def _check_finite(data: Any) -> None:
    """ValueError for a float that parsed to infinity (`1e400`). Iterative: no recursion."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError("a number too large for a float")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _json_reason(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"line {exc.lineno}: {exc.msg}"
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 text"
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__


def read_json(path: Path, limit: int) -> Any:
    """A regular file of at most `limit` bytes, as JSON; `InputError` naming the file if not."""
    data = read_bytes(path, limit)
    try:
        return parse_json(data.removeprefix(b"\xef\xbb\xbf"))  # a BOM, as some editors write
    except ValueError as exc:
        raise InputError(f"{path} is not valid JSON ({_json_reason(exc)})") from None


NAME_MAX, PATH_MAX = 255, 4096
"""The longest file name and path Linux takes, in bytes (a path: PATH_MAX - 1 and a NUL)."""


def _shown_path(text: str) -> str:
    return text if len(text) <= 60 else f"{text[:28]}...{text[-28:]} ({len(text):,} characters)"


def user_path(text: str) -> Path:
    """A path as a person typed it (`~` and `~user` expanded as a shell would), refused in one
    line (`InputError`) when no file could have it: a user with no home, a NUL, characters that are
    not a file name, a name past NAME_MAX bytes or a path past PATH_MAX. Checked where it enters,
    so that a later `stat` or `open` never raises what it cannot say in a line."""
    shown = _shown_path(text)
    if "\0" in text:
        raise InputError(f"{shown!r} is not a file name (it holds a NUL)")
    path = Path(text)
    if text.startswith("~"):
        try:
            path = path.expanduser()
        except RuntimeError:  # `~nosuchuser`: no such user, or no home to expand
            user = text[1:].split("/", 1)[0]
            who = f"no user {user!r}" if user else "no home directory"
            raise InputError(f"{shown}: there is {who} to expand ~ to") from None
    try:
        encoded = os.fsencode(path)
    except UnicodeEncodeError:
        raise InputError(f"{shown!r} is not a file name (characters no file name holds)") from None
    longest = max(len(part) for part in encoded.split(b"/"))
    if longest > NAME_MAX:
        raise InputError(
            f"{shown}: a name of {longest:,} bytes (a file name is at most {NAME_MAX})"
        )
    if len(encoded) >= PATH_MAX:
        raise InputError(
            f"{shown}: a path of {len(encoded):,} bytes (a path is at most {PATH_MAX - 1:,})"
        )
    return path


def output_file(text: str) -> Path:
    """A file to write, as a person typed it (`user_path`), that names a file: not a path ending
    in `/`, which asks for a directory, nor a directory that exists (`InputError`)."""
    path = user_path(text)
    if text.endswith("/") or path.is_dir():
        raise InputError(
            f"{_shown_path(text)} names a directory, not a regular file; give a file's name"
        )
    return path


def argv_text(text: str) -> str:
    """Text from the command line as text: bytes that were not UTF-8 (which Python keeps as lone
    surrogates, U+DC80..U+DCFF) decoded with U+FFFD in their place, so that the text encodes,
    prints and records without a UnicodeEncodeError."""
    text = _NOT_A_BYTE.sub("\ufffd", text)  # surrogates that never stood for a byte
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


_NOT_A_BYTE = re.compile("[\ud800-\udc7f\udd00-\udfff]")

MAX_COLUMNS, MAX_ROWS = 1_000, 500
"""The largest terminal kvtui draws. An 8K display in a 6-pixel font is about 1,000 x 400 cells;
a page claiming 4,000 x 4,000 had an app lay out and draw 16 million cells a frame (its first
frame took minutes)."""


def terminal_size(width: Any, height: Any) -> tuple[int, int]:
    """A terminal's size as a page declares it (kvtui serve's: in its URL, then with each
    resize), in cells: clamped to 1..MAX_COLUMNS by 1..MAX_ROWS (a size of 0 is laid out never,
    so the app would never draw), and refused where either is not an integer."""
    if not (_is_int(width) and _is_int(height)):
        raise InputError(f"a terminal size of {width!r:.20} x {height!r:.20} cells")
    return max(1, min(MAX_COLUMNS, width)), max(1, min(MAX_ROWS, height))


def read_lines(path: Path, limit: int, line_limit: int) -> Generator[tuple[int, str], None, None]:
    """(number, text) of each line of a regular UTF-8 file of at most `limit` bytes, whose lines
    are at most `line_limit` bytes; `InputError` naming the file (and the line) if not."""
    with open_regular(path) as f:
        if _size(f) > limit:
            raise _too_big(path, limit)
        total = 0
        number = 0
        while True:
            try:
                raw = f.readline(line_limit + 1)
            except OSError as exc:
                raise InputError(f"cannot read {path}: {_reason(exc)}") from None
            if not raw:
                return
            number += 1
            total += len(raw)
            if total > limit:
                raise _too_big(path, limit)
            if len(raw) > line_limit and not raw.endswith(b"\n"):
                raise InputError(
                    f"{path}, line {number}: longer than the {line_limit // KIB:,} KiB a line "
                    "may be"
                )
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{path}, line {number}: not UTF-8 text") from None


# --- a Hugging Face model folder's weights -------------------------------------------------------

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
SAFE_INDEX_END = ".safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
"""Weights in Python's pickle format: loading one can run any code, so kvtui never does."""

INDEX_LIMIT = 64 * MIB
"""The largest shard index read (DeepSeek-V3's, with 91,000 tensors, is 8.9 MB)."""
MAX_SHARDS = 10_000
SAFETENSORS_HEADER_LIMIT = 100_000_000
"""The largest safetensors header, as the safetensors library itself caps it."""

_DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
"""Bits per element of each safetensors dtype."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def safetensors_header(path: Path) -> dict[str, Any]:
    """The header of a safetensors file, checked as the safetensors library checks it before
    mapping the file, so that a lying header is one line here and never a crash there.

    The layout: 8 bytes, a little-endian length N; N bytes of a JSON object naming each tensor's
    dtype, shape and `data_offsets` [start, end) in the data that follows, plus an optional
    `__metadata__` of strings. The tensors must tile the data exactly, each as long as its dtype
    and shape say. Returns the header, `__metadata__` included."""
    with open_regular(path) as f:
        size = _size(f)
        if size < 8:
            raise InputError(f"{path} is not a safetensors file ({size} bytes)")
        try:
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8 or n > SAFETENSORS_HEADER_LIMIT:
                raise InputError(
                    f"{path}: corrupt safetensors header (it claims {n:,} bytes; the file has "
                    f"{size:,})"
                )
            raw = f.read(n)
        except OSError as exc:
            raise InputError(f"cannot read {path}: {_reason(exc)}") from None
    if len(raw) != n:
        raise InputError(f"{path}: the file ends inside its safetensors header")
    try:
        header = parse_json(raw)
    except ValueError as exc:
        raise InputError(f"{path}: corrupt safetensors header ({_json_reason(exc)})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (not a JSON object)")
    _check_tensors(path, header, size - 8 - n)
    return header


def _check_tensors(path: Path, header: dict[str, Any], data_bytes: int) -> None:
    def bad(why: str) -> InputError:
        return InputError(f"{path}: corrupt safetensors header ({why})")

    metadata = header.get("__metadata__")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad("__metadata__ must map names to strings")
    spans = []
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(tensor, dict):
            raise bad(f"tensor {name!r} is not an object")
        dtype, shape, offsets = tensor.get("dtype"), tensor.get("shape"), tensor.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
            raise bad(f"tensor {name!r} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"tensor {name!r} has a bad shape")
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
        ):
            raise bad(f"tensor {name!r} has bad data_offsets")
        start, end = offsets
        if not 0 <= start <= end <= data_bytes:
            raise bad(f"tensor {name!r} lies outside the file's {data_bytes:,} bytes of data")
        bits = math.prod(shape) * _DTYPE_BITS[dtype]
        if bits % 8 or bits // 8 != end - start:
            raise bad(f"tensor {name!r} is {end - start:,} bytes, not what its shape and dtype say")
        spans.append((start, end))
    at = 0
    for start, end in sorted(spans):
        if start != at:
            raise bad("tensors overlap or leave gaps")
        at = end
    if at != data_bytes:
        raise bad(f"the tensors cover {at:,} of the file's {data_bytes:,} bytes of data")


def _inside(root: Path, name: Any, where: str) -> Path:
    """`root / name` for a plain relative name that stays inside `root` once symlinks are
    resolved (or, in a Hugging Face hub cache's `snapshots/REV` folder, inside its `blobs`)."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise InputError(f"{where}: {name!r} is not a file name in the model folder")
    if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
        raise InputError(f"{where}: {name!r} is outside the model folder")
    path = root / name
    try:
        resolved = path.resolve(strict=True)
    except FileNotFoundError:
        raise InputError(f"{where}: {name} does not exist") from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise InputError(f"{where}: cannot resolve {name} ({exc})") from None
    allowed = [root]
    if root.parent.name == "snapshots":  # huggingface_hub's cache: links into ../../blobs
        allowed.append(root.parent.parent / "blobs")
    if not any(resolved.is_relative_to(top) for top in allowed):
        raise InputError(f"{where}: {name} is a link to {resolved}, outside the model folder")
    return path


FOLDER_FILE_LIMIT = 256 * MIB
"""The largest config, tokenizer or template file a model folder may hold (transformers reads
them whole; the largest published tokenizer.json is about 35 MB)."""
MAX_FOLDER_ENTRIES = 10_000
_READ_WHOLE = (".json", ".txt", ".model", ".jinja", ".tiktoken")


def check_folder_files(directory: Path) -> None:
    """`InputError` unless every file in a model folder (links followed) is a regular file or a
    folder, and every file transformers reads whole (`*.json`, `*.txt`, `*.model`, `*.jinja`,
    `*.tiktoken`) is at most FOLDER_FILE_LIMIT: a FIFO named tokenizer.json would block the
    load forever, and `/dev/zero` linked as one would fill memory."""
    try:
        entries = os.scandir(directory)
    except OSError as exc:
        raise InputError(f"cannot read {directory}: {_reason(exc)}") from None
    with entries:
        for count, entry in enumerate(entries):
            if count >= MAX_FOLDER_ENTRIES:
                raise InputError(f"{directory} holds more than {MAX_FOLDER_ENTRIES:,} files")
            try:
                info = os.stat(entry.path)
            except OSError:
                continue  # a dangling link: nothing can read it
            if stat.S_ISDIR(info.st_mode):
                continue
            if not stat.S_ISREG(info.st_mode):
                raise InputError(
                    f"{entry.path} is a {_kind(info.st_mode)}, not a regular file: kvtui loads "
                    "model folders of regular files only"
                )
            if entry.name.endswith(_READ_WHOLE) and info.st_size > FOLDER_FILE_LIMIT:
                raise _too_big(Path(entry.path), FOLDER_FILE_LIMIT)


def model_weights(directory: Path, explicit: Any = None) -> list[Path]:
    """The safetensors files transformers would load from a model folder, each checked
    (`safetensors_header`); `InputError` with one line, before anything is loaded, if one is
    not safetensors, lies outside the folder, or has a header that does not check out.

    Which files, in transformers' order: the config's `transformers_weights` (`explicit`) when
    it names one, else `model.safetensors`, else every shard `model.safetensors.index.json` maps
    a tensor to. A folder with neither is refused, pickled weights or not."""
    root = directory.resolve()
    if explicit is not None:
        if not (isinstance(explicit, str) and explicit.endswith((".safetensors", SAFE_INDEX_END))):
            raise InputError(
                f"{directory}/config.json: transformers_weights {explicit!r} is not a safetensors "
                "file (kvtui never loads pickled weights)"
            )
        entry = explicit
    elif os.path.lexists(root / SAFE_WEIGHTS):
        entry = SAFE_WEIGHTS
    elif os.path.lexists(root / SAFE_INDEX):
        entry = SAFE_INDEX
    else:
        pickled = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        found = f" (found {pickled[0]})" if pickled else ""
        raise InputError(
            f"{directory} has no safetensors weights{found}: kvtui loads {SAFE_WEIGHTS} or "
            f"{SAFE_INDEX} and never pickled weights"
        )
    if not entry.endswith(SAFE_INDEX_END):
        files = [_inside(root, entry, str(directory))]
    else:
        index_path = _inside(root, entry, str(directory))
        index = read_json(index_path, INDEX_LIMIT)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{index_path} has no weight_map of tensor names to files")
        names = set()
        for shard in weight_map.values():
            if not (isinstance(shard, str) and shard.endswith(".safetensors")):
                raise InputError(
                    f"{index_path} names {shard!r}, not a .safetensors file (kvtui never loads "
                    "pickled weights)"
                )
            names.add(shard)
        if len(names) > MAX_SHARDS:
            raise InputError(f"{index_path} names {len(names):,} files; kvtui reads {MAX_SHARDS:,}")
        files = [_inside(root, name, str(index_path)) for name in sorted(names)]
    for path in files:
        safetensors_header(path)
    return files
