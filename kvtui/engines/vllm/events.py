"""vLLM's KV cache events, received and decoded, without a UI: the blocks its prefix cache stores
and evicts, as it publishes them (`--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}'`).

vLLM's publisher (vllm/distributed/kv_events.py, `ZmqEventPublisher`) sends each batch as three
frames: a topic, an 8-byte big-endian sequence number, and a msgpack `EventBatch`, an array
`[ts, events, data_parallel_rank]`. Each event is a tagged struct: in vLLM 0.32 a map with a
`type` key (`BlockStored`: `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`,
`lora_id`, `medium`, ...; `BlockRemoved`: `block_hashes`, `medium`; `AllBlocksCleared`), in
older releases (array_like) an array whose first element is the tag and the rest the fields in
that order; both are read. A publisher given a `tcp://HOST:PORT` endpoint (no `*`) connects to
it, so kvtui's subscriber binds there; data-parallel rank r publishes on PORT + r.

Everything here is untrusted input: a batch is refused whole, in one line, when it is not what
vLLM sends (too large, not msgpack, a wrong shape or type, a count past the bounds below), and
the subscriber goes on. pyzmq and msgpack (`kvtui[vllm]`) are imported only when a subscriber
is opened.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from typing import Any

from kvtui.errors import EngineError
from kvtui.format import safe_text

MAX_BATCH_BYTES = 4 * 2**20
"""The largest batch read (a batch of vLLM 0.32 storing four blocks of 32 tokens is 344 bytes;
a 128k-token prompt in blocks of 16 about 400 KB); libzmq drops a larger message unread."""
MAX_EVENTS = 65_536
"""The most events a batch may carry."""
MAX_HASHES = 65_536
"""The most block hashes an event may carry."""
MAX_BLOCK_TOKENS = 4096
"""The largest block size taken (vLLM's are 1 to 256 tokens)."""
MAX_TOKEN_ID = 2**32 - 1
MAX_HASH_BYTES = 64
"""A block hash is a 64-bit integer (vLLM 0.32) or, in some releases, bytes up to this many."""
MAX_TAG_CHARS = 64
INSTALL_HINT = "pip install 'kvtui[vllm]'"

BlockKey = int | bytes
"""A block's content hash, as the server sends it."""


class EventsError(EngineError):
    """A batch that is not what vLLM sends, or an endpoint kvtui cannot bind: one line."""


@dataclass(frozen=True)
class Endpoint:
    """Where kvtui's subscriber binds: `tcp://HOST:PORT`, HOST an IP address of this machine."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def for_rank(self, rank: int) -> Endpoint:
        """Where data-parallel rank `rank` publishes (vLLM offsets the port by the rank)."""
        return Endpoint(self.host, self.port + rank)


def parse_endpoint(text: str) -> Endpoint:
    """`tcp://HOST:PORT` (HOST an IP address or `localhost`, PORT 1-65535) as an `Endpoint`;
    `EventsError` in one line for anything else. Whether it can be bound here is `check_bind`."""
    shown = safe_text(text[:200], one_line=True)
    usage = f"--kv-events {shown}: expected tcp://HOST:PORT, the endpoint vLLM's publisher "
    if not text.startswith("tcp://") or len(text) > 300:
        raise EventsError(usage + "connects to (e.g. tcp://127.0.0.1:5557)")
    rest = text[len("tcp://") :]
    host, colon, port_text = rest.rpartition(":")
    if not colon or not port_text.isdigit() or not port_text.isascii():
        raise EventsError(usage + "connects to, with a port")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise EventsError(f"--kv-events {shown}: the port must be 1-65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise EventsError(
            f"--kv-events {shown}: kvtui binds the endpoint, so its host must be an IP address "
            "of this machine (127.0.0.1 where vLLM runs here; no * and no host name)"
        ) from None
    if address.is_unspecified or address.is_multicast:
        raise EventsError(
            f"--kv-events {shown}: bind one address (127.0.0.1, or this machine's address that "
            "vLLM connects to), not every interface"
        )
    return Endpoint(str(address), port)


MAX_RANKS = 16
"""The most data-parallel ranks `--kv-events ...,ranks=N` binds a port for."""


def parse_events(text: str) -> tuple[Endpoint, Endpoint | None, int]:
    """`--kv-events`: `ENDPOINT`, then `,replay=REPLAY` and `,ranks=N` where given: REPLAY the
    server's replay socket (its --kv-events-config `replay_endpoint`, a ROUTER it binds: kvtui
    connects there to ask for the batches a gap lost); N the server's data-parallel ranks, rank r
    publishing on ENDPOINT's port + r (vLLM's), each bound. `EventsError` in one line otherwise."""
    endpoint, *options = text.split(",")
    replay: Endpoint | None = None
    ranks = 1
    named: set[str] = set()
    for option in options:
        name, equals, value = option.partition("=")
        if not equals or name not in ("replay", "ranks") or name in named:
            shown = safe_text(option[:100], one_line=True)
            raise EventsError(
                "--kv-events: after the endpoint, expected replay=tcp://HOST:PORT or ranks=N "
                f"(each once), not {shown}"
            )
        named.add(name)
        if name == "replay":
            replay = parse_endpoint(value)
        elif (
            value.isascii() and value.isdigit() and len(value) <= 3 and 1 <= int(value) <= MAX_RANKS
        ):
            ranks = int(value)
        else:
            shown = safe_text(value[:20], one_line=True)
            raise EventsError(f"--kv-events: ranks= takes 1 to {MAX_RANKS}, not {shown}")
    point = parse_endpoint(endpoint)
    if point.port + ranks - 1 > 65_535:
        raise EventsError(f"--kv-events: {ranks} ranks from port {point.port} pass port 65535")
    return point, replay, ranks


def events_text(endpoint: Endpoint, replay: Endpoint | None, ranks: int = 1) -> str:
    """`parse_events`'s input, as kvtui writes it."""
    text = str(endpoint) if replay is None else f"{endpoint},replay={replay}"
    return text if ranks == 1 else f"{text},ranks={ranks}"


