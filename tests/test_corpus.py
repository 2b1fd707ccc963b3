"""The R lazy-load reader, on a small database written here in R's XDR format (no R needed)."""

import gzip
import struct
import zlib

import pytest

from kvtui.training.corpus import (
    DEBIAN_DATA_DIR,
    NOVELS,
    RDataError,
    austen_novels,
    read_lazyload,
    train_val_split,
    unserialize,
)

# R's serialization (R Internals, 1.8): type codes and flag bits
STRSXP, VECSXP, INTSXP, CHARSXP, LISTSXP, SYMSXP, NILVALUE = 16, 19, 13, 9, 2, 1, 254
HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10


def i32(n: int) -> bytes:
    return struct.pack(">i", n)


def charsxp(text: str | None) -> bytes:
    if text is None:
        return i32(CHARSXP) + i32(-1)
    data = text.encode("utf-8")
    return i32(CHARSXP | (1 << 15)) + i32(len(data)) + data  # UTF-8 flag in the levels


def strsxp(values: list[str | None], names: list[str] | None = None) -> bytes:
    flags = STRSXP | (HAS_ATTR if names else 0)
    out = i32(flags) + i32(len(values)) + b"".join(charsxp(v) for v in values)
    return out + (names_attr(names) if names else b"")


def names_attr(names: list[str]) -> bytes:
    # a pairlist of one tagged element, names = STRSXP, then the end of the list
    return i32(LISTSXP | HAS_TAG) + i32(SYMSXP) + charsxp("names") + strsxp(names) + i32(NILVALUE)


def vecsxp(items: list[bytes], names: list[str]) -> bytes:
    return i32(VECSXP | HAS_ATTR) + i32(len(items)) + b"".join(items) + names_attr(names)


def intsxp(values: list[int]) -> bytes:
    return i32(INTSXP) + i32(len(values)) + b"".join(i32(v) for v in values)


def serialize(body: bytes) -> bytes:
    return b"X\n" + i32(3) + i32(0x040201) + i32(0x030500) + i32(5) + b"UTF-8" + body


def write_database(folder, objects: dict[str, bytes]) -> None:
    rdb, index = b"", {}
    for name, body in objects.items():
        blob = serialize(body)
        entry = i32(len(blob)) + zlib.compress(blob)
        index[name] = (len(rdb), len(entry))
        rdb += entry
    variables = vecsxp([intsxp(list(v)) for v in index.values()], list(index))
    rdx = vecsxp(
        [variables, vecsxp([], []), vecsxp([], [])], ["variables", "references", "compressed"]
    )
    (folder / "Rdata.rdb").write_bytes(rdb)
    (folder / "Rdata.rdx").write_bytes(gzip.compress(serialize(rdx)))


def test_unserialize_strings_with_na_and_utf8():
    assert unserialize(serialize(strsxp(["Miss Bennet", None, "naïve £5"]))) == [
        "Miss Bennet",
        None,
        "naïve £5",
    ]
    assert unserialize(serialize(strsxp(["a", "b"], names=["x", "y"]))) == {"x": "a", "y": "b"}


def test_read_lazyload_and_the_six_novels(tmp_path):
    novels = {
        name: strsxp([f"{name.upper()}", "", f"Chapter 1 of {name}.", None]) for name in NOVELS
    }
    write_database(tmp_path, {"unrelated": intsxp([1, 2]), **novels})
    assert read_lazyload(tmp_path)["unrelated"] == [1, 2]
    texts = austen_novels(tmp_path)
    assert list(texts) == list(NOVELS)
    assert texts["emma"] == "EMMA\n\nChapter 1 of emma.\n\n"


def test_missing_novels_and_broken_files_are_clear_errors(tmp_path):
    write_database(tmp_path, {"emma": strsxp(["EMMA"])})
    with pytest.raises(RDataError, match="novels missing"):
        austen_novels(tmp_path)
    (tmp_path / "Rdata.rdx").write_bytes(b"not gzip")
    with pytest.raises(RDataError, match="cannot read"):
        read_lazyload(tmp_path)
    with pytest.raises(RDataError, match="not an XDR"):
        unserialize(b"A\n....")


def test_validation_split_holds_out_the_end_of_each_novel_on_a_line_boundary():
    novels = {
        "a": "".join(f"line {i} of a\n" for i in range(100)),
        "b": "".join(f"b{i}\n" for i in range(100)),
    }
    train, val = train_val_split(novels, 0.05)
    assert train + val != "" and len(val) < 0.1 * len(train)
    assert val.startswith("line 9") and "b9" in val
    assert train.endswith("\n") and train.count("line") + val.count("line") == 100


@pytest.mark.skipif(not DEBIAN_DATA_DIR.is_dir(), reason="r-cran-janeaustenr is not installed")
def test_the_real_debian_package():
    texts = austen_novels()
    assert texts["prideprejudice"].startswith("PRIDE AND PREJUDICE")
    assert "It is a truth universally acknowledged" in texts["prideprejudice"]
    assert sum(len(t.encode()) for t in texts.values()) > 4_000_000
