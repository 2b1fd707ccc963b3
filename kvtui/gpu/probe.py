"""Device memory probes: what a GPU holds and how fast it can read it, without a UI.

This module is where "is there a GPU at all?" is decided: `cuda_visible()` answers it without
torch or NVML (the CLI's check before an app opens: a device node of the driver), and
`open_probe()` answers it through NVML. It never raises just
because there is no GPU: it returns an `NvmlProbe` when NVML initialises and the device exists,
otherwise a `NullProbe` whose `why` says, in words, what is missing (nvidia-ml-py not installed,
the NVML library not found, the driver not loaded, no device at that index). After that, every
NVML call goes through one query helper with a default (as nvitop's `api/libnvml.py` does), so a
field the device does not support (on MIG, on unified-memory parts) degrades to None with a reason
and never to a traceback.

Importing this module is cheap and quiet: it imports neither pynvml nor torch and does not
initialise NVML. pynvml is imported, and NVML initialised, in `open_probe()`; torch is consulted
for the process's own share only when it is already imported (see `torch_memory`).

Device indices are CUDA's, as torch numbers them: when CUDA_VISIBLE_DEVICES lists indices or
GPU-/MIG- UUIDs, the probe opens the NVML device that entry names. (CUDA's default
CUDA_DEVICE_ORDER=FASTEST_FIRST can still differ from NVML's PCI order on mixed multi-GPU boxes.)
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from typing_extensions import Self

from kvtui.format import format_bytes

_NVML_LIBRARY = "nvml.dll" if sys.platform.startswith("win") else "libnvidia-ml.so.1"

# NVML error codes (nvml.h) and what they mean to someone looking at the header of a TUI. Looked
# up by name on the nvml module in use, so a fake module in the tests can define its own values.
_NVML_ERROR_WORDS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": f"NVML library not found ({_NVML_LIBRARY})",
    "NVML_ERROR_DRIVER_NOT_LOADED": "NVIDIA driver not loaded",
    "NVML_ERROR_NO_PERMISSION": "no permission to query the GPU",
    "NVML_ERROR_NOT_SUPPORTED": "not supported on this device",
    "NVML_ERROR_FUNCTION_NOT_FOUND": "not provided by this driver's NVML",
    "NVML_ERROR_GPU_IS_LOST": "the GPU has fallen off the bus",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": "NVML and the kernel driver versions differ",
    "NVML_ERROR_NOT_FOUND": "no such device",
    "NVML_ERROR_INVALID_ARGUMENT": "no such device",
}


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a device's memory. None means unknown; `why` then says why."""

    name: str | None = None
    """Marketing name as the driver reports it, e.g. "NVIDIA H100 80GB HBM3"."""
    total_bytes: int | None = None
    """Device memory visible to programs (NVML's total; slightly under the label's GB)."""
    used_bytes: int | None = None
    """In use by every process on the device (NVML); excludes driver-reserved memory when the
    driver offers nvmlDeviceGetMemoryInfo_v2."""
    free_bytes: int | None = None
    peak_bandwidth_bytes_per_s: float | None = None
    """Estimated peak memory bandwidth: max memory clock x 2 (double data rate) x bus width.
    A datasheet-style ceiling, not a measurement (see `peak_bandwidth_bytes_per_s`)."""
    memory_clock_mhz: int | None = None
    """Max memory clock as NVML reports it (NVML_CLOCK_MEM), the input to the estimate."""
    memory_bus_bits: int | None = None
    process_allocated_bytes: int | None = None
    """This process's live tensors (torch.cuda.memory_allocated); None unless this process uses
    CUDA through torch. NVML cannot see a process's own memory inside most containers."""
    process_reserved_bytes: int | None = None
    """Held by this process's torch caching allocator (torch.cuda.memory_reserved)."""
    driver_version: str | None = None
    cuda_version: str | None = None
    """Highest CUDA version the driver supports, e.g. "12.4"."""
    why: str | None = None
    """Why the unknown fields are unknown, in words ("field: reason; ..."); None when all known."""


