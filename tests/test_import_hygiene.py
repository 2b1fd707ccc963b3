"""Importing the simulator and the CLI loads neither torch, textual nor pynvml.

The only way to prove a deferral actually defers is to import in a fresh interpreter and look at
sys.modules (as Harlequin's tests/unit_tests/test_import_hygiene.py does).
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "textual", "pynvml", "numpy")

PROBE = """
import json, sys
import kvtui.sim, kvtui.sim.work, kvtui.sim.memory, kvtui.sim.catalog, kvtui.format, kvtui.cli
kvtui.sim.catalog.get_model("gpt2"); kvtui.sim.catalog.get_gpu("h100")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})))
"""


def test_sim_and_cli_imports_stay_light():
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=set(HEAVY))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert [m for m in loaded if m.split(".")[0] in {"torch", "textual", "pynvml"}] == []
