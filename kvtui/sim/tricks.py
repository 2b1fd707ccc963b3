"""The tricks that stretch a KV cache, as arithmetic, without a UI.

Four ways serving engines make the cache fit. kvtui's own engine runs each for real
(kvtui.gpu.tricks); these are their formulas, and the predictions a run is checked against:

- **a smaller element** (`--kv-cache-dtype`, vLLM's flag and meaning): fp8 codes (vLLM's e4m3, one
  scale per tensor) or int8 codes with an fp16 scale per token and head
  (kvtui.sim.memory.KV_SCALE_BYTES); `auto` keeps the model's own dtype;
- **a window with attention sinks** (`--kv-window W --kv-sinks S`; StreamingLLM, Xiao et al. 2023,
  arXiv:2309.17453): the first S positions and the last W - S are kept, a block with no kept
  position goes back to the pool, and positions are counted within the cache, so a run goes on past
  the model's positions with its memory flat;
- **shared prefixes** (`--enable-prefix-caching`, vLLM's name): a full block of prompt tokens that
  a sequence of the batch already holds is kept once, found by a hash of its tokens and its
  parent block's hash. Only full blocks are shared, and the last prompt token is always computed
  (a step needs its logits: vLLM v1's `max_cache_hit_length = num_tokens - 1`), so each later
  sequence shares floor((P - 1) / block) blocks and computes the rest of its prompt itself;
- **fewer key/value heads** (`--kv-heads N`): multi-query attention (N = 1; Shazeer 2019) made from
  a grouped-query model by averaging its key and value heads (the GQA paper's conversion, Ainslie
  et al. 2023, arXiv:2305.13245, without the uptraining it pays 5% of pre-training for); what
  multi-head attention would hold is a formula (`mha_spec`).

A trick changes the formulas only where it changes the work: a window bounds the positions
attention reads and the cache holds (a ModelSpec whose every layer slides, as Mistral's), sharing
removes the later sequences' shared prefill, fewer heads shrink the key and value projections. A
smaller element changes the bytes, not the FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvtui.format import format_bytes, format_int
from kvtui.sim.catalog import ModelSpec, normalize_dtype
from kvtui.sim.memory import check_count, kv_bytes, kv_bytes_per_token
from kvtui.sim.pool import KVPool
from kvtui.sim.work import (
    StepCost,
    decode_step_bytes,
    prefill_chunk_flops,
    step_cost,
    uncached_step_bytes,
    uncached_step_flops,
)

QUALITY_BYTES = 1024
"""Bytes of held-out text a trick's quality is measured on by default (`kvtui bench`,
`kvtui tricks`): enough for a window of 256 to slide, a few seconds on a CPU."""

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
"""`--kv-cache-dtype`: `auto` (the model's dtype), `fp8` (vLLM's choice) and `int8` (llama.cpp's
q8_0 cache, or LMDeploy's int8 KV; not a vLLM choice)."""


@dataclass(frozen=True)
class KVLayout:
    """How a run keeps its KV cache: the plain paged cache is `KVLayout()`."""

    cache_dtype: str = "auto"
    """`auto`, `fp8` or `int8` (KV_CACHE_DTYPES)."""
    window: int | None = None
    """Positions kept per sequence (sinks included); None keeps every one."""
    sinks: int = 0
    """The first positions kept whatever the window (StreamingLLM's attention sinks)."""
    prefix_caching: bool = False
    """Full blocks of the prompt that another sequence holds are shared (hash, refcount)."""
    kv_heads: int | None = None
    """Key/value heads after averaging the model's own (None: the model's)."""

    def problem(self, model_kv_heads: int | None = None) -> str | None:
        """Why this layout cannot run, in one line, or None."""
        if self.cache_dtype not in KV_CACHE_DTYPES:
            return f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}"
        if self.window is None and self.sinks:
            return "--kv-sinks keeps the first positions of a window: give --kv-window too"
        if self.window is not None:
            if self.window < 1 or self.sinks < 0:
                return "--kv-window must be at least 1 and --kv-sinks at least 0"
            if self.sinks >= self.window:
                return (
                    f"--kv-sinks {self.sinks} leaves no room in a --kv-window of {self.window}: "
                    "the window holds the sinks and at least the newest position"
                )
            if self.prefix_caching:
                return (
                    "--kv-window with --enable-prefix-caching is not modelled: a window frees "
                    "the blocks another sequence would share"
                )
        if self.kv_heads is not None:
            if self.kv_heads < 1:
                return "--kv-heads must be at least 1"
            if model_kv_heads is not None and (
                self.kv_heads > model_kv_heads or model_kv_heads % self.kv_heads
            ):
                return (
                    f"--kv-heads {self.kv_heads}: the model's {model_kv_heads} key/value heads "
                    "average into a number that divides them (1 is multi-query attention)"
                )
        return None

    @property
    def is_plain(self) -> bool:
        return self == KVLayout()

    @property
    def paged_as_is(self) -> bool:
        """Whether the plain paged cache keeps it: no smaller element, window or sharing (fewer
        heads is a change of the model, whose cache is then plain)."""
        return self.cache_dtype == "auto" and self.window is None and not self.prefix_caching

    def storage_dtype(self, model_dtype: str) -> str:
        """The catalog dtype the cache stores: the model's for `auto`."""
        return normalize_dtype(model_dtype) if self.cache_dtype == "auto" else self.cache_dtype

    def words(self) -> str:
        """The layout in a few words: "plain", "int8", "window 256 + 4 sinks", ..."""
        parts = []
        if self.kv_heads is not None:
            parts.append(f"{self.kv_heads} KV head{'s' if self.kv_heads > 1 else ''} (averaged)")
        if self.cache_dtype != "auto":
            parts.append(f"{self.cache_dtype} cache")
        if self.window is not None:
            sinks = f" + {self.sinks} sink{'s' if self.sinks != 1 else ''}" if self.sinks else ""
            parts.append(f"window {format_int(self.window - self.sinks)}{sinks}")
        if self.prefix_caching:
            parts.append("prefix caching")
        return ", ".join(parts) or "plain"

    def to_json(self) -> dict[str, Any]:
        return {
            "kv_cache_dtype": self.cache_dtype,
            "kv_window": self.window,
            "kv_sinks": self.sinks,
            "enable_prefix_caching": self.prefix_caching,
            "kv_heads": self.kv_heads,
        }