def check_bind(endpoint: Endpoint) -> None:
    """Whether the endpoint can be bound here now (a plain socket, bound and closed, reusing an
    address as libzmq does: a connection of a run just ended waits in TIME-WAIT there): one line
    when the address is not this machine's or the port is taken."""
    family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((endpoint.host, endpoint.port))
        except OSError as exc:
            why = (exc.strerror or type(exc).__name__).lower()
            raise EventsError(f"--kv-events {endpoint}: cannot bind it here ({why})") from None


def require_libraries() -> None:
    """pyzmq and msgpack, imported now: one line naming the extra where either is missing."""
    missing = []
    for name, package in (("zmq", "pyzmq"), ("msgpack", "msgpack")):
        try:
            __import__(name)
        except ImportError:
            missing.append(package)
    if missing:
        raise EventsError(f"--kv-events needs {' and '.join(missing)}: {INSTALL_HINT}")


# --- what a batch holds ------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """Blocks the server stored, a chain: block_hashes[0]'s parent is `parent`, each later one's
    the one before it; `token_ids` holds len(hashes) x block_size tokens, in order."""

    hashes: tuple[BlockKey, ...]
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None


@dataclass(frozen=True)
class Removed:
    """Blocks the server evicted."""

    hashes: tuple[BlockKey, ...]
    medium: str | None = None


@dataclass(frozen=True)
class Cleared:
    """The server dropped every block (a prefix cache reset)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    """One published batch: its sequence number, the server's time, its events, its DP rank."""

    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None
    topic: str = ""


def decode_frames(frames: list[bytes]) -> Batch:
    """A received message as a `Batch`; `EventsError` in one line when it is not one."""
    if len(frames) != 3:
        raise EventsError(f"a message of {len(frames)} frames, not 3 (topic, sequence, batch)")
    topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise EventsError(f"a sequence number of {len(seq_bytes)} bytes, not 8")
    if len(payload) > MAX_BATCH_BYTES or len(topic) > 1024:
        raise EventsError(f"a batch of {len(payload):,} bytes, past the {MAX_BATCH_BYTES:,} read")
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    ts, events, rank = _batch_fields(_unpack(payload))
    return Batch(
        seq=seq,
        ts=ts,
        events=tuple(_event(e) for e in events),
        dp_rank=rank,
        topic=safe_text(topic.decode("utf-8", errors="replace"), one_line=True),
    )


