"""What a served KV cache's figures mean under the settings the server runs with, without a UI:
the dtype its blocks were sized in, how its data-parallel engines share them, and whether the
model's own shape gives them exactly.

vLLM sizes each engine's cache as kvtui.sim.pool.KVPool does: floor(memory / (block tokens x
bytes a token)) blocks, where a token's bytes are the model's KV elements a token (2 x layers x KV
heads x head dim, from its config.json) times the bytes of the element it serves them in. What
/metrics says (`vllm:cache_config_info`, vLLM 0.32, vllm/v1/engine/core_client.py):

- `kv_cache_memory_bytes`: each engine's (and, under tensor or pipeline parallel, each GPU's);
- `num_gpu_blocks`: the blocks of all its data-parallel engines together, the same total on every
  engine's sample; `kv_cache_size_tokens`, `kv_cache_max_concurrency`: each engine's own;
- `cache_dtype`: "auto" (the dtype the model computes in: `--dtype`, not always config.json's) or
  the KV dtype it was told (`fp8`);
- nothing of `--tensor-parallel-size` or `--pipeline-parallel-size`: a GPU then holds a share of
  the KV heads or of the layers, so its token takes that share of the bytes.

So the served dtype is read back from the blocks: the element sizes vLLM serves KV in (4, 2 and
1 bytes; only the one it was told where `cache_dtype` names one) are tried, on one GPU and then
split over 2, 4 or 8, and every one that gives the reported blocks exactly is a fit. The check can
still fail: where none does, the arithmetic truly disagrees, and `Fit.reason` says with what.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

ELEMENT_BYTES = (4, 2, 1)
"""The bytes of a KV element vLLM serves in: float32, bfloat16 or float16, an 8-bit float."""
ELEMENT_NAMES = {4: "fp32", 2: "bf16", 1: "fp8"}
"""The catalog's name of an element of that many bytes (bf16 and fp16 take the same bytes: the
blocks cannot tell them apart, so `Fit.words` names both)."""
ELEMENT_WORDS = {4: "fp32", 2: "bf16 or fp16", 1: "fp8"}
SHARDS = (1, 2, 4, 8)
"""The GPUs one engine's cache may be split over (tensor or pipeline parallel), tried in turn."""


@dataclass(frozen=True)
class Fit:
    """One way the reported blocks come out exactly."""

    element_bytes: int
    shards: int
    """GPUs one engine's cache is split over (1: one GPU)."""
    bytes_per_token: int
    """A token's KV bytes on one GPU: elements x element bytes / shards."""

    @property
    def dtype(self) -> str:
        return ELEMENT_NAMES[self.element_bytes]

    def words(self) -> str:
        where = f" over {self.shards} GPUs" if self.shards > 1 else ""
        return f"{ELEMENT_WORDS[self.element_bytes]} ({self.element_bytes} B){where}"


