"""A fleet of served replicas (`vllm:URL1,URL2,...`), folded once from their polls, without a UI:
one `ServerWatch` per replica (kvtui.run.serving reads each, capacity and prediction included),
the fleet's totals over the replicas that answer, and the skew between them in words when it
matters (one replica full or queueing while another idles).

Every figure is a server's own, as its `/metrics` said; the totals are kvtui's sums of them (the
fleet's KV usage weights each replica's usage by its token slots, so a small replica full does
not read as half the fleet full).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtui.engines.protocol import RunStarted, ServerMetrics
from kvtui.engines.vllm.fleet import MAX_REPLICAS
from kvtui.format import format_percent
from kvtui.run.serving import CapacityCheck, ServerWatch

FULL_USAGE = 0.9
"""A replica's KV usage from which it counts as full in the skew's words."""
IDLE_USAGE = 0.1
"""A replica's KV usage under which, with no request waiting, it counts as idle."""
SKEW_GAP = 0.5
"""The gap in usage between two replicas that is said even when neither is full nor idle."""


@dataclass(frozen=True)
class FleetTotals:
    """The fleet's figures summed over the replicas whose newest poll answered."""

    answering: int
    replicas: int
    capacity_tokens: int | None
    """Token slots of the answering replicas' KV caches (None: one of them did not say)."""
    usage: float | None
    """Their KV usage, weighted by their token slots (None without slots or usage)."""
    running: int
    waiting: int
    preemptions_seen: int
    prefix_queries_seen: int
    prefix_hits_seen: int


@dataclass
class FleetWatch:
    """The polls of every replica, folded (`add`): replica 0 is the one the decode runs on."""

    replicas: list[ServerWatch] = field(default_factory=lambda: [ServerWatch()])

    def add(self, poll: ServerMetrics) -> None:
        """Fold a poll into its replica's watch; a replica past MAX_REPLICAS (a record that
        says so) is not kept."""
        if not 0 <= poll.replica < MAX_REPLICAS:
            return
        while len(self.replicas) <= poll.replica:
            self.replicas.append(ServerWatch())
        self.replicas[poll.replica].add(poll)

    def snapshot(self) -> FleetWatch:
        return FleetWatch([watch.snapshot() for watch in self.replicas])

    @property
    def decode(self) -> ServerWatch:
        """The replica the decode streams from (the first given)."""
        return self.replicas[0]

    @property
    def size(self) -> int:
        return len(self.replicas)

    def gone(self) -> list[int]:
        """The replicas whose newest poll got no figures (in the order given)."""
        return [i for i, w in enumerate(self.replicas) if w.error]

    def capacity(self, replica: int, started: RunStarted | None) -> CapacityCheck | str:
        """A replica's capacity beside kvtui's prediction (kvtui.run.serving), or why there is
        none: a replica that says it serves another model than the decode's is not predicted
        from the decode model's config.json."""
        watch = self.replicas[replica]
        m = watch.latest
        if m is not None and m.model and started is not None and m.model != started.model:
            return f"it serves {m.model!r}, not the model kvtui read ({started.model!r})"
        return watch.capacity(started)

    def totals(self) -> FleetTotals:
        answering = [w for w in self.replicas if w.answering]
        slots: list[int] = []
        used = 0.0
        for w in answering:
            m = w.latest
            assert m is not None  # answering
            if m.kv_capacity_tokens:
                slots.append(m.kv_capacity_tokens)
                used += (m.kv_usage or 0.0) * m.kv_capacity_tokens
        capacity = sum(slots) if len(slots) == len(answering) and slots else None
        usage = used / capacity if capacity else None

        def total(name: str) -> int:
            return sum(getattr(w.latest, name) or 0 for w in answering)

        def seen(name: str) -> int:
            return sum(getattr(w, name) or 0 for w in answering)

        return FleetTotals(
            answering=len(answering),
            replicas=len(self.replicas),
            capacity_tokens=capacity,
            usage=usage,
            running=total("requests_running"),
            waiting=total("requests_waiting"),
            preemptions_seen=seen("preemptions_seen"),
            prefix_queries_seen=seen("prefix_queries_seen"),
            prefix_hits_seen=seen("prefix_hits_seen"),
        )

    def skew(self, names: list[str]) -> str:
        """The imbalance between the answering replicas in words (`names[i]` names replica i),
        or "" when there is none worth saying: one full (or queueing) while another idles, or
        their usage SKEW_GAP apart."""
        live = [(i, w.latest) for i, w in enumerate(self.replicas) if w.answering]
        usage = [(i, m.kv_usage, m) for i, m in live if m is not None and m.kv_usage is not None]
        if len(usage) < 2:
            return ""
        high_i, high, high_m = max(usage, key=lambda u: u[1])
        low_i, low, low_m = min(usage, key=lambda u: u[1])
        busy = high >= FULL_USAGE or (high_m.requests_waiting or 0) > 0
        idle = low < IDLE_USAGE and not (low_m.requests_waiting or 0)
        if busy and idle and high_i != low_i:
            waiting = high_m.requests_waiting or 0
            state = "full" if high >= FULL_USAGE else f"queues {waiting:,}"
            queue = f", {waiting:,} waiting" if waiting and high >= FULL_USAGE else ""
            return (
                f"Skewed: {names[high_i]} {state} (KV {format_percent(high)}{queue}) while "
                f"{names[low_i]} idles (KV {format_percent(low)})."
            )
        if high - low >= SKEW_GAP:
            return (
                f"Uneven: {names[high_i]} at KV {format_percent(high)}, {names[low_i]} at "
                f"{format_percent(low)}."
            )
        return ""
