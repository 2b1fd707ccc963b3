"""What the whole run shares: the real vLLM servers for tests/vllm, started as the run is
configured (in the process that runs the session: xdist's controller, or the only process), so
that their one to two minutes of start overlap every other test. The workers get their URLs and
logs through the environment (tests/vllm/server.py) and never start one of their own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.vllm.server import SETTINGS, VLLMServer, vllm_python

_servers: list[VLLMServer] = []


def _selects_vllm_tests(config: pytest.Config) -> bool:
    """Whether the run may select tests/vllm: no paths given (the testpaths), or a path at or
    under or above that folder, and no `-m` that leaves out `vllm`."""
    if "not vllm" in (config.option.markexpr or ""):
        return False
    folder = (Path(__file__).parent / "vllm").resolve()
    paths = [Path(str(arg).split("::")[0]).resolve() for arg in config.args]
    return not config.args or any(
        p == folder or folder in p.parents or p in folder.parents for p in paths
    )


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _selects_vllm_tests(config):
        return  # an xdist worker (it reads the environment), or no vLLM test to serve
    for setting in SETTINGS:
        python = vllm_python(setting)
        if python is None or os.environ.get(setting.url_variable):
            continue  # no vLLM here, or this server given
        server = VLLMServer(python, setting)
        server.start()
        server.hand_on()  # the workers (spawned after this) and the fixtures
        _servers.append(server)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _servers:
        server = _servers.pop()
        server.stop()
        server.take_back()