@dataclass(frozen=True)
class ServedLayout:
    """The server's KV figures read with its settings (see the module's docstring)."""

    engines: int
    """Data-parallel engines, each with a cache of its own."""
    blocks_total: int
    """vLLM's num_gpu_blocks: every engine's together."""
    blocks_per_engine: int | None
    """None where the total does not divide among the engines."""
    block_tokens: int
    memory_bytes: int | None
    """Each engine's (each GPU's) KV memory; None where the server did not say."""
    elements_per_token: Fraction
    """The model's KV elements a token (config.json's shape)."""
    config_element_bytes: Fraction
    """The element kvtui predicted in (config.json's dtype, or the cache dtype the server said)."""
    fits: tuple[Fit, ...]
    """Every element size and split that gives the blocks exactly, the likeliest first."""
    told: bool = False
    """The server named its cache dtype (`fp8`): only its element was tried."""

    @property
    def served_bytes_per_token(self) -> Fraction | None:
        """The memory over the blocks one engine holds, a token: at least what a token takes
        (the blocks are floored, so a little memory is left over)."""
        if self.memory_bytes is None or not self.blocks_per_engine:
            return None
        return Fraction(self.memory_bytes, self.blocks_per_engine * self.block_tokens)

    @property
    def served_element_bytes(self) -> Fraction | None:
        per_token = self.served_bytes_per_token
        return None if per_token is None else per_token / self.elements_per_token

    @property
    def fit(self) -> Fit | None:
        return self.fits[0] if self.fits else None

    @property
    def differs(self) -> bool:
        """The blocks fit another element than the one predicted (a served dtype, a split)."""
        fit = self.fit
        return fit is not None and (
            fit.element_bytes != self.config_element_bytes or fit.shards != 1
        )

    def reason(self) -> str:
        """Why none fits, in words (empty where one does)."""
        if self.fits:
            return ""
        if self.blocks_per_engine is None:
            return (
                f"{self.blocks_total:,} blocks do not divide among {self.engines} data-parallel "
                "engines"
            )
        if self.memory_bytes is None:
            return "the server gives no KV memory figure to size blocks from"
        served = self.served_element_bytes
        tried = ", ".join(str(e) for e in self._elements())
        per_element = f"{float(served):.2f}" if served is not None else "?"
        return (
            f"{self.memory_bytes:,} B / ({self.blocks_per_engine:,} blocks x "
            f"{self.block_tokens} tokens x {float(self.elements_per_token):,.0f} elements a "
            f"token) is {per_element} B an element: none of {tried} B, on one GPU or split over "
            "2, 4 or 8, gives the blocks exactly"
        )

    def _elements(self) -> tuple[int, ...]:
        if self.told:
            return tuple(e for e in ELEMENT_BYTES if e == self.config_element_bytes)
        return ELEMENT_BYTES


def blocks_held(memory_bytes: int, block_tokens: int, bytes_per_token: int) -> int:
    """The blocks vLLM cuts `memory_bytes` into (kvtui.sim.pool.KVPool's rule)."""
    return memory_bytes // (block_tokens * bytes_per_token)


def read_layout(
    *,
    blocks_total: int,
    block_tokens: int,
    engines: int | None,
    memory_bytes: int | None,
    elements_per_token: Fraction,
    element_bytes: Fraction,
    cache_dtype_told: bool,
    layers: int,
    kv_heads: int,
) -> ServedLayout:
    """The layout of a server's reported cache for a model of `elements_per_token` KV elements
    a token, predicted in elements of `element_bytes` (config.json's dtype, or the server's
    named cache dtype when `cache_dtype_told`: then only that element is tried)."""
    engines = max(1, engines or 1)
    per_engine = blocks_total // engines if blocks_total % engines == 0 else None
    elements = elements_per_token
    candidates: list[int]
    if cache_dtype_told or element_bytes not in ELEMENT_BYTES:
        candidates = [int(element_bytes)] if element_bytes in ELEMENT_BYTES else []
    else:  # the predicted element first, then the others vLLM serves
        predicted = int(element_bytes)
        candidates = [predicted] + [e for e in ELEMENT_BYTES if e != predicted]
    fits: list[Fit] = []
    if per_engine is not None and memory_bytes is not None:
        for shards in SHARDS:
            if shards > 1 and kv_heads % shards and layers % shards:
                continue  # no tensor or pipeline split of this model over that many GPUs
            for element in candidates:
                per_token = elements * element / shards
                if per_token.denominator != 1 or per_token < 1:
                    continue
                if blocks_held(memory_bytes, block_tokens, int(per_token)) == per_engine:
                    fits.append(Fit(element, shards, int(per_token)))
    return ServedLayout(
        engines=engines,
        blocks_total=blocks_total,
        blocks_per_engine=per_engine,
        block_tokens=block_tokens,
        memory_bytes=memory_bytes,
        elements_per_token=elements,
        config_element_bytes=element_bytes,
        fits=tuple(fits),
        told=cache_dtype_told,
    )
