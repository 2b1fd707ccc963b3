"""A small, seeded slice of the third sweep (`benchmarks/fuzz_inputs.py`, strategies in
tests/hostile.py): numbers at the edges in a record's fields, paths as people type them, and raw
HTTP requests to `kvtui serve`'s web app. Each must end in one line and exit 2, a run, or an
answer, never a traceback, a hang or a file written where it should not be."""

from __future__ import annotations

import asyncio
import io
import logging

import pytest
from hypothesis import HealthCheck, given, settings

from kvtui import serve
from tests import hostile, hostile_server
from tests.test_hostile_inputs import try_record

SEEDED = settings(
    max_examples=12,
    deadline=None,
    database=None,
    derandomize=True,  # the same examples on every run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@SEEDED
@given(data=hostile.record_numbers())
def test_fuzz_record_numbers(tmp_path, capsys, data):
    assert try_record(tmp_path, data, capsys.readouterr) in ("exit 0", "exit 2")


@SEEDED
@given(value=hostile.paths)
def test_fuzz_paths(tmp_path, capsys, value):
    assert hostile.try_path(tmp_path, value, capsys.readouterr) in ("exit 0", "exit 2")


@SEEDED
@given(requests=hostile.http_requests.map(lambda r: [r]))
def test_fuzz_serve_requests(requests):
    """Raw requests to the web app (in this process): each answered or closed within its bound,
    at most one line on the server's terminal, never a traceback or a page for a foreign Host."""
    pytest.importorskip("textual_serve")
    from aiohttp.test_utils import TestServer

    stream = io.StringIO()
    handler = serve.install_log(stream)

    async def exchange() -> list[bytes]:
        server = serve.make_server("true", [], 0)
        async with TestServer(await server._make_app()) as test_server:
            answers = []
            for data in requests:
                reader, writer = await asyncio.open_connection("127.0.0.1", test_server.port)
                writer.write(data)
                try:
                    answers.append(await asyncio.wait_for(reader.read(65536), 3))
                except (TimeoutError, asyncio.TimeoutError):
                    answers.append(b"")  # waiting for the rest of a request: allowed
                except ConnectionError:
                    answers.append(b"")
                finally:
                    writer.close()
            return answers

    try:
        answers = asyncio.run(exchange())
    finally:
        logging.getLogger().removeHandler(handler)
    said = stream.getvalue()
    assert said.count("\n") <= len(requests) and "Traceback" not in said, said
    for answer in answers:
        status = answer.split(b"\r\n", 1)[0]
        assert not status.endswith(b" 200 OK") or b"Index of" not in answer


@SEEDED
@given(value=hostile_server.server_urls())
def test_fuzz_server_urls(capsys, value):
    """`vllm:URL` and `kvtui load URL` given URLs of any shape (hosts loopback or invalid): one
    line and exit 2 (refused, or nothing listening), never a traceback."""
    assert hostile_server.try_url(value, capsys.readouterr) == "exit 2"
