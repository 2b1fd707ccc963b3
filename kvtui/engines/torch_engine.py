"""The torch engines behind the engine protocol, without a UI: `tiny` (the shipped model in
assets/), `shape:NAME` (a catalog model's exact shape with random weights) and `hf:DIR`
(kvtui.engines.hf), all running kvtui.engines.loops.

Each step becomes a `StepSample` of what was measured (the positions the model computed, observed
by a `PositionCounter`; on sampled steps the FLOPs torch counted; the wall time after device sync;
the KV bytes held, from the cache's tensors; on a GPU the device memory in use) beside what the
formula prices it at (kvtui.sim.work.step_cost: its FLOPs and bytes read), so that the two can
disagree. kvtui's own decoder runs a batch (`--batch`) with its cache's blocks taken from one
pool, which stops the batch where kvtui.sim.pool.KVPool says. Out of memory on a GPU ends the
loop with "device out of memory after token N", frees the cache, and the process goes on.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor

from kvtui.engines.attention import ATTENTION_PER_SECOND, ATTENTION_SCALE, MAX_SPANS, spans_for
from kvtui.engines.capabilities import KVTUI_TORCH, Capabilities
from kvtui.engines.loops import (
    TRIM_EVERY_STEPS,
    CachedModel,
    DecoderCache,
    Sampling,
    Step,
    cached_loop,
    recompute_all,
    recompute_loop,
    trim_host_memory,
)
from kvtui.engines.protocol import (
    FLOP_COUNTER_PHRASE,
    Loop,
    Progress,
    RunFinished,
    RunSettings,
    RunStarted,
    StepSample,
    quiet,
)
from kvtui.errors import EngineError
from kvtui.format import error_line, format_bytes
from kvtui.gpu.cache import KVCacheFull
from kvtui.gpu.counting import PositionCounter, flop_counter_warm
from kvtui.gpu.device import (
    describe_device,
    device_ridge,
    dtype_name,
    out_of_memory,
    pick_device,
    run_dtype,
)
from kvtui.gpu.kernels import newest_attention
from kvtui.gpu.load import (
    build_shape,
    load_tiny,
    parameter_bytes,
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
    full_message,
    layout_bytes_per_token,
    layout_step_cost,
    shared_prefix_tokens,
    tokens_before_full,
)
from kvtui.sim.work import step_cost
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


# --- the engines ---------------------------------------------------------------------------------


class TorchEngine(ABC):
    """A torch model behind the engine protocol: one `started` and one `steps` for every torch
    engine. Subclasses say what the model is, how its loops run and how its ids become text."""

    settings: RunSettings
    spec: ModelSpec
    """kvtui.sim's view of the model's shape, for the FLOPs and bytes of each step."""
    device: torch.device
    label: str
    model: torch.nn.Module
    max_positions: int
    """Most positions (prompt + answer) the model can run."""
    trained_positions: int | None
    """The longest sequence the model was trained on, where known."""
    prompt_text: str
    """The prompt as the model sees it, as text (its first token alone in lesson mode)."""
    pool: KVPool | None = None
    """The KV pool the cached loop's blocks come from; None where the engine keeps a cache of
    its own (`hf:`: transformers' StaticCache, sized for the run)."""
    pool_source: str = ""
    """Where the pool's capacity came from, in words."""
    dtype_source: str = ""
    """Why the model computes in its dtype, in words (kvtui.gpu.device.run_dtype)."""
    counter: PositionCounter
    """The positions the model has computed, observed as it runs."""
    attention_layer: int | None = None
    """The layer whose newest query's attention some steps carry (`newest_attention`), or None."""
    attention_heads: int | None = None
    """The query heads that attention is the mean of."""
    attention_per_second: float = ATTENTION_PER_SECOND
    """The most steps of a loop a second that carry it (0: none; `benchmarks/attention_cost.py`
    compares the two)."""
    clock: Callable[[], float] = time.monotonic
    """What the attention's rate is kept by (a test gives its own)."""
    _attention_sent: dict[str, float]
    """When each loop last sent its attention (time.monotonic)."""
    prompt_pieces: tuple[str, ...] = ()
    """The text of each prompt token, for the cache picture's rows."""
    can: Capabilities = KVTUI_TORCH
    """What the engine can do (kvtui.engines.capabilities): kvtui's own decoder's here."""

    @abstractmethod
    def prompt_ids(self) -> Tensor:
        """The prompt's tokens, `(1, P)`, on the device."""

    @abstractmethod
    def cached(self, max_len: int, batch: int) -> CachedModel:
        """The model with a fresh KV cache for `batch` sequences of `max_len` positions."""

    @abstractmethod
    def recompute(self, ids: Tensor) -> Tensor:
        """Last-position logits `(B, vocab)` of the whole sequences `ids` `(B, T)`, computed with
        no cache."""

    @abstractmethod
    def text_stream(self) -> Callable[[int], str]:
        """A function from each new token id to the text it adds."""

    @abstractmethod
    def free_cache(self) -> None:
        """Let go of the KV cache (and, on a GPU, hand its memory back)."""

    kv_heads_model: int | None = None
    """The model's own key/value heads where `--kv-heads` averaged them."""

    @property
    def dtype_name(self) -> str:
        return dtype_name(next(self.model.parameters()).dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """The formula's bytes a position adds to the cached loop's cache, in its layout
        (kvtui.sim.tricks: codes and scales)."""
        return layout_bytes_per_token(self.spec, self.settings.layout, self.dtype_name)

    @property
    def shared_tokens(self) -> int:
        """Prompt positions each later sequence shares (prefix caching), else 0."""
        s = self.settings
        P = self.prompt_ids().shape[1]
        return shared_prefix_tokens(s.layout, P, s.kv_block_tokens, s.batch)

    def started(self) -> RunStarted:
        """What runs, and where: the model's shape, its measured weights, the device."""
        where, total, peak = describe_device(self.device)
        ridge, ridge_source = device_ridge(self.device, total)
        layout = self.settings.layout
        return RunStarted(
            engine=self.settings.engine,
            model=self.label,
            device=where,
            dtype=self.dtype_name,
            layers=self.spec.layers,
            kv_heads=self.spec.kv_heads,
            head_dim=self.spec.head_dim,
            kv_bytes_per_token=self.kv_bytes_per_token,
            weights_bytes=parameter_bytes(self.model),
            prompt_tokens=self.prompt_ids().shape[1],
            tokens=self.settings.tokens,
            timing="measured",
            threads=torch.get_num_threads(),
            peak_bandwidth_bytes_per_s=peak,
            device_memory_total_bytes=total,
            max_positions=self.max_positions,
            trained_positions=self.trained_positions,
            prompt_text=self.prompt_text,
            kv_capacity_bytes=self.pool.capacity_bytes if self.pool else None,
            kv_block_tokens=self.pool.block_tokens if self.pool else None,
            kv_pool_source=self.pool_source,
            batch=self.settings.batch,
            ridge_flops_per_byte=ridge,
            ridge_source=ridge_source,
            dtype_source=self.dtype_source,
            prompt_pieces=self.prompt_pieces,
            attention_layer=self.attention_layer,
            attention_heads=self.attention_heads,
            kv_cache_dtype=layout.cache_dtype,
            kv_window=layout.window,
            kv_sinks=layout.sinks,
            prefix_caching=layout.prefix_caching,
            kv_shared_tokens=self.shared_tokens,
            kv_heads_model=self.kv_heads_model,
            can=self.can,
            sliding_window=self.spec.sliding_window,
            sliding_layers=self.spec.sliding_layers,
        )

    def steps(self, loop: Loop) -> Generator[StepSample | RunFinished, None, None]:
        s = self.settings
        B = s.batch
        prompt = self.prompt_ids().expand(B, -1)  # (B, P): the same prompt in every row
        P = prompt.shape[1]
        windowed = loop == "cached" and s.kv_window is not None  # positions counted in the window
        if P + s.tokens > self.max_positions and not windowed:
            message = f"{P + s.tokens:,} positions is past the model's {self.max_positions:,}"
            yield RunFinished(loop, "error", 0, message)
            return
        sampling = Sampling(temperature=s.temperature, top_k=s.top_k, seed=s.seed, greedy=s.greedy)
        text = self.text_stream()
        allocated = filled = per_position = None
        done, stopped, failed = 0, "", ""
        run: Generator[Step, None, None] | None = None
        try:
            if loop == "cached":
                model = self.cached(P + s.tokens, B)
                per_position = model.kv_bytes_per_position()
                run = cached_loop(model, prompt, s.tokens, sampling, self.counter)
            else:
                run = recompute_loop(self.recompute, prompt, s.tokens, sampling, self.counter)
            last = self._last_step(loop, P)
            due = self._watch_step(loop, 0, last)  # decided before each step: only it is watched
            for step in run:
                if loop == "cached":
                    allocated, filled = step.kv_bytes_allocated, step.kv_bytes
                done += 1
                sample = self._sample(loop, step, P, text(step.token_id))
                read = self._attention(step.position) if due else None
                if read is not None:  # read outside the step's timing
                    sample = replace(sample, attention_spans=read[0], attention=read[1])
                due = self._watch_step(loop, step.index + 1, last)
                yield sample
                if loop == "uncached" and done % TRIM_EVERY_STEPS == 0:
                    trim_host_memory()  # between steps: never inside a timed one
        except KVCacheFull:
            stopped = (
                full_message(self.pool, s.layout, P, B) if self.pool else "the KV cache is full"
            )
        except Exception as exc:  # reported below, once the traceback no longer pins tensors
            if out_of_memory(exc):
                stopped = f"device out of memory after token {done:,}"
            else:  # whatever a model's forward raises ends this loop in one line, not a crash
                failed = f"the {loop} loop failed at step {done + 1:,}: {error_line(exc)}"
        finally:
            if run is not None:
                run.close()  # a stopped run's loop lets go of its cache too
            run = None
            if loop == "cached":
                self.free_cache()
            trim_host_memory()  # after the loop, outside every timed step
        reason: Literal["out_of_memory", "error", "done"] = (
            "error" if failed else "out_of_memory" if stopped else "done"
        )
        yield RunFinished(
            loop,
            reason,
            done,
            failed or stopped,
            kv_bytes_allocated=allocated,
            kv_bytes_filled=filled,
            kv_bytes_per_position=per_position,
        )

    def newest_attention(self) -> Tensor | None:
        """The latest step's newest query's attention over the keys it read, `(S,)` (its own
        key last), as `attention_layer` and `attention_heads` say; None where the engine does not
        observe it. A hook: kvtui's own decoder does."""
        return None

    def watch_next_step(self, on: bool) -> None:
        """Have the model keep what `newest_attention` reads during the next step, or not. A
        hook: kvtui's own decoder does."""
        return None

    def _last_step(self, loop: Loop, prompt_tokens: int) -> int:
        """The index of `loop`'s last step, as far as it can be told before the run: the run's
        length, or, sooner, the cached step that fills the pool (the layout's prediction, used
        only so that the picture's last read is of the step the loop stopped at)."""
        last = self.settings.tokens - 1
        if loop == "cached" and self.pool is not None:
            s = self.settings
            fits = tokens_before_full(self.pool, s.layout, prompt_tokens, s.batch)
            if fits is not None:
                last = min(last, fits - 1)
        return last

    def _watch_step(self, loop: Loop, index: int, last: int) -> bool:
        """Whether step `index` of `loop`, about to run, carries its attention; the model
        watches that step only (keeping a layer's queries and keys on every step cost 4% of a
        cached step: benchmarks/attention_cost.py)."""
        due = self._attention_due(loop, index, last)
        self.watch_next_step(due)
        return due

    def _attention_due(self, loop: Loop, index: int, last: int) -> bool:
        """Whether step `index` of `loop` carries its attention: its first and `last` steps, and
        others at most `attention_per_second` a second (time kept per loop)."""
        if self.attention_layer is None or self.attention_per_second <= 0:
            return False
        now = self.clock()
        sent = self._attention_sent.get(loop)
        if index in (0, last) or sent is None:
            due = True
        else:
            due = now - sent >= 1 / self.attention_per_second
        if due:
            self._attention_sent[loop] = now
        return due

    def _attention(self, position: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The latest step's attention as a sample carries it (kvtui.engines.attention): its
        spans' first positions and their shares in millionths; None where there is nothing to
        read."""
        weights = self.newest_attention()
        if weights is None or not 0 < weights.shape[0] <= position:
            return None
        first = position - weights.shape[0]  # a window's keys begin after position 0
        block = self.pool.block_tokens if self.pool else 1
        sinks = self.settings.kv_sinks if first > 0 else 0
        if sinks:  # a window's sinks (kvtui.gpu.tricks) come first: one span from position 0,
            # over them and the positions the window let go, which got no attention
            weights = torch.cat([weights[:sinks].sum(0, keepdim=True), weights[sinks:]])
            first = position - weights.shape[0] + 1
            rolling = spans_for(first, position, block)
            rolling = rolling[:1] + rolling[2:] if len(rolling) >= MAX_SPANS else rolling
            spans = [0, *rolling]
            bounds = torch.tensor([first - 1, *rolling, position], device=weights.device)
            bounds = bounds - (first - 1)
        else:
            spans = spans_for(first, position, block)
            bounds = torch.tensor([*spans, position], device=weights.device) - first
        totals = torch.cat([weights.new_zeros(1), weights.double().cumsum(0)])
        shares = (totals[bounds[1:]] - totals[bounds[:-1]]) * ATTENTION_SCALE
        values = shares.round().clamp(0, ATTENTION_SCALE).long().tolist()
        return tuple(spans), tuple(values)

    def _sample(self, loop: Loop, step: Step, prompt_tokens: int, text: str) -> StepSample:
        """A measured step as the protocol's sample, beside the formula's FLOPs and bytes for the
        whole batch (kvtui.sim.work.step_cost, in the run's cache layout: kvtui.sim.tricks)."""
        s, dtype, P = self.settings, self.dtype_name, prompt_tokens
        if s.layout.is_plain:
            cost = step_cost(self.spec, loop == "cached", step.index, P, s.batch, dtype, dtype)
        else:  # the model's heads are the run's already: the layout prices the cache
            layout = replace(s.layout, kv_heads=None)
            cached = loop == "cached"
            cost = layout_step_cost(
                self.spec, layout, cached, step.index, P, s.batch, dtype, s.kv_block_tokens
            )
        on_gpu = self.device.type == "cuda"
        return StepSample(
            loop=loop,
            step=step.index,
            position=step.position,
            token_id=step.token_id,
            text=text,
            positions_computed=step.positions_computed,
            flops=cost.flops,
            bytes_read=cost.bytes_read,
            step_seconds=step.step_seconds,
            kv_bytes=step.kv_bytes,
            kv_bytes_allocated=step.kv_bytes_allocated,
            device_memory_bytes=torch.cuda.memory_allocated(self.device) if on_gpu else None,
            flops_counted=step.flops_counted,
        )

    def close(self) -> None:
        self.free_cache()
        self.counter.close()


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
