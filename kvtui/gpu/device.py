"""Where a torch model runs, without a UI: the device a run asks for, what it is in words, its
free memory, its dtype, and synchronising it before a step is timed."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

from kvtui.engine.protocol import EngineError
from kvtui.gpu.probe import open_probe
from kvtui.sim.catalog import compute_dtype, match_gpu, normalize_dtype


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a step is timed only after this (gpt-fast)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pick_device(name: str) -> torch.device:
    """`auto` is CUDA when present, else the CPU; `cuda` without a GPU is an `EngineError`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EngineError("--device cuda: no CUDA device is available (torch sees none)")
        return torch.device(name)
    raise EngineError(f"unknown device {name!r}: use auto, cpu or cuda")


def describe_device(device: torch.device) -> tuple[str, int | None, float | None]:
    """Where a run happens, in words; the device's memory; its peak bandwidth (NVML) if known."""
    if device.type != "cuda":
        return "cpu", None, None
    index = device.index or 0
    total = torch.cuda.get_device_properties(device).total_memory
    with open_probe(index) as probe:  # NVML: peak bandwidth from memory clock x bus width
        peak = probe.read().peak_bandwidth_bytes_per_s
    return f"cuda:{index} ({torch.cuda.get_device_name(device)})", total, peak


def device_ridge(device: torch.device, memory_bytes: int | None) -> tuple[float | None, str]:
    """The device's roofline ridge point (peak bf16 FLOP/s over peak bytes/s) and where it came
    from: a CUDA device's from the catalog GPU it matches (kvtui.sim.catalog.match_gpu); None,
    saying why, on a CPU (the catalog has no CPUs) or a GPU the catalog does not hold."""
    if device.type != "cuda":
        return None, "none: the catalog has no peak FLOP/s for a CPU"
    name = torch.cuda.get_device_name(device)
    gpu = match_gpu(name, memory_bytes)
    if gpu is None:
        return None, f"none: {name} is not in the GPU catalog"
    return gpu.ridge_flops_per_byte, f"the catalog's {gpu.display_name}"


_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def run_dtype(device: torch.device, stored: str) -> tuple[torch.dtype, str]:
    """The torch dtype a model stored in `stored` (a kvtui.sim name: "fp16") computes in on
    `device`, and why, in words (kvtui.sim.catalog.compute_dtype: the weights' own on a GPU
    where it can, fp32 on a CPU)."""
    gpu = device.type == "cuda"
    name, why = compute_dtype(stored, gpu=gpu, gpu_has_bf16=gpu and torch.cuda.is_bf16_supported())
    return _TORCH_DTYPES[name], why


def dtype_name(dtype: torch.dtype) -> str:
    """kvtui.sim's name of a torch dtype: torch.bfloat16 -> "bf16"."""
    return normalize_dtype(str(dtype))


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Free memory where the model would live, and what that memory is, in words;
    `EngineError` when it cannot be read (a budget is not checked against a guess)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"free memory on {torch.cuda.get_device_name(device)}"
    return host_room(proc=PROC, cgroup=CGROUP)


PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
_NO_LIMIT = 2**60
"""cgroup v1 writes "no limit" as a number near 2^63; anything past this is none."""


def host_room(*, proc: Path, cgroup: Path) -> tuple[int, str]:
    """The memory this process may still take on the host, and what bounds it, in words: the
    least of the free host RAM, the room left under an address-space limit (`ulimit -v`,
    RLIMIT_AS, against the address space already mapped) and the room left in its cgroup and
    every cgroup above it (v2 `memory.max` less `memory.current`, v1 `memory.limit_in_bytes` less
    `memory.usage_in_bytes`): a container with 4 GB on a large host has 4 GB, whatever the host
    has free. `EngineError` when the free RAM cannot be read."""
    try:
        rooms = [(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host RAM")]
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
    """A `kB` field of /proc/self/status, in bytes (0 where it cannot be read)."""
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


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that failed: torch's on a GPU, Python's, or the CPU
    allocator's (a RuntimeError "DefaultCPUAllocator: can't allocate memory", as under an address
    space or cgroup limit)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
