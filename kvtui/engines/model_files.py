"""What a run's model must be, checked cheaply and without torch or a UI: that a prompt and its
tokens fit the model's positions, and that a Hugging Face model folder is one kvtui will load (its
config.json, its safetensors files). Used by kvtui.engines.factory before a run opens and by
kvtui.engines.hf as it loads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvtui.errors import EngineError


def check_positions(label: str, prompt: int, tokens: int, limit: int) -> None:
    """`EngineError` when a prompt of `prompt` positions and `tokens` more pass `limit`."""
    if prompt + tokens > limit:
        room = limit - prompt
        hint = f"; ask for at most {room:,} tokens" if room > 0 else ""
        raise EngineError(
            f"{prompt:,} prompt + {tokens:,} tokens is {prompt + tokens:,} positions, past "
            f"{label}'s {limit:,}{hint}"
        )


def read_model_config(directory: Path) -> dict[str, Any]:
    """The config.json of a model folder as a JSON object (bounded, a regular file);
    `EngineError` when the folder or its config is missing or not one."""
    from kvtui.sim.catalog import ConfigError
    from kvtui.sim.hf_config import read_hf_config

    if not directory.exists():
        raise EngineError(f"model directory {directory} does not exist")
    if not directory.is_dir():
        raise EngineError(f"{directory} is not a directory (--model takes a model directory)")
    if not os.path.lexists(directory / "config.json"):
        raise EngineError(f"{directory} has no config.json: not a Hugging Face model directory")
    try:
        return read_hf_config(directory / "config.json")
    except ConfigError as exc:
        raise EngineError(str(exc)) from None


def check_model_files(directory: Path, config: dict[str, Any]) -> list[Path]:
    """The safetensors files transformers would load from the folder, each checked
    (kvtui.inputs.model_weights); `EngineError` for pickled weights, a weight file outside the
    folder or with a lying header, a PEFT adapter, or a file transformers might read that is not
    a regular file (a FIFO would hang the load) or is larger than a config or tokenizer can be."""
    from kvtui.inputs import InputError, check_folder_files, model_weights

    if os.path.lexists(directory / "adapter_config.json"):
        raise EngineError(
            f"{directory} holds a PEFT adapter (adapter_config.json), not a model; kvtui loads "
            "whole models only"
        )
    try:
        check_folder_files(directory)
        return model_weights(directory, config.get("transformers_weights"))
    except InputError as exc:
        raise EngineError(str(exc)) from None
