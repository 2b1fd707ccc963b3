"""A decode engine with no torch: steps counted by kvtui.sim and timed by the roofline.

`sim:MODEL@GPU` runs a catalog model on a catalog GPU on paper: each step's positions, FLOPs and
bytes come from kvtui.sim.work, its time is the roofline's (the slower of compute and memory at
peak), and the KV cache grows by kvtui.sim.memory's formula until the GPU is full, where the run
stops "out of memory", as a real one would. The tokens are a fixed passage of Austen (the same for
both loops: a cache changes the work, never the answer). For laptops, demos and deterministic tests.

`sim:MODEL@NxGPU` splits the model over N of the GPU by tensor parallelism: every figure is then
one GPU's (kvtui.sim.memory.shard: its query heads, its KV heads, each kept whole even when there
are fewer than GPUs, and its share of the weights), and a step also waits for the GPUs' exchanges,
two all-reduces per layer over the GPU-to-GPU link (kvtui.sim.work.tensor_parallel_step_seconds).
A split that vLLM cannot make, or whose share does not fit, is refused, naming the fewest GPUs
that hold the model. `sim:MODEL@GPU` is N = 1, one GPU, with no exchanges.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtui.engine.protocol import (
    EngineError,
    Loop,
    RunFinished,
    RunSettings,
    RunStarted,
    StepSample,
)
from kvtui.engine.replay import MAX_STEP_SECONDS
from kvtui.format import format_bytes
from kvtui.sim.catalog import GPUSpec, ModelSpec, UnknownNameError, get_gpu, get_model
from kvtui.sim.memory import (
    RUNTIME_RESERVE_BYTES,
    fewest_gpus,
    kv_bytes,
    kv_bytes_per_token,
    shard,
    tensor_parallel_problem,
    weights_bytes,
)
from kvtui.sim.work import (
    decode_step_bytes,
    decode_step_flops,
    tensor_parallel_step_seconds,
    uncached_step_bytes,
    uncached_step_flops,
)
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

    def __post_init__(self) -> None:
        self.share = shard(self.model, self.gpus)

    @classmethod
    def open(
        cls, settings: RunSettings, model_name: str, gpu_name: str, gpus: int = 1
    ) -> SimEngine:
        """The roofline engine for a catalog model on `gpus` of a catalog GPU; `EngineError`
        when either is unknown, vLLM cannot split the model over that many, or the weights (one
        GPU's share of them) do not fit."""
        try:
            model, gpu = get_model(model_name), get_gpu(gpu_name)
        except UnknownNameError as exc:
            raise EngineError(str(exc)) from exc
        problem = tensor_parallel_problem(model, gpus)
        if problem is not None:
            raise EngineError(problem)
        if gpus > 1 and not gpu.interconnect_bytes_per_s:
            raise EngineError(f"the catalog gives no GPU-to-GPU bandwidth for {gpu.display_name}")
        engine = cls(settings, model, gpu, gpus=gpus)
        weights = weights_bytes(engine.share, engine.weights_dtype)
        if weights + RUNTIME_RESERVE_BYTES > gpu.memory_bytes:
            if gpus == 1:
                raise EngineError(
                    f"{model.label}'s weights ({format_bytes(weights)}) do not fit in "
                    f"{gpu.display_name} ({format_bytes(gpu.memory_bytes)}); {engine._needs()}"
                )
            raise EngineError(
                f"{model.name} does not fit {gpus}x {gpu.display_name} ({format_bytes(weights)} "
                f"of {engine.weights_dtype} weights per GPU + the "
                f"{format_bytes(RUNTIME_RESERVE_BYTES)} runtime reserve > "
                f"{format_bytes(gpu.memory_bytes)}); {engine._needs()}"
            )
        return engine

    def _needs(self) -> str:
        """The fewest of this GPU whose shares of the weights fit, as a `sim:` name."""
        m, gpu = self.model, self.gpu

        def fits(share: ModelSpec) -> bool:
            held = weights_bytes(share, self.weights_dtype) + RUNTIME_RESERVE_BYTES
            return held <= gpu.memory_bytes

        fewest = fewest_gpus(m, fits)
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
            kv_bytes_per_token=kv_bytes_per_token(share, self.kv_dtype),
            weights_bytes=weights_bytes(share, self.weights_dtype),
            prompt_tokens=self.prompt_tokens,
            tokens=self.settings.tokens,
            threads=0,
            peak_bandwidth_bytes_per_s=self.gpu.bandwidth_bytes_per_s,
            device_memory_total_bytes=self.gpu.memory_bytes,
            max_positions=m.max_context,
            trained_positions=m.max_context,
            timing=MODELLED,
            prompt_text=bytes(encode_bytes(self.settings.prompt)[: self.prompt_tokens]).decode(
                "utf-8", errors="replace"
            ),
        )

    def steps(self, loop: Loop) -> Iterator[StepSample | RunFinished]:
        m, P = self.share, self.prompt_tokens  # one GPU's part: the whole model on one GPU
        text = Utf8Stream()
        passage = PASSAGE.encode("utf-8")
        room = self.gpu.memory_bytes - RUNTIME_RESERVE_BYTES - weights_bytes(m, self.weights_dtype)
        for i in range(self.settings.tokens):
            context = P + i  # keys and values held once this step is done
            if loop == "cached":
                computed = P if i == 0 else 1
                if i == 0:
                    flops = uncached_step_flops(m, P)
                    read = uncached_step_bytes(m, P, self.weights_dtype, self.kv_dtype)
                else:
                    flops = decode_step_flops(m, context)
                    read = decode_step_bytes(m, context, self.weights_dtype, self.kv_dtype)
                held = kv_bytes(m, context, 1, self.kv_dtype)
                if held > room:
                    yield RunFinished(
                        loop, "out_of_memory", i, f"out of memory at {context:,} tokens"
                    )
                    return
            else:
                computed = P + i
                flops = uncached_step_flops(m, computed)
                read = uncached_step_bytes(m, computed, self.weights_dtype, self.kv_dtype)
                held = 0
            seconds = tensor_parallel_step_seconds(
                self.model, flops, read, computed, self.gpus, self.gpu
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
                positions_computed=computed,
                flops=flops,
                bytes_read=read,
                step_seconds=seconds,
                kv_bytes=held,
                device_memory_bytes=weights_bytes(m, self.weights_dtype) + held,
            )
        yield RunFinished(
            loop,
            "done",
            self.settings.tokens,
            kv_bytes_allocated=kv_bytes(m, P + self.settings.tokens, 1, self.kv_dtype)
            if loop == "cached"
            else None,
        )

    def close(self) -> None:
        pass
