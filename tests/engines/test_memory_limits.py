"""Memory that is not the host's: a container's cgroup limit (v2 `memory.max`, v1
`memory.limit_in_bytes`) or an address-space limit (`ulimit -v`) bounds what a model may take, so
the pre-check reads them, and an allocation that fails anyway while a model is built or loaded is
one line, never a traceback."""

from __future__ import annotations

import resource

import pytest

torch = pytest.importorskip("torch")

from kvtui.cli import main  # noqa: E402
from kvtui.gpu import host  # noqa: E402

GIB = 2**30


def fake_cgroup(tmp_path, membership: str, files: dict[str, str]):
    """A /proc and a /sys/fs/cgroup that say this process is in `membership`."""
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(membership)
    (proc / "self" / "status").write_text("Name:\tpython\nVmSize:\t  1048576 kB\n")
    for name, text in files.items():
        path = cgroup / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc, cgroup


@pytest.fixture
def unlimited(monkeypatch):
    """No address-space limit, whatever the machine running the tests has."""
    monkeypatch.setattr(host.resource, "getrlimit", lambda which: (-1, -1))


def test_a_cgroup_v2_limit_bounds_the_room(tmp_path, unlimited):
    proc, cgroup = fake_cgroup(
        tmp_path,
        "0::/kubepods/pod1/box\n",
        {
            "kubepods/memory.max": "max\n",
            "kubepods/pod1/memory.max": f"{4 * GIB}\n",
            "kubepods/pod1/memory.current": f"{GIB}\n",
            "kubepods/pod1/box/memory.max": "max\n",
            "kubepods/pod1/box/memory.current": f"{GIB // 2}\n",
        },
    )
    room, where = host.host_room(proc=proc, cgroup=cgroup)
    assert room == 3 * GIB  # the tightest ancestor: 4 GiB less the 1 GiB it holds
    assert "memory.max" in where


def test_a_cgroup_v1_limit_bounds_the_room(tmp_path, unlimited):
    proc, cgroup = fake_cgroup(
        tmp_path,
        "5:cpu:/\n4:memory:/docker/abc\n",
        {
            "memory/docker/abc/memory.limit_in_bytes": f"{2 * GIB}\n",
            "memory/docker/abc/memory.usage_in_bytes": f"{GIB // 4}\n",
        },
    )
    room, where = host.host_room(proc=proc, cgroup=cgroup)
    assert room == 2 * GIB - GIB // 4 and "memory.limit_in_bytes" in where


def test_an_address_space_limit_bounds_the_room(tmp_path, monkeypatch):
    proc, cgroup = fake_cgroup(tmp_path, "0::/\n", {})
    monkeypatch.setattr(
        host.resource,
        "getrlimit",
        lambda which: (3 * GIB, -1) if which == resource.RLIMIT_AS else (-1, -1),
    )
    room, where = host.host_room(proc=proc, cgroup=cgroup)
    assert room == 2 * GIB  # 3 GiB of address space, 1 GiB of it (VmSize) already mapped
    assert "ulimit -v" in where


def test_a_model_past_the_containers_limit_is_refused_before_it_is_built(
    tmp_path, capsys, monkeypatch, unlimited
):
    proc, cgroup = fake_cgroup(
        tmp_path,
        "0::/box\n",
        {"box/memory.max": f"{4 * GIB}\n", "box/memory.current": f"{GIB // 2}\n"},
    )
    monkeypatch.setattr(host, "PROC", proc)
    monkeypatch.setattr(host, "CGROUP", cgroup)
    code = main(["bench", "--engine", "shape:llama-3.2-1b", "--device", "cpu", "--tokens", "2"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "memory.max" in err and "3.5 GiB" in err, err


def test_an_allocation_that_fails_while_building_is_one_line(capsys, monkeypatch):
    from kvtui.gpu.model import Transformer

    def refuse(self, seed):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 134217728 bytes. Error code 12"
        )

    monkeypatch.setattr(Transformer, "init_weights", refuse)
    code = main(["bench", "--engine", "shape:gpt2", "--device", "cpu", "--tokens", "2"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "out of memory while building" in err, err


def test_the_host_room_is_the_ram_available_not_only_the_free_pages(tmp_path, unlimited):
    """A server that has read its disks has little MemFree and much MemAvailable (page cache the
    kernel gives back): the room is the latter, or a model that fits is refused."""
    proc, cgroup = fake_cgroup(tmp_path, "0::/\n", {})
    (proc / "meminfo").write_text(
        f"MemTotal:       {64 * GIB // 1024} kB\nMemFree:        {GIB // 1024} kB\n"
        f"MemAvailable:   {40 * GIB // 1024} kB\n"
    )
    room, where = host.host_room(proc=proc, cgroup=cgroup)
    assert (room, where) == (40 * GIB, "available host RAM")
