"""Loopback ports that are free now, for the tests' servers and endpoints (one definition)."""

from __future__ import annotations

import contextlib
import socket

TRIES = 100


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive loopback ports all free now: the kernel picks the first,
    the rest are bound beside it while it is held, and a new first is taken where one is busy
    (a data-parallel server's rank r publishes on its endpoint's port + r, and the port after a
    free one is often a client's)."""
    for _ in range(TRIES):
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port: int = first.getsockname()[1]
            try:
                for offset in range(1, count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port + offset))
            except (OSError, OverflowError):  # busy, or past port 65535
                continue
            return port
    raise OSError(f"no {count} consecutive loopback ports free in {TRIES} tries")
