"""The server's prefix cache folded from its events, through a real zmq socket: a stand-in
publisher (a PUB in this process, connecting as vLLM's does) sends to the feed's bound SUB."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import msgpack
import pytest

from kvtui.engines.vllm.events import MAX_BATCH_BYTES, Batch, Endpoint, Stored, parse_endpoint
from kvtui.run.server_blocks import MAX_BLOCKS, SILENT_S, ServerBlocks, ServerBlocksFeed
from tests.kv_events_standin import StandIn, free_endpoint, removed, stored, wait_until

ABCD = list(b"abcd")
EFGH = list(b"efgh")


@pytest.fixture
def endpoint() -> Endpoint:
    return parse_endpoint(free_endpoint())


@pytest.fixture
def feed(endpoint: Endpoint) -> Iterator[ServerBlocksFeed]:
    opened = ServerBlocksFeed(endpoint)
    yield opened
    opened.close()


@pytest.fixture
def publisher(endpoint: Endpoint, feed: ServerBlocksFeed) -> Iterator[StandIn]:
    standin = StandIn(str(endpoint))
    standin.join(feed)
    yield standin
    standin.close()


def test_blocks_stored_and_evicted_are_modelled_as_chains(
    feed: ServerBlocksFeed, publisher: StandIn
) -> None:
    # two prompts sharing their first block ("abcd"): 1 -> 2 and 1 -> 3
    publisher.send(1, [stored([1, 2], ABCD + EFGH)])
    publisher.send(2, [stored([3], list(b"wxyz"), parent=1)])
    view = wait_until(lambda: (v := feed.view()).stored == 3 and v)
    assert (view.held, view.held_tokens, view.block_size) == (3, 12, 4)
    assert view.byte_level and view.shared_blocks == 1 and not view.gaps
    newest, older = view.sequences
    assert [b.key for b in newest.blocks] == [1, 3] and newest.shared == (2, 1) and newest.rooted
    assert [b.key for b in older.blocks] == [1, 2] and older.blocks[1].token_ids == tuple(EFGH)
    assert feed.prefix_tokens(ABCD + EFGH + [0]) == 8  # both blocks: vLLM's hit
    assert feed.prefix_tokens(ABCD + EFGH) == 4  # the last token is always computed
    assert feed.prefix_tokens(list(b"abc") + EFGH) == 0  # a shared start under a block: nothing
    publisher.send(3, [removed([3, 99])])
    view = wait_until(lambda: (v := feed.view()).removed == 2 and v)
    assert view.held == 2 and view.removed_unknown == 1 and view.shared_blocks == 0
    publisher.send(4, [{"type": "AllBlocksCleared"}])
    view = wait_until(lambda: (v := feed.view()).cleared == 1 and v)
    assert view.held == 0 and view.sequences == ()


def test_a_silent_endpoint_says_no_events_without_hanging() -> None:
    now = [100.0]
    fold = ServerBlocks("tcp://127.0.0.1:1", opened_at=now[0])
    assert not fold.view(now[0] + 1).waiting
    assert fold.view(now[0] + SILENT_S).waiting


def test_a_feed_with_no_publisher_says_it_is_silent(endpoint: Endpoint) -> None:
    clock = iter(range(0, 10**6, 3))  # each reading of the clock 3 s on
    feed = ServerBlocksFeed(endpoint, clock=lambda: float(next(clock)))
    try:
        view = wait_until(lambda: (v := feed.view()).waiting and v)
        assert view.batches == 0 and view.silent_s >= SILENT_S
    finally:
        feed.close()


def test_malformed_messages_are_said_and_the_feed_goes_on(
    feed: ServerBlocksFeed, publisher: StandIn
) -> None:
    publisher.frames([b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])
    publisher.frames([b"only one frame"])
    publisher.frames([b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [["BlockStored", 5]], 0])])
    view = wait_until(lambda: (v := feed.view()).refused == 3 and v)
    assert "BlockStored without" in view.refused_why and not view.error
    publisher.send(1, [stored([7], ABCD)])
    view = wait_until(lambda: (v := feed.view()).stored == 1 and v)
    assert view.held == 1 and not view.gaps


def test_a_sequence_gap_is_said(feed: ServerBlocksFeed, publisher: StandIn) -> None:
    publisher.send(1, [stored([1], ABCD)])
    publisher.send(5, [stored([2], EFGH, parent=1)])
    view = wait_until(lambda: (v := feed.view()).stored == 2 and v)
    assert view.missed == 3 and [(g.first, g.last, g.batches) for g in view.gaps] == [(2, 4, 3)]


def test_a_gap_is_recovered_from_the_servers_replay_socket(endpoint: Endpoint) -> None:
    replay = free_endpoint()
    feed = ServerBlocksFeed(endpoint, replay=parse_endpoint(replay))
    publisher = StandIn(str(endpoint), replay=replay)
    try:
        publisher.join(feed)
        publisher.send(1, [stored([1], ABCD)])
        publisher.send(2, [stored([2], EFGH, parent=1)], lost=True)
        publisher.send(3, [removed([1])], lost=True)
        publisher.send(4, [stored([3], list(b"ijkl"), parent=2)])
        view = wait_until(lambda: (v := feed.view()).stored == 3 and v)
        assert publisher.replays == [2]  # asked from the first batch missed
        assert (view.recovered, view.missed, view.gaps) == (2, 0, ())
        # folded in order: block 1 was evicted after block 2 was stored
        assert view.held == 2 and [[b.key for b in s.blocks] for s in view.sequences] == [[2, 3]]
    finally:
        publisher.close()
        feed.close()


def test_a_replay_waited_for_never_keeps_the_fold_from_its_readers(endpoint: Endpoint) -> None:
    """While the feed waits for a replay, what draws the panel (prefix_tokens, view) still reads
    the fold: the replay is answered only after they have."""
    replay, hold = free_endpoint(), threading.Event()
    feed = ServerBlocksFeed(endpoint, replay=parse_endpoint(replay))
    publisher = StandIn(str(endpoint), replay=replay, hold=hold)
    try:
        publisher.join(feed)
        publisher.send(1, [stored([1], ABCD)])
        publisher.send(2, [stored([2], EFGH, parent=1)], lost=True)
        publisher.send(3, [stored([3], list(b"ijkl"), parent=2)])
        wait_until(lambda: publisher.replays)  # the feed is waiting for its answer
        assert feed.prefix_tokens(ABCD + [0]) == 4 and feed.view().stored == 1
        hold.set()
        view = wait_until(lambda: (v := feed.view()).stored == 3 and v)
        assert (view.recovered, view.missed) == (1, 0)
    finally:
        hold.set()
        publisher.close()
        feed.close()


def test_a_replay_that_does_not_answer_leaves_the_gap_said(endpoint: Endpoint) -> None:
    silent = free_endpoint()  # nothing bound there
    feed = ServerBlocksFeed(endpoint, replay=parse_endpoint(silent))
    publisher = StandIn(str(endpoint))
    try:
        publisher.join(feed)
        publisher.send(1, [stored([1], ABCD)])
        publisher.send(4, [stored([3], EFGH)])
        view = wait_until(lambda: (v := feed.view()).stored == 2 and v, timeout=15)
        assert (view.recovered, view.missed) == (0, 2)
    finally:
        publisher.close()
        feed.close()


def test_a_sequence_that_goes_back_is_a_restarted_server(
    feed: ServerBlocksFeed, publisher: StandIn
) -> None:
    publisher.send(8, [stored([1], ABCD)])
    wait_until(lambda: feed.view().held == 1)
    publisher.send(3, [stored([2], EFGH)])
    view = wait_until(lambda: (v := feed.view()).restarts == 1 and v)
    assert [s.blocks[0].key for s in view.sequences] == [2]  # block 1 went with the old server


def test_huge_batches_are_bounded() -> None:
    fold = ServerBlocks("tcp://127.0.0.1:1", opened_at=0.0)
    hashes = tuple(range(MAX_BLOCKS + 500))
    fold.apply(Batch(1, 0.0, (Stored(hashes, None, (300,) * len(hashes), 1),), 0), 0.0)
    view = fold.view(0.0)
    assert view.held == MAX_BLOCKS and view.forgotten == 500 and view.stored == MAX_BLOCKS + 500
    assert not view.byte_level  # an id past 255: ids, not text
    assert len(view.sequences) == 1 and len(view.sequences[0].blocks) <= 4096


def test_a_block_stored_twice_and_a_cycle_are_drawn_once() -> None:
    fold = ServerBlocks("tcp://127.0.0.1:1", opened_at=0.0)
    fold.apply(Batch(1, 0.0, (Stored((1, 2), 2, tuple(ABCD + EFGH), 4),), 0), 0.0)
    fold.apply(Batch(2, 0.0, (Stored((1,), 2, tuple(ABCD), 4),), 0), 0.0)
    view = fold.view(0.0)
    assert view.held == 2 and sum(len(s.blocks) for s in view.sequences) == 2


def test_a_message_past_the_bound_is_never_read_and_becomes_a_gap(
    feed: ServerBlocksFeed, publisher: StandIn
) -> None:
    """libzmq drops a message past MAX_BATCH_BYTES unread, with the publisher's connection; the
    publisher connects again, and the batch it carried is a gap, said."""
    publisher.frames([b"", (1).to_bytes(8, "big"), b"\x00" * (MAX_BATCH_BYTES + 8192)])

    def arrived() -> bool:
        publisher.send(2, [stored([1], ABCD)])  # again until the new connection carries it
        return feed.view().stored == 1

    wait_until(arrived)
    view = wait_until(lambda: (v := feed.view()).stored == 1 and v)
    assert view.refused == 0 and view.missed == 1 and view.held == 1


def test_a_data_parallel_servers_ranks_are_heard_each_on_its_port() -> None:
    """`--kv-events ENDPOINT,ranks=2`: rank 1 publishes on the port after ENDPOINT's (vLLM's
    offset), with sequence numbers of its own; both ranks' blocks are held, and no gap is said
    where the two sequences interleave."""
    endpoint = parse_endpoint(free_endpoint(ranks=2))
    feed = ServerBlocksFeed(endpoint, ranks=2)
    ranks = [StandIn(str(endpoint)), StandIn(str(endpoint.for_rank(1)))]
    try:
        for standin in ranks:
            standin.join(feed)
        ranks[0].send(1, [stored([1], ABCD)], rank=0)
        ranks[1].send(1, [stored([2], EFGH)], rank=1)
        ranks[1].send(2, [stored([3], list(b"wxyz"), parent=2)], rank=1)
        view = wait_until(lambda: (v := feed.view()).stored == 3 and v)
        assert view.held == 3 and not view.gaps
        assert feed.prefix_tokens(EFGH + list(b"wxyz") + [0]) == 8  # rank 1's chain
    finally:
        for standin in ranks:
            standin.close()
        feed.close()
