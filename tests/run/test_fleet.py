"""A fleet's polls folded (kvtui.run.fleet): a watch per replica, the totals, the skew in words,
the replicas gone; and the rows screen 3 draws of them (kvtui.widgets.fleet.fleet_lines). The polls
are ServerMetrics as the engine sends them, each tagged with its replica. No server."""

from __future__ import annotations

from dataclasses import replace

from kvtui.engines.protocol import RunStarted, ServerMetrics, event_from_json, to_json
from kvtui.engines.vllm.fleet import MAX_REPLICAS, parse_urls
from kvtui.run.fleet import FleetWatch
from kvtui.run.summary import RunSummary
from kvtui.widgets.fleet import fleet_lines

URLS = parse_urls("http://127.0.0.1:8101,http://127.0.0.1:8102")
NAMES = ["replica 1 (127.0.0.1:8101)", "replica 2 (127.0.0.1:8102)"]


def poll(replica: int, seconds: float = 1.0, **figures: object) -> ServerMetrics:
    base: dict[str, object] = {
        "kv_usage": 0.0,
        "kv_blocks": 40,
        "kv_block_tokens": 32,
        "kv_capacity_tokens": 1280,
        "requests_running": 0,
        "requests_waiting": 0,
        "preemptions": 0,
        "prefix_queries_tokens": 0,
        "prefix_hits_tokens": 0,
        "model": "m",
        "found": ("kv_usage=vllm:kv_cache_usage_perc",),
    }
    return ServerMetrics(seconds, replica=replica, **(base | figures))  # type: ignore[arg-type]


def test_each_replica_s_polls_go_to_its_own_watch():
    fleet = FleetWatch()
    fleet.add(poll(0, kv_usage=0.5))
    fleet.add(poll(1, kv_usage=0.25, kv_capacity_tokens=3840, kv_blocks=60, kv_block_tokens=64))
    fleet.add(poll(1, seconds=2.0, kv_usage=0.75, kv_capacity_tokens=3840))
    assert fleet.size == 2
    assert fleet.decode.peak_usage == 0.5
    assert (fleet.replicas[1].polls, fleet.replicas[1].peak_usage) == (2, 0.75)


def test_the_totals_weigh_each_replica_s_usage_by_its_slots():
    fleet = FleetWatch()
    fleet.add(poll(0, kv_usage=1.0, requests_running=4, requests_waiting=3, preemptions=2))
    fleet.add(poll(1, kv_usage=0.0, kv_capacity_tokens=3840, requests_running=1))
    fleet.add(poll(0, seconds=2.0, kv_usage=1.0, requests_waiting=3, preemptions=7))
    t = fleet.totals()
    assert (t.answering, t.replicas, t.capacity_tokens) == (2, 2, 1280 + 3840)
    assert t.usage == 1280 / 5120  # the small one full is a quarter of the fleet, not half
    assert (t.running, t.waiting, t.preemptions_seen) == (1, 3, 5)


def test_one_replica_full_while_another_idles_is_said_with_both_names():
    fleet = FleetWatch()
    fleet.add(poll(0, kv_usage=0.97, requests_waiting=5))
    fleet.add(poll(1, kv_usage=0.02))
    words = fleet.skew(NAMES)
    assert words == (
        "Skewed: replica 1 (127.0.0.1:8101) full (KV 97%, 5 waiting) while replica 2 "
        "(127.0.0.1:8102) idles (KV 2%)."
    )
    fleet.add(poll(0, seconds=2.0, kv_usage=0.6, requests_waiting=4))
    assert fleet.skew(["1", "2"]) == "Skewed: 1 queues 4 (KV 60%) while 2 idles (KV 2%)."


