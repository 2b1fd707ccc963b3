"""A running vLLM (or SGLang) server as an engine: its HTTP `client`, the `metrics` it publishes,
the `engine` that watches it, and the `load` kvtui can put on it. No torch, no UI."""
