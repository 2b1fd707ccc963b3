"""The engines, one per kind, without a UI: what an engine is and emits (`protocol`), the one
factory that parses a name and opens the engine it names (`factory`), and the engines themselves:
`torch_engine` (tiny and `shape:`, with its `loops` and `quality`), `hf` (a local transformers
model), `roofline` (`sim:`, modelled), `replay` (a recorded run) and `vllm` (a running server,
watched). Only `torch_engine` and `hf` import torch, and only when opened."""