def test_a_balanced_fleet_says_nothing_and_an_uneven_one_says_so():
    fleet = FleetWatch()
    fleet.add(poll(0, kv_usage=0.5))
    fleet.add(poll(1, kv_usage=0.6))
    assert fleet.skew(NAMES) == ""
    fleet.add(poll(1, seconds=2.0, kv_usage=0.95))
    assert fleet.skew(NAMES) == ""  # full, but the other is not idle, nor 50 points below
    fleet.add(poll(0, seconds=2.0, kv_usage=0.3))
    assert fleet.skew(NAMES) == (
        "Uneven: replica 2 (127.0.0.1:8102) at KV 95%, replica 1 (127.0.0.1:8101) at 30%."
    )


def test_a_replica_gone_is_named_and_left_out_of_the_totals():
    fleet = FleetWatch()
    fleet.add(poll(0, kv_usage=0.5, requests_running=2))
    fleet.add(poll(1, kv_usage=0.9, requests_running=9))
    fleet.add(ServerMetrics(3.0, error="no answer from http://127.0.0.1:8102", replica=1))
    assert fleet.gone() == [1]
    t = fleet.totals()
    assert (t.answering, t.running, t.capacity_tokens) == (1, 2, 1280)
    lines = [text for text, _ in fleet_lines(fleet, None, URLS)]
    assert any(
        line.startswith("  NOT ANSWERING since 3.00 s: no answer from http://127.0.0.1:8102")
        for line in lines
    )
    assert lines[-1] == ("replica 2 (127.0.0.1:8102) stopped answering; the other 1 still watched")


def test_a_replica_past_the_most_is_not_kept_and_the_tag_survives_a_record():
    fleet = FleetWatch()
    fleet.add(poll(MAX_REPLICAS))
    assert fleet.size == 1 and fleet.decode.polls == 0
    again = event_from_json(to_json(poll(3, model="x")))
    assert isinstance(again, ServerMetrics) and (again.replica, again.model) == (3, "x")


def test_the_run_s_server_is_the_decode_replica_and_a_snapshot_stays_as_it_was():
    run = RunSummary()
    run.apply(poll(0, kv_usage=0.5))
    run.apply(poll(1, kv_usage=0.1))
    snap = run.snapshot()
    run.apply(poll(1, seconds=2.0, kv_usage=0.9))
    assert run.server is run.fleet.decode and run.server.peak_usage == 0.5
    assert snap.fleet.replicas[1].peak_usage == 0.1 and run.fleet.replicas[1].peak_usage == 0.9


def started(model: str = "m") -> RunStarted:
    return RunStarted(
        engine="vllm:x",
        model=model,
        device="vLLM",
        dtype="fp32",
        layers=4,
        kv_heads=4,
        head_dim=24,
        kv_bytes_per_token=3072,
        weights_bytes=0,
        prompt_tokens=1,
        tokens=8,
        timing="measured",
        threads=0,
        served_by="vLLM at x",
    )


def test_each_row_has_its_capacity_read_and_predicted_usage_requests_and_hits():
    fleet = FleetWatch()
    fleet.add(poll(0, kv_cache_memory_bytes=4_000_000, kv_cache_dtype="auto"))
    fleet.add(
        poll(
            0,
            seconds=2.0,
            kv_usage=0.9,
            kv_cache_memory_bytes=4_000_000,
            kv_cache_dtype="auto",
            requests_running=3,
            requests_waiting=2,
            waiting_reasons=("capacity=2", "deferred=0"),
            preemptions=4,
            prefix_queries_tokens=200,
            prefix_hits_tokens=50,
        )
    )
    fleet.add(poll(1, model="other"))
    lines = [text for text, _ in fleet_lines(fleet, started(), URLS)]
    assert lines[0] == ("1 127.0.0.1:8101 decode · 1,280 = 40 x 32 tokens · kvtui 40: agree")
    assert lines[1] == (
        "  KV 90% (peak 90%) · 3 run, 2 wait (capacity 2) · 4 preemptions · prefix 25% hit"
    )
    assert lines[2].startswith("2 127.0.0.1:8102 · 1,280 = 40 x 32 tokens · kvtui: no prediction")
    assert "serves 'other', not the model kvtui read ('m')" in lines[2]
    assert lines[2].endswith("· serves other")
    assert lines[4].startswith("Sum of 2/2 answering: 2,560 tokens, KV 45%")


