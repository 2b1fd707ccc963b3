"""A torch engine's steps, without a UI: the decode loops, with and without a KV cache, timed and
counted as the model computed them, and each step as the protocol's `StepSample` (`TorchEngine`,
the base of kvtui's own decoder, kvtui.engines.torch_engine, and of `hf:`). One module, because a
step passes through both: the forward's logits become a `Step`, and the `Step` a `StepSample`.

In the manner of gpt-fast's `generate.py`, generic over models (`hf:` runs them through
transformers' forward): `cached_loop` prefills (the prompt's P positions in one pass, filling the
cache), then computes one new position per step against the cache; `recompute_loop` has no cache:
the step that emits token t runs all P + t - 1 positions so far. Both decode a batch of prompts
`(B, P)` together, one model call per step, and sample with their own `Sampler` (row r seeded
`seed + r`, one draw per row per step), so with the same prompt, seed and settings they emit the
same tokens, row by row. Every step is timed after synchronising the device.

What a step computed is observed, not restated: the positions are read off a `PositionCounter`
(kvtui.gpu.counting) before and after the step, and on sampled steps (`counts_flops`) the step's
model call is run once more, outside its timing, under torch's `FlopCounterMode` (writing the same
keys and values at the same positions: `CachedModel.replay_flops`), never sampling. Beside what
was measured, each sample carries what the formula prices the step at (kvtui.sim.work.step_cost),
so that the two can disagree. A full pool, or a GPU out of memory, ends the loop in a
`RunFinished` that says so and frees the cache; the process goes on.
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch
from torch import Tensor

from kvtui.engines.attention import ATTENTION_PER_SECOND, ATTENTION_SCALE, MAX_SPANS, spans_for
from kvtui.engines.capabilities import KVTUI_TORCH, Capabilities
from kvtui.engines.protocol import Loop, RunFinished, RunSettings, RunStarted, StepSample
from kvtui.format import error_line
from kvtui.gpu.cache import KVCacheFull
from kvtui.gpu.counting import PositionCounter, count_flops
from kvtui.gpu.device import describe_device, device_ridge, dtype_name, out_of_memory, synchronize
from kvtui.gpu.host import trim_host_memory
from kvtui.gpu.load import parameter_bytes
from kvtui.gpu.model import Transformer
from kvtui.gpu.tricks import LayoutKVCache, prefill_shared
from kvtui.sim.catalog import ModelSpec
from kvtui.sim.pool import KVPool
from kvtui.sim.tricks import (
    full_message,
    layout_bytes_per_token,
    layout_step_cost,
    shared_prefix_tokens,
    tokens_before_full,
)
from kvtui.sim.work import step_cost


def never(index: int) -> bool:
    """Count no step's FLOPs."""
    return False


def counts_flops(index: int) -> bool:
    """Whether the loops count the FLOPs of step `index` (0-based): the first two (a cached
    loop's prefill and first one-token step) and every power of two, so a run of n steps counts
    about log2(n) of them and the replays cost about one more of the longest uncached step."""
    return index < 2 or index & (index - 1) == 0


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits."""

    temperature: float = 0.8
    top_k: int = 40
    seed: int = 0
    greedy: bool = False


@dataclass(frozen=True)
class Step:
    """One measured decode step of a batch of sequences (one sequence: a batch of 1)."""

    index: int
    """0-based index of the generated token."""
    position: int
    """Position of the generated tokens in their sequences."""
    token_ids: tuple[int, ...]
    """Each row's token."""
    positions_computed: int
    """Positions whose keys and values this step computed, every row's: observed, the rows of
    keys the model's layers produced during the step (`PositionCounter`)."""
    step_seconds: float
    kv_bytes: int
    """KV-cache bytes filled after this step, every row's (0 without a cache)."""
    kv_bytes_allocated: int = 0
    """KV-cache bytes allocated after this step: whole blocks, or the buffers a cache holds."""
    flops_counted: int | None = None
    """FLOPs torch's FlopCounterMode counted over this step's model call, on the steps
    `counts_flops` samples (None on the others, and where the model cannot replay a step)."""

    @property
    def token_id(self) -> int:
        """Row 0's token."""
        return self.token_ids[0]


