"""--kv-events where it enters: one line and exit 2 for an endpoint kvtui cannot bind, one
beside an engine that is not served, or pyzmq and msgpack missing; and they are imported only
when it is asked for."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from kvtui.cli import main
from kvtui.engines.vllm.events import EventsError, require_libraries
from tests.kv_events_standin import free_endpoint

SERVED = ["--engine", "vllm:http://127.0.0.1:1"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--kv-events", "tcp://*:5557"], "argument --kv-events: tcp://*:5557: kvtui binds"),
        ([*SERVED, "--kv-events", "5557"], "expected tcp://HOST:PORT"),
        ([*SERVED, "--kv-events", "tcp://example.com:5557"], "IP address of this machine"),
        (["--kv-events", "tcp://127.0.0.1:5557"], "give it beside --engine vllm:URL"),
        ([*SERVED, "--kv-events", "tcp://192.0.2.1:5557"], "cannot bind it here"),
    ],
)
def test_a_bad_kv_events_is_one_line_and_exit_2(capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_an_endpoint_in_use_is_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        assert main([*SERVED, "--kv-events", endpoint]) == 2
    assert "cannot bind it here (address already in use)" in capsys.readouterr().err


def test_missing_libraries_name_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "zmq", None)  # `import zmq` raises ImportError
    with pytest.raises(EventsError, match=r"needs pyzmq: pip install 'kvtui\[vllm\]'"):
        require_libraries()
    monkeypatch.setitem(sys.modules, "msgpack", None)
    assert main([*SERVED, "--kv-events", free_endpoint()]) == 2
    assert "--kv-events needs pyzmq and msgpack: pip install 'kvtui[vllm]'" in (
        capsys.readouterr().err
    )


def test_pyzmq_and_msgpack_are_imported_only_when_asked_for():
    """Parsing the command line, its checks and the app's modules load neither."""
    code = (
        "import json, sys; import kvtui.cli, kvtui.app, kvtui.screens.cache; "
        "from kvtui.options import kv_events_endpoint; kv_events_endpoint('tcp://127.0.0.1:9'); "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'zmq', 'msgpack'})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []
