"""A vLLM server's prefix cache as its KV cache events draw it, folded once, without a UI: the
blocks it holds (by content hash, each with its parent: the chains), the tokens they hold, what
it stored and evicted while kvtui listened, which sequences share which blocks, and the batches
kvtui missed (a gap in a rank's sequence numbers) or refused (kvtui.engines.vllm.events).

The events say what `/metrics` cannot: which blocks hold content. A block is published only
once it is full (a prompt of 107 tokens in blocks of 32 stores 3, its last 11 tokens none), and
stays until evicted, whether a request holds it or not; vLLM's `kv_cache_usage_perc` counts the
blocks requests hold, so a cached block no request holds is free there while it still holds its
prefix (evicted only when a new block needs its place).

Memory is bounded whatever a publisher sends: at most MAX_BLOCKS blocks are held here (past it
the oldest are forgotten, and counted), each keeping at most MAX_TOKENS_KEPT of its token ids.
`ServerBlocksFeed` runs the subscriber on a thread of its own and publishes an immutable
`BlocksView` at most VIEWS_PER_SECOND times a second; drawing reads the newest.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvtui.engines.vllm.events import (
    Batch,
    BlockKey,
    Cleared,
    Endpoint,
    EventsError,
    Removed,
    Stored,
    Subscriber,
)

MAX_BLOCKS = 20_000
"""The most blocks held here (vLLM's whole cache on a large GPU is ~100,000 blocks of 16; what
is drawn is the newest few dozen)."""
MAX_TOKENS_KEPT = 256
"""The most token ids kept of each block (vLLM's block sizes are at most 256)."""
MAX_GAPS_KEPT = 32
"""The newest sequence gaps kept to say (all are counted)."""
MAX_SEQUENCES = 64
"""The most sequences (chains, newest first) a view carries."""
MAX_CHAIN = 4096
"""The longest chain walked from a block to its root (a cycle a publisher made is cut there)."""
SILENT_S = 5.0
"""After this long without a batch, the view says none has come."""
VIEWS_PER_SECOND = 4
RECEIVE_WAIT_S = 0.25
REPLAY_WAIT_S = 2.0
"""The longest a replay is waited for (the feed listens to nothing else meanwhile)."""


@dataclass(frozen=True)
class Block:
    """A block the server holds: its hash, its parent's, and its tokens."""

    key: BlockKey
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    """Its first MAX_TOKENS_KEPT token ids (all of them in blocks up to that size)."""
    size: int
    """Its token slots (the block size it was stored with), all filled: vLLM publishes full
    blocks only."""


@dataclass(frozen=True)
class Gap:
    """Batches a rank published that never arrived here: sequence numbers `first` to `last`."""

    rank: int | None
    first: int
    last: int

    @property
    def batches(self) -> int:
        return self.last - self.first + 1


@dataclass(frozen=True)
class Sequence:
    """One chain of held blocks, root first, ending at a block no held block follows: a
    prompt (with the blocks its answer filled). `shared[i]` is how many sequences hold block i."""

    blocks: tuple[Block, ...]
    shared: tuple[int, ...]
    rooted: bool
    """Whether its first block has no parent (False: its parent was evicted, or stored before
    kvtui listened)."""


@dataclass(frozen=True)
class BlocksView:
    """What the events said so far, for drawing (a pure read: nothing here changes)."""

    endpoint: str
    held: int
    """Blocks held now, as the events tell it."""
    held_tokens: int
    """Their token slots (each full)."""
    block_size: int | None
    """The newest block size stored with (None before any)."""
    stored: int
    removed: int
    removed_unknown: int
    """Removals of blocks stored before kvtui listened (or forgotten past MAX_BLOCKS)."""
    cleared: int
    batches: int
    refused: int
    refused_why: str
    """The newest refused batch's reason, in one line."""
    gaps: tuple[Gap, ...]
    """The newest MAX_GAPS_KEPT gaps."""
    missed: int
    """Batches missed in all gaps (those a replay recovered not among them)."""
    recovered: int
    """Batches a gap lost that the server's replay socket sent again, folded in order."""
    restarts: int
    """Times a rank's sequence went back (the server restarted: its cache began again)."""
    forgotten: int
    """Blocks forgotten here, past MAX_BLOCKS (still held by the server)."""
    silent_s: float
    """Seconds since the newest batch (since listening, before any)."""
    byte_level: bool
    """Whether every token id seen is below 256 (the byte-level model's: shown as text)."""
    sequences: tuple[Sequence, ...]
    """Chains, newest first, at most MAX_SEQUENCES."""
    shared_blocks: int
    """Held blocks that two or more sequences share."""
    error: str = ""
    """Why nothing is listened to (the subscriber could not open or ended), else empty."""

    @property
    def waiting(self) -> bool:
        """No batch yet, and none for SILENT_S: the endpoint is silent."""
        return self.batches == 0 and self.refused == 0 and self.silent_s >= SILENT_S


@dataclass
class ServerBlocks:
    """The fold: apply each batch (or refusal) as it arrives; `view` for drawing."""

    endpoint: str
    opened_at: float
    blocks: OrderedDict[BlockKey, Block] = field(default_factory=OrderedDict)
    """Held blocks, oldest stored first."""
    by_content: dict[tuple[BlockKey | None, bytes], BlockKey] = field(default_factory=dict)
    """A held block by its parent and its tokens: how a prompt's hits are found."""
    stored: int = 0
    removed: int = 0
    removed_unknown: int = 0
    cleared: int = 0
    batches: int = 0
    refused: int = 0
    refused_why: str = ""
    gaps: deque[Gap] = field(default_factory=lambda: deque(maxlen=MAX_GAPS_KEPT))
    missed: int = 0
    recovered: int = 0
    restarts: int = 0
    forgotten: int = 0
    last_at: float | None = None
    max_token_id: int = -1
    block_size: int | None = None
    last_seq: dict[int | None, int] = field(default_factory=dict)
    error: str = ""

    def apply(self, batch: Batch, now: float) -> None:
        """Fold one batch: its sequence number first (a gap said, a repeat skipped, a number
        that went back: the server began again), then its events in order."""
        self.last_at = now
        last = self.last_seq.get(batch.dp_rank)
        if last is not None and batch.seq == last:
            return  # the same batch again
        if last is not None and batch.seq < last:
            self.restarts += 1
            self._clear()
        elif last is not None and batch.seq > last + 1:
            self.gaps.append(Gap(batch.dp_rank, last + 1, batch.seq - 1))
            self.missed += batch.seq - last - 1
        self.last_seq[batch.dp_rank] = batch.seq
        self.batches += 1
        for event in batch.events:
            if isinstance(event, Stored):
                self._store(event)
            elif isinstance(event, Removed):
                self._remove(event.hashes)
            elif isinstance(event, Cleared):
                self.cleared += 1
                self._clear()

    def gap_before(self, batch: Batch) -> tuple[int, int] | None:
        """The sequence numbers `batch` would skip on its rank (first, last), or None."""
        last = self.last_seq.get(batch.dp_rank)
        if last is None or batch.seq <= last + 1:
            return None
        return last + 1, batch.seq - 1

    def refuse(self, error: EventsError, now: float) -> None:
        """A message that was not a batch: counted and said, the rest goes on."""
        self.last_at = now
        self.refused += 1
        self.refused_why = str(error)

    def _store(self, event: Stored) -> None:
        self.block_size = event.block_size
        parent = event.parent
        size = event.block_size
        for i, key in enumerate(event.hashes):
            tokens = event.token_ids[i * size : (i + 1) * size]
            self.max_token_id = max(self.max_token_id, max(tokens, default=-1))
            kept = tokens[:MAX_TOKENS_KEPT]
            if key in self.blocks:  # stored again: it moves to the newest
                self._drop(key)
            self.blocks[key] = Block(key, parent, kept, size)
            if len(kept) == size:
                self.by_content[(parent, _packed(kept))] = key
            self.stored += 1
            parent = key
        while len(self.blocks) > MAX_BLOCKS:
            oldest = next(iter(self.blocks))
            self._drop(oldest)
            self.forgotten += 1

    def _remove(self, hashes: Iterable[BlockKey]) -> None:
        for key in hashes:
            self.removed += 1
            if key in self.blocks:
                self._drop(key)
            else:
                self.removed_unknown += 1

    def _drop(self, key: BlockKey) -> None:
        block = self.blocks.pop(key)
        content = (block.parent, _packed(block.token_ids))
        if self.by_content.get(content) == key:
            del self.by_content[content]

    def _clear(self) -> None:
        self.blocks.clear()
        self.by_content.clear()

    def prefix_tokens(self, token_ids: list[int]) -> int | None:
        """The tokens of `token_ids` (a prompt) that held blocks cover from its start: what the
        server's prefix cache would hit now (vLLM hits whole blocks only, and always computes the
        prompt's last token: a block that ends at it is not hit). None before any block size is
        known."""
        size = self.block_size
        if size is None:
            return None
        parent: BlockKey | None = None
        hit = 0
        while hit + size <= len(token_ids) - 1:
            key = self.by_content.get((parent, _packed(tuple(token_ids[hit : hit + size]))))
            if key is None:
                break
            hit += size
            parent = key
        return hit

    def view(self, now: float) -> BlocksView:
        """The fold as drawn: counters, and the chains (newest first) with what they share."""
        since = self.last_at if self.last_at is not None else self.opened_at
        sequences, shared = self._sequences()
        return BlocksView(
            endpoint=self.endpoint,
            held=len(self.blocks),
            held_tokens=sum(b.size for b in self.blocks.values()),
            block_size=self.block_size,
            stored=self.stored,
            removed=self.removed,
            removed_unknown=self.removed_unknown,
            cleared=self.cleared,
            batches=self.batches,
            refused=self.refused,
            refused_why=self.refused_why,
            gaps=tuple(self.gaps),
            missed=self.missed,
            recovered=self.recovered,
            restarts=self.restarts,
            forgotten=self.forgotten,
            silent_s=max(0.0, now - since),
            byte_level=0 <= self.max_token_id < 256,
            sequences=sequences,
            shared_blocks=shared,
            error=self.error,
        )

    def _sequences(self) -> tuple[tuple[Sequence, ...], int]:
        """Each held block's count of the sequences through it (children are stored after their
        parents, so one pass from the newest adds each block's count to its parent's), and the
        newest chains."""
        blocks = self.blocks
        through: dict[BlockKey, int] = dict.fromkeys(blocks, 0)
        leaves: list[BlockKey] = []
        for key in reversed(blocks):
            if through[key] == 0:
                through[key] = 1
                leaves.append(key)
            parent = blocks[key].parent
            if parent is not None and parent in through:
                through[parent] += through[key]
        sequences = []
        for leaf in leaves[:MAX_SEQUENCES]:
            chain: list[Block] = []
            at: BlockKey | None = leaf
            seen: set[BlockKey] = set()
            while at is not None and at in blocks and at not in seen and len(chain) < MAX_CHAIN:
                seen.add(at)
                chain.append(blocks[at])
                at = blocks[at].parent
            chain.reverse()
            sequences.append(
                Sequence(
                    tuple(chain),
                    tuple(through[b.key] for b in chain),
                    rooted=chain[0].parent is None,
                )
            )
        return tuple(sequences), sum(1 for n in through.values() if n > 1)


def _packed(tokens: tuple[int, ...]) -> bytes:
    return array("I", tokens).tobytes()


class ServerBlocksFeed:
    """The one owner of a server's events: it binds the subscriber (at `endpoint`, and PORT + r
    for each further data-parallel rank), folds what arrives on a thread of its own, and keeps
    the newest `BlocksView` (`view`), made at most VIEWS_PER_SECOND times a second. `close`
    ends the thread and the socket. Opening raises `EventsError` in one line (the libraries
    missing, the endpoint not bindable)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        ranks: int = 1,
        replay: Endpoint | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._subscriber = Subscriber(endpoint, ranks, replay)
        self._fold = ServerBlocks(str(endpoint), clock())
        self._lock = threading.Lock()
        self._view = self._fold.view(clock())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="kvtui-kv-events", daemon=True)
        self._thread.start()

    def view(self) -> BlocksView:
        """The newest view (made on the feed's thread; reading it takes no lock)."""
        return self._view

    def prefix_tokens(self, token_ids: list[int]) -> int | None:
        """ServerBlocks.prefix_tokens, now."""
        with self._lock:
            return self._fold.prefix_tokens(token_ids)

    def _listen(self) -> None:
        made = 0.0
        changed = False
        try:
            while not self._stop.is_set():
                got = self._subscriber.receive(RECEIVE_WAIT_S)
                for item in got:
                    replayed = self._replayed(item) if isinstance(item, Batch) else []
                    now = self._clock()
                    with self._lock:  # held only to fold: a replay is waited for without it
                        for batch in replayed:
                            self._fold.apply(batch, now)
                            self._fold.recovered += 1
                        if isinstance(item, Batch):
                            self._fold.apply(item, now)
                        else:
                            self._fold.refuse(item, now)
                changed = changed or bool(got)
                now = self._clock()
                if now - made >= 1 / VIEWS_PER_SECOND and (changed or now - made >= 1.0):
                    with self._lock:
                        self._view = self._fold.view(now)
                    made, changed = now, False
        except Exception as exc:  # a zmq failure (the context ended): said, the app stays up
            with self._lock:
                self._fold.error = f"the subscriber ended: {type(exc).__name__}: {exc}"[:200]
                self._view = self._fold.view(self._clock())

    def _replayed(self, batch: Batch) -> list[Batch]:
        """Before a batch that skips sequence numbers, the skipped ones from the server's replay
        socket (where one was given), in order, up to the first it did not send (the rest stays
        a gap: said when `batch` is folded)."""
        with self._lock:
            gap = self._fold.gap_before(batch)
            if gap is None or self._subscriber.replay_endpoint is None:
                return []
            self._view = self._fold.view(self._clock())  # what came so far, drawn meanwhile
        first, last = gap
        sent = {
            b.seq: b
            for b in self._subscriber.replay(first, REPLAY_WAIT_S)
            if isinstance(b, Batch) and first <= b.seq <= last and b.dp_rank == batch.dp_rank
        }
        replayed = []
        for seq in range(first, last + 1):
            if seq not in sent:
                break
            replayed.append(sent[seq])
        return replayed

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._subscriber.close()
