"""The engine side of kvtui, without a UI: what an engine is and emits (`protocol`), engine names
(`spec`), the engines (`torch_engine` for the project's decoder, `hf` for local transformers
models, `roofline` for `sim:`, `replay` for recorded runs), the engine's own process (`process`)
and `kvtui bench` (`bench`). Only `torch_engine` and `hf` import torch, and only when opened."""