class Sampler:
    """Greedy or seeded top-k sampling of `batch` rows: row r draws from its own generator,
    seeded `seed + r`, one draw per row per step whatever the logits."""

    def __init__(self, sampling: Sampling, device: torch.device, batch: int = 1) -> None:
        self.sampling = sampling
        self.generators = [
            torch.Generator(device=device).manual_seed(sampling.seed + row) for row in range(batch)
        ]

    def __call__(self, logits: Tensor) -> Tensor:
        """The next tokens `(B, 1)` from the last position's logits `(B, vocab)`."""
        s = self.sampling
        if s.greedy or s.temperature <= 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits.float() / s.temperature
        if 0 < s.top_k < logits.size(-1):
            kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if len(self.generators) == 1:
            return torch.multinomial(probs, 1, generator=self.generators[0])
        return torch.cat(  # each row from its own stream: row r's tokens do not depend on B
            [
                torch.multinomial(probs[row : row + 1], 1, generator=generator)
                for row, generator in enumerate(self.generators)
            ]
        )


class CachedModel(Protocol):
    """What the cached loop needs of a model whose KV cache is already set up."""

    def prefill(self, prompt: Tensor) -> Tensor:
        """Run the prompts `(B, P)` into the cache; the last position's logits `(B, vocab)`."""
        ...

    def decode_one_token(self, token: Tensor, position: int) -> Tensor:
        """Feed one token per row `(B, 1)` at `position`, computing only their keys and values;
        their logits `(B, vocab)`."""
        ...

    def kv_bytes_filled(self, positions: int) -> int:
        """Bytes of keys and values the cache holds for the first `positions` positions of
        every row."""
        ...

    def kv_bytes_allocated(self) -> int:
        """Bytes of the cache's storage taken so far, measured from its tensors."""
        ...

    def kv_bytes_per_position(self) -> int | None:
        """Bytes of one position of one sequence, every layer, measured from the cache's
        tensors (codes and scales); None where the cache does not say."""
        ...

    def replay_flops(self, call: Callable[[], Tensor], start: int) -> int | None:
        """The FLOPs of a step's call (whose new positions begin at `start`) run once more,
        leaving the cache as the step left it (the same keys and values written over
        themselves); None where the cache cannot replay a step."""
        ...


Counter = Callable[[], int]
"""Positions the model has computed so far (kvtui.gpu.counting.PositionCounter)."""


Call = Callable[[], Tensor]
"""One step's model call: the last position's logits `(B, vocab)`."""


def _timed_steps(
    calls: Iterator[tuple[Call, Callable[[], int | None]]],
    sample: Sampler,
    device: torch.device,
    counted: Counter,
    flops_at: Callable[[int], bool],
) -> Iterator[tuple[Tensor, tuple[int, ...], int, float, int | None]]:
    """Run each model call as one step: its tokens `(B, 1)` and as ids, the positions the model
    computed in it, its wall time after device sync, and (on sampled steps) the FLOPs its
    `replay` counted over the call run again, outside the timing."""
    for i, (call, replay) in enumerate(calls):
        before = counted()
        synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            token = sample(call())  # (B, 1)
        ids = tuple(token[:, 0].tolist())  # .tolist() synchronises too
        synchronize(device)
        seconds = time.perf_counter() - t0
        computed = counted() - before
        flops = replay() if flops_at(i) else None
        yield token, ids, computed, seconds, flops


