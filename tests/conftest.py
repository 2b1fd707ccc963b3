"""What the whole run shares: a real vLLM server for tests/vllm, started as the run is
configured (in the process that runs the session: xdist's controller, or the only process), so
that its one to two minutes of start overlap every other test. The workers get its URL and log
through the environment (tests/vllm/server.py) and never start one of their own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.vllm.server import EXTERNAL_LOG, EXTERNAL_URL, VLLMServer, vllm_python

_server: VLLMServer | None = None


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
    global _server
    if hasattr(config, "workerinput") or os.environ.get(EXTERNAL_URL):
        return  # an xdist worker, or a server given: nothing to start here
    python = vllm_python()
    if python and _selects_vllm_tests(config):
        _server = VLLMServer(python)
        _server.start()
        os.environ[EXTERNAL_URL] = _server.url  # the workers (spawned after this) and fixtures
        os.environ[EXTERNAL_LOG] = str(_server.log)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _server
    if _server is not None:
        _server.stop()
        os.environ.pop(EXTERNAL_URL, None)
        os.environ.pop(EXTERNAL_LOG, None)
        _server = None
