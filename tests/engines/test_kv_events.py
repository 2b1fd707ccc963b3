"""vLLM's KV cache events decoded as vLLM 0.32 (and the array-like releases) encode them, and
everything else refused in one line: the endpoint, the frames, the msgpack, the shapes."""

from __future__ import annotations

import socket

import msgpack
import pytest

from kvtui.engines.vllm.events import (
    MAX_BATCH_BYTES,
    MAX_EVENTS,
    Cleared,
    Endpoint,
    EventsError,
    Removed,
    Stored,
    check_bind,
    decode_frames,
    parse_endpoint,
)
from tests.kv_events_standin import removed, stored


def frames(payload: object, seq: int = 7) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgpack.packb(payload)]


def test_a_batch_of_vllm_0_32_is_decoded() -> None:
    tokens = list(b"It is a truth un")
    batch = decode_frames(
        frames(
            [
                1.5,
                [
                    stored([11, 12], tokens[:8], parent=None),
                    removed([9]),
                    {"type": "AllBlocksCleared"},
                ],
                0,
            ]
        )
    )
    assert batch.seq == 7 and batch.ts == 1.5 and batch.dp_rank == 0
    first, second, third = batch.events
    assert first == Stored((11, 12), None, tuple(tokens[:8]), 4, "GPU")
    assert second == Removed((9,), "GPU")
    assert third == Cleared()


def test_the_array_like_encoding_of_older_releases_is_decoded() -> None:
    old = ["BlockStored", [5], 4, [1, 2, 3, 4], 4, None, "GPU"]
    batch = decode_frames(frames([2.0, [old, ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"]]]))
    assert batch.events == (
        Stored((5,), 4, (1, 2, 3, 4), 4, "GPU"),
        Removed((5,), "GPU"),
        Cleared(),
    )
    assert batch.dp_rank is None


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ([b"", b"\0" * 8], "2 frames"),
        ([b"", b"\0" * 4, msgpack.packb([1.0, [], 0])], "sequence number of 4 bytes"),
        ([b"", b"\0" * 8, b"\xc1\xc1\xc1"], "not msgpack"),
        ([b"", b"\0" * 8, msgpack.packb([1.0, [], 0]) + b"\x01"], "not msgpack"),
        ([b"", b"\0" * 8, b"\x91" * 5000], "not msgpack"),  # nested past msgpack's stack
        ([b"", b"\0" * 8, b"\0" * (MAX_BATCH_BYTES + 1)], "past the"),
        (frames({"ts": 1.0}), "not [ts, events, dp_rank]"),
        (frames(["now", [], 0]), "time is a str"),
        (frames([1.0, {"a": 1}, 0]), "events are a dict"),
        (frames([1.0, [], "zero"]), "rank is a str"),
        (frames([1.0, [], -1]), "rank is -1"),
        (frames([1.0, [42], 0]), "event that is a int"),
        (frames([1.0, [{"type": "BlockEaten"}], 0]), "unknown type (BlockEaten)"),
        (frames([1.0, [{"type": "\x1b[31mred"}], 0]), "unknown type (\\x1b[31mred)"),
        (frames([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]), "without"),
        (frames([1.0, [stored([1], [1, 2, 3], size=4)], 0]), "with 3 token ids, not 4"),
        (frames([1.0, [stored([1], [1, 2, 3, -4])], 0]), "token id -4"),
        (frames([1.0, [stored([1], [1, 2, 3, "x"])], 0]), "token id a str"),
        (frames([1.0, [stored([1], [], size=0)], 0]), "block size is 0"),
        (frames([1.0, [stored(["h"], [1, 2, 3, 4])], 0]), "block hash that is a str"),
        (frames([1.0, [stored([b"h" * 65], [1, 2, 3, 4])], 0]), "block hash that is a bytes"),
        (frames([1.0, [stored([1], [1, 2, 3, 4], parent=True)], 0]), "block hash that is a bool"),
        (frames([1.0, [removed([])], 0]), "not a list of hashes"),
        (frames([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}], 0]), "medium"),
    ],
)
def test_what_is_not_a_batch_is_refused_in_one_line(message: list[bytes], words: str) -> None:
    with pytest.raises(EventsError) as caught:
        decode_frames(message)
    said = str(caught.value)
    assert words in said and "\n" not in said and "\x1b" not in said and len(said) < 300


