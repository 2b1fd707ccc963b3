"""kvtui: see, and measure, why LLM decoding needs a KV cache."""

__version__ = "0.1.0"
