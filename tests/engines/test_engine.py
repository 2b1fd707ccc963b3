"""The torch engines through the engine protocol: what `kvtui bench` and the screens consume."""

from dataclasses import replace

import pytest
import torch

from kvtui.engines import loops, torch_engine
from kvtui.engines.drive import TURN_SECONDS, run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunControl, RunFinished, RunSettings, RunStarted, StepSample
from kvtui.errors import EngineError
from kvtui.gpu import device, load
from kvtui.sim.memory import kv_bytes
from kvtui.sim.work import (
    cached_step_positions,
    decode_step_flops,
    naive_step_positions,
    uncached_step_flops,
)

TINY = RunSettings(engine="tiny", device="cpu", tokens=24, seed=3)


def steps_of(events, loop):
    return [e for e in events if isinstance(e, StepSample) and e.loop == loop]


@pytest.fixture(scope="module")
def tiny_run():
    engine = open_engine(TINY)
    return engine, list(run_events(engine, TINY))


def test_tiny_run_shares_the_engine_fairly_and_finishes(tiny_run):
    """A turn goes to the loop that has spent the least measured time so far (while both run)
    and lasts TURN_SECONDS of its steps: so the cached loop, with its short steps, gets ahead,
    and neither is ever more than a turn (and a step) ahead of the other."""
    engine, events = tiny_run
    assert isinstance(events[0], RunStarted) and events[0].device == "cpu"
    assert events[0].dtype == "fp32"  # fp32 on the CPU
    spent, running = {"uncached": 0.0, "cached": 0.0}, {"uncached", "cached"}
    for event in events[1:]:
        if isinstance(event, RunFinished):
            running.discard(event.loop)
        elif isinstance(event, StepSample):
            assert all(spent[event.loop] < spent[other] + TURN_SECONDS for other in running)
            spent[event.loop] += event.step_seconds
    finished = [e for e in events if isinstance(e, RunFinished)]
    assert {(f.loop, f.reason, f.steps) for f in finished} == {
        ("uncached", "done", 24),
        ("cached", "done", 24),
    }


def test_both_loops_give_the_same_text(tiny_run):
    _, events = tiny_run
    cached, uncached = steps_of(events, "cached"), steps_of(events, "uncached")
    assert [s.token_id for s in cached] == [s.token_id for s in uncached]
    assert "".join(s.text for s in cached) == "".join(s.text for s in uncached)