def test_a_batch_of_too_many_events_is_refused_unread() -> None:
    with pytest.raises(EventsError, match="events, past"):
        decode_frames(frames([1.0, [["AllBlocksCleared"]] * (MAX_EVENTS + 1), 0]))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tcp://127.0.0.1:5557", Endpoint("127.0.0.1", 5557)),
        ("tcp://localhost:5557", Endpoint("127.0.0.1", 5557)),
        ("tcp://[::1]:6000", Endpoint("::1", 6000)),
    ],
)
def test_an_endpoint_is_parsed(text: str, expected: Endpoint) -> None:
    assert parse_endpoint(text) == expected
    assert parse_endpoint(str(expected)) == expected


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("127.0.0.1:5557", "expected tcp://HOST:PORT"),
        ("ipc:///tmp/kv", "expected tcp://HOST:PORT"),
        ("tcp://127.0.0.1", "with a port"),
        ("tcp://127.0.0.1:0", "1-65535"),
        ("tcp://127.0.0.1:70000", "1-65535"),
        ("tcp://*:5557", "IP address of this machine"),
        ("tcp://vllm.example.com:5557", "IP address of this machine"),
        ("tcp://0.0.0.0:5557", "not every interface"),
        ("tcp://\x1b[2J:5557", "\\x1b"),
    ],
)
def test_a_bad_endpoint_is_one_line(text: str, words: str) -> None:
    with pytest.raises(EventsError) as caught:
        parse_endpoint(text)
    assert words in str(caught.value) and "\x1b" not in str(caught.value)


def test_an_endpoint_taken_or_not_here_cannot_be_bound() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EventsError, match="cannot bind it here"):
            check_bind(Endpoint("127.0.0.1", port))
    with pytest.raises(EventsError, match="cannot bind it here"):
        check_bind(Endpoint("192.0.2.1", 5557))  # TEST-NET-1: no machine's own address


def test_a_replay_endpoint_is_parsed_after_the_endpoint() -> None:
    from kvtui.engines.vllm.events import events_text, parse_events

    text = "tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558"
    assert parse_events(text) == (Endpoint("127.0.0.1", 5557), Endpoint("127.0.0.1", 5558), 1)
    assert events_text(*parse_events(text)) == text
    assert parse_events("tcp://127.0.0.1:5557") == (Endpoint("127.0.0.1", 5557), None, 1)
    with pytest.raises(EventsError, match="expected replay=tcp://HOST:PORT or ranks=N"):
        parse_events("tcp://127.0.0.1:5557,again")
    with pytest.raises(EventsError, match="with a port"):
        parse_events("tcp://127.0.0.1:5557,replay=tcp://127.0.0.1")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("tcp://127.0.0.1:5557,ranks=0", "ranks= takes 1 to 16, not 0"),
        ("tcp://127.0.0.1:5557,ranks=17", "ranks= takes 1 to 16, not 17"),
        ("tcp://127.0.0.1:5557,ranks=²", "ranks= takes 1 to 16"),
        ("tcp://127.0.0.1:5557,ranks=2,ranks=2", "each once"),
        ("tcp://127.0.0.1:65535,ranks=2", "2 ranks from port 65535 pass port 65535"),
    ],
)
def test_a_data_parallel_servers_ranks_are_bound_each_on_its_port(text: str, says: str) -> None:
    """vLLM's data-parallel rank r publishes on the endpoint's port + r: `ranks=N` binds each
    (the issue's DP server sent rank 1's events where kvtui never listened)."""
    from kvtui.engines.vllm.events import events_text, parse_events

    given = "tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5600,ranks=2"
    first, replay, ranks = parse_events(given)
    assert (first.for_rank(1), replay, ranks) == (
        Endpoint("127.0.0.1", 5558),
        Endpoint("127.0.0.1", 5600),
        2,
    )
    assert events_text(first, replay, ranks) == given
    with pytest.raises(EventsError, match=says):
        parse_events(text)