def _unpack(payload: bytes) -> Any:
    import msgpack

    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            max_str_len=MAX_BATCH_BYTES,
            max_bin_len=MAX_BATCH_BYTES,
            max_array_len=max(MAX_EVENTS, MAX_HASHES, MAX_BLOCK_TOKENS * 64),
            max_map_len=64,
            max_ext_len=0,
        )
    # msgpack raises a dozen types for bytes that are not msgpack (ExtraData, FormatError,
    # StackError, UnicodeDecodeError, ValueError, TypeError for a bad map key...): each is the
    # batch refused, in one line, never the subscriber ended.
    except Exception as exc:
        raise EventsError(f"a batch that is not msgpack ({type(exc).__name__})") from None


def _batch_fields(value: Any) -> tuple[float, list[Any], int | None]:
    if not isinstance(value, list) or not 2 <= len(value) <= 3:
        raise EventsError(f"a batch that is not [ts, events, dp_rank] (a {_kind(value)})")
    ts, events = value[0], value[1]
    rank = value[2] if len(value) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts != ts:
        raise EventsError(f"a batch whose time is a {_kind(ts)}")
    if not isinstance(events, list):
        raise EventsError(f"a batch whose events are a {_kind(events)}, not a list")
    if len(events) > MAX_EVENTS:
        raise EventsError(f"a batch of {len(events):,} events, past the {MAX_EVENTS:,} read")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise EventsError(f"a batch whose data-parallel rank is a {_kind(rank)}")
    if rank is not None and not 0 <= rank < 65536:
        raise EventsError(f"a batch whose data-parallel rank is {rank}")
    return float(ts), events, rank


FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}
"""The fields kvtui reads of each event, in the order of vLLM's structs (an array-like event
carries them in this order after its tag; `medium` follows `lora_id` in BlockStored and the
hashes in BlockRemoved)."""
MEDIUM_AT = {"BlockStored": 5, "BlockRemoved": 1}


def _event(value: Any) -> Event:
    if isinstance(value, dict):
        tag = value.get("type")
        fields: dict[str, Any] = value
    elif isinstance(value, list) and value:
        tag = value[0]
        names = FIELDS.get(tag, ()) if isinstance(tag, str) else ()
        fields = dict(zip(names, value[1:], strict=False))
        at = MEDIUM_AT.get(tag) if isinstance(tag, str) else None
        if at is not None and len(value) > at + 1:
            fields["medium"] = value[at + 1]
    else:
        raise EventsError(f"an event that is a {_kind(value)}, not a tagged struct")
    if not isinstance(tag, str) or tag not in FIELDS:
        shown = safe_text(str(tag)[:MAX_TAG_CHARS], one_line=True)
        raise EventsError(f"an event of an unknown type ({shown})")
    missing = [name for name in FIELDS[tag] if name not in fields]
    if missing:
        raise EventsError(f"a {tag} without {', '.join(missing)}")
    medium = _medium(fields.get("medium"), tag)
    if tag == "AllBlocksCleared":
        return Cleared()
    hashes = _hashes(fields["block_hashes"], tag)
    if tag == "BlockRemoved":
        return Removed(hashes, medium)
    parent = fields["parent_block_hash"]
    parent_key = None if parent is None else _hash(parent, tag)
    size = fields["block_size"]
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_BLOCK_TOKENS:
        raise EventsError(f"a BlockStored whose block size is {_shown_value(size)}")
    tokens = fields["token_ids"]
    if not isinstance(tokens, list) or len(tokens) != len(hashes) * size:
        count = len(tokens) if isinstance(tokens, list) else _kind(tokens)
        raise EventsError(
            f"a BlockStored of {len(hashes)} blocks of {size} with {count} token ids, "
            f"not {len(hashes) * size}"
        )
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise EventsError(f"a BlockStored with a token id {_shown_value(token)}")
    return Stored(hashes, parent_key, tuple(tokens), size, medium)


