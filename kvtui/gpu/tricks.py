"""The tricks that stretch the KV cache, in torch, without a UI: the paged cache's other layouts.

`LayoutKVCache` keeps a run's keys and values in blocks from a pool, as `PagedKVCache`
(kvtui.gpu.cache) does, in one of the layouts of kvtui.sim.tricks.KVLayout, which also holds their
formulas:

- **a smaller element** (`cache_dtype` fp8 or int8): the blocks hold codes, written by `update`
  and dequantized as attention reads them. fp8 is `torch.float8_e4m3fn` with vLLM's default scale
  of 1.0 per tensor (values past +-448 saturate); int8 is symmetric with one fp16 scale per token
  and head, absmax / 127 rounded up, so no code clips (llama.cpp's q8_0 for a head of 32). The
  scales sit in tensors beside the codes and count in `bytes_per_position`, measured from them;
- **a window with sinks** (`window` W, `sinks` S; StreamingLLM): each sequence keeps its first S
  positions and its last W - S. A block none of whose positions is kept goes back to the pool
  before the step takes any (as vLLM's sliding-window manager frees skipped blocks), so a long run
  holds at most `window_blocks_most` blocks. Keys are stored as projected, not rotated, and
  rotated by their index in the cache as they are read, the new query by its own index
  (StreamingLLM, section 3.2: "positions within the cache rather than those in the original
  text"), so RoPE never runs past its table and a run can go past the model's positions;
- **shared prefixes** (`prefix_caching`): `plan_prefix` hashes each full block of each prompt with
  its parent's hash (vLLM's scheme), and a block already held is shared (a reference count per
  block) rather than computed again; the last prompt token is never shared (its logits are
  needed), so a sequence's partial last block is its own and computed. `prefill_shared` then
  runs the prompt's rest, row groups by where their sharing ends. A block that more than one
  sequence holds and one of them writes into is copied first (copy-on-write: `fork`, vLLM v0's
  parallel sampling, makes such a block).

Fewer key/value heads is a change of the model, not of its cache: `average_kv_heads`.

Every layout reads its positions by slot (no contiguous view), so a layout costs a gather and
(with codes) a dequantization per layer per step: what it costs in speed is measured
(`benchmarks/tricks.py`), not assumed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from kvtui.gpu.cache import BlockPool
from kvtui.gpu.model import Transformer, apply_rope
from kvtui.sim.tricks import KVLayout, window_blocks_most

FP8_MAX = 448.0
"""The largest float8_e4m3fn: vLLM clamps to it before the cast."""
INT8_MAX = 127
INT8_SCALE_MARGIN = 1 + 2**-10
"""absmax / 127 times this before rounding the scale to fp16 (relative error at most 2^-11):
the stored scale is never below absmax / 127, so no code clips."""
INT8_SMALLEST_SCALE = 2**-14
"""fp16's smallest normal: the scale of an all-zero (or near-zero) vector."""
SCALE_DTYPE = torch.float16
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
"""The value of each of the 256 fp8 (e4m3fn) codes, by its byte."""


class Codec:
    """How a layout stores a layer's keys or values: as they are (`auto`), fp8 or int8 codes."""

    def __init__(self, cache_dtype: str, dtype: torch.dtype) -> None:
        self.cache_dtype, self.dtype = cache_dtype, dtype
        self.code_dtype = {"fp8": torch.uint8, "int8": torch.int8}.get(cache_dtype, dtype)
        """The storage's dtype: fp8 codes are kept as their bytes (`index_copy_` has no fp8 on a
        CPU)."""
        self.scaled = cache_dtype == "int8"
        self._fp8_values = FP8_VALUES.to(dtype)

    def to(self, device: torch.device | str) -> Codec:
        self._fp8_values = self._fp8_values.to(device)
        return self

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Codes of `x` `(..., head_dim)`, and its scales `(..., 1)` (int8) or None."""
        if self.cache_dtype == "fp8":
            codes = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return codes.view(torch.uint8), None
        if self.cache_dtype == "int8":
            amax = x.abs().amax(dim=-1, keepdim=True).float()
            scale = (amax / INT8_MAX * INT8_SCALE_MARGIN).clamp_min(INT8_SMALLEST_SCALE)
            scale = scale.to(SCALE_DTYPE)
            codes = (x.float() / scale.float()).round().clamp(-INT8_MAX, INT8_MAX)
            return codes.to(torch.int8), scale
        return x, None

    def decode(self, codes: Tensor, scales: Tensor | None) -> Tensor:
        """The values `codes` (and `scales`) stand for, in the model's dtype."""
        if self.cache_dtype == "fp8":  # each byte's value looked up: the same numbers as
            # `.view(torch.float8_e4m3fn).to(dtype)`, 2.3x faster on a CPU (no fp8 unit there)
            return torch.take(self._fp8_values, codes.long())
        if scales is not None:
            return codes.to(self.dtype) * scales.to(self.dtype)
        return codes


