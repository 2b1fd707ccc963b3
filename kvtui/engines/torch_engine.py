"""kvtui's own decoder as an engine, without a UI: `tiny` (the shipped model in assets/) and
`shape:NAME` (a catalog model's exact shape with random weights), a `TorchEngine` whose steps
(kvtui.engines.loops) run `forward` over a paged KV cache set up for each run. It decodes a batch
(`--batch`) with its cache's blocks taken from one pool (`open_pool`), which stops the batch where
kvtui.sim.pool.KVPool says; it sends the newest query's attention on some steps; and it measures
what a cache trick costs in quality (kvtui.engines.quality).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from kvtui.engines.generate import recompute_all
from kvtui.engines.loops import CachedModel, DecoderCache, TorchEngine
from kvtui.engines.protocol import (
    FLOP_COUNTER_PHRASE,
    Loop,
    Progress,
    RunSettings,
    quiet,
)
from kvtui.errors import EngineError
from kvtui.format import format_bytes
from kvtui.gpu.counting import PositionCounter, flop_counter_warm
from kvtui.gpu.device import (
    pick_device,
    run_dtype,
)
from kvtui.gpu.kernels import newest_attention
from kvtui.gpu.load import (
    build_shape,
    load_tiny,
    ready_to_decode,
    spec_from_args,
    tiny_stored_dtype,
    trained_context,
)
from kvtui.gpu.model import Transformer
from kvtui.gpu.tricks import average_kv_heads, setup_layout_caches
from kvtui.paths import TINY_NAME
from kvtui.sim.catalog import ModelSpec, UnknownNameError, get_model
from kvtui.sim.pool import CPU_KV_BUDGET_BYTES, KVPool, gpu_pool_bytes
from kvtui.sim.tricks import (
    KVLayout,
)
from kvtui.text import Utf8Stream, encode_bytes


def open_pool(
    settings: RunSettings, device: torch.device, kv_bytes_per_token: int
) -> tuple[KVPool, str]:
    """The KV pool a run's cached loop takes its blocks from, and where its capacity came from:
    `--kv-budget`; else on a GPU its share (kvtui.sim.pool.gpu_pool_bytes, measured now, with
    the weights loaded); else the CPU default."""
    if settings.kv_budget_bytes is not None:
        capacity, source = settings.kv_budget_bytes, "--kv-budget"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        u = settings.gpu_memory_utilization
        capacity = gpu_pool_bytes(total, free, u)
        source = (
            f"{u:g} of the GPU's {format_bytes(total)} less the {format_bytes(total - free)} in use"
        )
    else:
        capacity, source = CPU_KV_BUDGET_BYTES, "the CPU default"
    return KVPool(capacity, settings.kv_block_tokens, kv_bytes_per_token), source


class DecoderEngine(TorchEngine):
    """kvtui's own decoder: `tiny` (byte-level, the shipped weights) or `shape:NAME` (a catalog
    model's shape, random weights, random prompt ids as long as the prompt's bytes)."""

    model: Transformer
    pool: KVPool
    """Always opened (`open_pool`): the cached loop's blocks come from it."""

    def __init__(
        self,
        settings: RunSettings,
        model: Transformer,
        spec: ModelSpec,
        device: torch.device,
        label: str,
        *,
        byte_level: bool,
        trained_positions: int | None,
    ) -> None:
        self.settings, self.model, self.spec = settings, model, spec
        self.device, self.label, self.byte_level = device, label, byte_level
        self.max_positions = model.args.max_positions
        self.trained_positions = trained_positions
        self.counter = PositionCounter(model)
        self.pool, self.pool_source = open_pool(settings, device, self.kv_bytes_per_token)
        ids = encode_bytes(settings.prompt)
        if not byte_level:  # random token ids, as many as the prompt has bytes
            gen = torch.Generator().manual_seed(settings.seed)
            ids = torch.randint(0, spec.vocab_size, (len(ids),), generator=gen).tolist()
        if settings.lesson:
            ids = ids[:1]
        self._prompt = torch.tensor([ids], dtype=torch.long, device=device)
        self.prompt_text = (
            bytes(ids).decode("utf-8", errors="replace")
            if byte_level
            else "".join(f" {i}" for i in ids)
        )
        stream = self.text_stream()
        self.prompt_pieces = tuple(stream(i) for i in ids)
        self.attention_layer = model.args.n_layer // 2
        self.attention_heads = model.args.n_head
        self._attention_sent = {}

    def newest_attention(self) -> Tensor | None:
        """The watched layer's newest query over its keys (kvtui.gpu.kernels.newest_attention)."""
        watched, self.model.watched = self.model.watched, None
        if watched is None:
            return None
        with torch.inference_mode():
            return newest_attention(*watched)

    def prompt_ids(self) -> Tensor:
        return self._prompt

    def watch_next_step(self, on: bool) -> None:
        self.model.watch_layer = self.attention_layer if on else None

    baseline: Transformer | None = None
    """The model as shipped, where `--kv-heads` averaged its heads (the reference its quality
    is measured against); None: `model` is the shipped one."""

    def measure_quality(self, loop: Loop, text_bytes: int) -> dict[str, Any] | None:
        """What this loop's cache layout costs in quality (kvtui.engines.quality) on the first
        `text_bytes` of the shipped held-out text: the cached loop keeps the run's layout, the
        uncached loop none (its model, averaged heads and all, is what it costs). None for a
        model whose tokens are not bytes of text (`shape:`, random weights), and where the loop
        runs the shipped model with the plain cache or none (the uncached loop of a cache trick):
        nothing to cost, it would be the model scored against itself."""
        layout = self.settings.layout if loop == "cached" else KVLayout()
        if not self.byte_level or layout.paged_as_is and self.baseline is None:
            return None
        from kvtui.engines.quality import heldout_ids, measure_quality

        ids = heldout_ids(text_bytes, self.device)
        baseline = self.baseline or self.model
        words = f"the first {ids.shape[1]:,} bytes of held-out Austen (assets/austen-heldout.txt)"
        return measure_quality(baseline, self.model, layout, ids, source=words).to_json()

    def reopen(self, settings: RunSettings) -> DecoderEngine | None:
        """This engine for another run in its process, the model kept and the pool opened anew
        (`open_pool`: a budget resized in place, nothing loaded); None where that run's model
        would differ (`MODEL_SETTINGS`): the caller opens a fresh engine."""
        fixed = MODEL_SETTINGS | (frozenset() if self.byte_level else SHAPE_SETTINGS)
        if any(getattr(settings, name) != getattr(self.settings, name) for name in fixed):
            return None
        args = (settings, self.model, self.spec, self.device, self.label)
        engine = DecoderEngine(
            *args, byte_level=self.byte_level, trained_positions=self.trained_positions
        )
        engine.dtype_source, engine.kv_heads_model = self.dtype_source, self.kv_heads_model
        engine.baseline = self.baseline
        return engine

    def cached(self, max_len: int, batch: int) -> CachedModel:
        pool, layout = self.pool, self.settings.layout
        if layout.paged_as_is:
            self.model.setup_caches(
                batch=batch,
                max_len=max_len,
                block_tokens=pool.block_tokens,
                pool_blocks=pool.blocks,
            )
        else:  # a smaller element, a window or shared prefixes (kvtui.gpu.tricks)
            setup_layout_caches(
                self.model,
                batch,
                max_len,
                layout,
                block_tokens=pool.block_tokens,
                pool_blocks=pool.blocks,
            )
        return DecoderCache(self.model)

    def recompute(self, ids: Tensor) -> Tensor:
        return recompute_all(self.model, ids)

    def text_stream(self) -> Callable[[int], str]:
        return Utf8Stream().push if self.byte_level else (lambda token_id: f" {token_id}")

    def free_cache(self) -> None:
        self.model.drop_caches()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


