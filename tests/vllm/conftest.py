"""The vLLM tests' servers (tests/vllm/server.py): the ones the run's controller started
(tests/conftest.py), or, where none was (a run that did not look as if it selects these tests),
ones started here; they all run in one xdist worker (the group "vllm"), since they read the
servers' counters before and after what they do."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server import FIRST, SECOND, Setting, VLLMServer, skip_reason, vllm_python

_servers: dict[str, VLLMServer] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.xdist_group("vllm"))


def _running(setting: Setting) -> VLLMServer:
    """The setting's server, running (waited for), or a skip that says why there is none."""
    python = vllm_python(setting)
    if python is None:
        pytest.skip(skip_reason())
    if setting.name not in _servers:
        _servers[setting.name] = server = VLLMServer(python, setting)
        server.start()
    server = _servers[setting.name]
    server.wait_ready()
    return server


@pytest.fixture(scope="session")
def vllm_server() -> Iterator[VLLMServer]:
    """FIRST: config.json's own dtype, 40 blocks of 32, prefix caching, its events published."""
    yield _running(FIRST)


@pytest.fixture(scope="session")
def vllm_server_b() -> Iterator[VLLMServer]:
    """SECOND: bf16, data parallel 2, blocks of 64, 4 sequences at once, no prefix caching."""
    yield _running(SECOND)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for server in _servers.values():
        server.stop()  # ones started here (an external server is the controller's to stop)
