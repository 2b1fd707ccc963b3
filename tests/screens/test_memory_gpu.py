"""Screen 3 budgets the probed GPU: its catalog entry where the matcher finds one (and only a
real match), else the device by its own name and memory."""

from __future__ import annotations

import pytest
from conftest import SETTINGS, screen_text
from fakes import FakeEngine
from test_screens import settle

from kvtui.app import make_app
from kvtui.sim.catalog import gpu_from_probe

MIB = 2**20


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        ({"name": "NVIDIA L40S", "total_bytes": 46068 * MIB}, "l40s"),  # was an L4
        ({"name": "NVIDIA A10", "total_bytes": 23028 * MIB}, "a10"),  # was no match
        ({"name": "Tesla V100-SXM2-32GB", "total_bytes": 32510 * MIB}, "v100-32gb"),
        ({"name": "NVIDIA A100-SXM4-40GB", "total_bytes": 40960 * MIB}, "a100-40gb"),
        ({"name": "NVIDIA RTX A6000", "total_bytes": 48676 * MIB}, "nvidia rtx a6000"),
        ({"name": None, "total_bytes": None, "description": "CPU, no GPU: why"}, None),
        ({"description": "device unknown (the probe failed)"}, None),
        (None, None),
    ],
)
def test_gpu_from_probe(probe, expected):
    gpu = gpu_from_probe(probe)
    assert (gpu.name if gpu else None) == expected


def _app(probe: dict):
    return make_app(SETTINGS, 3, probe=probe, engine_factory=lambda settings: FakeEngine(settings))


async def test_screen3_budgets_for_the_probed_gpu():
    app = _app(
        {"description": "NVIDIA L40S · 45 GiB", "name": "NVIDIA L40S", "total_bytes": 46068 * MIB}
    )
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        assert app.screen.gpu == "l40s"
        assert "on NVIDIA L40S (this machine's GPU)" in screen_text(app)


async def test_screen3_budgets_a_gpu_the_catalog_lacks_by_its_own_name_and_memory():
    """An uncatalogued GPU is not an H100 'example': the what-if is the device itself, its
    memory NVML's, and says the catalog lacks it (its peak FLOP/s are unknown)."""
    probe = {"description": "NVIDIA RTX A6000 · 47.5 GiB", "name": "NVIDIA RTX A6000"}
    app = _app({**probe, "probe": "nvml", "total_bytes": 48676 * MIB})
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        assert app.screen.gpu == "nvidia rtx a6000"
        assert app.screen.budget().vram_bytes == 48676 * MIB
        text = screen_text(app)
        assert "on NVIDIA RTX A6000 (this GPU, not in the catalog)" in text
        assert "of 47.5 GiB" in text  # the ALL IN USE card: the device's own memory
        assert "example" not in text