class LayoutKVCache:
    """Every layer's keys and values in blocks from a pool, in a `KVLayout` (see the module).

    Each sequence has a block table: logical block j (positions j x block_tokens onwards) is
    physical block `table[j]`, or -1 once a window let it go. `reserve` prepares a step for the
    sequences in `rows` (all of them, unless a shared prefill is running a group): frees what the
    window no longer keeps, copies shared blocks the step writes into, takes new blocks (or raises
    `KVCacheFull` having taken none), and addresses the step's writes and its reads, the kept
    positions in order. `length` is the positions each sequence has written so far."""

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_kv_head: int,
        head_dim: int,
        *,
        block_tokens: int,
        n_blocks: int,
        layout: KVLayout,
        rotations: Tensor,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        problem = layout.problem(n_kv_head)
        if problem:
            raise ValueError(problem)
        if layout.window is not None and layout.window > rotations.shape[0]:
            raise ValueError(
                f"a window of {layout.window:,} is past the model's {rotations.shape[0]:,} "
                "rotary positions"
            )
        self.layout, self.batch, self.block_tokens = layout, batch, block_tokens
        self.codec = Codec(layout.cache_dtype, dtype).to(device)
        self.rotations = rotations
        """The model's RoPE table as complex numbers `(positions, 1, head_dim // 2)`."""
        self.keys_rotated_on_read = layout.window is not None
        slots = n_blocks * block_tokens
        shape = (1, n_kv_head, slots, head_dim)
        self._layers: list[LayoutLayer] = []
        for _ in range(n_layer):
            k = torch.empty(shape, dtype=self.codec.code_dtype, device=device)
            scales = None
            if self.codec.scaled:
                scales = torch.empty((*shape[:3], 1), dtype=SCALE_DTYPE, device=device)
            self._layers.append(
                LayoutLayer(
                    self,
                    k,
                    torch.empty_like(k),
                    scales,
                    None if scales is None else torch.empty_like(scales),
                )
            )
        self.pool = BlockPool(n_blocks)
        self.refs = [0] * n_blocks
        """Sequences holding each block."""
        self.filled = [0] * n_blocks
        """Positions written into each block."""
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.rows: list[int] = list(range(batch))
        """The sequences the next `reserve` (and model call) is for."""
        self.length = 0
        held = sum(t.numel() * t.element_size() for layer in self._layers for t in layer.tensors())
        self.bytes_per_position = held // slots if slots else 0
        """Keys and values of one position of one sequence, every layer, codes and scales:
        measured, the storage's bytes over its slots."""
        self.block_bytes = block_tokens * self.bytes_per_position
        self._by_hash: dict[bytes, int] = {}
        """Full blocks of prompt tokens by their hash (prefix caching)."""
        self._hash_of: dict[int, bytes] = {}
        self._logical: dict[int, int] = {}
        """The logical index of each block more than one sequence holds."""
        self.prefix_plan: list[tuple[list[int], int]] | None = None
        """The groups of a shared prefill, once planned: (rows, first position computed)."""
        self.prefill_positions = 0
        """Positions the shared prefill computes, every sequence's (the plan's, a count the
        model's own observes)."""
        self._read_n = 0
        self.write_slots = self.read_slots = torch.zeros(0, dtype=torch.long, device=device)
        self._slots = torch.zeros((batch, 0), dtype=torch.long, device=device)
        """Slot of each position of each sequence, set as blocks are assigned (grown as the
        sequences grow: a window's run may go on past any length)."""
        self._first_rolling = [0] * batch
        """Per sequence, the first logical block after the sinks' that the window has not yet
        let go (it lets them go in order)."""

    @property
    def layers(self) -> Sequence[LayoutLayer]:
        return self._layers

    # --- positions and blocks ----------------------------------------------------------------

    def kept(self, end: int) -> Tensor:
        """The positions a sequence of `end` positions keeps, in order: the sinks, then the last
        `window - sinks` (every one without a window)."""
        w = self.layout.window
        if w is None or end <= w:
            return torch.arange(end)
        sinks = self.layout.sinks
        return torch.cat((torch.arange(sinks), torch.arange(end - (w - sinks), end)))

    def _assign(self, row: int, j: int, block: int) -> None:
        """Logical block j of sequence `row` is `block` (appended, or replacing a copy)."""
        table, bt = self.tables[row], self.block_tokens
        if j == len(table):
            table.append(block)
        else:
            table[j] = block
        if self._slots.shape[1] < (j + 1) * bt:  # grow the slot table, doubling
            grown = torch.zeros(
                (self.batch, max(2 * self._slots.shape[1], (j + 1) * bt)),
                dtype=torch.long,
                device=self._slots.device,
            )
            grown[:, : self._slots.shape[1]] = self._slots
            self._slots = grown
        first = block * bt
        self._slots[row, j * bt : (j + 1) * bt] = torch.arange(
            first, first + bt, device=self._slots.device
        )

    def _let_go(self, row: int, end: int) -> None:
        """Give back the blocks of sequence `row` that hold no position a window keeps once
        `end` positions are written: rolling blocks wholly before the window, in order."""
        w, bt, sinks = self.layout.window, self.block_tokens, self.layout.sinks
        if w is None:
            return
        table = self.tables[row]
        j = max(self._first_rolling[row], -(-sinks // bt))
        while j < len(table) and (j + 1) * bt <= end - (w - sinks):
            if table[j] >= 0:
                self._release(table[j])
                table[j] = -1
            j += 1
        self._first_rolling[row] = j

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.pool.give_back([block])
            self._by_hash.pop(self._hash_of.pop(block, b""), None)
        if self.refs[block] <= 1:
            self._logical.pop(block, None)

    def rope_start(self, start: int, n: int) -> int:
        """The rotary index of the first new position: its place among the kept ones."""
        if self.layout.window is None:
            return start
        return min(start + n, self.layout.window) - n

    def reserve(self, start: int, n: int) -> None:
        """Make positions `start..start+n-1` of the sequences in `rows` writable (see the
        class), and address the step's writes and reads."""
        end, bt, rows = start + n, self.block_tokens, self.rows
        if self.layout.window is not None and n > 1 and end > self.layout.window:
            raise ValueError(
                f"{n} positions at once past a window of {self.layout.window}: a window's steps "
                "after the first are one position each"
            )
        for row in rows:  # what the window no longer keeps goes back first
            self._let_go(row, end)
        wanted = -(-end // bt)
        refs = list(self.refs)
        copies: list[tuple[int, int]] = []  # (row, logical block) appended to while shared
        new = 0
        for row in rows:
            table = self.tables[row]
            new += max(0, wanted - len(table))
            for j in range(start // bt, min(wanted, len(table))):
                block = table[j]
                # Appending to a block that holds positions another sequence reads: copy it first.
                # (A block's first writer fills what its sharers wait for; a step replayed for
                # its FLOPs rewrites what is there: neither appends.)
                appends = min(end - j * bt, bt) > self.filled[block] > 0 if block >= 0 else False
                if appends and refs[block] > 1:
                    refs[block] -= 1
                    copies.append((row, j))
        fresh = iter(self.pool.take(new + len(copies)))  # KVCacheFull: none taken
        for row, j in copies:  # copy-on-write
            old, block = self.tables[row][j], next(fresh)
            for layer in self._layers:
                layer.copy_block(old, block)
            self.refs[block], self.filled[block] = 1, self.filled[old]
            self._release(old)
            self._assign(row, j, block)
        for row in rows:
            table = self.tables[row]
            while len(table) < wanted:
                block = next(fresh)
                self.refs[block], self.filled[block] = 1, 0
                self._assign(row, len(table), block)
            for j in range(start // bt, wanted):
                if table[j] >= 0:
                    self.filled[table[j]] = max(self.filled[table[j]], min(end - j * bt, bt))
        self.length = max(self.length, end)
        slots = self._slots if len(rows) == self.batch else self._slots[rows]
        self.write_slots = slots[:, start:end].reshape(-1)
        w = self.layout.window
        if w is None or end <= w:
            self.read_slots, self._read_n = slots[:, :end].reshape(-1), end
        else:  # the sinks, then the latest w - sinks
            sinks = self.layout.sinks
            kept = (slots[:, :sinks], slots[:, end - (w - sinks) : end])
            self.read_slots, self._read_n = torch.cat(kept, dim=1).reshape(-1), w

    def fork(self, source: int, target: int) -> None:
        """Sequence `target` (holding nothing) shares every block of `source`, its partial last
        one too, as a forked sequence of parallel sampling does: the first write into a shared
        block copies it (`reserve`)."""
        if self.tables[target]:
            raise ValueError(f"sequence {target} already holds blocks")
        for j, block in enumerate(self.tables[source]):
            if block < 0:
                self.tables[target].append(block)
                continue
            self._assign(target, j, block)
            self.refs[block] += 1
            self._logical[block] = j

    # --- prefix caching ----------------------------------------------------------------------

    def plan_prefix(self, prompt: Tensor) -> list[tuple[list[int], int]]:
        """Share the full prompt blocks that an earlier sequence (or run) holds, take every
        other block the prompts need (`KVCacheFull` taking none), and return the groups of
        sequences to prefill, each with the first position it computes, in the order to run.

        A block is identified by the SHA-256 of its parent's hash and its tokens (vLLM's
        scheme), among the first (P - 1) // block_tokens of each prompt: the last prompt token
        is always computed, so the block holding it is never shared."""
        B, P = prompt.shape
        bt = self.block_tokens
        full, total = (P - 1) // bt, -(-P // bt)
        known = set(self._by_hash)
        plans: list[tuple[list[bytes], dict[int, bytes]]] = []
        for row in range(B):
            tokens = prompt[row].tolist()
            parent, hits, own = b"", list[bytes](), dict[int, bytes]()
            for j in range(full):
                digest = block_hash(parent, tokens[j * bt : (j + 1) * bt])
                parent = digest
                if len(hits) == j and digest in known:
                    hits.append(digest)
                else:
                    own[j] = digest
                    known.add(digest)
            plans.append((hits, own))
        fresh = iter(self.pool.take(sum(total - len(hits) for hits, _ in plans)))
        groups: dict[int, list[int]] = {}
        for row, (hits, own) in enumerate(plans):
            for j, digest in enumerate(hits):
                block = self._by_hash[digest]
                self.refs[block] += 1
                self._logical[block] = j
                self._assign(row, j, block)
            for j in range(len(hits), total):
                block = next(fresh)
                self.refs[block], self.filled[block] = 1, 0
                self._assign(row, j, block)
                if j in own:
                    self._by_hash[own[j]] = block
                    self._hash_of[block] = own[j]
            groups.setdefault(len(hits) * bt, []).append(row)
        self.prefix_plan = [(rows, start) for start, rows in sorted(groups.items())]
        self.prefill_positions = sum(len(rows) * (P - start) for rows, start in self.prefix_plan)
        return self.prefix_plan

    # --- what the cache holds ----------------------------------------------------------------

    @property
    def shared_positions(self) -> int:
        """Positions held once for more than one sequence, counted once for each extra holder."""
        bt, extra = self.block_tokens, 0
        for block, j in self._logical.items():
            extra += (self.refs[block] - 1) * max(0, min(bt, self.length - j * bt))
        return extra

    @property
    def positions_held(self) -> int:
        """Positions whose keys and values the cache holds, every sequence's, a shared block
        once: the window's kept ones, or every one written."""
        each = self.length if self.layout.window is None else min(self.length, self.layout.window)
        return self.batch * each - self.shared_positions

    @property
    def filled_bytes(self) -> int:
        return self.positions_held * self.bytes_per_position

    @property
    def allocated_bytes(self) -> int:
        return self.pool.taken * self.block_bytes

    def free(self) -> None:
        """Give every block back to the pool and forget the prompts' hashes."""
        for table in self.tables:
            for block in table:
                if block >= 0:
                    self._release(block)
            table.clear()
        self._by_hash.clear()
        self._hash_of.clear()
        self._logical.clear()
        self.rows = list(range(self.batch))
        self.length = 0
        self.prefix_plan = None
        self._first_rolling = [0] * self.batch


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """A block's identity: the SHA-256 of its parent's hash and its token ids (vLLM's
    `hash_block_tokens`, with sha256 as its `prefix_caching_hash_algo` allows)."""
    h = hashlib.sha256(parent)
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


class LayoutLayer:
    """One layer's keys and values in a `LayoutKVCache`: codes (and scales) written and read at
    the slots its `reserve` addressed."""

    def __init__(
        self,
        owner: LayoutKVCache,
        k: Tensor,
        v: Tensor,
        k_scales: Tensor | None,
        v_scales: Tensor | None,
    ) -> None:
        self.owner, self.k, self.v, self.k_scales, self.v_scales = owner, k, v, k_scales, v_scales

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.k, self.v, self.k_scales, self.v_scales) if t is not None]

    def copy_block(self, source: int, target: int) -> None:
        bt = self.owner.block_tokens
        for t in self.tensors():
            t.narrow(2, target * bt, bt).copy_(t.narrow(2, source * bt, bt))

    def _write(self, store: Tensor, x: Tensor) -> None:
        B, KV, T, last = x.shape
        store[0].index_copy_(1, self.owner.write_slots, x.transpose(0, 1).reshape(KV, B * T, last))

    def _read(self, store: Tensor, rows: int) -> Tensor:
        KV, last = store.shape[1], store.shape[3]
        picked = store[0].index_select(1, self.owner.read_slots)
        return picked.view(KV, rows, self.owner._read_n, last).transpose(0, 1)

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Encode and write `k`, `v` `(B, n_kv_head, T, head_dim)` (B: the `rows` of the step);
        return the kept positions' keys and values, decoded (and, in a window, the keys rotated
        by their index in the cache)."""
        codec = self.owner.codec
        k_codes, k_scales = codec.encode(k)
        v_codes, v_scales = codec.encode(v)
        self._write(self.k, k_codes)
        self._write(self.v, v_codes)
        if self.k_scales is not None and self.v_scales is not None:
            assert k_scales is not None and v_scales is not None  # int8 codes come with them
            self._write(self.k_scales, k_scales)
            self._write(self.v_scales, v_scales)
        return self.read(k.shape[0])

    def read(self, rows: int | None = None) -> tuple[Tensor, Tensor]:
        """The kept positions' keys and values as attention reads them, `(B, n_kv_head, kept,
        head_dim)`."""
        owner = self.owner
        rows = len(owner.rows) if rows is None else rows
        k_scales = None if self.k_scales is None else self._read(self.k_scales, rows)
        v_scales = None if self.v_scales is None else self._read(self.v_scales, rows)
        k = owner.codec.decode(self._read(self.k, rows), k_scales)
        v = owner.codec.decode(self._read(self.v, rows), v_scales)
        if owner.keys_rotated_on_read:  # each key by its index among the kept positions
            freqs = owner.rotations.narrow(0, 0, owner._read_n)
            k = apply_rope(k.transpose(1, 2), freqs).transpose(1, 2)
        return k, v


# --- a model decoding in a layout ------------------------------------------------------------


def setup_layout_caches(
    model: Transformer,
    batch: int,
    max_len: int,
    layout: KVLayout,
    *,
    block_tokens: int,
    pool_blocks: int | None = None,
) -> LayoutKVCache:
    """Give `model` a `LayoutKVCache` for `batch` sequences of up to `max_len` positions (past
    the model's own with a window), in blocks of `block_tokens` from a pool of `pool_blocks`
    (default, and at most: as many as the sequences can use)."""
    args = model.args
    if layout.window is None and max_len > args.max_positions:
        raise ValueError(f"{max_len} positions is past the model's {args.max_positions}")
    if layout.window is not None:
        usable = batch * window_blocks_most(layout.window, layout.sinks, block_tokens)
    else:
        usable = batch * -(-max_len // block_tokens)
    p = model.output.weight
    kv = LayoutKVCache(
        args.n_layer,
        batch,
        args.n_kv_head,
        args.head_dim,
        block_tokens=block_tokens,
        n_blocks=usable if pool_blocks is None else min(pool_blocks, usable),
        layout=layout,
        rotations=model.rotations(),
        dtype=p.dtype,
        device=p.device,
    )
    model.adopt_cache(kv)
    return kv


def prefill_shared(model: Transformer, prompt: Tensor) -> Tensor:
    """The prefill of prompts `(B, P)` with prefix caching: the plan of the cache's `plan_prefix`
    (made once: a replay of the step runs the same groups), each group of sequences computing its
    prompt from where its sharing ends. The last position's logits `(B, vocab)`."""
    kv = model.kv
    if not isinstance(kv, LayoutKVCache):
        raise RuntimeError("setup_layout_caches() first")
    plan = kv.prefix_plan if kv.prefix_plan is not None else kv.plan_prefix(prompt)
    B, P = prompt.shape
    logits: list[Tensor | None] = [None] * B
    for rows, start in plan:
        kv.rows = rows
        out = model(prompt[rows, start:], start=start, use_cache=True, last_only=True)
        for i, row in enumerate(rows):
            logits[row] = out[i, -1]
    kv.rows = list(range(B))
    return torch.stack([row for row in logits if row is not None])


@torch.no_grad()
def average_kv_heads(model: Transformer, kv_heads: int) -> Transformer:
    """A copy of `model` with `kv_heads` key/value heads, each the mean of a group of its own
    (the GQA paper's mean-pooling, without the uptraining): multi-query attention at 1. Ready to
    decode as the original was (`ready_to_decode`'s layout is not copied: call it again)."""
    args = model.args
    if kv_heads < 1 or args.n_kv_head % kv_heads or kv_heads > args.n_kv_head:
        raise ValueError(
            f"{args.n_kv_head} key/value heads do not average into {kv_heads} (it must divide them)"
        )
    new_args = replace(args, n_kv_head=kv_heads)
    p = model.output.weight
    smaller = Transformer(new_args, dtype=p.dtype, device=p.device)
    H, KV, hd = args.n_head, args.n_kv_head, args.head_dim

    def mean(rows: Tensor) -> Tensor:  # consecutive heads, as consecutive query heads share one
        return rows.view(kv_heads, KV // kv_heads, hd, -1).mean(dim=1).reshape(kv_heads * hd, -1)

    state = {}
    for key, value in model.state_dict().items():
        if key.endswith("attention.wqkv.weight"):  # (H + 2 KV) x head_dim rows
            q, k, v = value.contiguous().split((H * hd, KV * hd, KV * hd))
            value = torch.cat((q, mean(k), mean(v)))
        state[key] = value.contiguous()
    smaller.load_state_dict(state)
    return smaller.eval()
