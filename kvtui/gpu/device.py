"""Where a torch model runs, without a UI: the device a run asks for, what it is in words, its
free memory, its dtype, and synchronising it before a step is timed."""

from __future__ import annotations

import torch

from kvtui.errors import EngineError
from kvtui.gpu.host import host_room
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
    return host_room()


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that failed: torch's on a GPU, Python's, or the CPU
    allocator's (a RuntimeError "DefaultCPUAllocator: can't allocate memory", as under an address
    space or cgroup limit)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
