"""The memory this process may take on its host, torch-free: the free RAM, and the limits a
container or a shell sets below it (cgroup v2 and v1, `ulimit -v`). Read by the torch engines'
pre-checks (kvtui.gpu.device.available_bytes) and by the check before an app opens
(kvtui.engines.factory.free_memory) alike. And handing back what a loop freed
(`trim_host_memory`), so that an engine's RSS does not climb run after run."""

from __future__ import annotations

import ctypes
import functools
import os
import resource
from collections.abc import Callable
from pathlib import Path

from kvtui.errors import EngineError

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
_NO_LIMIT = 2**60
"""cgroup v1 writes "no limit" as a number near 2^63; anything past this is none."""


def host_room(*, proc: Path | None = None, cgroup: Path | None = None) -> tuple[int, str]:
    """The memory this process may still take on the host, and what bounds it, in words: the
    least of the host RAM available (/proc/meminfo's MemAvailable, else the free pages), the
    room left under an address-space limit (`ulimit -v`, RLIMIT_AS, against the address space
    already mapped) and the room left in its cgroup and every cgroup above it (v2 `memory.max`
    less `memory.current`, v1 `memory.limit_in_bytes` less `memory.usage_in_bytes`): a
    container with 4 GB on a large host has 4 GB, whatever the host has free. `EngineError`
    when the free RAM cannot be read. (`proc` and `cgroup`: where /proc and /sys/fs/cgroup are,
    PROC and CGROUP.)"""
    proc, cgroup = proc or PROC, cgroup or CGROUP
    # MemAvailable counts the page cache the kernel gives back on demand; MemFree (sysconf's
    # free pages), where there is no MemAvailable, does not, and on a server that has read its
    # disks it is a fraction of what a model can really take.
    available = _status_bytes(proc / "meminfo", "MemAvailable")
    try:
        rooms = [
            (available, "available host RAM")
            if available
            else (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host RAM")
        ]
    except (ValueError, OSError) as exc:
        raise EngineError(f"cannot read this machine's free memory: {exc}") from None
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft >= 0:
        mapped = _status_bytes(proc / "self" / "status", "VmSize")
        room = "the room under this process's address-space limit (ulimit -v)"
        rooms.append((max(0, soft - mapped), room))
    rooms += _cgroup_rooms(proc / "self" / "cgroup", cgroup)
    return min(rooms)


def _read_int(path: Path) -> int | None:
    """The number a cgroup or /proc file holds; None for "max", a missing or unreadable file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _status_bytes(path: Path, field: str) -> int:
    """A `kB` field of /proc/self/status or /proc/meminfo, in bytes (0 where it cannot be
    read)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == field and value.split() and value.split()[0].isdigit():
                return int(value.split()[0]) * 1024
    except OSError:
        pass
    return 0


def _cgroup_rooms(membership: Path, root: Path) -> list[tuple[int, str]]:
    """The room left in each cgroup this process is in, and each above it, that has a limit."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return []
    rooms = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, where = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            top, limit_file, used_file = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1: the memory controller's own
            top, limit_file, used_file = (
                root / "memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        folder = top / where.strip("/")
        while folder.is_relative_to(top):
            limit = _read_int(folder / limit_file)
            if limit is not None and limit < _NO_LIMIT:
                used = _read_int(folder / used_file) or 0
                rooms.append(
                    (max(0, limit - used), f"the room in this process's cgroup ({limit_file})")
                )
            if folder == top:
                break
            folder = folder.parent
    return rooms


def trim_host_memory() -> None:
    """Hand the host memory a finished loop freed back to the system (glibc's `malloc_trim`).

    glibc keeps much of what the uncached loop's long steps freed (the whole sequence's
    activations: +70 MiB of RSS after 4,000 positions of the tiny model, of which all but 5 MiB
    is free), so an engine's RSS would climb run after run without it. Elsewhere than glibc, a
    no-op."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim` from the running process's own symbols; None without glibc."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
