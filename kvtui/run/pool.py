"""The running engine's KV pool as the screens see it: its room, and the cached loop's share of
it after its last step, in the one vocabulary of the pool (tokens, positions, rows, slots,
blocks)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtui.sim.pool import KVPool
from kvtui.sim.tricks import KVLayout, tokens_before_full


@dataclass(frozen=True)
class LivePool:
    """The running engine's KV pool, and the cached loop's share of it after its last step."""

    pool: KVPool
    source: str
    """Where its capacity came from, in words."""
    prompt_tokens: int
    run_tokens: int
    batch: int
    """Sequences decoded together, each with its own blocks."""
    allocated_bytes: int
    """Whole blocks taken (measured: the engine's own count of its tensors' blocks)."""
    filled_bytes: int
    """Keys and values of the positions written."""
    steps: int
    full: str = ""
    """The engine's message if the pool ran out (the run stopped there), else empty."""
    freed: bool = False
    """The cached loop has ended and handed its blocks back (the figures are its last)."""

    layout: KVLayout = KVLayout()
    """How the cached loop keeps its cache (kvtui.sim.tricks): where it stops depends on it."""
    model_dtype: str = ""
    """The dtype the model computes in (the run's `RunStarted.dtype`): an `auto` cache's."""

    # The one vocabulary of the pool, every screen's: *tokens* are what the run generated
    # (`steps`, `run_tokens`); *positions* are the sequence's, prompt + tokens; *rows* are the
    # positions whose keys and values the cache holds, P + t - 1 after t tokens (the newest
    # token's row is written by the step after it); *slots* and *blocks* are the pool's room.

    @property
    def blocks(self) -> int:
        return self.allocated_bytes // self.pool.block_bytes

    @property
    def rows(self) -> int:
        """Rows the cache holds now, per sequence (measured: the bytes its tensors hold)."""
        return self.filled_bytes // (self.pool.kv_bytes_per_token * self.batch)

    filled_tokens = rows  # the name it had: rows cached per sequence

    @property
    def run_rows(self) -> int:
        """Rows the whole run caches per sequence if nothing stops it: P + T - 1 (a plain
        layout's; a window keeps fewer)."""
        return self.prompt_tokens + self.run_tokens - 1

    @property
    def tail_bytes(self) -> int:
        """Allocated but not yet filled: the last block's unused slots."""
        return self.allocated_bytes - self.filled_bytes

    @property
    def free_bytes(self) -> int:
        """The free pool: whole blocks not taken."""
        return (self.pool.blocks * self.pool.block_bytes) - self.allocated_bytes

    @property
    def spare_bytes(self) -> int:
        """The budget's bytes past its last whole block: too few for a block, never used."""
        return self.pool.capacity_bytes - self.pool.blocks * self.pool.block_bytes

    @property
    def cache_dtype(self) -> str:
        """What the cache keeps each key and value in: the layout's (int8, fp8) or, for `auto`,
        the model's dtype, in the catalog's name where it has one."""
        try:
            return self.layout.storage_dtype(self.model_dtype)
        except ValueError:  # a dtype the catalog does not name (a record's, say): as it is
            return self.model_dtype

    @property
    def tokens_before_full(self) -> int | None:
        """Tokens the cached loop generates on this pool before it is full (predicted), in its
        layout; None if it never fills (a window whose blocks it holds)."""
        return tokens_before_full(self.pool, self.layout, self.prompt_tokens, self.batch)

    @property
    def stops_at(self) -> int | None:
        """The token the cached loop stops at on this pool (predicted), None if the run fits."""
        room = self.tokens_before_full
        return room if room is not None and room < self.run_tokens else None
