"""Engine names, parsed once: `tiny`, `shape:MODEL`, `sim:MODEL@GPU`, `replay:FILE`, `hf:DIR`.

`parse_engine` turns a name into an `EngineSpec` (or one `EngineError` line); `check_engine`
refuses, cheaply and without torch, a run that cannot start, so that the CLI can say so before a
UI opens; `open_engine` builds the engine a spec names, importing torch only for the torch
engines (kvtui.engine.torch_engine, kvtui.engine.hf), never for `sim:` (kvtui.engine.roofline)
or `replay:` (kvtui.engine.replay).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvtui.engine.protocol import EngineError, RunSettings, StepSource

EngineKind = Literal["tiny", "shape", "sim", "replay", "hf"]

ENGINE_FORMS = "tiny, shape:MODEL, sim:MODEL@GPU, replay:FILE, hf:DIR"


@dataclass(frozen=True)
class EngineSpec:
    """An engine name, parsed."""

    kind: EngineKind
    model: str | None = None
    """The catalog model of `shape:` and `sim:`."""
    gpu: str | None = None
    """The catalog GPU of `sim:`."""
    path: Path | None = None
    """The record of `replay:`, the model directory of `hf:`."""


def parse_engine(name: str) -> EngineSpec:
    """The spec of an engine name; `EngineError` with one line for a malformed one."""
    name = name.strip()
    kind, colon, arg = name.partition(":")
    arg = arg.strip()
    if name == "tiny":
        return EngineSpec("tiny")
    if not colon or kind not in ("shape", "sim", "replay", "hf"):
        raise EngineError(f"unknown engine {name!r}: use one of {ENGINE_FORMS}")
    if kind == "shape":
        if not arg:
            raise EngineError("shape: needs a model name, e.g. shape:llama-3.2-1b")
        return EngineSpec("shape", model=arg)
    if kind == "sim":
        model, at, gpu = arg.partition("@")
        if not (model and at and gpu):
            raise EngineError("sim: needs MODEL@GPU, e.g. sim:llama-3.1-8b@h100")
        return EngineSpec("sim", model=model.strip(), gpu=gpu.strip())
    if not arg:
        example = "replay:runs/h100.jsonl" if kind == "replay" else "hf:~/models/Llama-3.2-1B"
        raise EngineError(f"{kind}: needs a path, e.g. {example}")
    return EngineSpec(kind, path=Path(arg).expanduser())  # type: ignore[arg-type]


def open_engine(settings: RunSettings) -> StepSource:
    """The engine `settings.engine` names; `EngineError` for a bad name or a run that can't fit."""
    spec = parse_engine(settings.engine)
    if settings.tokens < 1:
        raise EngineError("tokens must be at least 1")
    if spec.kind in ("tiny", "shape"):
        from kvtui.engine.torch_engine import open_torch_engine

        return open_torch_engine(settings, spec.model)
    if spec.kind == "sim":
        from kvtui.engine.roofline import SimEngine

        return SimEngine.open(settings, spec.model, spec.gpu)
    if spec.kind == "replay":
        from kvtui.engine.replay import ReplayEngine

        return ReplayEngine.open(spec.path, settings)
    from kvtui.engine.hf import open_hf_engine

    return open_hf_engine(settings, spec.path)


def check_engine(settings: RunSettings) -> None:
    """Refuse a run that cannot start, before a UI opens: `EngineError` with one clear line.

    Cheap and torch-free: names are looked up in the catalogs, a replay file is read, a model
    directory is looked at; whether a torch model fits in memory is still the engine's to say.
    """
    spec = parse_engine(settings.engine)
    if spec.kind in ("sim", "replay"):
        open_engine(settings).close()
    elif spec.kind == "shape":
        from kvtui.sim.catalog import UnknownNameError, get_model

        try:
            get_model(spec.model)
        except UnknownNameError as exc:
            raise EngineError(str(exc)) from None
    elif spec.kind == "hf" and not (spec.path / "config.json").is_file():
        raise EngineError(f"{spec.path} is not a Hugging Face model directory (no config.json)")
