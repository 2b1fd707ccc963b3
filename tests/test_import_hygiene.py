"""Every layer loads only what it may: proved in fresh interpreters, and as import contracts.

The only way to prove a deferral actually defers is to import in a fresh interpreter and look at
sys.modules (as Harlequin's tests/unit_tests/test_import_hygiene.py does). The static rule is
also written as import-linter contracts in pyproject.toml, checked here with `lint-imports`.
"""

from __future__ import annotations

import ast
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


FIRST_FRAME = """
import asyncio, json, sys
from textual.css.stylesheet import Stylesheet
import kvtui.cli as cli
from kvtui.engines.factory import check_engine

reparsed, restyled = [], set()
reparse, update_nodes = Stylesheet.reparse, Stylesheet.update_nodes
Stylesheet.reparse = lambda self: reparsed.append(1) or reparse(self)

def counted(self, nodes, animate=False):
    nodes = list(nodes)
    restyled.update(type(node).__name__ for node in nodes)
    return update_nodes(self, nodes, animate)

Stylesheet.update_nodes = counted

args = cli.build_parser().parse_args(["--lesson", "--engine", "tiny", "--device", "cpu"])
settings = cli.settings_from_args(args, default_tokens=cli.DEFAULT_APP_TOKENS)
check_engine(settings)
from kvtui.app import make_app

async def main():
    probe = {"probe": "null", "description": "no GPU"}  # not kvtui.testing's: it imports screens
    app = make_app(settings, probe=probe, autostart=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        return {
            "screen": type(app.screen).__name__,
            "loaded": sorted(sys.modules),
            "reparsed": len(reparsed),
            "restyled": sorted(restyled),
        }

print(json.dumps(asyncio.run(main())))
"""

NOT_FOR_SCREEN_1 = (
    "kvtui.screens.cache",
    "kvtui.screens.memory",
    "kvtui.screens.tricks",
    "kvtui.screens.present",
    "kvtui.reports.table",
    "kvtui.engines.vllm.client",
    "kvtui.engines.vllm.events",
    "kvtui.engines.vllm.load",
    "kvtui.engines.vllm.metrics",
    "kvtui.run.fleet",
    "kvtui.run.serving",
    "kvtui.gpu.probe",
    "http.client",
)
"""What the launch of `kvtui --lesson` (tiny) needs no part of before its first frame: the other
screens, a server's client, load, events and fleet, the table's process, and the device probe (run
after the first frame)."""


def test_the_app_opens_on_screen_1_with_only_what_it_draws():
    """The app's first frame waits for screen 1 alone, from the command line on: the other
    screens' modules (and what only they, or a served run, use) are imported when first needed;
    screen 1 is composed without a restyle (Textual parses the whole stylesheet again on
    entering a mode), and no widget of it is styled twice (the screen's size classes, the
    footer's compact keys and Textual's restyle on a screen's first resume each did that)."""
    done = subprocess.run(
        [sys.executable, "-c", FIRST_FRAME], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    opened = json.loads(done.stdout.strip().splitlines()[-1])
    assert opened["screen"] == "RecomputeScreen"
    assert [m for m in opened["loaded"] if m in NOT_FOR_SCREEN_1] == []
    assert "kvtui.screens.recompute" in opened["loaded"]
    assert opened["reparsed"] == 0
    assert set(opened["restyled"]) <= {"RunHeader", "Note"}  # the class the run's state gives


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed")
def test_the_import_contracts_hold():
    done = subprocess.run(
        ["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert "0 broken" in done.stdout


def _kvtui_imports() -> dict[str, set[str]]:
    """Every kvtui module and the kvtui modules it imports, anywhere in it: at the top, inside
    functions (deferred) and under TYPE_CHECKING alike."""
    modules = {}
    for path in (ROOT / "kvtui").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:  # the module a dotted name is in (a name in it, say)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
        found = {known(name) for name in names if name.startswith("kvtui")}
        graph[module] = {m for m in found if m is not None and m != module}
    return graph


def test_no_import_circle_even_through_deferred_imports():
    """import-linter sees only the imports at the top of a module; a circle through a deferred
    import (`engines.spec` <-> `engines.hf` once) works until the day it is imported first from
    the other end. Strongly connected components (Tarjan) of the whole graph: none of two."""
    graph = _kvtui_imports()
    assert "kvtui.engines.loops" in graph["kvtui.engines.torch_engine"]  # the walk sees imports
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert circles == []
