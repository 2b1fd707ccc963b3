"""The device memory probe: the real null path on this machine, and the NVML path through a fake."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvtui.gpu import probe as probe_module
from kvtui.gpu.probe import (
    DeviceMemory,
    NullProbe,
    NvmlProbe,
    TorchMemory,
    open_probe,
    peak_bandwidth_bytes_per_s,
    probe_summary,
    torch_memory,
)

H100_TOTAL_BYTES = 81559 * 2**20  # NVML's total for an H100 80GB HBM3 (81559 MiB)


class FakeNvml:
    """The few pynvml calls the probe makes, with knobs for what a device refuses."""

    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_CLOCK_MEM = 2
    nvmlMemory_v2 = 0x02000028

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(
        self,
        *,
        name: bytes | str = b"NVIDIA H100 80GB HBM3",
        total: int = H100_TOTAL_BYTES,
        used: int = 1 * 2**30,
        mem_clock_mhz: int = 2619,
        bus_bits: int = 5120,
        count: int = 1,
        init_error: int | None = None,
        not_supported: tuple[str, ...] = (),
    ) -> None:
        self.name, self.total, self.used = name, total, used
        self.mem_clock_mhz, self.bus_bits, self.count = mem_clock_mhz, bus_bits, count
        self.init_error, self.not_supported = init_error, set(not_supported)
        self.live_inits = 0
        self.calls: list[str] = []

    def _call(self, fn: str) -> None:
        self.calls.append(fn)
        if fn in self.not_supported:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)

    def nvmlInit(self) -> None:
        self._call("nvmlInit")
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)
        self.live_inits += 1

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self.live_inits -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self._call("nvmlDeviceGetHandleByIndex")
        return f"handle-{index}"

    def nvmlDeviceGetName(self, handle: str) -> bytes | str:
        self._call("nvmlDeviceGetName")
        return self.name

    def nvmlDeviceGetMemoryInfo(self, handle: str, version: int | None = None) -> SimpleNamespace:
        self._call("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=self.total, used=self.used, free=self.total - self.used)

    def nvmlDeviceGetMaxClockInfo(self, handle: str, clock_type: int) -> int:
        self._call("nvmlDeviceGetMaxClockInfo")
        assert clock_type == self.NVML_CLOCK_MEM
        return self.mem_clock_mhz

    def nvmlDeviceGetMemoryBusWidth(self, handle: str) -> int:
        self._call("nvmlDeviceGetMemoryBusWidth")
        return self.bus_bits

    def nvmlSystemGetDriverVersion(self) -> str:
        self._call("nvmlSystemGetDriverVersion")
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._call("nvmlSystemGetCudaDriverVersion_v2")
        return 12040


@pytest.fixture(autouse=True)
def _no_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


# The null path, for real: this machine has no NVML library.

with open_probe() as _probe:
    HAS_NVML = not isinstance(_probe, NullProbe)


@pytest.mark.skipif(HAS_NVML, reason="this machine has NVML; the null path is not real here")
def test_open_probe_without_nvml_library_is_a_null_probe_that_says_why() -> None:
    with open_probe() as probe:
        assert isinstance(probe, NullProbe)
        assert "NVML library not found" in probe.why
        reading = probe.read()
        assert reading == DeviceMemory(why=probe.why)
        assert probe.describe().startswith("CPU, no GPU: NVML library not found")
        assert probe.label() == "CPU, no GPU"


@pytest.mark.skipif(HAS_NVML, reason="this machine has NVML; the null path is not real here")
def test_probe_summary_without_nvml_is_plain_json() -> None:
    summary = probe_summary()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["probe"] == "null"
    assert summary["total_bytes"] is None
    assert summary["description"].startswith("CPU, no GPU")
    assert summary["label"] == "CPU, no GPU"


def test_missing_nvidia_ml_py_is_a_null_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    probe = open_probe()
    assert isinstance(probe, NullProbe)
    assert "nvidia-ml-py is not installed" in probe.why


def test_import_loads_neither_torch_nor_pynvml_and_prints_nothing() -> None:
    code = (
        "import sys, kvtui.gpu.probe\n"
        "print(sorted(m for m in ('torch', 'pynvml', 'textual') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
    assert result.stderr == ""


def test_torch_memory_does_not_import_torch_unless_asked() -> None:
    code = (
        "import sys\n"
        "from kvtui.gpu.probe import torch_memory\n"
        "print(torch_memory().why, 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "torch is not imported in this process False"


def test_torch_memory_without_cuda_says_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert torch_memory(force=True).why == "torch sees no CUDA device"


# The NVML path, through a fake of the NVML calls.


def test_peak_bandwidth_of_an_h100_sxm_is_3_35_tb_per_s() -> None:
    # 2619 MHz x 1e6 x 2 (double data rate) x 5120 bits / 8 = 3.35232e12 B/s.
    assert peak_bandwidth_bytes_per_s(2619, 5120) == 3_352_320_000_000


@pytest.mark.parametrize("name", [b"NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"])
def test_nvml_probe_reads_a_normal_device(
    name: bytes | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    share = TorchMemory(allocated_bytes=3 * 2**20, reserved_bytes=4 * 2**20)
    monkeypatch.setattr(probe_module, "torch_memory", lambda device: share)
    fake = FakeNvml(name=name)
    with open_probe(nvml=fake) as probe:
        assert isinstance(probe, NvmlProbe)
        reading = probe.read()
        assert probe.describe() == "NVIDIA H100 80GB HBM3 · 79.6 GiB"
        assert probe.label() == "NVIDIA H100 80GB HBM3"
    assert reading.name == "NVIDIA H100 80GB HBM3"
    assert reading.total_bytes == H100_TOTAL_BYTES
    assert reading.used_bytes == 2**30
    assert reading.free_bytes == H100_TOTAL_BYTES - 2**30
    assert reading.memory_clock_mhz == 2619
    assert reading.memory_bus_bits == 5120
    assert reading.peak_bandwidth_bytes_per_s == 3_352_320_000_000
    assert reading.driver_version == "550.54.15"
    assert reading.cuda_version == "12.4"
    assert reading.process_allocated_bytes == 3 * 2**20
    assert reading.process_reserved_bytes == 4 * 2**20
    assert reading.why is None
    assert fake.live_inits == 0  # closed on leaving the `with`


def test_memory_is_read_afresh_each_time() -> None:
    fake = FakeNvml()
    with open_probe(nvml=fake) as probe:
        first = probe.read()
        fake.used = 5 * 2**30
        second = probe.read()
    assert (first.used_bytes, second.used_bytes) == (2**30, 5 * 2**30)


def test_unsupported_field_degrades_to_none_with_a_reason() -> None:
    # As on a MIG slice or a unified-memory part: the bus width is refused.
    fake = FakeNvml(not_supported=("nvmlDeviceGetMemoryBusWidth",))
    with open_probe(nvml=fake) as probe:
        reading = probe.read()
    assert reading.name == "NVIDIA H100 80GB HBM3"
    assert reading.total_bytes == H100_TOTAL_BYTES
    assert reading.memory_clock_mhz == 2619
    assert reading.memory_bus_bits is None
    assert reading.peak_bandwidth_bytes_per_s is None
    assert "memory_bus_bits: not supported on this device" in reading.why
    assert "peak_bandwidth_bytes_per_s: needs both" in reading.why


def test_unsupported_memory_info_leaves_name_and_bandwidth() -> None:
    fake = FakeNvml(not_supported=("nvmlDeviceGetMemoryInfo",))
    with open_probe(nvml=fake) as probe:
        reading = probe.read()
        assert probe.describe() == "NVIDIA H100 80GB HBM3"
    assert (reading.total_bytes, reading.used_bytes, reading.free_bytes) == (None, None, None)
    assert reading.peak_bandwidth_bytes_per_s == 3_352_320_000_000
    assert "memory: not supported on this device" in reading.why


def test_call_missing_from_old_bindings_degrades_too() -> None:
    fake = FakeNvml()
    fake.nvmlSystemGetCudaDriverVersion_v2 = None  # as if this nvidia-ml-py predates it
    with open_probe(nvml=fake) as probe:
        reading = probe.read()
    assert reading.cuda_version is None
    assert "cuda_version: nvmlSystemGetCudaDriverVersion_v2 is not in this" in reading.why


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML library not found"),
        (FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED, "NVIDIA driver not loaded"),
        (999, "NVML error 999"),
    ],
)
def test_nvml_init_failing_is_a_null_probe_with_the_reason(error: int, words: str) -> None:
    probe = open_probe(nvml=FakeNvml(init_error=error))
    assert isinstance(probe, NullProbe)
    assert words in probe.why
    assert probe.describe() == f"CPU, no GPU: {probe.why}"
    assert probe.label() == "CPU, no GPU"


def test_no_device_at_index_is_a_null_probe_and_shuts_nvml_down() -> None:
    fake = FakeNvml(count=1)
    probe = open_probe(device_index=1, nvml=fake)
    assert isinstance(probe, NullProbe)
    assert probe.why == "no GPU at index 1 (NVML sees 1)"
    assert fake.live_inits == 0
    assert open_probe(nvml=FakeNvml(count=0)).why == "NVML sees no GPU"


def test_cuda_visible_devices_picks_the_nvml_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    fake = FakeNvml(count=4)
    seen: list[int] = []
    fake.nvmlDeviceGetHandleByIndex = lambda index: seen.append(index) or f"handle-{index}"
    with open_probe(0, nvml=fake) as probe:
        assert isinstance(probe, NvmlProbe)
    assert seen == [3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert open_probe(0, nvml=FakeNvml()).why == "CUDA_VISIBLE_DEVICES hides every GPU"


def test_close_is_idempotent_and_reading_after_close_is_an_error() -> None:
    fake = FakeNvml()
    probe = open_probe(nvml=fake)
    probe.close()
    probe.close()
    assert fake.calls.count("nvmlShutdown") == 1
    with pytest.raises(RuntimeError, match="closed"):
        probe.read()


def test_probe_summary_through_the_fake_is_plain_json() -> None:
    summary = probe_summary(nvml=FakeNvml())
    assert json.loads(json.dumps(summary)) == summary
    assert summary["probe"] == "nvml"
    assert summary["total_bytes"] == H100_TOTAL_BYTES
    assert summary["description"] == "NVIDIA H100 80GB HBM3 · 79.6 GiB"
    assert summary["label"] == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("name", "total", "description"),
    [
        ("NVIDIA A100-SXM4-80GB", 81920 * 2**20, "NVIDIA A100-SXM4-80GB · 80 GiB"),
        ("NVIDIA L40S", 46068 * 2**20, "NVIDIA L40S · 45 GiB"),
        ("NVIDIA RTX A6000", 48676 * 2**20, "NVIDIA RTX A6000 · 47.5 GiB"),
    ],
)
def test_description_gives_the_memory_as_kvtui_formats_it(name, total, description) -> None:
    summary = probe_summary(nvml=FakeNvml(name=name, total=total))
    assert (summary["description"], summary["label"]) == (description, name)


def test_a_device_without_a_name_is_labelled_by_its_index() -> None:
    with open_probe(nvml=FakeNvml(not_supported=("nvmlDeviceGetName",))) as probe:
        assert probe.label() == "GPU 0"
        assert probe.describe() == "GPU 0 · 79.6 GiB"


def test_probe_module_keeps_its_boundary() -> None:
    assert probe_module.__doc__ and "without a UI" in probe_module.__doc__


# A real GPU.


@pytest.mark.cuda
def test_real_gpu_reads_name_total_and_this_process_share() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB, initialises CUDA
    with open_probe() as probe:
        assert isinstance(probe, NvmlProbe), probe.describe()
        reading = probe.read()
    assert reading.name
    assert reading.total_bytes and reading.total_bytes > 0
    assert reading.used_bytes is not None and reading.free_bytes is not None
    assert reading.used_bytes + reading.free_bytes <= reading.total_bytes
    assert reading.process_allocated_bytes is not None
    assert reading.process_allocated_bytes >= block.numel()
    if reading.peak_bandwidth_bytes_per_s is not None:
        assert 1e11 < reading.peak_bandwidth_bytes_per_s < 2e13


def test_a_null_probe_on_a_machine_that_shows_a_gpu_does_not_say_no_gpu() -> None:
    """NVML missing or refused where a driver's device node is there: the header says GPU."""
    assert NullProbe("NVML library not found", gpu_seen=True).label() == "GPU, NVML unavailable"
    assert NullProbe("NVML library not found", gpu_seen=False).label() == "CPU, no GPU"
