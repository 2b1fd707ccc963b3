"""The paged KV cache, in torch, without a UI: blocks of token slots taken from a pool as a
sequence grows (vLLM's PagedAttention layout; kvtui.sim.pool.KVPool is its arithmetic), so that a
run can find the pool empty (`KVCacheFull`)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor


class KVCacheFull(Exception):
    """A step needed a block of the KV pool and none was left."""


class BlockPool:
    """Which blocks of a KV pool are free. Taken lowest first, so that the blocks one sequence
    takes from an empty pool are consecutive and its keys and values read as one view."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self._free = list(range(blocks))  # a heap: the lowest free block first
        self.taken = 0

    @property
    def free(self) -> int:
        return self.blocks - self.taken

    def take(self, n: int) -> list[int]:
        """`n` blocks, lowest first; `KVCacheFull`, taking none, when fewer are free."""
        if n > self.free:
            raise KVCacheFull(f"{n} blocks asked of a pool with {self.free} free")
        self.taken += n
        return [heapq.heappop(self._free) for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        for block in blocks:
            heapq.heappush(self._free, block)
        self.taken -= len(blocks)


class LayerCache(Protocol):
    """One layer's keys and values in a KV cache, as `Transformer.forward` uses them."""

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new positions' keys and values `(B, n_kv_head, T, head_dim)` from `start`;
        return every position's the step attends to."""
        ...

    def read(self) -> tuple[Tensor, Tensor]: ...


class KVCache(Protocol):
    """What `Transformer.forward` needs of a KV cache: the plain `PagedKVCache`, or one of
    kvtui.gpu.tricks' layouts (a smaller element, a window, shared prefixes)."""

    @property
    def layers(self) -> Sequence[LayerCache]: ...

    pool: BlockPool
    bytes_per_position: int
    block_bytes: int
    keys_rotated_on_read: bool
    """Whether the layers' `update` rotates keys (RoPE) by their index in the cache as it reads
    them, so that `forward` hands them over un-rotated (a window re-indexes positions)."""

    def reserve(self, start: int, n: int) -> None: ...

    def rope_start(self, start: int, n: int) -> int:
        """The rotary index of the first of `n` new positions from `start`."""
        ...

    @property
    def filled_bytes(self) -> int: ...

    @property
    def allocated_bytes(self) -> int: ...

    def free(self) -> None: ...


class PagedKVCache:
    """Every layer's keys and values, in blocks of `block_tokens` token slots taken from a pool
    as positions are written: vLLM's PagedAttention layout (kvtui.sim.pool.KVPool), in torch.

    Each layer stores keys and values as `(1, n_kv_head, n_blocks x block_tokens, head_dim)`;
    block b is slots b x block_tokens onwards in every layer. Each sequence has a block table,
    the blocks it holds in order, and position p of it sits in slot
    `table[p // block_tokens] x block_tokens + p % block_tokens`. `reserve` takes the blocks a
    step's new positions need, for every sequence at once, before any layer runs: a step either
    has its slots or raises `KVCacheFull` having changed nothing.

    A sequence whose blocks are consecutive (one sequence in a fresh pool: `BlockPool` hands out
    the lowest first) reads its keys and values as one view of the storage, as a contiguous cache
    would; otherwise (a batch, or a table with gaps) they are gathered by slot. `length` is an
    integer that `reserve` advances: fullness is never inferred from the buffers.
    """

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_kv_head: int,
        head_dim: int,
        *,
        block_tokens: int,
        n_blocks: int,
        max_positions: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (1, n_kv_head, n_blocks * block_tokens, head_dim)
        self.layers: list[LayerKV] = []
        for _ in range(n_layer):
            k = torch.empty(shape, dtype=dtype, device=device)
            self.layers.append(LayerKV(self, k, torch.empty_like(k)))
        self.pool = BlockPool(n_blocks)
        self.batch, self.block_tokens = batch, block_tokens
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.length = 0
        slots = n_blocks * block_tokens
        held = sum(t.numel() * t.element_size() for kv in self.layers for t in (kv.k, kv.v))
        self.bytes_per_position = held // slots if slots else 0
        """Keys and values of one position of one sequence, every layer: measured, the storage's
        bytes over its slots (0 for a pool of no blocks, which never holds a position)."""
        self.block_bytes = block_tokens * self.bytes_per_position
        self.base: int | None = 0
        """The slot of position 0 when there is one sequence and its blocks are consecutive
        (its keys and values are then a view of the storage); None otherwise."""
        self._slots = torch.zeros((batch, max_positions), dtype=torch.long, device=device)
        """Slot of each position of each sequence, filled as blocks are taken."""
        self._consecutive = True
        self._held = 0
        """Blocks every sequence holds at least."""
        self.write_slots = self.read_slots = self._slots[0, :0]
        """The slots a step writes and reads, every sequence's in turn, where `base` is None."""

    keys_rotated_on_read = False
    """Keys arrive rotated by their positions, and are kept so."""

    def rope_start(self, start: int, n: int) -> int:
        """Positions are their own rotary indices."""
        return start

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the blocks taken: whole blocks, the last one's tail included."""
        return self.pool.taken * self.block_bytes

    @property
    def filled_bytes(self) -> int:
        """Bytes of the positions written so far (keys and values, every sequence)."""
        return self.length * self.batch * self.bytes_per_position

    def reserve(self, start: int, n: int) -> None:
        """Make positions `start..start+n-1` of every sequence writable: take the blocks they
        need (`KVCacheFull`, taking none, when the pool has too few), and address the step's
        writes and reads for the layers."""
        end, bt, limit = start + n, self.block_tokens, self._slots.shape[1]
        if end > limit:
            raise ValueError(f"position {end} is past the cache's {limit}")
        wanted = -(-end // bt)
        short = sum(max(0, wanted - len(t)) for t in self.tables) if wanted > self._held else 0
        new = iter(self.pool.take(short))
        for row, table in enumerate(self.tables):
            while len(table) < wanted:
                block, first = next(new), len(table) * bt
                if table and block != table[-1] + 1:
                    self._consecutive = False
                table.append(block)
                slots = torch.arange(block * bt, (block + 1) * bt, device=self._slots.device)
                self._slots[row, first : first + bt] = slots[: limit - first]
        self._held = min(len(t) for t in self.tables)
        self.length = max(self.length, end)
        if self.batch == 1 and self._consecutive:
            self.base = self.tables[0][0] * bt
        else:
            self.base = None
            self.write_slots = self._slots[:, start:end].reshape(-1)
            self.read_slots = self._slots[:, :end].reshape(-1)

    def free(self) -> None:
        """Give every block back to the pool."""
        for table in self.tables:
            self.pool.give_back(table)
            table.clear()
        self.length = self._held = 0
        self.base, self._consecutive = 0, True


class LayerKV:
    """One layer's keys and values in a `PagedKVCache`, written and read at the slots its
    `reserve` addressed for the step."""

    def __init__(self, owner: PagedKVCache, k: Tensor, v: Tensor) -> None:
        self.owner, self.k, self.v = owner, k, v

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write `k`, `v` `(B, n_kv_head, T, head_dim)` at the positions `reserve` made ready;
        return the keys and values of every position so far, `(B, n_kv_head, length, head_dim)`."""
        owner = self.owner
        base = owner.base
        if base is not None:  # one sequence, consecutive blocks: as a contiguous cache
            T = k.shape[2]
            self.k.narrow(2, base + start, T).copy_(k)
            self.v.narrow(2, base + start, T).copy_(v)
            return self.k.narrow(2, base, start + T), self.v.narrow(2, base, start + T)
        B, KV, T, hd = k.shape
        self.k[0].index_copy_(1, owner.write_slots, k.transpose(0, 1).reshape(KV, B * T, hd))
        self.v[0].index_copy_(1, owner.write_slots, v.transpose(0, 1).reshape(KV, B * T, hd))
        return self.read()

    def read(self) -> tuple[Tensor, Tensor]:
        """The keys and values of every position so far, `(B, n_kv_head, length, head_dim)`:
        a view where `base` is set, else gathered by slot."""
        owner = self.owner
        if owner.base is not None:
            base, length = owner.base, owner.length
            return self.k.narrow(2, base, length), self.v.narrow(2, base, length)
        B, S, KV, hd = owner.batch, owner.length, self.k.shape[1], self.k.shape[3]
        slots = owner.read_slots
        return (
            self.k[0].index_select(1, slots).view(KV, B, S, hd).transpose(0, 1),
            self.v[0].index_select(1, slots).view(KV, B, S, hd).transpose(0, 1),
        )