def test_kv_bytes_measured_equal_the_formula(tiny_run):
    """Filled: the formula for the positions cached; allocated: the whole blocks they sit in."""
    engine, events = tiny_run
    started = events[0]
    P, per_token, block = started.prompt_tokens, started.kv_bytes_per_token, 16
    assert started.kv_block_tokens == block and started.kv_capacity_bytes == 256 * 2**20
    assert per_token == 2 * 6 * 2 * 32 * 4  # layers x kv heads x head_dim x fp32
    cached = steps_of(events, "cached")
    assert [s.kv_bytes for s in cached] == [
        kv_bytes(engine.spec, P + i, 1, "fp32") for i in range(24)
    ]
    assert [s.kv_bytes_allocated for s in cached] == [
        -(-(P + i) // block) * block * per_token for i in range(24)
    ]
    finished = next(e for e in events if isinstance(e, RunFinished) and e.loop == "cached")
    assert finished.kv_bytes_filled == kv_bytes(engine.spec, P + 23, 1, "fp32")
    assert finished.kv_bytes_allocated == cached[-1].kv_bytes_allocated


def test_step_counts_agree_with_kvtui_sim(tiny_run):
    engine, events = tiny_run
    P = events[0].prompt_tokens
    uncached, cached = steps_of(events, "uncached"), steps_of(events, "cached")
    assert [s.positions_computed for s in uncached] == [
        naive_step_positions(t, P) for t in range(1, 25)
    ]
    assert [s.positions_computed for s in cached] == [
        cached_step_positions(t, P) for t in range(1, 25)
    ]
    assert [s.flops for s in uncached] == [
        uncached_step_flops(engine.spec, P + i) for i in range(24)
    ]
    assert [s.flops for s in cached[1:]] == [
        decode_step_flops(engine.spec, P + i) for i in range(1, 24)
    ]


def test_stop_between_steps_cancels_every_loop():
    control = RunControl()
    engine = open_engine(replace(TINY, tokens=200))
    seen = []
    for event in run_events(engine, replace(TINY, tokens=200), control):
        seen.append(event)
        if isinstance(event, StepSample) and event.step == 2:
            control.stop()
    finished = [e for e in seen if isinstance(e, RunFinished)]
    assert {f.reason for f in finished} == {"cancelled"}
    assert len([e for e in seen if isinstance(e, StepSample)]) <= 7
    assert engine.model.kv is None  # the cache was freed


def test_out_of_memory_ends_the_loop_cleanly_and_frees_the_cache(monkeypatch):
    engine = open_engine(replace(TINY, loops=("cached",), tokens=50))
    real_loop = loops.cached_loop

    def failing_loop(model, prompt, n, sampling, counted):
        for step in real_loop(model, prompt, n, sampling, counted):
            if step.index == 10:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            yield step

    monkeypatch.setattr(loops, "cached_loop", failing_loop)
    events = list(run_events(engine, engine.settings))
    finished = events[-1]
    assert isinstance(finished, RunFinished) and finished.reason == "out_of_memory"
    assert finished.steps == 10
    assert finished.message == "device out of memory after token 10"
    assert engine.model.kv is None
    # the process goes on: the same engine runs again
    monkeypatch.setattr(loops, "cached_loop", real_loop)
    again = list(run_events(engine, engine.settings))
    assert again[-1].reason == "done"


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ("nonsense", "unknown engine"),
        ("shape:", "needs a model name"),
        ("shape:llama-9", "unknown model"),
        ("shape:deepseek-v3", "not supported"),
        ("shape:llama-3.1-70b", "needs 266.8 GiB"),
    ],
)
def test_bad_engines_are_one_clear_error(engine, message, monkeypatch):
    # as if on a 16 GiB laptop, whatever this machine has
    monkeypatch.setattr(load, "available_bytes", lambda device: (16 << 30, "free host RAM"))
    with pytest.raises(EngineError, match=message):
        open_engine(RunSettings(engine=engine, device="cpu", tokens=4))


def test_shape_engine_runs_a_catalog_shape_with_random_weights(monkeypatch):
    from kvtui.sim.catalog import get_model

    spec = get_model("llama-3.2-1b")
    small = replace(
        spec,
        layers=1,
        hidden_size=128,
        heads=4,
        kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        vocab_size=1000,
    )
    monkeypatch.setattr(torch_engine, "get_model", lambda name: small)
    settings = RunSettings(engine="shape:llama-3.2-1b", device="cpu", tokens=8, greedy=True)
    engine = open_engine(settings)
    events = list(run_events(engine, settings))
    cached, uncached = steps_of(events, "cached"), steps_of(events, "uncached")
    assert [s.token_id for s in cached] == [s.token_id for s in uncached]
    assert all(0 <= s.token_id < 1000 for s in cached)
    assert events[0].kv_bytes_per_token == 2 * 1 * 2 * 32 * 4


def test_device_auto_is_the_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert device.pick_device("auto").type == "cpu"
    with pytest.raises(EngineError, match="no CUDA device"):
        device.pick_device("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_is_bf16_and_measures_device_memory():
    settings = RunSettings(engine="tiny", device="cuda", tokens=64, greedy=True)
    engine = open_engine(settings)
    events = list(run_events(engine, settings))
    assert events[0].dtype == "bf16" and events[0].device.startswith("cuda")
    cached = steps_of(events, "cached")
    assert all(s.device_memory_bytes and s.device_memory_bytes > 0 for s in cached)
    finished = next(e for e in events if isinstance(e, RunFinished) and e.loop == "cached")
    assert finished.kv_bytes_filled == kv_bytes(
        engine.spec, events[0].prompt_tokens + 63, 1, "bf16"
    )
