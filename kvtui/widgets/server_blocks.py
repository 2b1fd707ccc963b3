"""The server's own prefix cache, drawn from its KV cache events (kvtui.run.server_blocks): the
blocks it holds, their chains as the sequences that stored them (a cell a block: shared by two
or more sequences, or one's own), the tokens they hold (as text for the byte-level model, as ids
otherwise, escaped), what was stored and evicted while kvtui listened, gaps and refusals; and
beside vLLM's usage gauge, what `/metrics` cannot say. Drawing is a pure read of the newest view.
"""

from __future__ import annotations

import textwrap

from rich.console import Group
from rich.text import Text
from textual.widget import Widget

from kvtui.engines.protocol import ServerMetrics
from kvtui.engines.vllm.events import BlockKey
from kvtui.format import format_count, format_int, format_percent, safe_text
from kvtui.run.server_blocks import MAX_BLOCKS, Block, BlocksView, Sequence, ServerBlocksFeed
from kvtui.text import encode_bytes

REFRESH_S = 0.25
MIN_CHAINS = 3
"""Chains drawn before the words under them take the rows."""
MAX_CELLS = 12
"""Cells drawn for a sequence's blocks (past them, "+N")."""


def short_hash(key: BlockKey) -> str:
    """A block's content hash, its last 6 hex digits (a 64-bit integer as unsigned)."""
    if isinstance(key, bytes):
        return key.hex()[-6:]
    return f"{key & (2**64 - 1):016x}"[-6:]


def block_text(blocks: tuple[Block, ...], byte_level: bool) -> str:
    """The tokens of `blocks`, as one escaped line: text where every id is a byte, else ids."""
    ids = [t for b in blocks for t in b.token_ids]
    if byte_level:
        text = bytes(ids).decode("utf-8", errors="replace").replace("\n", "↵")
        return safe_text(text, one_line=True)
    return " ".join(str(t) for t in ids[:64])


def usage_words(view: BlocksView, latest: ServerMetrics | None) -> list[str]:
    """What the events say that vLLM's usage gauge cannot, most telling first: cached blocks no
    request holds are free in the gauge (yet hold their prefix until evicted); the gauge counts
    blocks in use, whole from their first token, where the events count blocks of content, each
    full."""
    size = view.block_size
    slots = f" = {format_int(view.held_tokens)} token slots, each full" if size else ""
    held = f"held, as the events say: {format_count(view.held, 'block')}{slots}"
    if latest is None or latest.kv_usage is None or not latest.kv_blocks:
        return [held[0].upper() + held[1:] + "."]
    in_use = round(latest.kv_usage * latest.kv_blocks)
    lines = []
    if view.held > in_use:
        lines.append(
            f"{format_count(view.held - in_use, 'cached block')} no request holds: free in "
            "vLLM's gauge, yet holding their prefix to hit until evicted."
        )
    lines.append(
        f"vLLM's gauge: {format_percent(latest.kv_usage)} of {format_int(latest.kv_blocks)} "
        f"blocks = {format_int(in_use)} in use (a block counts whole from its first token); "
        f"{held}."
    )
    return lines


def prompt_words(hit: int | None, prompt_tokens: int, size: int | None) -> str:
    """This run's prompt against the held blocks: what a repeat would hit, and why not more."""
    if hit is None or not size or not prompt_tokens:
        return ""
    most = (prompt_tokens - 1) // size * size
    return (
        f"This run's prompt: {format_int(hit)} of {format_int(prompt_tokens)} tokens in held "
        f"blocks, a repeat's hits (at most {format_int(most)}: whole blocks of {size}, never the "
        f"last token; a start shared for under {size} tokens shares nothing)."
    )


