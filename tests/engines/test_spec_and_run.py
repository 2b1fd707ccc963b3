"""The torch-free engines (sim, replay), the run loop and the engine's own process."""

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import (
    FLOP_COUNTER_PHRASE,
    RunControl,
    RunFailed,
    RunSettings,
    RunStarted,
    StepSample,
)
from kvtui.engines.replay import RecordWriter, read_record
from kvtui.errors import EngineError
from kvtui.run.process import EngineProcess, Engines
from kvtui.sim.catalog import get_gpu, get_model
from kvtui.sim.memory import kv_bytes, weights_bytes
from kvtui.sim.pool import kv_capacity
from kvtui.sim.work import (
    cached_step_positions,
    decode_step_bytes,
    decode_step_flops,
    naive_step_positions,
    roofline_seconds,
    uncached_step_bytes,
    uncached_step_flops,
)

SIM = RunSettings(engine="sim:llama-3.1-8b@h100", tokens=40, replay_speed=0)


def steps_of(events, loop):
    return [e for e in events if isinstance(e, StepSample) and e.loop == loop]


def test_sim_steps_agree_with_kvtui_sim_exactly():
    events = list(run_events(open_engine(SIM), SIM))
    spec, gpu = get_model("llama-3.1-8b"), get_gpu("h100")
    P = events[0].prompt_tokens
    cached, uncached = steps_of(events, "cached"), steps_of(events, "uncached")
    assert [s.positions_computed for s in uncached] == [
        naive_step_positions(t, P) for t in range(1, 41)
    ]
    assert [s.positions_computed for s in cached] == [
        cached_step_positions(t, P) for t in range(1, 41)
    ]
    for i, s in enumerate(uncached):
        assert s.flops == uncached_step_flops(spec, P + i)
        assert s.bytes_read == uncached_step_bytes(spec, P + i)
        assert s.step_seconds == roofline_seconds(s.flops, s.bytes_read, gpu)
    for i, s in enumerate(cached[1:], start=1):
        assert s.flops == decode_step_flops(spec, P + i)
        assert s.bytes_read == decode_step_bytes(spec, P + i)
        assert s.kv_bytes == kv_bytes(spec, P + i)
    assert [s.text for s in cached] == [s.text for s in uncached]


def test_sim_run_stops_out_of_memory_where_the_cache_fills_the_gpu():
    """The modelled pool is vLLM's KV cache on that GPU (`kvtui budget`'s figure): the run stops
    at the token it predicts, C - P + 1 for C tokens of cache."""
    settings = RunSettings(
        engine="sim:llama-3.1-8b@l4", tokens=131_000, replay_speed=0, loops=("cached",)
    )
    events = list(run_events(open_engine(settings), settings))
    spec, gpu = get_model("llama-3.1-8b"), get_gpu("l4")
    served = kv_capacity(spec, gpu, context_tokens=1)
    P = events[0].prompt_tokens
    last, finished = steps_of(events, "cached")[-1], events[-1]
    assert finished.reason == "out_of_memory"
    assert finished.steps == served.kv_capacity_tokens - P + 1
    assert f"full after token {finished.steps:,}" in finished.message
    assert f"holds {served.kv_capacity_tokens:,} rows" in finished.message
    assert last.kv_bytes == kv_bytes(spec, served.kv_capacity_tokens)  # every slot filled
    assert last.kv_bytes_allocated == served.kv_blocks * served.block_bytes_per_gpu


def test_sim_refuses_weights_that_do_not_fit():
    with pytest.raises(EngineError, match="do not fit"):
        open_engine(RunSettings(engine="sim:llama-3.1-70b@l4"))


@pytest.mark.parametrize(
    "engine", ["sim:llama-3.1-8b", "sim:llama-9@h100", "sim:llama-3.1-8b@h1000"]
)
def test_sim_bad_names(engine):
    with pytest.raises(EngineError):
        open_engine(RunSettings(engine=engine))


RECORDED_AT = "2026-12-02T06:00:00+0000"


