"""The KV cache drawn as it is: a row per cached position, grouped into the pool's blocks, and
the step's newest query reading every key, with the attention the engine measured.

With a cache, a step writes one new row (its keys and values; the prefill writes the prompt's)
and the rows before it never change; the newest query reads them all once and is dropped. Without
one, every row is computed again each step. Where there are more rows than lines, the picture
lists the first (the attention sink's) and the newest, and says what lies between: its positions,
its blocks and their share of the attention. Nothing here is drawn from a formula: the rows, blocks
and bytes are the engine's (measured, or modelled by `sim:`), the shares its model's.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from kvtui.engines.attention import SINK_TOKENS
from kvtui.format import format_bytes, format_count, format_share
from kvtui.run.live import CachePicture

NEWEST = 8
"""The newest positions whose share the picture sums up (the rest is the first SINK_TOKENS' and
the middle's)."""

EIGHTHS = " ▏▎▍▌▋▊▉█"

MAX_TOKEN_CELLS = 12
"""The widest a row's token is shown (a longer one is cut, marked "…")."""

SHARE_CELLS = 1 + 4 + 1 + 5
"""What a row's share takes at least: a space, a bar of 4, a space, "12.3%"."""


def token_label(piece: str | None, width: int) -> str:
    """A token's text in at most `width` cells, every character visible: a space as "␣", a
    newline as "↵", a tab as "⇥", other controls as "·", a byte in the middle of a character as
    "◌" (the character comes with a later byte), an unknown text as "?"; a longer text is cut,
    ending in "…"."""
    if piece is None:
        return "?"
    if piece == "":
        return "◌"
    marks = {" ": "␣", "\n": "↵", "\t": "⇥"}
    shown = "".join(marks.get(ch, ch if ch.isprintable() else "·") for ch in piece)
    return shown if len(shown) <= width else shown[: max(1, width - 1)] + "…"


def fit(variants: list[str], width: int) -> str:
    """The first of `variants` (fullest first) no wider than `width`, else the last."""
    return next((v for v in variants if len(v) <= width), variants[-1] if variants else "")


def bar(fraction: float, width: int) -> str:
    """A bar `width` cells long at 100%, in eighths of a cell; any share above 0 shows."""
    if width <= 0:
        return ""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    if fraction > 0 and eighths == 0:
        eighths = 1
    full, part = divmod(eighths, 8)
    return "█" * full + (EIGHTHS[part] if part else "")


def listed(rows: int, room: int) -> list[int | None]:
    """The positions the picture lists in `room` lines for `rows` rows: all of them when they
    fit, else the first ones (up to SINK_TOKENS), a gap (None) and as many of the newest as fit."""
    if rows <= room:
        return list(range(rows))
    if room < 3:  # the gap and the newest row at most
        return [None, *range(rows - room + 1, rows)]
    first = min(SINK_TOKENS, max(1, (room - 1) // 3))
    last = room - 1 - first
    return [*range(first), None, *range(rows - last, rows)]


class CacheGrid(Widget):
    """The KV cache picture of one loop: see the module's docstring."""

    DEFAULT_CSS = """
    CacheGrid {
        border: round $primary;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
        height: 1fr;
        width: 1fr;
    }
    CacheGrid > .grid--kept {
        color: auto;
        background: $success;
    }
    CacheGrid > .grid--new {
        color: auto;
        background: $accent;
        text-style: bold;
    }
    CacheGrid > .grid--recomputed {
        color: auto;
        background: $primary;
    }
    CacheGrid > .grid--query {
        color: $text-primary;
        text-style: bold;
    }
    CacheGrid > .grid--bar {
        color: $warning-darken-3;
    }
    CacheGrid > .grid--muted {
        color: $text-muted;
    }
    """

    COMPONENT_CLASSES = {
        "grid--kept",
        "grid--new",
        "grid--recomputed",
        "grid--query",
        "grid--bar",
        "grid--muted",
    }

    def __init__(
        self, picture: CachePicture, *, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(id=id, classes=classes)
        self.picture = picture

    def on_mount(self) -> None:
        self._titles()

    def on_resize(self) -> None:
        self._titles()

    def show(self, picture: CachePicture) -> None:
        """Draw `picture` (a repaint only when it changed)."""
        if picture == self.picture:
            return
        self.picture = picture
        self._titles()
        self.refresh()

    def _titles(self) -> None:
        """The border's title (how many rows, how large) and subtitle (the blocks, and how the
        figures were had), in as many words as the border holds."""
        p = self.picture
        room = max(8, self.outer_size.width - 6)  # the corners and a space each side
        what = "KV cache" if p.cached else "No cache"
        if p.step is None or p.unseen:
            self.border_title, self.border_subtitle = what, ""
            return
        how = [p.how] if p.how else []
        rows = format_count(p.rows, "row")
        if not p.cached:
            self.border_title = fit([f"{what}: all {rows} again", f"{what}: {rows} again"], room)
            self.border_subtitle = fit([" · ".join(["nothing kept", *how]), "0 B kept"], room)
            return
        sized = [f"{what}: {rows} × {format_bytes(p.row_bytes)}"] if p.row_bytes else []
        self.border_title = fit([*sized, f"{what}: {rows}"], room)
        blocks, split = [], []
        if p.block_tokens and p.blocks is not None:
            free = p.blocks * p.block_tokens - p.rows
            slots = f", {free} slots free" if free > 0 else ""
            blocks = [f"{format_count(p.blocks, 'block')} of {p.block_tokens}{slots}"]
            blocks.append(blocks[0].split(",")[0])
        if p.row_bytes:
            half = format_bytes(p.row_bytes / 2)
            split = [f"a row: K {half} + V {half}"]
        shorter = [[blocks[0]], [blocks[-1]]] if blocks else []  # none: the engine has no pool
        variants = [" · ".join([*b, *k, *how]) for b in [*shorter, []] for k in (split, [])]
        self.border_subtitle = fit([v for v in variants if v], room)

    def render(self) -> RenderableType:
        width, height = self.content_size.width, self.content_size.height
        p = self.picture
        if p.unseen:
            return Text(p.unseen, style=self._style("muted"))
        if p.step is None or width <= 0 or height <= 0:
            return Text("The first step's keys and values come here.", style=self._style("muted"))
        lines = self.lines(width, height)[:height]
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        return Text("\n", no_wrap=True, end="").join(lines)

    def _style(self, name: str) -> Style:
        return self.get_component_rich_style(f"grid--{name}")

    def lines(self, width: int, height: int) -> list[Text]:
        """The picture in `height` lines of `width` cells: the rows, the query, the shares."""
        p = self.picture
        footer = [self._count_line(width), self._query_line(width), self._share_line(width)]
        room = max(1, height - len(footer))
        shown = listed(p.rows, room)
        digits = len(f"{max(0, p.rows - 1)}")
        longest = max(
            (len(token_label(p.pieces.get(i), MAX_TOKEN_CELLS)) for i in shown if i is not None),
            default=1,
        )
        fixed = 1 + digits + 1 + 1 + len("K V") + (SHARE_CELLS if p.attention else 0)
        token_width = max(1, min(longest, width - fixed))
        body = [
            self._gap_line(shown, width, digits)
            if position is None
            else self._row_line(position, width, digits, token_width)
            for position in shown
        ]
        return body + footer[: max(0, height - len(body))]

    def _gutter(self, position: int) -> str:
        """The block bracket beside a row: ┌ the block's first slot, └ its last, │ between."""
        block = self.picture.block_tokens
        if not block:
            return " "
        slot = position % block
        if block == 1:
            return "╶"
        return "┌" if slot == 0 else "└" if slot == block - 1 else "│"

    def _row_line(self, position: int, width: int, digits: int, token_width: int) -> Text:
        p = self.picture
        new = position >= p.rows - p.new_rows
        line = Text(no_wrap=True, overflow="ellipsis", end="")
        line.append(self._gutter(position), style=self._style("muted"))
        line.append(f"{position:>{digits}} ", style=self._style("muted"))
        line.append(f"{token_label(p.pieces.get(position), token_width):<{token_width}} ")
        look = "recomputed" if not p.cached else "new" if new else "kept"
        line.append("K", style=self._style(look))
        line.append(" ")
        line.append("V", style=self._style(look))
        share = p.attention.at(position) if p.attention else None
        self._append_share(line, share, width)
        return line

    def _gap_line(self, shown: list[int | None], width: int, digits: int) -> Text:
        """What lies between the first rows listed and the newest: positions, blocks, share."""
        p = self.picture
        i = shown.index(None)
        start = shown[i - 1] + 1 if i > 0 and shown[i - 1] is not None else 0
        after = shown[i + 1] if i + 1 < len(shown) else None
        end = after if after is not None else p.rows
        line = Text(no_wrap=True, overflow="ellipsis", end="")
        line.append("⋮", style=self._style("muted"))
        rows = f" {start}-{end - 1}: {end - start:,} rows"
        blocks = (
            [f"{rows}, blocks {start // p.block_tokens}-{(end - 1) // p.block_tokens}"]
            if p.block_tokens
            else []
        )
        room = width - 1 - (SHARE_CELLS if p.attention else 0)
        line.append(
            fit([*blocks, rows, f" {end - start:,} rows"], room), style=self._style("muted")
        )
        share = p.attention.share(start, end) if p.attention else None
        self._append_share(line, share, width)
        return line

    def _append_share(self, line: Text, share: float | None, width: int) -> None:
        """Pad `line` and end it with the share's bar and figure, right-aligned."""
        if share is None:
            return
        figure = format_share(share)
        room = width - line.cell_len - len(figure) - 2
        if room < 1:
            return
        line.append(" ")
        drawn = bar(share, room)
        line.append(f"{drawn:<{room}}", style=self._style("bar"))
        line.append(f" {figure}", style=self._style("muted"))

    def _count_line(self, width: int) -> Text:
        """How the rows relate to the tokens the stream counts: the prompt's, and every token
        generated but the newest (whose keys and values the next step writes)."""
        p = self.picture
        tokens, answer = p.step + 1 if p.step is not None else 0, p.rows - p.prompt
        counts = f"{p.prompt:,} prompt + {answer:,} of {format_count(tokens, 'token')}"
        rows = format_count(p.rows, "row")
        shorter = [
            f"{p.prompt:,} prompt + {answer:,} of {tokens:,}",
            f"= {p.prompt:,} + {answer:,}",
        ]
        words = fit([f"{rows} = {counts}", counts, *shorter], width)
        return Text(words, style=self._style("muted"), no_wrap=True, end="")

    def _query_line(self, width: int) -> Text:
        """The newest query: which row asks, how many keys it read, that it is not kept, and
        the token it chose (whose keys and values are the next step's row)."""
        p = self.picture
        reads = f"q {p.rows - 1:,} reads {format_count(p.rows, 'key')}"
        then = [", used once", " once", ""] if p.cached else [""]
        chose = [] if p.next_piece is None else [f" → {token_label(p.next_piece, 6)}"]
        variants = [(reads + t, c) for t in then for c in [*chose, ""]]
        words, after = next(((w, a) for w, a in variants if len(w) + len(a) <= width), variants[-1])
        return Text.assemble(
            (words, self._style("query")), (after, self._style("muted")), no_wrap=True, end=""
        )

    def _share_line(self, width: int) -> Text:
        """Where the attention went (the first tokens: the sink; the newest), which layer it is
        of, or why there is none; in as many words as fit."""
        p = self.picture
        muted = self._style("muted")
        a = p.attention
        if a is None:
            return Text(p.no_attention or "no attention weights", style=muted, end="")
        read = a.query_position + 1  # the rows that step's query read
        sink = min(SINK_TOKENS, read)
        newest = min(NEWEST, max(0, read - sink))
        first = format_share(a.share(0, sink))
        last = format_share(a.share(read - newest, read))
        heads = f", {p.attention_heads} heads" if p.attention_heads else ""
        layer = "" if p.attention_layer is None else f"layer {p.attention_layer + 1}/{p.layers}"
        ago = f" · weights {format_count(p.behind, 'step')} ago" if p.behind else ""
        if newest:
            variants = [
                f"first {sink}: {first} · newest {newest}: {last} · {layer}{heads}{ago}",
                f"first {sink}: {first} · newest {newest}: {last} · {layer}{ago}",
                f"first {sink}: {first} · newest {newest}: {last}{ago}",
                f"first {sink} {first} · last {newest} {last}",
            ]
            if p.behind:  # narrow: the weights' age before the sink's share
                variants.insert(-1, f"last {newest} {last}, {format_count(p.behind, 'step')} ago")
        else:
            variants = [f"first {sink}: {first} · {layer}{heads}{ago}", f"first {sink}: {first}"]
        fits = next((v for v in variants if len(v) <= width), variants[-1])
        return Text(fits, style=muted, end="")
