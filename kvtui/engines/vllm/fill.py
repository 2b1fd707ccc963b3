"""A fill sized from the server's own limits (`kvtui load URL` with no other flag), without a
UI: its KV capacity from /metrics and its max_model_len from /v1/models make the plan
(kvtui.engines.vllm.load.fill_plan); the polls while it runs say whether it filled
(kvtui.run.pressure)."""

from __future__ import annotations

import math

from kvtui.engines.protocol import ServerMetrics
from kvtui.engines.vllm.client import Server, ServerError
from kvtui.engines.vllm.engine import read_served
from kvtui.engines.vllm.load import LoadPlan, fill_plan
from kvtui.engines.vllm.metrics import MAX_METRICS_BYTES, MetricsError, server_metrics
from kvtui.engines.vllm.url import ServerURL
from kvtui.errors import EngineError


def poll_metrics(url: ServerURL, seconds: float, *, until: float = math.inf) -> ServerMetrics:
    """One read of the server's /metrics; a `ServerMetrics` whose `error` says why not."""
    try:
        text = Server(url, until=until).text("/metrics", MAX_METRICS_BYTES)
        return server_metrics(text, seconds)
    except (ServerError, MetricsError) as exc:
        return ServerMetrics(seconds, error=f"{url}/metrics: {exc}")


def plan_from_server(url: ServerURL, *, until: float = math.inf) -> tuple[LoadPlan, int | None]:
    """The fill for the server at `url` and its max_model_len; `EngineError` (one line) when it
    reports no KV capacity to size one from."""
    served = read_served(url, until=until)
    poll = poll_metrics(url, 0.0, until=until)
    if poll.error or not poll.kv_capacity_tokens:
        why = poll.error or "its /metrics reports no KV-cache capacity"
        raise EngineError(
            f"no fill can be sized from {url} ({why}): give --concurrency, --prompt-tokens and "
            "--max-tokens"
        )
    return fill_plan(url, poll.kv_capacity_tokens, served.max_model_len), served.max_model_len