def write_record(path, settings, events, **header) -> list:
    """A record of `events` as `kvtui bench --record` writes one, its start stamped with when
    it was recorded; returns the events as written (what a replay of it plays)."""
    stamped = [
        replace(e, recorded_at=RECORDED_AT) if isinstance(e, RunStarted) else e for e in events
    ]
    with open(path, "w", encoding="utf-8") as out:
        writer = RecordWriter(out, settings, **header)
        for event in stamped:
            writer.write(event)
    return stamped


def as_replayed(events: list) -> list:
    """The events a replay of a record of `events` plays: its start says it is a replay of a
    run its engine could make (`Capabilities.replayed`)."""
    return [replace(e, can=e.can.replayed()) if isinstance(e, RunStarted) else e for e in events]


def test_record_then_replay_gives_the_same_samples(tmp_path):
    events = list(run_events(open_engine(SIM), SIM))
    path = tmp_path / "run.jsonl"
    events = write_record(path, SIM, events, device="test")
    header, recorded = read_record(path)
    assert header["settings"]["engine"] == SIM.engine and recorded == events
    replay = RunSettings(engine=f"replay:{path}", replay_speed=0)
    engine = open_engine(replay)
    assert engine.settings.tokens == 40  # what was recorded runs, whatever was asked
    assert list(run_events(engine, engine.settings)) == as_replayed(events)
    assert events[0].recorded_at == RECORDED_AT  # a replay says when it was recorded


def test_an_older_record_is_dated_from_its_header_or_unknown(tmp_path):
    """A record written before RunStarted carried its date: the header's `recorded_at`, else
    "unknown"; a replay is never taken for a run happening now."""
    events = list(run_events(open_engine(replace(SIM, tokens=2)), replace(SIM, tokens=2)))
    for header in ({"recorded_at": "2025-01-31T10:00:00+0000"}, {}):
        path = tmp_path / "old.jsonl"
        with open(path, "w", encoding="utf-8") as out:
            writer = RecordWriter(out, replace(SIM, tokens=2), **header)
            for event in events:  # as an older bench wrote them: the start undated
                writer.write(event)
        started = open_engine(RunSettings(engine=f"replay:{path}")).started()
        assert started.recorded_at == header.get("recorded_at", "unknown")


def test_replay_keeps_the_recorded_pace(tmp_path, monkeypatch):
    """Each replayed step waits its recorded time over the speed, before it is yielded; speed 0
    waits not at all. The waits are recorded, not timed: a clock would only test the machine."""
    from kvtui.engines import replay

    settings = replace(SIM, tokens=5, loops=("cached",))
    events = list(run_events(open_engine(settings), settings))
    slow = [
        replace(e, step_seconds=0.05 * (e.step + 1)) if isinstance(e, StepSample) else e
        for e in events
    ]
    path = tmp_path / "slow.jsonl"
    slow = write_record(path, settings, slow)
    yielded: list = []
    waits: list[tuple[float, int]] = []
    monkeypatch.setattr(replay.time, "sleep", lambda s: waits.append((s, len(yielded))))
    for speed, pace in (
        (1.0, [0.05, 0.1, 0.15, 0.2, 0.25]),
        (2.0, [0.025, 0.05, 0.075, 0.1, 0.125]),
    ):
        yielded.clear()
        waits.clear()
        engine = open_engine(RunSettings(engine=f"replay:{path}", replay_speed=speed))
        for event in run_events(engine, engine.settings):
            yielded.append(event)
        assert yielded == as_replayed(slow)
        assert [s for s, _ in waits] == pytest.approx(pace)
        assert [before for _, before in waits] == [1, 2, 3, 4, 5]  # after `started`, each step
    waits.clear()
    fast = open_engine(RunSettings(engine=f"replay:{path}", replay_speed=0))
    assert list(run_events(fast, fast.settings)) == as_replayed(slow) and waits == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "not a kvtui record"),
        ("hello\n", "not a kvtui record"),
        ('{"kind": "header", "format": "kvtui-record", "version": 9}\n', "version 9"),
        ('{"kind": "header", "format": "kvtui-record", "version": 1}\n{"kind": "step"\n', "line 2"),
        ('{"kind": "header", "format": "kvtui-record", "version": 1}\n', "no run"),
    ],
)
def test_corrupt_records_are_one_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(EngineError, match=message):
        open_engine(RunSettings(engine=f"replay:{path}"))
    with pytest.raises(EngineError, match="no recorded run"):
        open_engine(RunSettings(engine=f"replay:{tmp_path / 'missing.jsonl'}"))


