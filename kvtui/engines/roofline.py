"""A decode engine with no torch: steps counted by kvtui.sim and timed by the roofline.

`sim:MODEL@GPU` runs a catalog model on a catalog GPU on paper: each step's positions, FLOPs and
bytes come from kvtui.sim.work, its time is the roofline's (the slower of compute and memory at
peak), and the KV cache takes blocks from a modelled pool (kvtui.sim.pool.KVPool: `--kv-budget`,
or what vLLM's rule leaves of the GPU) until none is left, where the cached loop stops "out of
memory" at the token the pool predicts, as a real one would. The tokens are a fixed passage of
Austen (the same for both loops: a cache changes the work, never the answer). For laptops, demos
and deterministic tests.

A batch (`--batch B`) decodes B sequences of the prompt together: each step computes B times the
positions and FLOPs, reads the weights once and every sequence's KV cache (kvtui.sim.work's
functions with their `batch`), and the pool gives each sequence floor(blocks / B) blocks, so the
cached loop stops at `KVPool.tokens_before_full(P, B)`.

`sim:MODEL@NxGPU` splits the model over N of the GPU by tensor parallelism: every figure is then
one GPU's (kvtui.sim.parallel.shard: its query heads, its KV heads, each kept whole even when there
are fewer than GPUs, and its share of the weights), and a step also waits for the GPUs' exchanges,
two all-reduces per layer over the GPU-to-GPU link (kvtui.sim.work.tensor_parallel_step_seconds).
A split that vLLM cannot make, or whose share does not fit, is refused, naming the fewest GPUs
that hold the model. `sim:MODEL@GPU` is N = 1, one GPU, with no exchanges.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field, replace

from kvtui.engines.capabilities import ROOFLINE
from kvtui.engines.protocol import Loop, RunFinished, RunSettings, RunStarted, StepSample
from kvtui.engines.replay import MAX_STEP_SECONDS
from kvtui.errors import EngineError
from kvtui.format import format_bytes
from kvtui.sim.catalog import (
    GPUSpec,
    ModelSpec,
    UnknownNameError,
    get_gpu,
    get_model,
    serving_dtypes,
)
from kvtui.sim.memory import RUNTIME_RESERVE_BYTES, kv_bytes, weights_bytes
from kvtui.sim.parallel import shard, tensor_parallel_problem, tensor_parallel_sizes
from kvtui.sim.pool import KVPool, kv_capacity
from kvtui.sim.tricks import (
    KVLayout,
    blocks_held,
    full_message,
    layout_bytes_per_token,
    layout_step_cost,
    positions_held,
    shared_prefix_tokens,
    tokens_before_full,
    with_kv_heads,
)
from kvtui.sim.work import step_cost, tensor_parallel_step_seconds
from kvtui.text import Utf8Stream, encode_bytes

MODELLED = "modelled (roofline)"
"""How the sim engine's step times are had: by arithmetic, never measured."""

PASSAGE = (
    " a single man in possession of a good fortune, must be in want of a wife. However little "
    "known the feelings or views of such a man may be on his first entering a neighbourhood, this "
    "truth is so well fixed in the minds of the surrounding families, that he is considered the "
    "rightful property of some one or other of their daughters.\n\n"
)
"""What the sim engine "generates", byte by byte (Pride and Prejudice, chapter 1)."""