# --- the shape a layout runs, and its bytes ------------------------------------------------------


def with_kv_heads(spec: ModelSpec, kv_heads: int) -> ModelSpec:
    """`spec` with `kv_heads` key/value heads: its key and value projections (and so its
    parameters) resized; everything else as it was."""
    check_count("kv_heads", kv_heads, minimum=1)
    if spec.is_mla:
        raise ValueError(f"{spec.label} caches an MLA latent, not key/value heads")
    delta = spec.layers * 2 * (kv_heads - spec.kv_heads) * spec.head_dim * spec.hidden_size
    return replace(
        spec,
        kv_heads=kv_heads,
        params=spec.params + delta,
        active_params=None if spec.active_params is None else spec.active_params + delta,
        matrix_params=None if spec.matrix_params is None else spec.matrix_params + delta,
    )


def mha_spec(spec: ModelSpec) -> ModelSpec:
    """The same model with multi-head attention: a key/value head per query head."""
    return with_kv_heads(spec, spec.heads)


def layout_spec(spec: ModelSpec, layout: KVLayout) -> ModelSpec:
    """The shape the formulas price a layout's cached loop as: its key/value heads, and a window
    in every layer (the positions its attention reads and its cache holds, sinks included)."""
    if layout.kv_heads is not None and layout.kv_heads != spec.kv_heads:
        spec = with_kv_heads(spec, layout.kv_heads)
    if layout.window is not None:
        window = min(layout.window, spec.sliding_window or layout.window)
        spec = replace(spec, sliding_window=window, sliding_layers=tuple(range(spec.layers)))
    return spec


def layout_bytes_per_token(spec: ModelSpec, layout: KVLayout, model_dtype: str) -> int:
    """KV bytes one more position adds to one sequence's cache in this layout, scales included
    (the formula `kv_bytes_per_token_formula` reports): the model's shape (with the layout's heads)
    in the layout's storage dtype."""
    return kv_bytes_per_token(layout_spec(spec, layout), layout.storage_dtype(model_dtype))


def shared_prefix_tokens(
    layout: KVLayout, prompt_tokens: int, block_tokens: int, batch: int
) -> int:
    """Prompt positions each sequence after the first shares rather than computes: whole blocks,
    the last prompt token never among them (0 without prefix caching or with one sequence)."""
    check_count("prompt_tokens", prompt_tokens, minimum=1)
    if not layout.prefix_caching or batch < 2:
        return 0
    return (prompt_tokens - 1) // block_tokens * block_tokens


def positions_held(layout: KVLayout, positions: int, batch: int = 1, shared_tokens: int = 0) -> int:
    """Positions whose keys and values the cache holds (every sequence's, a shared block once)
    after `positions` positions of each of `batch` sequences: the window's at most, or the shared
    prefix once."""
    check_count("positions", positions, minimum=0)
    if layout.window is not None:
        return batch * min(positions, layout.window)
    shared = min(shared_tokens, positions)
    return shared + batch * (positions - shared)


