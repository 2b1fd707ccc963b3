"""A stand-in for vLLM's KV-events publisher (vllm/distributed/kv_events.py): a zmq PUB that
connects to kvtui's bound SUB, in this process, and sends what a test says: vLLM's three frames
(topic, an 8-byte big-endian sequence number, a msgpack [ts, events, dp_rank]) or any bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from tests.ports import free_port

WAIT_S = 10.0


def free_endpoint(ranks: int = 1) -> str:
    """A loopback tcp endpoint whose port, and the `ranks - 1` after it, are free now."""
    return f"tcp://127.0.0.1:{free_port(ranks)}"


def stored(hashes: list[Any], tokens: list[int], parent: int | None = None, size: int = 4) -> dict:
    """A BlockStored as vLLM 0.32 encodes it (a map tagged by `type`)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def wait_until(condition: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    """Poll `condition` until it is true (its value returned); AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s")


class StandIn:
    """A publisher connected to `endpoint`; with `replay`, a ROUTER bound there answers replay
    requests from what it sent (vLLM's `_service_replay`), on a thread of its own."""

    def __init__(
        self, endpoint: str, replay: str | None = None, hold: threading.Event | None = None
    ) -> None:
        """`hold`: a replay request is answered only once it is set."""
        self.hold = hold
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.replays: list[int] = []
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay is not None:
            router = self.context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay)
            self._replay_thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._replay_thread.start()

    def _serve(self, router: Any) -> None:
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            client, _, start = router.recv_multipart()
            self.replays.append(int.from_bytes(start, "big"))
            if self.hold is not None:
                self.hold.wait(WAIT_S)
            for seq, payload in list(self.buffer):
                if seq >= self.replays[-1]:
                    router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        router.close(linger=0)

    def send(
        self, seq: int, events: list[Any], rank: int | None = 0, *, lost: bool = False
    ) -> None:
        """Publish a batch (kept for replays); `lost`: kept, but never published."""
        payload = msgpack.packb([time.time(), events, rank])
        self.buffer.append((seq, payload))
        if not lost:
            self.frames([b"", seq.to_bytes(8, "big"), payload])

    def frames(self, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames)

    def join(self, feed: Any) -> None:
        """Send empty batch 0 until the feed has it (a PUB drops what it sends before the
        connection is up): later batches arrive in order, and the repeats of 0 are skipped."""

        def arrived() -> bool:
            self.send(0, [])
            time.sleep(0.01)
            return feed.view().batches >= 1

        wait_until(arrived)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(5)
        self.socket.close(linger=0)
        self.context.term()