@dataclass
class SimEngine:
    settings: RunSettings
    model: ModelSpec
    gpu: GPUSpec
    weights_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    gpus: int = 1
    """GPUs the model is split over (tensor parallel)."""
    share: ModelSpec = field(init=False)
    """One GPU's part of the model (the model itself on one GPU)."""
    pool: KVPool = field(init=False)
    """The KV pool of one GPU, modelled: `--kv-budget`, or what vLLM's rule leaves
    (kvtui.sim.pool.kv_capacity: memory x utilization - weights - the runtime reserve)."""
    pool_source: str = field(init=False)
    room_bytes: int = field(init=False)
    """What vLLM's rule leaves each GPU for a KV cache (negative when the weights take more)."""
    layout: KVLayout = field(init=False)
    """How the cached loop keeps its cache (kvtui.sim.tricks), modelled: a smaller element, a
    window, shared prefixes; fewer key/value heads have already changed `model`."""
    kv_heads_model: int | None = field(init=False, default=None)
    """The catalog model's key/value heads where `--kv-heads` averaged them."""

    def __post_init__(self) -> None:
        s = self.settings
        self.layout = replace(s.layout, kv_heads=None)
        if s.kv_heads is not None and s.kv_heads != self.model.kv_heads:
            self.kv_heads_model = self.model.kv_heads
            self.model = with_kv_heads(self.model, s.kv_heads)
        self.kv_dtype = self.layout.storage_dtype(self.kv_dtype)  # auto: as a server keeps it
        self.share = shard(self.model, self.gpus)
        self.room_bytes = self._room(self.gpus)
        if s.kv_budget_bytes is not None:
            capacity, self.pool_source = s.kv_budget_bytes, "--kv-budget"
        else:
            capacity = max(0, self.room_bytes)
            self.pool_source = (
                f"modelled: {s.gpu_memory_utilization:g} x {format_bytes(self.gpu.memory_bytes)}"
                f" - weights - {format_bytes(RUNTIME_RESERVE_BYTES)} reserve"
            )
        per_token = layout_bytes_per_token(self.share, self.layout, self.kv_dtype)
        self.pool = KVPool(capacity, s.kv_block_tokens, per_token)

    def _room(self, gpus: int) -> int:
        """What vLLM's rule leaves each of `gpus` GPUs for its KV cache
        (kvtui.sim.pool.kv_capacity); negative when the weights take more."""
        s = self.settings
        return kv_capacity(
            self.model,
            self.gpu,
            context_tokens=1,
            tp=gpus,
            gpu_memory_utilization=s.gpu_memory_utilization,
            block_size=s.kv_block_tokens,
            kv_dtype=self.kv_dtype,
            weights_dtype=self.weights_dtype,
        ).kv_bytes_available_per_gpu

    @classmethod
    def open(
        cls, settings: RunSettings, model_name: str, gpu_name: str, gpus: int = 1
    ) -> SimEngine:
        """The roofline engine for a catalog model on `gpus` of a catalog GPU; `EngineError`
        when either is unknown, vLLM cannot split the model over that many, their share of the
        memory (`--gpu-memory-utilization`) leaves no block for a KV cache beside the weights and
        the runtime reserve, or `--kv-budget` asks for more than it leaves."""
        try:
            model, gpu = get_model(model_name), get_gpu(gpu_name)
        except UnknownNameError as exc:
            raise EngineError(str(exc)) from exc
        problem = tensor_parallel_problem(model, gpus)
        if problem is not None:
            raise EngineError(problem)
        if gpus > 1 and not gpu.interconnect_bytes_per_s:
            raise EngineError(f"the catalog gives no GPU-to-GPU bandwidth for {gpu.display_name}")
        # The weights as published (the catalog's dtype), the KV cache as a server keeps it.
        weights, kv = serving_dtypes(model.default_dtype)  # as a server keeps it
        engine = cls(settings, model, gpu, weights, kv, gpus=gpus)
        room, block = engine.room_bytes, engine.pool.block_bytes
        u = settings.gpu_memory_utilization
        weights_size = weights_bytes(engine.share, engine.weights_dtype)
        if weights_size + RUNTIME_RESERVE_BYTES > gpu.memory_bytes:
            if gpus == 1:
                raise EngineError(
                    f"{model.label}'s weights ({format_bytes(weights_size)}) do not fit in "
                    f"{gpu.display_name} ({format_bytes(gpu.memory_bytes)}); {engine._needs()}"
                )
            raise EngineError(
                f"{model.name} does not fit {gpus}x {gpu.display_name} "
                f"({format_bytes(weights_size)} of {engine.weights_dtype} weights per GPU + the "
                f"{format_bytes(RUNTIME_RESERVE_BYTES)} runtime reserve > "
                f"{format_bytes(gpu.memory_bytes)}); {engine._needs()}"
            )
        if room < block:
            where = gpu.display_name if gpus == 1 else f"each of {gpus}x {gpu.display_name}"
            raise EngineError(
                f"{model.name}'s weights ({format_bytes(weights_size)}"
                + (" per GPU" if gpus > 1 else "")
                + f") and the {format_bytes(RUNTIME_RESERVE_BYTES)} runtime reserve leave no "
                f"room for a KV cache in {u:g} of {where} ({format_bytes(gpu.memory_bytes)}); "
                f"{engine._needs()}" + (" (or raise --gpu-memory-utilization)" if u < 1 else "")
            )
        if settings.kv_budget_bytes is not None and settings.kv_budget_bytes > room:
            raise EngineError(
                f"--kv-budget {format_bytes(settings.kv_budget_bytes)} is more than the "
                f"{format_bytes(room)} {gpu.display_name} has for a KV cache beside the weights "
                f"(at --gpu-memory-utilization {u:g})"
            )
        return engine

    def _needs(self) -> str:
        """The fewest of this GPU that leave room for a block of KV cache, as a `sim:` name."""
        m, gpu, block = self.model, self.gpu, self.pool.block_bytes
        sizes = tensor_parallel_sizes(m)
        fewest = next((tp for tp in sizes if self._room(tp) >= block), None)
        if fewest is None:
            return f"no split of its {m.heads} heads over {gpu.name} GPUs holds it"
        return f"it needs at least {fewest}: sim:{m.name}@{fewest}x{gpu.name}"

    @property
    def prompt_tokens(self) -> int:
        return 1 if self.settings.lesson else len(encode_bytes(self.settings.prompt))

    def started(self) -> RunStarted:
        m, share = self.model, self.share
        device = f"sim: {self.gpu.display_name}"
        if self.gpus > 1:  # every figure from here on is one GPU's
            device = f"sim: {self.gpus}x {self.gpu.display_name}, per GPU"
        return RunStarted(
            engine=self.settings.engine,
            model=m.name,
            device=device,
            dtype=self.weights_dtype,
            layers=m.layers,
            kv_heads=share.kv_heads,
            head_dim=m.head_dim,
            kv_bytes_per_token=self.pool.kv_bytes_per_token,
            weights_bytes=weights_bytes(share, self.weights_dtype),
            prompt_tokens=self.prompt_tokens,
            tokens=self.settings.tokens,
            threads=0,
            peak_bandwidth_bytes_per_s=self.gpu.bandwidth_bytes_per_s,
            device_memory_total_bytes=self.gpu.memory_bytes,
            max_positions=m.max_context,
            trained_positions=m.max_context,
            timing=MODELLED,
            kv_capacity_bytes=self.pool.capacity_bytes,
            kv_block_tokens=self.pool.block_tokens,
            kv_pool_source=self.pool_source,
            batch=self.settings.batch,
            ridge_flops_per_byte=self.gpu.ridge_flops_per_byte,
            ridge_source=f"the catalog's {self.gpu.display_name}",
            modelled_gpu=self.gpu.name,
            modelled_gpus=self.gpus,
            dtype_source=f"as vLLM serves {m.default_dtype} weights",
            prompt_text=bytes(encode_bytes(self.settings.prompt)[: self.prompt_tokens]).decode(
                "utf-8", errors="replace"
            ),
            prompt_pieces=self._prompt_pieces(),
            kv_cache_dtype=self.layout.cache_dtype,
            kv_window=self.layout.window,
            kv_sinks=self.layout.sinks,
            prefix_caching=self.layout.prefix_caching,
            kv_shared_tokens=self.shared_tokens,
            kv_heads_model=self.kv_heads_model,
            can=ROOFLINE,
            sliding_window=share.sliding_window,
            sliding_layers=share.sliding_layers,
        )

    def _prompt_pieces(self) -> tuple[str, ...]:
        """The text of each prompt byte, the prompt's tokens here (empty inside a character)."""
        stream = Utf8Stream()
        return tuple(
            stream.push(b) for b in encode_bytes(self.settings.prompt)[: self.prompt_tokens]
        )

    @property
    def shared_tokens(self) -> int:
        """Prompt positions each later sequence shares (prefix caching, modelled)."""
        s = self.settings
        return shared_prefix_tokens(self.layout, self.prompt_tokens, s.kv_block_tokens, s.batch)

    def steps(self, loop: Loop) -> Generator[StepSample | RunFinished, None, None]:
        m, P, pool = self.share, self.prompt_tokens, self.pool  # one GPU's part of the model
        B, wd, kd = self.settings.batch, self.weights_dtype, self.kv_dtype
        text = Utf8Stream()
        passage = PASSAGE.encode("utf-8")
        weights = weights_bytes(m, wd)
        layout, shared, bt = self.layout, self.shared_tokens, pool.block_tokens
        room: int | None = self.settings.tokens
        if loop == "cached":
            room = tokens_before_full(pool, layout, P, B)
        held = allocated = 0
        for i in range(self.settings.tokens):
            context = P + i  # keys and values held once this step is done, per sequence
            if room is not None and i >= room:  # this step would cache a position the pool
                yield RunFinished(  # has no block for
                    loop,
                    "out_of_memory",
                    i,
                    full_message(pool, layout, P, B),
                    kv_bytes_allocated=allocated,
                    kv_bytes_filled=held,
                )
                return
            if layout.window is None and not shared:  # every position held, by each sequence
                cost = step_cost(m, loop == "cached", i, P, B, wd, kd)
                if loop == "cached":
                    held = kv_bytes(m, context, B, kd)
                    allocated = pool.blocks_for(context, B) * pool.block_bytes
            else:  # a window, or blocks shared: what the layout holds (kvtui.sim.tricks)
                cost = layout_step_cost(m, layout, loop == "cached", i, P, B, wd, bt, kd)
                if loop == "cached":
                    held = positions_held(layout, context, B, shared) * pool.kv_bytes_per_token
                    allocated = blocks_held(layout, context, B, bt, shared) * pool.block_bytes
            computed = cost.positions // B  # per sequence
            flops, read = cost.flops, cost.bytes_read
            seconds = tensor_parallel_step_seconds(
                self.model, flops, read, computed, self.gpus, self.gpu, B
            )
            if self.settings.replay_speed > 0:
                time.sleep(min(seconds / self.settings.replay_speed, MAX_STEP_SECONDS))
            token = passage[i % len(passage)]
            yield StepSample(
                loop=loop,
                step=i,
                position=P + i,
                token_id=token,
                text=text.push(token),
                positions_computed=cost.positions,
                flops=flops,
                bytes_read=read,
                step_seconds=seconds,
                kv_bytes=held,
                kv_bytes_allocated=allocated,
                device_memory_bytes=weights + allocated,
            )
        yield RunFinished(
            loop,
            "done",
            self.settings.tokens,
            kv_bytes_allocated=allocated if loop == "cached" else None,
            kv_bytes_filled=held if loop == "cached" else None,
        )

    def close(self) -> None:
        pass