MODEL_SETTINGS = frozenset({"engine", "device", "threads", "seed", "kv_heads"})
"""What a loaded model is made with (the budget, length, sampling and layout are a run's own);
`SHAPE_SETTINGS`: what a `shape:` model's random weights are made for, besides (`build_shape`)."""
SHAPE_SETTINGS = frozenset({"tokens", "batch", "prompt", "lesson"})


def open_torch_engine(
    settings: RunSettings, model_name: str | None, progress: Progress = quiet
) -> DecoderEngine:
    """`tiny` (`model_name` None) or `shape:model_name`, on the device the settings ask for;
    `progress` hears each slow part as it begins."""
    torch.set_num_threads(max(1, settings.threads))
    device = pick_device(settings.device)
    if model_name is None:
        dtype, why = run_dtype(device, tiny_stored_dtype())
        progress(f"loading {TINY_NAME}'s weights, timing the kernels")
        shipped, meta = load_tiny(device, dtype, settings.seed)
        label = meta.get("name", TINY_NAME)
        model, own_heads = _with_kv_heads(shipped, settings.kv_heads)
        spec = spec_from_args(label, model.args)
        trained = trained_context(meta)
        if not flop_counter_warm():
            progress(FLOP_COUNTER_PHRASE)
        engine = DecoderEngine(
            settings, model, spec, device, label, byte_level=True, trained_positions=trained
        )
        engine.dtype_source = why
        engine.kv_heads_model = own_heads
        engine.baseline = shipped if model is not shipped else None
        return engine
    try:
        spec = get_model(model_name)
    except UnknownNameError as exc:
        raise EngineError(str(exc)) from exc
    dtype, why = run_dtype(device, spec.default_dtype)  # the catalog's published weights
    context = len(encode_bytes(settings.prompt)) + settings.tokens
    progress(f"making {spec.name}'s random weights, timing the kernels")
    model = build_shape(spec, device, dtype, context, settings.seed, settings.batch)
    model, own_heads = _with_kv_heads(model, settings.kv_heads)
    label = f"shape:{spec.name}"
    if not flop_counter_warm():
        progress(FLOP_COUNTER_PHRASE)
    # Priced as what runs: kvtui's decoder in that shape (its own parameters, every position
    # attended: no sliding window), not the catalog entry it was built from.
    ran = replace(spec_from_args(label, model.args), display_name=spec.label)
    engine = DecoderEngine(
        settings, model, ran, device, label, byte_level=False, trained_positions=spec.max_context
    )
    engine.dtype_source = why
    engine.kv_heads_model = own_heads
    return engine


def _with_kv_heads(model: Transformer, kv_heads: int | None) -> tuple[Transformer, int | None]:
    """The model with its key/value heads averaged into `kv_heads` (`--kv-heads`), ready to
    decode, and its own count of them; the model as it is, and None, without the flag."""
    if kv_heads is None:
        return model, None
    own = model.args.n_kv_head
    try:
        return ready_to_decode(average_kv_heads(model, kv_heads)), own
    except ValueError as exc:
        raise EngineError(str(exc)) from None
