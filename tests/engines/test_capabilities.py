"""What each engine can do (kvtui.engines.capabilities): its parsed name says it before the run,
its start event once it runs, a replay's says what the recorded run could do; a record written
before starts said gets it from its engine's name as it replays."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvtui.engines import torch_engine
from kvtui.engines.capabilities import (
    CAPABILITIES,
    KVTUI_TORCH,
    NOTHING,
    OWN_ENGINES,
    REPLAY,
    ROOFLINE,
    SERVED,
    TRANSFORMERS,
    Capabilities,
)
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine, parse_engine
from kvtui.engines.protocol import RunSettings, RunStarted, event_from_json, to_json
from kvtui.engines.replay import RecordWriter, read_record
from kvtui.paths import asset_path
from kvtui.run.live import LiveRun
from kvtui.run.process import EngineProcess, runs_torch
from kvtui.testing import ScriptedEngine, refuse_torch

OLD_RECORD = asset_path("tiny-cpu.jsonl")
"""A tiny run recorded on a CPU before starts said what their engine can do."""


def started_by(settings: RunSettings) -> RunStarted:
    engine = open_engine(settings)
    try:
        return engine.started()
    finally:
        engine.close()


def test_the_one_table():
    assert OWN_ENGINES == "kvtui's own engines (tiny, shape:, sim:)"
    names = {
        "tiny": "tiny",
        "shape": "shape:llama-3.2-1b",
        "sim": "sim:llama-3.1-8b@h100",
        "replay": "replay:run.jsonl",
        "hf": "hf:/models/x",
        "vllm": "vllm:http://127.0.0.1:8000",
    }
    assert set(names) == set(CAPABILITIES)
    for kind, name in names.items():
        assert parse_engine(name).can == CAPABILITIES[kind]
        assert runs_torch(RunSettings(engine=name)) == CAPABILITIES[kind].torch
    assert [k for k, can in CAPABILITIES.items() if can.torch] == ["tiny", "shape", "hf"]
    assert [k for k, can in CAPABILITIES.items() if can.own_cache] == ["tiny", "shape", "sim"]
    assert dataclasses.replace(NOTHING, replay=True) == REPLAY
    assert ROOFLINE.replayed() == dataclasses.replace(ROOFLINE, own_cache=False, replay=True)
    assert KVTUI_TORCH.replayed() == Capabilities(
        torch=False, own_cache=False, attention=True, modelled=False, served=False, replay=True
    )
    for name in ("tiny", "hf:/models/x"):
        with pytest.raises(ValueError, match="never imports torch"):
            refuse_torch(RunSettings(engine=name))
    refuse_torch(RunSettings(engine="sim:llama-3.1-8b@h100"))


def test_the_sim_engine_says_so_with_its_windows():
    s = started_by(RunSettings(engine="sim:mistral-7b@2xh100", tokens=4))
    assert s.can == ROOFLINE and s.sliding_window == 4096 and len(s.sliding_layers) == 32
    assert started_by(RunSettings(engine="sim:llama-3.1-8b@h100", tokens=4)).sliding_window is None


def test_kvtui_torch_engines_say_so():
    pytest.importorskip("torch")
    tiny = started_by(RunSettings(engine="tiny", device="cpu", tokens=4))
    assert tiny.can == KVTUI_TORCH and tiny.attention_layer is not None
    assert tiny.sliding_window is None


def test_a_shape_says_so_and_keeps_every_position(monkeypatch):
    pytest.importorskip("torch")
    from kvtui.sim.catalog import get_model

    small = dataclasses.replace(
        get_model("mistral-7b"),
        layers=1,
        hidden_size=128,
        heads=4,
        kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        vocab_size=1000,
    )
    monkeypatch.setattr(torch_engine, "get_model", lambda name: small)
    shape = started_by(RunSettings(engine="shape:mistral-7b", device="cpu", tokens=4))
    assert shape.can == KVTUI_TORCH
    assert shape.sliding_window is None  # kvtui's decoder slides no window, whatever the shape


def test_an_hf_model_says_so_with_its_config_windows(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.engines.test_hf import build_tokenizer

    tokenizer = build_tokenizer()
    config = transformers.MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=8,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    hf = started_by(RunSettings(engine=f"hf:{tmp_path}", device="cpu", tokens=4))
    assert hf.can == TRANSFORMERS
    assert hf.sliding_window == 8 and hf.sliding_layers == (0, 1)


def test_a_served_run_says_so():
    from tests.vllm.fake import FakeVLLM

    server = FakeVLLM().start()
    try:
        settings = RunSettings(engine=f"vllm:{server.url}", tokens=4, loops=("cached",))
        assert started_by(settings).can == SERVED
    finally:
        server.close()


def _record(path: Path, settings: RunSettings) -> Path:
    with path.open("w", encoding="utf-8") as out:
        writer = RecordWriter(out, settings)
        for event in run_events(open_engine(settings), settings):
            writer.write(event)
    return path


def test_a_replay_says_what_the_recorded_run_could_do(tmp_path):
    sim = RunSettings(engine="sim:mistral-7b@h100", tokens=4, replay_speed=0)
    path = _record(tmp_path / "sim.jsonl", sim)
    _, events = read_record(path)
    assert events[0].can == ROOFLINE  # as recorded
    replay = RunSettings(engine=f"replay:{path}", replay_speed=0)
    s = started_by(replay)
    assert s.can == ROOFLINE.replayed() and s.can.modelled and not s.can.own_cache
    assert s.sliding_window == 4096  # the recorded windows
    live = LiveRun(replay)
    assert live.can == REPLAY  # before its start: a record
    live.apply(s)
    assert live.can == ROOFLINE.replayed()


def test_a_record_from_before_capabilities_replays_with_them():
    """assets/tiny-cpu.jsonl has no `can`: its replay finds a tiny run's from its engine's name,
    in this process (kvtui.testing) and through the engine's own process (the JSON pipe)."""
    _, events = read_record(OLD_RECORD)
    assert events[0].can is None and events[0].engine == "tiny"
    want = KVTUI_TORCH.replayed()
    settings = RunSettings(engine=f"replay:{OLD_RECORD}", replay_speed=0)
    assert started_by(settings).can == want
    scripted = list(ScriptedEngine.from_record(OLD_RECORD).events())  # kvtui.testing's
    assert isinstance(scripted[0], RunStarted) and scripted[0].can == want
    child = EngineProcess(settings)
    child.start()
    try:
        first = next(e for e in child.events() if isinstance(e, RunStarted))
    finally:
        child.close()
    assert first.can == want and first.recorded_at.startswith("2026-12-02")
    live = LiveRun(settings)
    live.apply(first)
    assert live.can.replay and live.can.attention and not live.can.torch


def test_capabilities_cross_the_pipe_as_json():
    s = started_by(RunSettings(engine="sim:mistral-7b@h100", tokens=4))
    data = to_json(s)
    assert data["can"] == dataclasses.asdict(ROOFLINE)
    assert event_from_json(data) == s
    old = {k: v for k, v in data.items() if k not in ("can", "sliding_window", "sliding_layers")}
    assert event_from_json(old).can is None
    for can, says in (
        ("yes", "can is 'yes', not an object or null"),
        ([True], "can is [True], not an object or null"),
        ({**data["can"], "served": "no"}, "can: served is 'no', not true or false"),
        ({k: v for k, v in data["can"].items() if k != "replay"}, "can: replay is missing"),
    ):
        with pytest.raises(ValueError, match=f"^started event: {re.escape(says)}$"):
            event_from_json({**data, "can": can})
    assert event_from_json({**data, "can": {**data["can"], "later": 1}}).can == ROOFLINE
