"""Byte-level text: the tokens of the shipped model are UTF-8 bytes. No torch, no UI."""

from __future__ import annotations

import codecs


class Utf8Stream:
    """Bytes in, text out, never splitting a multi-byte character (invalid bytes become U+FFFD)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, byte: int) -> str:
        """The text that `byte` completes: empty in the middle of a multi-byte character."""
        return self._decoder.decode(bytes([byte]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def encode_bytes(text: str) -> list[int]:
    """The byte-level tokens of `text` (a lone newline for empty text: decoding needs a start)."""
    return list(text.encode("utf-8")) or [ord("\n")]


def decode_bytes(token_ids: list[int]) -> str:
    return bytes(token_ids).decode("utf-8", errors="replace")
