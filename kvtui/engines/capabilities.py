"""What each kind of engine can do, in one table: the app, the reports and the tests ask these,
never an engine's name.

Before a run, its parsed name answers (`kvtui.engines.factory.EngineSpec.can`, from `CAPABILITIES`);
once it runs, its `RunStarted.can` does: a replay's says what the recorded run could do (measured
or modelled, served or not, with attention or without) and that it is a replay
(`Capabilities.replayed`). A record written before starts said this gets it from its engine's
name as it replays (`kvtui.engines.factory.recorded_start`). Imports nothing of kvtui's, so that
every engine, the protocol and the factory can.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

EngineKind = Literal["tiny", "shape", "sim", "replay", "hf", "vllm"]


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do. Every field is stated: a record's `can` without one is refused."""

    torch: bool
    """Runs torch in its own process (tiny, shape:, hf:): a spare child that imported torch ahead
    speeds its start, and kvtui.testing, which never imports torch, cannot run it."""
    own_cache: bool
    """kvtui's own engine (tiny, shape:, sim:): it keeps the cached loop's keys and values in
    kvtui's paged KV pool, as kvtui lays them out, so `--batch`, `--kv-budget` and the cache
    layouts (kvtui.sim.tricks) apply, and the tricks table and screen 4's race run on it."""
    attention: bool
    """Sends the newest query's attention on some steps (kvtui.engines.attention)."""
    modelled: bool
    """Its figures are the roofline's arithmetic (sim:), not measured."""
    served: bool
    """It watches a server someone else runs (vllm:): the cache is the server's, so the run has
    its cached loop only, and the figures beside kvtui's clock are the server's."""
    replay: bool
    """It plays a recorded run back: what ran was recorded, so nothing of the run can be asked
    anew (lesson mode, the batch, the tricks)."""

    def replayed(self) -> Capabilities:
        """What a replay of a run its engine could do this with can do: the recorded run's
        figures (measured or modelled, served or not, its attention), played back."""
        return replace(self, torch=False, own_cache=False, replay=True)


KVTUI_TORCH = Capabilities(
    torch=True, own_cache=True, attention=True, modelled=False, served=False, replay=False
)
"""kvtui's own decoder on torch: the shipped model (`tiny`) or a catalog shape (`shape:`)."""
ROOFLINE = Capabilities(
    torch=False, own_cache=True, attention=False, modelled=True, served=False, replay=False
)
"""The roofline engine (`sim:`): kvtui's pool and layouts, on paper."""
TRANSFORMERS = Capabilities(
    torch=True, own_cache=False, attention=False, modelled=False, served=False, replay=False
)
"""A local transformers model (`hf:`): measured, with transformers' own cache."""
SERVED = Capabilities(
    torch=False, own_cache=False, attention=False, modelled=False, served=True, replay=False
)
"""A vLLM server, watched (`vllm:`)."""
NOTHING = Capabilities(
    torch=False, own_cache=False, attention=False, modelled=False, served=False, replay=False
)
"""An engine that can do none of these: a name that does not parse."""
REPLAY = NOTHING.replayed()
"""A record, before it is read (`replay:`): its start says what the recorded run could do."""

CAPABILITIES: dict[EngineKind, Capabilities] = {
    "tiny": KVTUI_TORCH,
    "shape": KVTUI_TORCH,
    "sim": ROOFLINE,
    "replay": REPLAY,
    "hf": TRANSFORMERS,
    "vllm": SERVED,
}
"""Each kind of engine's capabilities: the one table."""


def _written(kind: EngineKind) -> str:
    """A kind as a name begins with it: `tiny` alone, the others before their argument."""
    return kind if kind == "tiny" else f"{kind}:"


OWN_ENGINES = (
    "kvtui's own engines ("
    + ", ".join(_written(kind) for kind, can in CAPABILITIES.items() if can.own_cache)
    + ")"
)
"""The engines that keep kvtui's own cache, in words: "kvtui's own engines (tiny, shape:, sim:)"."""