def cached_loop(
    model: CachedModel,
    prompt: Tensor,
    n_tokens: int,
    sampling: Sampling,
    counted: Counter,
    flops_at: Callable[[int], bool] = counts_flops,
) -> Generator[Step, None, None]:
    """Prefill (P positions of each of the B rows of `prompt` `(B, P)`), then one new position
    per row per step: P + n - 1 positions in all, per row, if the model computes only what it
    must (`counted` says what it did)."""
    B, P = prompt.shape
    tokens: list[Tensor] = []

    def calls() -> Iterator[tuple[Call, Callable[[], int | None]]]:
        for i in range(n_tokens):
            if i == 0:
                call, start = functools.partial(model.prefill, prompt), 0
            else:
                call, start = (
                    functools.partial(model.decode_one_token, tokens[-1], P + i - 1),
                    P + i - 1,
                )
            yield call, functools.partial(model.replay_flops, call, start)

    sample = Sampler(sampling, prompt.device, B)
    run = _timed_steps(calls(), sample, prompt.device, counted, flops_at)
    for i, (token, ids, computed, seconds, flops) in enumerate(run):
        tokens[:] = [token]
        filled, allocated = model.kv_bytes_filled(P + i), model.kv_bytes_allocated()
        yield Step(i, P + i, ids, computed, seconds, filled, allocated, flops)


def recompute_loop(
    recompute: Callable[[Tensor], Tensor],
    prompt: Tensor,
    n_tokens: int,
    sampling: Sampling,
    counted: Counter,
    flops_at: Callable[[int], bool] = counts_flops,
) -> Generator[Step, None, None]:
    """The uncached loop around any model: `recompute(ids)` gives the last position's logits
    `(B, vocab)` of the whole sequences `ids` `(B, T)`, computed from scratch. The step that
    emits token t (1-based) recomputes all P + t - 1 positions so far of each row of `prompt`
    `(B, P)`."""
    B, P = prompt.shape
    ids = torch.empty((B, P + n_tokens), dtype=torch.long, device=prompt.device)
    ids[:, :P] = prompt
    steps = (functools.partial(recompute, ids[:, : P + i]) for i in range(n_tokens))
    calls = ((call, functools.partial(count_flops, call)) for call in steps)  # a pure call
    sample = Sampler(sampling, prompt.device, B)
    run = _timed_steps(calls, sample, prompt.device, counted, flops_at)
    for i, (token, row_ids, computed, seconds, flops) in enumerate(run):
        ids[:, P + i] = token[:, 0]
        yield Step(i, P + i, row_ids, computed, seconds, 0, 0, flops)


@dataclass
class DecoderCache:
    """kvtui's own decoder as a `CachedModel`, its paged KV cache set up (`setup_caches`): one
    `forward` for the prefill and every step."""

    model: Transformer

    def prefill(self, prompt: Tensor) -> Tensor:
        kv = self.model.kv
        if isinstance(kv, LayoutKVCache) and kv.layout.prefix_caching:
            return prefill_shared(
                self.model, prompt
            )  # the later rows compute what they don't share
        logits: Tensor = self.model(prompt, start=0, use_cache=True, last_only=True)
        return logits[:, -1]

    def decode_one_token(self, token: Tensor, position: int) -> Tensor:
        logits: Tensor = self.model(token, start=position, use_cache=True)
        return logits[:, -1]

    def kv_bytes_filled(self, positions: int) -> int:
        assert self.model.kv is not None
        return self.model.kv.filled_bytes

    def kv_bytes_allocated(self) -> int:
        assert self.model.kv is not None
        return self.model.kv.allocated_bytes

    def kv_bytes_per_position(self) -> int | None:
        assert self.model.kv is not None
        return self.model.kv.bytes_per_position

    def replay_flops(self, call: Call, start: int) -> int | None:
        """A step again: `reserve` takes no block twice and the writes land where they did."""
        return count_flops(call)


TRIM_EVERY_STEPS = 64
"""How often the uncached loop hands freed host memory back, in steps: each step's activations
cover the whole sequence and grow with it, and glibc would keep the largest so far."""


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