def window_blocks(positions: int, window: int, sinks: int, block_tokens: int) -> int:
    """Blocks one sequence holds after `positions` positions, keeping the first `sinks` and the
    last `window - sinks`: a block goes back to the pool once none of its positions is kept."""
    if positions <= 0:
        return 0
    sink_blocks = -(-min(sinks, positions) // block_tokens)
    first = max(sinks, positions - (window - sinks))  # the oldest rolling position kept
    last = positions - 1
    if first > last:
        return sink_blocks
    low, high = max(first // block_tokens, sink_blocks), last // block_tokens
    return sink_blocks + max(0, high - low + 1)


def window_blocks_most(window: int, sinks: int, block_tokens: int) -> int:
    """The most blocks a windowed sequence ever holds (a window straddles one block more than it
    fills, until it lines up)."""
    horizon = window + 2 * block_tokens
    return max(window_blocks(n, window, sinks, block_tokens) for n in range(1, horizon + 1))


def blocks_held(
    layout: KVLayout, positions: int, batch: int, block_tokens: int, shared_tokens: int = 0
) -> int:
    """Blocks `batch` sequences of `positions` positions hold in this layout: a window's, the
    shared prefix's once, or every sequence's own."""
    if positions <= 0:
        return 0
    if layout.window is not None:
        return batch * window_blocks(positions, layout.window, layout.sinks, block_tokens)
    each = -(-positions // block_tokens)
    shared = min(shared_tokens // block_tokens, each)
    return shared + batch * (each - shared)


def tokens_before_full(
    pool: KVPool, layout: KVLayout, prompt_tokens: int, batch: int = 1
) -> int | None:
    """Tokens the cached loop generates, after a prompt of `prompt_tokens`, before a step finds
    no block in this layout; None if it never does (a window whose blocks the pool holds).

    The step that emits token t holds P + t - 1 positions of each sequence (the prefill, t = 1,
    the prompt's P). Plain, and with a smaller element: C - P + 1 for C slots a sequence
    (`KVPool.tokens_before_full`, C from the layout's bytes per token). Shared prefixes: C =
    (h + (N - h) // B) x block for N blocks, h of them shared by the B sequences. A window:
    the first t whose positions need more blocks than the pool has (`window_blocks`)."""
    check_count("prompt_tokens", prompt_tokens, minimum=1)
    check_count("batch", batch, minimum=1)
    P, B, bt, N = prompt_tokens, batch, pool.block_tokens, pool.blocks
    if layout.window is not None:
        W, S = layout.window, layout.sinks
        for n in range(P, max(P, W) + 2 * bt + 2):
            if B * window_blocks(n, W, S, bt) > N:
                return n - P  # the step with n positions is token n - P + 1: it fails
        return None
    shared = shared_prefix_tokens(layout, P, bt, B)
    if shared:
        h = shared // bt
        slots = (h + (N - h) // B) * bt if h <= N else 0
        return max(0, slots - P + 1)
    return pool.tokens_before_full(P, B)


def full_message(pool: KVPool, layout: KVLayout, prompt_tokens: int, batch: int = 1) -> str:
    """What a run that stopped on this pool says, in one line."""
    if layout.window is None and not shared_prefix_tokens(
        layout, prompt_tokens, pool.block_tokens, batch
    ):
        return pool.full_message(prompt_tokens, batch)
    stop = tokens_before_full(pool, layout, prompt_tokens, batch)
    after = "" if stop is None else f" after token {format_int(stop)}"
    per = f" per sequence ({batch} decoded together)" if batch > 1 else ""
    head = (
        f"the KV cache cannot hold the prompt's {format_int(prompt_tokens)} tokens{per}"
        if stop == 0
        else f"the KV cache is full{after}{per}"
    )
    return (
        f"{head}: {format_bytes(pool.capacity_bytes)} holds "
        f"{format_int(pool.blocks)} blocks of {pool.block_tokens} rows of "
        f"{format_int(pool.kv_bytes_per_token)} bytes ({layout.words()})"
    )


def kv_bytes_held(
    spec: ModelSpec,
    layout: KVLayout,
    model_dtype: str,
    positions: int,
    batch: int = 1,
    shared_tokens: int = 0,
) -> int:
    """The formula's KV bytes for a layout after `positions` positions of `batch` sequences:
    the positions held (`positions_held`) at the layout's bytes per token."""
    held = positions_held(layout, positions, batch, shared_tokens)
    return held * layout_bytes_per_token(spec, layout, model_dtype)


def layout_step_cost(
    spec: ModelSpec,
    layout: KVLayout,
    cached: bool,
    step: int,
    prompt: int,
    batch: int = 1,
    weights_dtype: str = "bf16",
    block_tokens: int = 16,
    kv_dtype: str | None = None,
) -> StepCost:
    """kvtui.sim.work.step_cost for a layout: the cached loop priced as `layout_spec` (its heads,
    its window), its cache read in the layout's storage dtype (`auto`: `kv_dtype`, the weights'
    unless given: a server keeps fp8 weights' cache in bf16), and with shared prefixes a prefill
    in which the later sequences compute only what they do not share. The uncached loop keeps
    no cache: the model as it is (with the layout's heads, which change the model)."""
    if not cached:
        plain = KVLayout(kv_heads=layout.kv_heads)
        model_kv = normalize_dtype(kv_dtype or weights_dtype)  # its keys and values, recomputed
        return step_cost(
            layout_spec(spec, plain), False, step, prompt, batch, weights_dtype, model_kv
        )
    shape = layout_spec(spec, layout)
    kv_dtype = layout.storage_dtype(kv_dtype or weights_dtype)
    shared = shared_prefix_tokens(layout, prompt, block_tokens, batch)
    if step > 0 or not shared:
        return step_cost(shape, True, step, prompt, batch, weights_dtype, kv_dtype)
    rest = prompt - shared
    flops = uncached_step_flops(shape, prompt) + prefill_chunk_flops(shape, shared, rest, batch - 1)
    read = uncached_step_bytes(shape, prompt, weights_dtype, kv_dtype) + kv_bytes(
        shape, rest, batch - 1, kv_dtype
    )
    return StepCost(prompt + (batch - 1) * rest, flops, read)


def decode_bytes(spec: ModelSpec, layout: KVLayout, context: int, weights_dtype: str) -> int:
    """Bytes one cached step reads in a layout (the weights, and the cache it keeps)."""
    shape = layout_spec(spec, layout)
    return decode_step_bytes(shape, context, weights_dtype, layout.storage_dtype(weights_dtype))


# --- published figures to hold the measurements against ------------------------------------------


@dataclass(frozen=True)
class Reference:
    """A published figure about a trick, shown beside kvtui's measurements as a reference."""

    trick: str
    """Which: "fp8", "int8", "kivi", "window", "kv-heads"."""
    claim: str
    source: str
    short: str = ""
    """The claim in a line, with whose it is (screen 4)."""


PUBLISHED: tuple[Reference, ...] = (
    Reference(
        "fp8",
        "about 2x the tokens in the same memory (fp8 against a 16-bit cache); no latency gain "
        "without fused dequantization",
        "vLLM docs, Quantized KV Cache (docs.vllm.ai/en/v0.11.2/features/quantization/"
        "quantized_kvcache)",
        "vLLM: an fp8 cache holds about 2x the tokens of a 16-bit one",
    ),
    Reference(
        "int8",
        "perplexity 6.2322 -> 6.2346 with a q8_0 (8-bit) cache on a 7B model",
        "llama.cpp pull request #7412 (github.com/ggml-org/llama.cpp/pull/7412)",
        "llama.cpp: a q8_0 cache, perplexity 6.2322 -> 6.2346 on a 7B",
    ),
    Reference(
        "kivi",
        "2-bit keys (per channel) and values (per token): 2.6x less peak memory, weights included",
        "KIVI, Liu et al. 2024, arXiv:2402.02750 (not run here)",
        "KIVI: a 2-bit cache, 2.6x less peak memory",
    ),
    Reference(
        "window",
        "4 sinks + 1,020 window: perplexity 5.40, against 5,158 for a 1,024 window alone "
        "(Llama-2-13B, 65K tokens of PG19)",
        "StreamingLLM, Xiao et al. 2023, arXiv:2309.17453, table 1",
        "StreamingLLM: 4 sinks + 1,020 window, perplexity 5.40; the window alone 5,158",
    ),
    Reference(
        "kv-heads",
        "a multi-head checkpoint becomes grouped-query by mean-pooling its heads, then "
        "uptraining on 5% of the pre-training compute",
        "GQA, Ainslie et al. 2023, arXiv:2305.13245, section 2.1",
        "GQA paper: averaged heads need uptraining, 5% of pre-training",
    ),
)


def references(trick: str) -> list[Reference]:
    """The published figures about one trick."""
    return [r for r in PUBLISHED if r.trick == trick]
