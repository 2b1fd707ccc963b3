"""Large type for a room, without a UI: text drawn by pyfiglet in the largest font that fits a box.

Presenter mode's figures, titles and question grow with the terminal. The fonts are FIGlet
fonts that ship with pyfiglet, a ladder from 3 rows (`future`, the box-drawing digits Textual's
`Digits` draw) to `ansi_regular`'s solid blocks drawn at two, three and four times their size:
`fit` takes the largest whose rendering fits the width and the rows it is given (wrapping words
onto more lines where it may). Each font's band of rows is fixed (cropped once from a reference
rendering), so every text in one font is as tall as any other: a figure keeps its height while
it counts up.

`title_card` lays out the title slide as plain lines, the same for the app's first frame and
for the card `kvtui --present` prints before the app has imported (kvtui.cli): no dead air.
`kept_title_card` keeps each size's card for the next launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import textwrap
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyfiglet


@dataclass(frozen=True)
class Font:
    """A FIGlet font shipped with pyfiglet, drawn `scale` times its size."""

    name: str
    scale: int = 1


LADDER: tuple[Font, ...] = (
    Font("future"),
    Font("ansi_regular"),
    Font("dos_rebel"),
    Font("ansi_regular", 2),
    Font("ansi_regular", 3),
    Font("ansi_regular", 4),
)
"""The fonts `fit` tries, smallest first: a line of figures in them is 3, 5, 9, 10, 15 and 20
rows tall."""

REFERENCE = "0123456789,.%xKMGiB"
"""What a font's band of rows is measured on: the digits, a comma's tail and the units. A text
that reaches beyond it (a "g"'s tail) takes the rows it needs too."""

SUBSTITUTES = str.maketrans({"×": "x", "·": "-", "—": "-", "–": "-", "…": "...", "’": "'"})
"""Characters outside FIGlet's ASCII, drawn as the ASCII nearest them."""


@dataclass(frozen=True)
class Big:
    """Text drawn large: its lines, the font they are in (an index into the ladder), and how
    many rows they take."""

    lines: tuple[str, ...]
    font: int

    @property
    def rows(self) -> int:
        return len(self.lines)

    @property
    def width(self) -> int:
        return max((len(line) for line in self.lines), default=0)


def ascii_text(text: str) -> str:
    """`text` as FIGlet can draw it: a few symbols as their nearest ASCII, anything else left
    out."""
    return "".join(ch for ch in text.translate(SUBSTITUTES) if " " <= ch <= "~")


@lru_cache(maxsize=16)
def _figlet(name: str) -> pyfiglet.Figlet:
    import pyfiglet  # its fonts take longer to load than the card takes to draw (`kept_title_card`)

    return pyfiglet.Figlet(font=name, width=100_000)


def _used(rows: list[str]) -> tuple[int, int]:
    used = [i for i, row in enumerate(rows) if row.strip()] or [0]
    return used[0], used[-1] + 1


@lru_cache(maxsize=16)
def _band(name: str) -> tuple[int, int]:
    """The rows (first, last + 1) of `name`'s rendering that every text takes."""
    return _used(_figlet(name).renderText(REFERENCE).split("\n"))


def font_rows(font: Font) -> int:
    """The rows a line of figures in `font` takes (a text with a descender may take more)."""
    first, last = _band(font.name)
    return (last - first) * font.scale


@lru_cache(maxsize=512)
def render(text: str, font: Font) -> tuple[str, ...]:
    """One line of `text` in `font`: the font's band of rows (and any more it reaches), trailing
    spaces cut to the widest."""
    rows = _figlet(font.name).renderText(ascii_text(text)).split("\n")
    first, last = _band(font.name)
    top, bottom = _used(rows)
    rows = rows[min(first, top) : max(last, bottom)]
    width = max((len(row.rstrip()) for row in rows), default=0)
    rows = [row[:width].ljust(width) for row in rows]
    if font.scale > 1:
        rows = ["".join(ch * font.scale for ch in row) for row in rows for _ in range(font.scale)]
    return tuple(rows)


def _wrapped(text: str, font: Font, width: int, lines: int) -> list[tuple[str, ...]] | None:
    """`text` in `font`, its words wrapped greedily into at most `lines` lines no wider than
    `width`; None where a word alone is too wide or it takes more lines."""
    drawn: list[tuple[str, ...]] = []
    line = ""
    for word in text.split():
        candidate = f"{line} {word}" if line else word
        if line and len(render(candidate, font)[0]) > width:
            drawn.append(render(line, font))
            line = word
        else:
            line = candidate
        if len(render(line, font)[0]) > width:
            return None
    if line:
        drawn.append(render(line, font))
    return drawn if len(drawn) <= lines else None


def fit(
    text: str,
    width: int,
    height: int,
    *,
    wrap: bool = False,
    most: int | None = None,
    gap: int = 0,
) -> Big | None:
    """`text` in the largest font of the ladder (at most the `most`-th) that fits `width` x
    `height` cells, its words wrapped onto more lines (`gap` blank rows apart) if `wrap`; None
    where even the smallest does not fit."""
    top = len(LADDER) - 1 if most is None else max(0, min(most, len(LADDER) - 1))
    for index in range(top, -1, -1):
        font = LADDER[index]
        rows = font_rows(font)
        if rows > height:
            continue
        lines = (height + gap) // (rows + gap) if wrap else 1
        drawn = _wrapped(text, font, width, lines)
        if drawn is None or sum(len(b) for b in drawn) + gap * (len(drawn) - 1) > height:
            continue
        out: list[str] = []
        for i, block in enumerate(drawn):
            out += [""] * (gap if i else 0)
            out += block
        return Big(tuple(out), index)
    return None


def largest_font(texts: list[str], width: int, height: int) -> int | None:
    """The largest font in which every one of `texts` fits on one line of `width` x `height`
    (a node's figures share their size), or None."""
    fonts = [fit(text, width, height) for text in texts if text]
    if not fonts or any(f is None for f in fonts):
        return None
    return min(f.font for f in fonts if f is not None)


TITLE = "kvtui"
SUBTITLE = "why LLM decoding needs a KV cache"
IDEA = (
    "A model decodes beside this screen, with and without a cache: every figure says if "
    "it is measured, recorded or modelled. Space moves on."
)


@dataclass(frozen=True)
class CardLine:
    """A line of the title card, and what it is: "title", "subtitle", "idea" or "blank"."""

    text: str
    kind: str


def title_card(width: int, height: int) -> list[CardLine]:
    """The title slide in `width` x `height` cells, centred: the name large, the subtitle large
    where it fits (else in words), the sentence, wrapped. Its last two rows are left for the
    engine's line (what it is doing while it starts)."""
    room = max(1, height - 2)
    lines: list[CardLine] = []
    name = fit(TITLE, width - 4, max(3, room // 3))
    sub = fit(SUBTITLE, width - 4, max(3, room // 3), wrap=True, most=2, gap=1)
    idea = textwrap.wrap(IDEA, max(1, min(width - 4, 72)))
    body: list[CardLine] = []
    if name is not None:
        body += [CardLine(line, "title") for line in name.lines]
    else:
        body.append(CardLine(TITLE, "title"))
    body.append(CardLine("", "blank"))
    if sub is not None and len(body) + sub.rows + 1 + len(idea) <= room:
        body += [CardLine(line, "subtitle") for line in sub.lines]
    else:
        body.append(CardLine(SUBTITLE, "subtitle"))
    body.append(CardLine("", "blank"))
    body += [CardLine(line, "idea") for line in idea]
    top = max(0, (room - len(body)) // 2)
    lines += [CardLine("", "blank")] * top
    for line in body[:room]:
        pad = max(0, (width - len(line.text)) // 2)
        lines.append(CardLine(" " * pad + line.text, line.kind))
    return lines


CARD_KINDS = ("title", "subtitle", "idea", "blank")
KEPT_CARDS = 32
"""The most sizes of card `kept_title_card` keeps (the sizes drawn last)."""
KEPT_BYTES = 1 << 20
"""A file of kept cards larger than this is not read."""


def kept_title_card(width: int, height: int, folder: Path) -> list[CardLine]:
    """`title_card(width, height)` as the last launch at this size drew it, kept in `folder`
    (title-cards.json), so that a launch draws its card without loading pyfiglet's fonts (most
    of the card's cost, which the app's first frame waits for); drawn, and kept, where it is
    not there. The file is checked as any file from outside is: cards kept by another version
    of this module (its source is the key), a line that is not printable text or does not fit,
    a file that is not what kvtui writes, too large or not a regular file: drawn afresh. Where
    the file cannot be read or written the card is drawn, and not kept."""
    path = folder / "title-cards.json"
    try:
        key = f"{zlib.crc32(Path(__file__).read_bytes()):08x}"
    except OSError:  # no source to key it by (kvtui run from a zip, say): drawn, not kept
        return title_card(width, height)
    size = f"{width}x{height}"
    cards: dict[str, object] = {}
    try:
        found = path.stat()
        if stat.S_ISREG(found.st_mode) and found.st_size <= KEPT_BYTES:  # a FIFO would hang
            kept = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(kept, dict) and kept.get("key") == key:
                cards = kept["cards"] if isinstance(kept.get("cards"), dict) else {}
    except (OSError, ValueError, RecursionError):
        pass
    card = _card_from(cards.get(size), width, height)
    if card is not None:
        return card
    card = title_card(width, height)
    cards = {k: v for k, v in cards.items() if k != size}
    cards[size] = [[line.text, line.kind] for line in card]
    cards = dict(list(cards.items())[-KEPT_CARDS:])
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        part.write_text(json.dumps({"key": key, "cards": cards}), encoding="utf-8")
        os.replace(part, path)
    except OSError:
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
    return card


def _card_from(kept: object, width: int, height: int) -> list[CardLine] | None:
    """A kept card's lines, if it is one that fits `width` x `height`: printable text only."""
    if not isinstance(kept, list) or len(kept) > height:
        return None
    card = []
    for line in kept:
        if not (isinstance(line, list) and len(line) == 2 and line[1] in CARD_KINDS):
            return None
        text = line[0]
        if not (isinstance(text, str) and len(text) <= width and text.isprintable()):
            return None
        card.append(CardLine(text, line[1]))
    return card
