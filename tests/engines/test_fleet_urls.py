"""A fleet's servers where they enter (`vllm:URL1,URL2,...`, kvtui.engines.vllm.fleet), and a
repeated `--engine`: each a clear line and exit 2, never the last one silently winning. No
server."""

from __future__ import annotations

import pytest

from kvtui.cli import main
from kvtui.engines.factory import parse_engine
from kvtui.engines.vllm.fleet import MAX_REPLICAS, parse_urls, replica_name
from kvtui.engines.vllm.url import ServerURL
from kvtui.errors import EngineError

A, B = "http://127.0.0.1:8101", "http://127.0.0.1:8102"


def test_a_list_is_every_server_in_order_the_decode_on_the_first():
    spec = parse_engine(f"vllm:{A}, {B}/v1")
    assert [str(u) for u in spec.urls] == [A, B]
    assert spec.url == spec.urls[0]
    assert parse_engine(f"vllm:{A}").urls == (ServerURL.parse(A),)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (f"{A},{A}/", "given twice (servers 1 and 2)"),
        (f"{A},http://127.0.0.1:8101/v1", "given twice"),
        (f"{A},,{B}", "server 2 of 3 is empty"),
        (f"{A},", "server 2 of 2 is empty"),
        (f"{A},ftp://x", "server 2 'ftp://x' must start with http://"),
        (f"{A},http://u:p@h", "server 2 'http://u:p@h' holds credentials"),
        (",".join(f"http://127.0.0.1:{9000 + i}" for i in range(MAX_REPLICAS + 1)), "up to 8"),
    ],
)
def test_a_bad_list_is_one_line_saying_which(text, says):
    with pytest.raises(EngineError, match="^vllm:") as caught:
        parse_urls(text, "vllm:")
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_as_many_as_the_most_are_taken():
    urls = ",".join(f"http://127.0.0.1:{9000 + i}" for i in range(MAX_REPLICAS))
    assert len(parse_urls(urls)) == MAX_REPLICAS


def test_a_replica_is_named_by_its_place_and_address():
    urls = parse_urls(f"{A},{B}")
    assert replica_name(urls, 1) == "replica 2 (127.0.0.1:8102)"
    assert replica_name(urls, 5) == "replica 6"


def usage_error(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv",
    [
        ["--engine", "tiny", "--engine", f"vllm:{A}"],
        ["bench", "--engine", f"vllm:{A}", "--engine", f"vllm:{B}"],
        ["serve", "--engine", f"vllm:{A}", "--engine", f"vllm:{B}"],
        ["tricks", "--engine", "tiny", "--engine", "tiny"],
    ],
)
def test_a_second_engine_is_refused_not_silently_taken(capsys, argv):
    err = usage_error(capsys, argv)
    assert "--engine: given twice" in err and "vllm:URL1,URL2" in err


def test_a_bad_fleet_on_the_command_line_is_one_line(capsys):
    err = usage_error(capsys, ["bench", "--engine", f"vllm:{A},{A}"])
    assert "given twice (servers 1 and 2)" in err