class ServerBlocksPanel(Widget):
    """vLLM's prefix cache, from its events: `feed` is listened to already (the screen that
    draws this owns it); `show` gives the server's newest poll and the run's prompt."""

    DEFAULT_CSS = """
    ServerBlocksPanel {
        height: 1fr;
        border: round $primary 40%;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
    }
    ServerBlocksPanel.-trouble { border-subtitle-color: $error; }
    ServerBlocksPanel > .blocks--shared { color: $warning; text-style: bold; }
    ServerBlocksPanel > .blocks--own { color: $primary; }
    ServerBlocksPanel > .blocks--muted { color: $text-muted; }
    ServerBlocksPanel > .blocks--bad { color: $error; text-style: bold; }
    """

    COMPONENT_CLASSES = {"blocks--shared", "blocks--own", "blocks--muted", "blocks--bad"}

    def __init__(
        self, feed: ServerBlocksFeed, *, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(id=id, classes=classes)
        self.feed = feed
        self._view = feed.view()
        self._latest: ServerMetrics | None = None
        self._prompt: list[int] = []
        self.border_title = "vLLM's prefix cache, from its events: ■ shared □ own"
        self.border_subtitle = self._subtitle(self._view)

    def on_mount(self) -> None:
        self.set_interval(REFRESH_S, self._follow)

    def _follow(self) -> None:
        view = self.feed.view()
        if view is not self._view:
            self._view = view
            self.border_subtitle = self._subtitle(view)
            self.set_class(bool(view.gaps or view.refused or view.error), "-trouble")
            self.refresh()

    def show(self, latest: ServerMetrics | None, prompt_text: str) -> None:
        """The server's newest poll (its usage gauge) and this run's prompt (byte-level ids)."""
        prompt = encode_bytes(prompt_text) if prompt_text else []
        if latest is not self._latest or prompt != self._prompt:
            self._latest, self._prompt = latest, prompt
            self.refresh()

    def render(self) -> Group:
        """The head (counts), the newest chains and the words under them, fitted to the rows:
        the words that say something is wrong first, then the gauge's, then the prompt's; at
        least MIN_CHAINS chains where they fit."""
        view = self._view
        width = max(10, self.size.width)
        rows = max(1, self.size.height)
        head = [Text(line) for text in self._head(view) for line in _wrap(text, width)]
        tail: list[Text] = []
        muted = self._style("muted")
        chains_wanted = min(len(view.sequences), MIN_CHAINS)
        for words, style in self._tail(view):
            lines = _wrap(words, width)
            if len(head) + len(tail) + len(lines) + chains_wanted > rows:
                break
            tail.extend(Text(line, style=self._style(style) if style else muted) for line in lines)
        room = max(0, rows - len(head) - len(tail))
        chains = [self._sequence(s, view.byte_level, width) for s in view.sequences[:room]]
        return Group(*(head + chains + tail)[:rows])

    def _style(self, name: str) -> str:
        return str(self.get_component_rich_style(f"blocks--{name}"))

    def _head(self, view: BlocksView) -> list[str]:
        if view.error:
            return [view.error]
        if view.waiting:
            return [
                f"No events yet ({view.silent_s:.0f} s listening at {view.endpoint}). vLLM sends "
                'them when started with --kv-events-config \'{"enable_kv_cache_events": true, '
                f'"publisher": "zmq", "endpoint": "{view.endpoint}"}}\'.'
            ]
        if not view.batches:
            return [f"Listening at {view.endpoint}: no batch yet."]
        return [
            f"{format_int(view.held)} blocks held · stored {format_int(view.stored)} · evicted "
            f"{format_int(view.removed)} · {format_count(len(view.sequences), 'sequence')}, "
            f"{format_count(view.shared_blocks, 'block')} shared"
        ]

    def _tail(self, view: BlocksView) -> list[tuple[str, str]]:
        """The words under the chains, most needed first, each with its style ("" muted)."""
        lines: list[tuple[str, str]] = []
        if view.gaps:
            gap = view.gaps[-1]
            rank = "" if gap.rank is None else f" of rank {gap.rank}"
            lines.append(
                (
                    f"Missed {format_int(view.missed)} of {format_int(view.batches + view.missed)}"
                    f" batches (newest gap: {gap.first:,}-{gap.last:,}{rank}): what was stored or "
                    "evicted then is not drawn"
                    + (
                        f" ({format_int(view.recovered)} more were replayed)."
                        if view.recovered
                        else " (--kv-events ENDPOINT,replay=R recovers them from a server with a "
                        "replay_endpoint)."
                    ),
                    "bad",
                )
            )
        if view.refused:
            lines.append((f"Refused {format_int(view.refused)}: {view.refused_why}", "bad"))
        if view.restarts:
            lines.append((f"The server began again ({format_int(view.restarts)}).", "bad"))
        if view.forgotten:
            lines.append(
                (
                    f"{format_int(view.forgotten)} oldest blocks forgotten here (at most "
                    f"{format_int(MAX_BLOCKS)} are kept).",
                    "",
                )
            )
        usage = usage_words(view, self._latest) if view.batches else []
        said = prompt_words(
            self.feed.prefix_tokens(self._prompt) if view.byte_level and self._prompt else None,
            len(self._prompt),
            view.block_size,
        )
        lines.extend((words, "") for words in [*usage[:-1], said, *usage[-1:]] if words)
        return lines

    def _sequence(self, sequence: Sequence, byte_level: bool, width: int) -> Text:
        """One chain: a cell a block (shared ■, own □), the newest block's hash, its text from
        where it branches off what it shares."""
        line = Text(no_wrap=True, overflow="ellipsis")
        cells = list(zip(sequence.blocks, sequence.shared, strict=True))
        shown = cells[-MAX_CELLS:] if len(cells) > MAX_CELLS else cells
        if len(cells) > MAX_CELLS:
            line.append(f"+{len(cells) - MAX_CELLS}", style=self._style("muted"))
        if not sequence.rooted:
            line.append("…", style=self._style("muted"))
        for _, shared in shown:
            many = shared > 1
            line.append("■" if many else "□", style=self._style("shared" if many else "own"))
        own = tuple(b for b, n in cells if n <= 1)
        common = len(cells) - len(own)
        line.append(f" {short_hash(sequence.blocks[-1].key)} ", style=self._style("muted"))
        if common:
            line.append(f"{common} shared + ", style=self._style("muted"))
        words = block_text(own or sequence.blocks, byte_level)
        room = max(0, width - len(line) - 2)
        line.append(f'"{words[:room]}"' if byte_level else words[:room])
        return line

    @staticmethod
    def _subtitle(view: BlocksView) -> str:
        parts = []
        if view.block_size:
            parts.append(f"blocks of {view.block_size}")
        parts.append(f"missed {format_int(view.missed)}" if view.gaps else "no gaps")
        if view.recovered:
            parts.append(f"{format_int(view.recovered)} replayed")
        return " · ".join(parts) + f" · {view.endpoint}"


def _wrap(words: str, width: int) -> list[str]:
    return textwrap.wrap(words, width) or [""]