def test_pause_holds_the_run_between_steps():
    control = RunControl()
    control.pause()
    events = run_events(open_engine(SIM), SIM, control)
    assert isinstance(next(events), RunStarted)
    import threading

    got = []
    thread = threading.Thread(target=lambda: got.append(next(events)))
    thread.start()
    thread.join(0.2)
    assert not got  # paused: no step
    control.resume()
    thread.join(30)  # a bound: it returns with the step
    assert isinstance(got[0], StepSample)


# --- the engine in its own process ---------------------------------------------------------------


def test_engine_process_streams_a_sim_run_without_torch_in_the_parent():
    code = (
        "import sys\n"
        "from kvtui.run.process import EngineProcess\n"
        "from kvtui.engines.protocol import RunSettings\n"
        "s = RunSettings(engine='sim:llama-3.1-8b@h100', tokens=10, replay_speed=0)\n"
        "p = EngineProcess(s)\n"
        "p.start(); events = list(p.events()); p.close()\n"
        "print(len(events), events[0].kind, events[-1].kind, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["23", "started", "finished", "False"], out.stderr


def test_engine_process_reports_a_bad_engine_as_run_failed():
    proc = EngineProcess(RunSettings(engine="sim:nope@h100"))
    proc.start()
    events = list(proc.events())
    proc.close()
    assert len(events) == 1 and isinstance(events[0], RunFailed)
    assert "unknown model 'nope'" in events[0].message


def test_a_killed_engine_process_becomes_run_failed():
    proc = EngineProcess(replace(SIM, tokens=100_000, replay_speed=1.0))
    proc.start()
    events = proc.events()
    assert isinstance(next(events), RunStarted)
    os.kill(proc.pid, signal.SIGKILL)
    rest = list(events)
    assert isinstance(rest[-1], RunFailed)
    assert "killed by signal 9" in rest[-1].message
    proc.close()


def test_stop_and_close_end_the_engine_process_when_asked():
    proc = EngineProcess(replace(SIM, tokens=100_000, replay_speed=1.0))
    proc.start()
    events = proc.events()
    next(events)
    next(events)
    # A bound, not a goal: close returns once the child has exited, and terminates it only
    # if it ignored the stop (how soon it stops is a benchmark's, not this test's).
    proc.close(timeout=60.0)
    assert not proc.alive
    assert proc.returncode == 0  # it stopped when asked: not terminated, not killed


def test_engine_process_pause_and_resume():
    import threading

    proc = EngineProcess(replace(SIM, tokens=100_000, replay_speed=1.0))
    proc.start()
    seen = []
    arrived = threading.Condition()

    def read() -> None:
        for event in proc.events():
            with arrived:
                seen.append(event)
                arrived.notify_all()

    def quiet_for(seconds: float) -> bool:
        """True when no event arrives for `seconds` (the child has really stopped stepping)."""
        with arrived:
            count = len(seen)
            arrived.wait(seconds)
            return len(seen) == count

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with arrived:
        assert arrived.wait_for(lambda: len(seen) >= 5, timeout=30)
    proc.pause()
    # Steps already in the pipe may still arrive; then nothing, however long we look.
    assert any(quiet_for(0.3) for _ in range(20)), "the engine never paused"
    held = len(seen)
    assert quiet_for(0.5) and len(seen) == held
    proc.resume()
    with arrived:
        assert arrived.wait_for(lambda: len(seen) > held, timeout=30)
    proc.close()
    reader.join(5)


def test_child_rejects_bad_settings():
    out = subprocess.run(
        [sys.executable, "-m", "kvtui.engines.drive"],
        input="not json\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert json.loads(out.stdout)["kind"] == "failed"


# --- the engine's process runs no code from where kvtui was started -----------------------------


MODULE_THAT_TELLS = "import pathlib\npathlib.Path({marker!r}).touch()\n"


@pytest.mark.parametrize("how", ["cwd", "PYTHONPATH"])
def test_engine_process_imports_nothing_from_the_users_directory(tmp_path, monkeypatch, how):
    """A json.py (imported by every engine) and a torch.py in the directory the app was started
    from, or on PYTHONPATH, are never imported by the engine's process."""
    marker = tmp_path / "imported"
    for name in ("json", "torch", "kvtui_sitecustomize", "sitecustomize"):
        (tmp_path / f"{name}.py").write_text(MODULE_THAT_TELLS.format(marker=str(marker)))
    if how == "cwd":
        monkeypatch.chdir(tmp_path)
    else:
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    # A relative replay path still names the file in the directory the app was started from.
    events = list(run_events(open_engine(replace(SIM, tokens=3)), replace(SIM, tokens=3)))
    record = tmp_path / "run.jsonl"
    events = write_record(record, replace(SIM, tokens=3), events)
    monkeypatch.chdir(tmp_path)
    proc = EngineProcess(RunSettings(engine="replay:run.jsonl", replay_speed=0))
    proc.start()
    got = list(proc.events())
    proc.close()
    assert got == as_replayed(events), got[-1]
    assert not marker.exists()


# --- sim: split over several GPUs ----------------------------------------------------------------


def test_sim_names_take_a_gpu_count():
    from kvtui.engines.factory import parse_engine

    spec = parse_engine("sim:llama-3.1-70b@4xh100")
    assert (spec.kind, spec.model, spec.gpu, spec.gpus) == ("sim", "llama-3.1-70b", "h100", 4)
    assert parse_engine("sim:llama-3.1-70b@ 8 X h200").gpus == 8
    assert parse_engine("sim:llama-3.1-8b@h100").gpus == 1
    for bad in (
        "sim:llama-3.1-8b@0xh100",
        "sim:llama-3.1-8b@2000xh100",
        f"sim:x@{'9' * 5000}xh100",
    ):
        with pytest.raises(EngineError, match="GPU count must be from 1 to 1,024"):
            parse_engine(bad)


def test_one_gpu_written_1x_is_the_same_run():
    one = replace(SIM, engine="sim:llama-3.1-8b@1xh100")
    a = [e for e in run_events(open_engine(SIM), SIM) if isinstance(e, StepSample)]
    b = [e for e in run_events(open_engine(one), one) if isinstance(e, StepSample)]
    assert a == b


def test_sim_split_over_4_gpus_runs_each_gpus_share():
    from kvtui.sim.memory import kv_bytes_per_token
    from kvtui.sim.parallel import shard
    from kvtui.sim.work import tensor_parallel_step_link_bytes

    settings = RunSettings(engine="sim:llama-3.1-70b@4xh100", tokens=8, replay_speed=0)
    events = list(run_events(open_engine(settings), settings))
    started, spec, gpu = events[0], get_model("llama-3.1-70b"), get_gpu("h100")
    share = shard(spec, 4)
    assert started.device == "sim: 4x NVIDIA H100 (SXM, 80GB), per GPU"
    assert (started.kv_heads, started.kv_bytes_per_token) == (2, kv_bytes_per_token(share))
    assert started.weights_bytes == weights_bytes(share) == 35_278_831_616
    P = started.prompt_tokens
    for i, s in enumerate(steps_of(events, "cached")[1:], start=1):
        assert s.bytes_read == decode_step_bytes(share, P + i)
        assert s.kv_bytes == kv_bytes(share, P + i)
        link = tensor_parallel_step_link_bytes(spec, 1, 4) / gpu.interconnect_bytes_per_s
        assert s.step_seconds == roofline_seconds(s.flops, s.bytes_read, gpu) + link
    # against the whole model on one H200 (it fits there): each H100 reads a quarter of it
    alone = RunSettings(
        engine="sim:llama-3.1-70b@h200", tokens=8, replay_speed=0, gpu_memory_utilization=1.0
    )
    whole = steps_of(list(run_events(open_engine(alone), alone)), "cached")
    for split, one in zip(steps_of(events, "cached")[1:], whole[1:], strict=True):
        assert split.step_seconds < one.step_seconds / 2


@pytest.mark.parametrize(
    ("engine", "says"),
    [
        (
            "sim:llama-3.1-70b@2xl4",
            "llama-3.1-70b does not fit 2x NVIDIA L4 (65.7 GiB of bf16 weights per GPU + the "
            "1 GiB runtime reserve > 24 GiB); it needs at least 8: sim:llama-3.1-70b@8xl4",
        ),
        (
            "sim:llama-3.1-70b@h100",
            "do not fit in NVIDIA H100 (SXM, 80GB) (80 GiB); it needs at least 2",
        ),
        ("sim:deepseek-v3@4xh200", "it needs at least 8: sim:deepseek-v3@8xh200"),  # fp8
        ("sim:llama-3.1-70b@3xh100", "64 attention heads do not split evenly over 3 GPUs"),
    ],
)
def test_sim_refuses_a_split_too_small_naming_the_fewest_gpus(engine, says):
    with pytest.raises(EngineError) as caught:
        open_engine(RunSettings(engine=engine))
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_the_fewest_gpus_named_are_the_fewest_that_fit():
    from kvtui.sim.parallel import shard

    gib = 2**30
    spec = get_model("llama-3.1-70b")
    for tp, fits in ((4, False), (8, True)):  # 24 GiB L4s; 5, 6 and 7 do not split 64 heads
        assert (weights_bytes(shard(spec, tp)) + gib <= 24 * gib) is fits
    deepseek = get_model("deepseek-v3")  # 671B, bf16 in the sim (1,250 GiB), on 141 GiB H200s
    assert weights_bytes(shard(deepseek, 8), "bf16") + gib > 141 * gib
    assert weights_bytes(shard(deepseek, 16), "bf16") + gib <= 141 * gib


def test_a_run_closed_before_it_starts_ends_the_spare_it_was_given():
    """A run that is closed unstarted (its reader cancelled before it ran) ends the spare child
    it holds, where the spare went on running with no one to close it."""
    engines = Engines()
    engines.prepare(RunSettings(engine="tiny", device="cpu", tokens=3))
    spare = engines.spare
    assert spare is not None and spare.alive
    run = engines(RunSettings(engine="tiny", device="cpu", tokens=3))
    try:
        run.close()
        assert not spare.alive and spare.proc.returncode is not None  # ended and reaped
    finally:
        spare.close()
        engines.close()


def test_a_spare_engine_process_is_started_between_runs_and_adopted_by_the_next():
    """`Engines` starts a spare child for a torch engine (torch imported ahead); the next torch
    run adopts it, and its progress says what it did while it waited; another kind of engine
    closes it and starts its own child."""
    engines = Engines()
    engines.prepare(SIM)
    assert engines.spare is None  # sim: needs no torch, so no spare
    tiny = RunSettings(engine="tiny", device="cpu", tokens=3, seed=1)
    engines.prepare(tiny)
    first = engines.spare
    assert first is not None and first.alive
    sim_run = engines(replace(SIM, tokens=2, replay_speed=0))
    assert engines.spare is None and not first.alive  # closed unused
    sim_run.start()
    assert [e.kind for e in sim_run.events()][-1] == "finished"
    sim_run.close()
    engines.prepare(tiny)
    spare = engines.spare
    run = engines(tiny)
    try:
        run.start()
        assert run.pid == spare.proc.pid  # the spare, adopted
        kinds = [(e.kind, getattr(e, "phrase", "")) for e in run.events()]
    finally:
        run.close()
        engines.close()
    said = [phrase for kind, phrase in kinds if kind == "progress"]
    assert said[:2] == ["importing torch", FLOP_COUNTER_PHRASE]  # while it waited
    assert FLOP_COUNTER_PHRASE not in said[2:]  # ready: not said again
    assert kinds[len(said)][0] == "started" and kinds[-1][0] == "finished"