@dataclass(frozen=True)
class TorchMemory:
    """This process's view of one CUDA device through torch. None means unknown; see `why`."""

    free_bytes: int | None = None
    """Free on the device, as the CUDA driver reports it (torch.cuda.mem_get_info)."""
    total_bytes: int | None = None
    allocated_bytes: int | None = None
    """Live tensors of this process (torch.cuda.memory_allocated)."""
    reserved_bytes: int | None = None
    """Held by this process's caching allocator (torch.cuda.memory_reserved)."""
    why: str | None = None


class DeviceProbe(Protocol):
    """Reads one device's memory. Use as a context manager, or call `close()`."""

    def read(self) -> DeviceMemory: ...

    def label(self) -> str:
        """The device in a few words for a narrow header: "NVIDIA H100 80GB HBM3", "CPU, no GPU"."""
        ...

    def describe(self) -> str:
        """One line for a header: "NVIDIA H100 80GB HBM3 · 79.6 GiB" or "CPU, no GPU: why"."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> DeviceProbe: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class _ClosesOnExit:
    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class NullProbe(_ClosesOnExit):
    """No GPU NVML can read: every reading is unknown, for the reason given. Where the machine
    shows a GPU all the same (`cuda_visible`: a driver's device node), it says so rather than
    "no GPU"."""

    def __init__(self, why: str, *, gpu_seen: bool | None = None) -> None:
        self.why = why
        self.gpu_seen = cuda_visible() if gpu_seen is None else gpu_seen

    def read(self) -> DeviceMemory:
        return DeviceMemory(why=self.why)

    def label(self) -> str:
        return "GPU, NVML unavailable" if self.gpu_seen else "CPU, no GPU"

    def describe(self) -> str:
        return f"{self.label()}: {self.why}"

    def __repr__(self) -> str:
        return f"NullProbe(why={self.why!r})"


class NvmlProbe(_ClosesOnExit):
    """One NVML device. Build it with `open_probe()`, which has already initialised NVML.

    Name, total, clocks and versions do not change and are read once; used and free memory are
    read on every `read()`. Each field that NVML refuses becomes None with its reason.
    """

    def __init__(self, nvml: Any, handle: Any, device_index: int) -> None:
        self._nvml = nvml
        self._handle = handle
        self.device_index = device_index
        self._closed = False
        self._static_reasons: dict[str, str] = {}
        self._memory_v2 = hasattr(nvml, "nvmlMemory_v2")

        name = self._query("name", "nvmlDeviceGetName", handle)
        self._name = name.decode() if isinstance(name, bytes) else name
        clock = self._query(
            "memory_clock_mhz",
            "nvmlDeviceGetMaxClockInfo",
            handle,
            getattr(nvml, "NVML_CLOCK_MEM", 2),
        )
        bus = self._query("memory_bus_bits", "nvmlDeviceGetMemoryBusWidth", handle)
        self._clock_mhz = int(clock) if clock is not None else None
        self._bus_bits = int(bus) if bus is not None else None
        self._bandwidth = (
            peak_bandwidth_bytes_per_s(self._clock_mhz, self._bus_bits)
            if self._clock_mhz and self._bus_bits
            else None
        )
        if self._bandwidth is None:
            self._static_reasons["peak_bandwidth_bytes_per_s"] = (
                "needs both the memory clock and the bus width"
            )
        driver = self._query("driver_version", "nvmlSystemGetDriverVersion")
        self._driver = driver.decode() if isinstance(driver, bytes) else driver
        cuda = self._query(
            "cuda_version", ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion")
        )
        self._cuda = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
        # Total does not change: read once so `describe()` needs no fresh reading.
        self._total = self._memory_info({})[0]

    def _query(
        self,
        field: str,
        function: str | tuple[str, ...],
        *args: Any,
        reasons: dict[str, str] | None = None,
    ) -> Any:
        """`_nvml_call` for one field: its value, or None with the reason noted under `field`."""
        value, reason = _nvml_call(self._nvml, function, *args)
        if reason is not None:
            (self._static_reasons if reasons is None else reasons)[field] = reason
        return value

    def _memory_info(self, reasons: dict[str, str]) -> tuple[int | None, int | None, int | None]:
        """(total, used, free). v2 separates driver-reserved memory from `used`; fall back to v1."""
        nvml = self._nvml
        info = None
        if self._memory_v2:
            info, _ = _nvml_call(
                nvml, "nvmlDeviceGetMemoryInfo", self._handle, version=nvml.nvmlMemory_v2
            )
            self._memory_v2 = info is not None  # older drivers refuse v2: stop asking
        if info is None:
            info = self._query("memory", "nvmlDeviceGetMemoryInfo", self._handle, reasons=reasons)
        if info is None:
            return None, None, None
        return int(info.total), int(info.used), int(info.free)

    def read(self) -> DeviceMemory:
        if self._closed:
            raise RuntimeError("read() on a closed probe")
        reasons = dict(self._static_reasons)
        total, used, free = self._memory_info(reasons)
        torch_share = torch_memory(self.device_index)
        if torch_share.why is not None:
            reasons["process memory"] = torch_share.why
        return DeviceMemory(
            name=self._name,
            total_bytes=total if total is not None else self._total,
            used_bytes=used,
            free_bytes=free,
            peak_bandwidth_bytes_per_s=self._bandwidth,
            memory_clock_mhz=self._clock_mhz,
            memory_bus_bits=self._bus_bits,
            process_allocated_bytes=torch_share.allocated_bytes,
            process_reserved_bytes=torch_share.reserved_bytes,
            driver_version=self._driver,
            cuda_version=self._cuda,
            why="; ".join(f"{k}: {v}" for k, v in reasons.items()) or None,
        )

    def label(self) -> str:
        return self._name or f"GPU {self.device_index}"

    def describe(self) -> str:
        if self._total is None:
            return self.label()
        return f"{self.label()} · {format_bytes(self._total)}"

    def close(self) -> None:
        """Shut NVML down (NVML counts inits, so other open probes stay usable). Idempotent."""
        if not self._closed:
            self._closed = True
            _nvml_call(self._nvml, "nvmlShutdown")

    def __repr__(self) -> str:
        return f"NvmlProbe(device_index={self.device_index}, name={self._name!r})"


def peak_bandwidth_bytes_per_s(memory_clock_mhz: float, memory_bus_bits: int) -> float:
    """Estimated peak memory bandwidth from NVML's max memory clock and bus width.

    clock (MHz) x 1e6 x 2 x bus (bits) / 8. The factor 2 is double data rate: NVML reports a
    memory clock at which two transfers happen per cycle. Checked against datasheets:
    H100 SXM 2619 MHz x 5120 bits -> 3.35e12 B/s (3.35 TB/s); A100 40GB 1215 MHz x 5120 bits ->
    1.555e12 (1,555 GB/s); RTX 4090 10501 MHz x 384 bits -> 1.008e12 (1,008 GB/s). It is a
    ceiling: decode kernels reach perhaps 70-90% of it.
    """
    return memory_clock_mhz * 1e6 * 2 * memory_bus_bits / 8


def cuda_visible() -> bool:
    """Whether this machine shows a CUDA (or ROCm) device, without importing torch: a device
    node of the NVIDIA driver (`/dev/nvidia0`; Jetson's `/dev/nvhost-*`), WSL's GPU (`/dev/dxg`)
    or ROCm's (`/dev/kfd`), not hidden by CUDA_VISIBLE_DEVICES. torch may still see none; the
    engine then says so."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    nodes = glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/nvhost-*")
    return bool(nodes) or any(os.path.exists(node) for node in ("/dev/dxg", "/dev/kfd"))


def open_probe(device_index: int = 0, *, nvml: Any = None) -> DeviceProbe:
    """An `NvmlProbe` for CUDA device `device_index`, or a `NullProbe` saying why not.

    Never raises for a missing GPU, driver, library or binding. `nvml` is the module to call
    (the tests pass a fake); by default pynvml from nvidia-ml-py, imported here and not before.
    """
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return NullProbe("nvidia-ml-py is not installed (no pynvml module)")
        nvml = pynvml
    _, reason = _nvml_call(nvml, "nvmlInit")
    if reason is not None:
        return NullProbe(reason)
    handle, reason = _open_handle(nvml, device_index)
    if reason is not None:
        _nvml_call(nvml, "nvmlShutdown")
        return NullProbe(reason)
    return NvmlProbe(nvml, handle, device_index)


def torch_memory(device: Any = 0, *, force: bool = False) -> TorchMemory:
    """This process's share of a CUDA device through torch, without importing torch by surprise.

    By default torch is used only when already imported and only when this process has already
    initialised CUDA, because `mem_get_info` would otherwise create a CUDA context (seconds, and
    some hundreds of MiB of device memory) just to look. `force=True` imports torch and lets it
    initialise CUDA.
    """
    torch: Any = sys.modules.get("torch")
    if torch is None and not force:
        return TorchMemory(why="torch is not imported in this process")
    if torch is None:
        try:
            import torch as torch_module
        except ImportError:
            return TorchMemory(why="torch is not installed")
        torch = torch_module
    if not torch.cuda.is_available():
        return TorchMemory(why="torch sees no CUDA device")
    if not force and not torch.cuda.is_initialized():
        return TorchMemory(why="this process has not initialised CUDA")
    try:
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
    except (RuntimeError, AssertionError, ValueError) as error:
        # CUDA errors surface as RuntimeError; a bad device index as AssertionError/ValueError.
        return TorchMemory(why=f"torch could not read device {device}: {error}")
    return TorchMemory(
        free_bytes=int(free),
        total_bytes=int(total),
        allocated_bytes=int(allocated),
        reserved_bytes=int(reserved),
    )


def probe_summary(device_index: int = 0, *, nvml: Any = None) -> dict[str, Any]:
    """One reading as a plain, JSON-able dict (for `--json` and for crossing a process pipe).

    The keys are `DeviceMemory`'s fields plus `probe` ("nvml" or "null"), `description` (the
    probe's `describe()`, one line with the detail) and `label` (its `label()`, a few words).
    """
    with open_probe(device_index, nvml=nvml) as probe:
        summary = asdict(probe.read())
        summary["probe"] = "nvml" if isinstance(probe, NvmlProbe) else "null"
        summary["description"] = probe.describe()
        summary["label"] = probe.label()
    return summary


def _nvml_call(
    nvml: Any, function: str | tuple[str, ...], *args: Any, **kwargs: Any
) -> tuple[Any, str | None]:
    """The one place NVML is called: (value, None), or (None, the reason in words).

    `function` names the call, or several names to try in order (newest first), so that a call
    missing from older bindings counts as unsupported instead of raising AttributeError.
    """
    names = (function,) if isinstance(function, str) else function
    fn = next((f for f in (getattr(nvml, n, None) for n in names) if f is not None), None)
    if fn is None:
        return None, f"{names[0]} is not in this nvidia-ml-py"
    # NVMLLibraryMismatchError (bindings newer than the driver) does not derive from NVMLError.
    errors = (nvml.NVMLError, getattr(nvml, "NVMLLibraryMismatchError", nvml.NVMLError))
    try:
        return fn(*args, **kwargs), None
    except errors as error:
        return None, _nvml_words(nvml, error)


def _nvml_words(nvml: Any, error: BaseException) -> str:
    value = getattr(error, "value", None)
    for constant, words in _NVML_ERROR_WORDS.items():
        if value is not None and value == getattr(nvml, constant, object()):
            return words
    return str(error) or type(error).__name__


def _open_handle(nvml: Any, device_index: int) -> tuple[Any, str | None]:
    """The NVML handle for CUDA device `device_index`, honouring CUDA_VISIBLE_DEVICES."""
    count, reason = _nvml_call(nvml, "nvmlDeviceGetCount")
    if reason is not None:
        return None, reason
    if not count:
        return None, "NVML sees no GPU"
    visible = [
        entry.strip()
        for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        if entry.strip()
    ]
    if "CUDA_VISIBLE_DEVICES" in os.environ and not visible:
        return None, "CUDA_VISIBLE_DEVICES hides every GPU"
    target: int | str = device_index
    if visible:
        if not 0 <= device_index < len(visible):
            return None, f"no GPU {device_index} in CUDA_VISIBLE_DEVICES={','.join(visible)}"
        entry = visible[device_index]
        target = int(entry) if entry.isdigit() else entry
    if isinstance(target, str):
        if not target.startswith(("GPU-", "MIG-")):
            return None, f"cannot map CUDA_VISIBLE_DEVICES entry {target!r} to an NVML device"
        handle, reason = _nvml_call(nvml, "nvmlDeviceGetHandleByUUID", target)
    elif not 0 <= target < count:
        return None, f"no GPU at index {target} (NVML sees {count})"
    else:
        handle, reason = _nvml_call(nvml, "nvmlDeviceGetHandleByIndex", target)
    return handle, reason