def test_text_from_a_server_is_drawn_escaped():
    fleet = FleetWatch()
    fleet.add(poll(0, model="[b]x\x1b[2J"))
    fleet.add(replace(poll(1), model="m"))
    lines = [text for text, _ in fleet_lines(fleet, started(), URLS)]
    assert all("\x1b" not in line for line in lines)


def test_rows_without_the_servers_list_name_replicas_by_place():
    fleet = FleetWatch()
    fleet.add(poll(0))
    fleet.add(poll(1))
    lines = [text for text, _ in fleet_lines(fleet, None, ())]  # a replayed record's
    assert lines[0].startswith("replica 1 decode · ") and lines[2].startswith("replica 2 · ")


def test_a_data_parallel_replica_s_row_says_its_prediction_per_engine_and_its_prefix_caching():
    """Server B's real text (bf16 on 2 data-parallel engines, no prefix caching): its row read
    "3,840 = 60 x 64 tokens · kvtui 30: agree" (one engine's 30 beside both engines' 60) and
    "prefix: none looked up" where the server caches no prefix at all."""
    from pathlib import Path

    from kvtui.engines.vllm.metrics import server_metrics

    text = Path(__file__).parents[1] / "engines" / "data" / "vllm-0.32-dp2-bf16-busy.txt"
    fleet = FleetWatch()
    fleet.add(poll(0, kv_cache_memory_bytes=4_000_000, kv_cache_dtype="auto"))
    fleet.add(replace(server_metrics(text.read_text(), 1.0), replica=1, model="m"))
    lines = [text for text, _ in fleet_lines(fleet, started(), URLS)]
    assert lines[2] == "2 127.0.0.1:8102 · 3,840 = 60 x 64 tokens · kvtui 30 x 2 engines: agree"
    assert lines[3].endswith("· prefix caching off")


OLDER_VLLM = """# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 1.0
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 200.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 50.0
"""
"""An older vLLM's names (before 0.32: `gpu_cache_usage_perc`, `gpu_prefix_cache_*`), no
cache_config_info."""


def test_a_fleet_of_mixed_versions_reads_each_replica_under_its_own_names():
    """Replicas of different releases behind one router: vLLM 0.32 (a real text), an older vLLM,
    and SGLang 0.5.23 (its collectors' text). Each row reads its own names; the totals weigh
    only the replicas whose capacity is known, and say so by their count."""
    from pathlib import Path

    from kvtui.engines.vllm.metrics import server_metrics

    data = Path(__file__).parents[1] / "engines" / "data"
    urls = parse_urls("http://127.0.0.1:8101,http://127.0.0.1:8102,http://127.0.0.1:30000")
    texts = [
        (data / "vllm-0.32-busy.txt").read_text(),
        OLDER_VLLM,
        (data / "sglang-0.5.23-busy.txt").read_text(),
    ]
    fleet = FleetWatch()
    for replica, text in enumerate(texts):
        fleet.add(replace(server_metrics(text, 1.0), replica=replica, model="m"))
    newest, older, sglang = (watch.latest for watch in fleet.replicas)
    assert newest.kv_blocks == 40 and newest.kv_usage is not None
    assert older.kv_usage == 0.5 and older.kv_blocks is None and older.requests_running == 3
    assert sglang.kv_capacity_tokens and sglang.kv_usage is not None
    lines = [text for text, _ in fleet_lines(fleet, started(), urls)]
    assert lines[2].startswith("2 127.0.0.1:8102 · capacity not reported")
    assert lines[3].startswith("  KV 50% (peak 50%) · 3 run, 1 wait")
    assert lines[4].startswith("3 127.0.0.1:30000 · ")
    assert lines[6].startswith("Sum of 3/3 answering: ")