def _hashes(value: Any, tag: str) -> tuple[BlockKey, ...]:
    if not isinstance(value, list) or not value:
        raise EventsError(f"a {tag} whose block_hashes are a {_kind(value)}, not a list of hashes")
    if len(value) > MAX_HASHES:
        raise EventsError(f"a {tag} of {len(value):,} blocks, past the {MAX_HASHES:,} read")
    return tuple(_hash(v, tag) for v in value)


def _hash(value: Any, tag: str) -> BlockKey:
    if isinstance(value, bool):
        raise EventsError(f"a {tag} with a block hash that is a bool")
    if isinstance(value, int) and -(2**63) <= value < 2**64:
        return value
    if isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES:
        return value
    raise EventsError(f"a {tag} with a block hash that is a {_kind(value)}")


def _medium(value: Any, tag: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_TAG_CHARS:
        raise EventsError(f"a {tag} whose medium is a {_kind(value)}")
    return safe_text(value, one_line=True)


def _kind(value: Any) -> str:
    return type(value).__name__


def _shown_value(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}" if abs(value) < 10**30 else "past any id"
    return f"a {_kind(value)}"


# --- the subscriber ----------------------------------------------------------------------------

RECEIVE_MAX = 256
"""The most messages one `receive` takes (the rest wait for the next)."""
REPLAY_MAX = 10_000
"""The most batches one replay takes (vLLM keeps 10,000 by default: `buffer_steps`)."""
END_SEQ = -1
"""The sequence number that ends a replay (vLLM's `END_SEQ`)."""


class Subscriber:
    """A zmq SUB socket bound at an endpoint (and at PORT + r for each further data-parallel
    rank r below `ranks`), every topic. `receive` hands on what arrived, each message a `Batch`
    or the `EventsError` that says why it was refused; it never raises for what a publisher
    sent. Opening it imports pyzmq and msgpack (`require_libraries` says what is missing)."""

    def __init__(self, endpoint: Endpoint, ranks: int = 1, replay: Endpoint | None = None) -> None:
        require_libraries()
        import zmq

        self.endpoint = endpoint
        self.replay_endpoint = replay
        self._replay: Any = None
        self._zmq = zmq
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        # libzmq drops a message past this unread (and the publisher's connection with it).
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES + 4096)
        self._socket.setsockopt(zmq.RCVHWM, 10_000)
        try:
            for rank in range(ranks):
                self._socket.bind(str(endpoint.for_rank(rank)))
        except zmq.ZMQError as exc:
            self.close()
            raise EventsError(f"--kv-events {endpoint}: cannot bind it here ({exc})") from None

    def receive(self, timeout_s: float) -> list[Batch | EventsError]:
        """What arrived within `timeout_s` (at most RECEIVE_MAX messages; [] when none)."""
        zmq = self._zmq
        got: list[Batch | EventsError] = []
        if not self._socket.poll(max(0, int(timeout_s * 1000))):
            return got
        while len(got) < RECEIVE_MAX:
            try:
                frames = self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            try:
                got.append(decode_frames(frames))
            except EventsError as exc:
                got.append(exc)
        return got

    def replay(self, start: int, timeout_s: float) -> list[Batch | EventsError]:
        """Ask the server's replay socket for its buffered batches from `start` on (a DEALER to
        its ROUTER: an empty frame and the 8-byte number; each batch comes back as an empty
        frame and vLLM's three, then END_SEQ), within `timeout_s` in all; [] without a replay
        endpoint. What came before the deadline is handed on."""
        if self.replay_endpoint is None or not 0 <= start < 2**63:
            return []
        zmq = self._zmq
        if self._replay is None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES + 4096)
            self._replay.connect(str(self.replay_endpoint))
        self._replay.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[Batch | EventsError] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < REPLAY_MAX:
            left = deadline - time.monotonic()
            if left <= 0 or not self._replay.poll(max(1, int(left * 1000))):
                self._replay.close(linger=0)  # a late answer must not meet the next question
                self._replay = None
                break
            frames = self._replay.recv_multipart(copy=True)
            if len(frames) == 4 and frames[2] == END_SEQ.to_bytes(8, "big", signed=True):
                break
            try:
                got.append(decode_frames(frames[1:]))
            except EventsError as exc:
                got.append(exc)
        return got

    def close(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
        self._socket.close(linger=0)
        self._context.term()
