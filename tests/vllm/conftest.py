"""The vLLM tests' server (tests/vllm/server.py): the one the run's controller started
(tests/conftest.py), or, where none was (a run that did not look as if it selects these tests),
one started here; they all run in one xdist worker (the group "vllm"), since they read the one
server's counters before and after what they do."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server import VLLMServer, skip_reason, vllm_python

_server: VLLMServer | None = None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.xdist_group("vllm"))


@pytest.fixture(scope="session")
def vllm_server() -> Iterator[VLLMServer]:
    """The running server (waited for), or a skip that says why there is none."""
    global _server
    python = vllm_python()
    if python is None:
        pytest.skip(skip_reason())
    if _server is None:
        _server = VLLMServer(python)
        _server.start()
    _server.wait_ready()
    yield _server


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _server is not None:
        _server.stop()  # one started here (an external server is the controller's to stop)
