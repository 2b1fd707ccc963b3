"""The bounds of a load (kvtui.engines.vllm.load): what `kvtui load` checks its options against
before any request is sent. Apart from the load, so that the command line's parser reads them
without importing an HTTP client."""

from __future__ import annotations

MAX_CONCURRENCY = 256
"""The most requests at once: vLLM's default max_num_seqs."""
MAX_PROMPT_TOKENS = 131_072
MAX_NEW_TOKENS = 131_072
MAX_REQUESTS = 10_000
MAX_SECONDS = 3600.0
DEFAULT_SECONDS = 120.0
"""A load's wall-time limit unless told: two minutes."""
