"""Screen-test fixtures: synthetic runs from kvtui.sim's formulas, and `FakeEngine`, a
`kvtui.testing.ScriptedEngine` that plays them and remembers every instance."""

from __future__ import annotations

from dataclasses import replace

from kvtui.engines.drive import run_events
from kvtui.engines.protocol import Event, RunSettings, RunStarted, StepSample
from kvtui.engines.roofline import MODELLED
from kvtui.sim.catalog import get_gpu, get_model
from kvtui.sim.memory import kv_bytes_per_token, weights_bytes
from kvtui.sim.pool import kv_capacity
from kvtui.sim.work import (
    cached_step_positions,
    decode_step_bytes,
    decode_step_flops,
    naive_step_positions,
    uncached_step_flops,
)
from kvtui.testing import ScriptedEngine

WORDS = [
    "It",
    "was",
    "the",
    "best",
    "of",
    "times",
    ",",
    "it",
    "was",
    "the",
    "worst",
    "of",
    "times",
    ",",
    "it",
    "was",
    "the",
    "age",
    "of",
    "wisdom",
]


PROMPT_TOKENS = 9
"""The fake run's prompt, in tokens (1 in lesson mode)."""


class _Steps:
    """Per-loop step lists as a StepSource, so that `run_events` orders them as a real run."""

    def __init__(self, started: RunStarted, steps: dict[str, list[StepSample]]) -> None:
        self._started, self._steps = started, steps

    def started(self) -> RunStarted:
        return self._started

    def steps(self, loop):
        yield from self._steps[loop]

    def close(self) -> None:
        pass


def sim_events(
    settings: RunSettings, model: str = "llama-3.1-8b", gpu: str = "h100"
) -> list[Event]:
    """A deterministic run of both loops, timed by a made-up but fixed rule, in the order the
    engine's fair schedule gives them (the cached loop's short steps race ahead).

    Its device is a `sim:` one and its step times are arithmetic, not a clock, so it says what
    the `sim:` engine says: timing modelled, no threads. `measured_events` is the same run as a
    measured engine reports it."""
    spec, card = get_model(model), get_gpu(gpu)
    prompt = 1 if settings.lesson else PROMPT_TOKENS
    per_token = kv_bytes_per_token(spec, "bf16")
    started = RunStarted(
        engine=settings.engine,
        model=model,
        device=f"sim: {gpu}",
        dtype="bf16",
        layers=spec.layers,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        kv_bytes_per_token=per_token,
        weights_bytes=weights_bytes(spec, "bf16"),
        prompt_tokens=prompt,
        tokens=settings.tokens,
        timing=MODELLED,
        threads=0,
        peak_bandwidth_bytes_per_s=card.bandwidth_bytes_per_s,
        device_memory_total_bytes=card.memory_bytes,
        prompt_text=" ".join(WORDS[:prompt]),
        kv_capacity_bytes=kv_capacity(spec, card, 1).kv_bytes_available_per_gpu,
        kv_block_tokens=16,
        kv_pool_source="modelled",
        ridge_flops_per_byte=card.ridge_flops_per_byte,
        ridge_source=f"the catalog's {card.display_name}",
        modelled_gpu=card.name,
    )
    steps: dict[str, list[StepSample]] = {loop: [] for loop in settings.loops}
    for step in range(settings.tokens):
        position = prompt + step
        text = " " + WORDS[(prompt + step) % len(WORDS)]
        for loop in settings.loops:
            cached = loop == "cached"
            t = step + 1
            computed = (
                cached_step_positions(t, prompt) if cached else naive_step_positions(t, prompt)
            )
            bytes_read = decode_step_bytes(spec, position + 1)
            flops = (
                decode_step_flops(spec, position + 1)
                if cached
                else uncached_step_flops(spec, position + 1)
            )
            # a cached step reads at 80% of the card's peak; an uncached one grows with position
            seconds = (
                bytes_read / (0.8 * card.bandwidth_bytes_per_s) + 0.00001 * position
                if cached
                else 0.004 + 0.0009 * position
            )
            steps[loop].append(
                StepSample(
                    loop=loop,
                    step=step,
                    position=position,
                    token_id=(prompt + step) % len(WORDS),
                    text=text,
                    positions_computed=computed,
                    flops=flops,
                    bytes_read=bytes_read,
                    step_seconds=seconds,
                    kv_bytes=per_token * position if cached else 0,  # positions 0..position-1
                    kv_bytes_allocated=-(-position // 16) * 16 * per_token if cached else 0,
                )
            )
    return list(run_events(_Steps(started, steps), settings))


def measured_events(settings: RunSettings) -> list[Event]:
    """`sim_events` as a measured engine on a CPU reports its run: timing measured, the device
    `cpu`, one thread. For the screens' measured path (wall-time labels and explanations)."""
    return [
        replace(e, timing="measured", device="cpu", threads=1, modelled_gpu="")
        if isinstance(e, RunStarted)
        else e
        for e in sim_events(settings)
    ]


class FakeEngine(ScriptedEngine):
    """`kvtui.testing.ScriptedEngine` over `sim_events` of its settings (`measured_events` with
    `measured`), or over `events`; every one made is kept in `FakeEngine.instances` (cleared
    before each screen test), so a test can reach the engine the app started."""

    instances: list[FakeEngine] = []

    def __init__(
        self,
        settings: RunSettings,
        events: list[Event] | None = None,
        hold_at: int | None = None,
        fail_start: Exception | None = None,
        measured: bool = False,
    ) -> None:
        if events is None:
            events = measured_events(settings) if measured else sim_events(settings)
        super().__init__(events, settings=settings, hold_at=hold_at, fail_start=fail_start)
        FakeEngine.instances.append(self)
