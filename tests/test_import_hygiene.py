"""Every layer loads only what it may: proved in fresh interpreters, and as import contracts.

The only way to prove a deferral actually defers is to import in a fresh interpreter and look at
sys.modules (as Harlequin's tests/unit_tests/test_import_hygiene.py does). The static rule is
also written as import-linter contracts in pyproject.toml, checked here with `lint-imports`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
{imports}
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & {forbidden!r})))
"""

LAYERS = {
    "the maths and the CLI": (
        "import kvtui.sim.work, kvtui.sim.memory, kvtui.sim.budget, kvtui.sim.pool\n"
        "import kvtui.sim.parallel, kvtui.sim.catalog, kvtui.format, kvtui.cli\n"
        "kvtui.sim.catalog.get_model('gpt2'); kvtui.sim.catalog.get_gpu('h100')",
        {"torch", "textual", "pynvml"},
    ),
    "the engine protocol, names, process, roofline, replay and bench": (
        "import kvtui.engines.protocol, kvtui.engines.factory, kvtui.run.process, "
        "kvtui.engines.roofline, kvtui.engines.replay, kvtui.reports.bench",
        {"torch", "textual", "pynvml"},
    ),
    "the torch engines, the decoder and training": (
        "import kvtui.engines.torch_engine, kvtui.engines.hf, kvtui.gpu.model, "
        "kvtui.training.train",
        {"textual", "transformers"},
    ),
    "the device probe": ("import kvtui.gpu.probe", {"torch", "textual", "pynvml"}),
    "the app, its screens and widgets": (
        "import kvtui.app, kvtui.screens.help, kvtui.screens.quiz, kvtui.widgets.vram",
        {"torch"},
    ),
    "the headless test kit, running a sim: engine in its own process": (
        "import kvtui.testing\n"
        "from kvtui.engines.protocol import RunSettings\n"
        "engine = kvtui.testing.ScriptedEngine.from_settings("
        "RunSettings(engine='sim:llama-3.1-8b@h100', tokens=8, lesson=True))\n"
        "engine.start(); assert len(list(engine.events())) == 1 + 2 * 8 + 2",
        {"torch", "transformers"},
    ),
}


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_loads_only_what_it_may(layer):
    imports, forbidden = LAYERS[layer]
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(imports=imports, forbidden=forbidden)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [], f"{layer} loaded {done.stdout.strip()}"


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed")
def test_the_import_contracts_hold():
    done = subprocess.run(
        ["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert "0 broken" in done.stdout
