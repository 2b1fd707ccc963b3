"""The torch engines: decoding with and without a KV cache, step by step and timed. No UI.

The loops, in the manner of gpt-fast's `generate.py`, generic over models (the `hf:` engine runs
them through transformers' forward):

- `cached_loop`: prefill (the prompt's P positions in one pass, filling the cache), then one new
  position per step against the cache;
- `recompute_loop`: no cache; the step that emits token t runs all P + t - 1 positions so far
  (the lesson's staircase, counted as kvtui.engine.protocol defines it).

Both take a batch of prompts `(B, P)` and decode the B rows together, one model call per step.
Both sample with their own `Sampler`, row r seeded `seed + r`, one draw per row per step, so with
the same prompt, seed and settings they emit the same tokens, row by row. Every step is timed after
synchronising the device.

`TorchEngine` wraps the loops in the engine protocol, once for every torch engine: `tiny` (the
shipped model in assets/), `shape:NAME` (a catalog model's exact shape with random weights), and
`hf:DIR` (kvtui.engine.hf). Each step becomes a `StepSample` with the FLOPs and bytes kvtui.sim
counts for it (the whole batch's), the measured wall time, the KV bytes held and, on a GPU, the
device memory in use. kvtui's own decoder runs a batch (`--batch`) with its cache's blocks taken
from one pool, which stops the batch where kvtui.sim.memory.KVPool says.
Out of memory on a GPU ends the loop with "out of memory at N tokens", frees the cache, and the
process goes on.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from safetensors import safe_open
from torch import Tensor

from kvtui.decoder import KVCacheFull, ModelArgs, Transformer
from kvtui.engine.protocol import (
    EngineError,
    Loop,
    RunFinished,
    RunSettings,
    RunStarted,
    StepSample,
)
from kvtui.format import format_bytes
from kvtui.paths import asset_path
from kvtui.probe import open_probe
from kvtui.sim.catalog import (
    ModelSpec,
    UnknownNameError,
    get_model,
    match_gpu,
    normalize_dtype,
)
from kvtui.sim.memory import (
    CPU_KV_BUDGET_BYTES,
    DEFAULT_BLOCK_SIZE,
    KVPool,
    gpu_pool_bytes,
    kv_bytes,
    kv_bytes_per_token,
)
from kvtui.sim.work import (
    decode_step_bytes,
    decode_step_flops,
    uncached_step_bytes,
    uncached_step_flops,
)
from kvtui.text import Utf8Stream, encode_bytes

TINY_WEIGHTS = "tiny-austen.safetensors"
TINY_ARGS = ModelArgs(n_layer=6, n_head=8, n_kv_head=2, dim=256, intermediate_size=512)
"""The tiny model's shape, used for seeded random weights when the shipped file is missing."""


# --- the loops -----------------------------------------------------------------------------------


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
    """Positions whose keys and values this step computed, every row's."""
    step_seconds: float
    kv_bytes: int
    """KV-cache bytes filled after this step, every row's (0 without a cache)."""
    kv_bytes_allocated: int = 0
    """KV-cache bytes allocated after this step: whole blocks, or the buffers a cache holds."""

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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def cached_loop(
    model: CachedModel, prompt: Tensor, n_tokens: int, sampling: Sampling
) -> Iterator[Step]:
    """Prefill (P positions of each of the B rows of `prompt` `(B, P)`), then one new position
    per row per step: P + n - 1 positions in all, per row."""
    device = prompt.device
    B, P = prompt.shape
    sample = Sampler(sampling, device, B)
    token = None
    for i in range(n_tokens):
        synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            if i == 0:
                logits, computed = model.prefill(prompt), P
            else:
                logits, computed = model.decode_one_token(token, P + i - 1), 1
            token = sample(logits)  # (B, 1)
        token_ids = tuple(token[:, 0].tolist())  # .tolist() synchronises too
        synchronize(device)
        seconds = time.perf_counter() - t0
        filled, allocated = model.kv_bytes_filled(P + i), model.kv_bytes_allocated()
        yield Step(i, P + i, token_ids, B * computed, seconds, filled, allocated)


def recompute_loop(
    recompute: Callable[[Tensor], Tensor], prompt: Tensor, n_tokens: int, sampling: Sampling
) -> Iterator[Step]:
    """The uncached loop around any model: `recompute(ids)` gives the last position's logits
    `(B, vocab)` of the whole sequences `ids` `(B, T)`, computed from scratch. The step that
    emits token t (1-based) recomputes all P + t - 1 positions so far of each row of `prompt`
    `(B, P)`."""
    device = prompt.device
    B, P = prompt.shape
    ids = torch.empty((B, P + n_tokens), dtype=torch.long, device=device)
    ids[:, :P] = prompt
    sample = Sampler(sampling, device, B)
    for i in range(n_tokens):
        synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            token = sample(recompute(ids[:, : P + i]))  # (B, 1)
        ids[:, P + i] = token[:, 0]
        token_ids = tuple(token[:, 0].tolist())
        synchronize(device)
        seconds = time.perf_counter() - t0
        yield Step(i, P + i, token_ids, B * (P + i), seconds, 0)


@dataclass
class DecoderCache:
    """kvtui's own decoder as a `CachedModel`, its paged KV cache set up (`setup_caches`)."""

    model: Transformer

    def prefill(self, prompt: Tensor) -> Tensor:
        return self.model(prompt, start=0, use_cache=True)[:, -1]

    def decode_one_token(self, token: Tensor, position: int) -> Tensor:
        return self.model.decode(token, position)

    def kv_bytes_filled(self, positions: int) -> int:
        return self.model.kv.filled_bytes

    def kv_bytes_allocated(self) -> int:
        return self.model.kv.allocated_bytes


def recompute_all(model: Transformer, ids: Tensor) -> Tensor:
    """Run the whole sequences `(B, T)` with no cache: keys and values for all T positions of
    every row again."""
    return model(ids, start=0, use_cache=False)[:, -1]


def generate(
    model: Transformer, prompt: Tensor, n_tokens: int, sampling: Sampling, *, cache: bool
) -> Iterator[Step]:
    """kvtui's decoder through the cached loop (its caches set up for the run and dropped after)
    or the uncached one, on prompts `(B, P)`: for scripts, benchmarks and tests that want steps
    without an engine."""
    if not cache:
        yield from recompute_loop(lambda ids: recompute_all(model, ids), prompt, n_tokens, sampling)
        return
    model.setup_caches(  # in the engine's blocks, from a pool that holds the run
        batch=prompt.shape[0],
        max_len=prompt.shape[1] + n_tokens,
        block_tokens=DEFAULT_BLOCK_SIZE,
    )
    try:
        yield from cached_loop(DecoderCache(model), prompt, n_tokens, sampling)
    finally:
        model.drop_caches()


def encode_text(text: str, device: torch.device | str = "cpu") -> Tensor:
    """The byte-level tokens of `text`, `(1, n_bytes)`."""
    return torch.tensor([encode_bytes(text)], dtype=torch.long, device=device)


# --- devices, weights and shapes -----------------------------------------------------------------


TRIM_EVERY_STEPS = 64
"""How often the uncached loop hands freed host memory back, in steps: each step's activations
cover the whole sequence and grow with it, and glibc would keep the largest so far."""


def trim_host_memory() -> None:
    """Hand the host memory a finished loop freed back to the system (glibc's `malloc_trim`).

    glibc keeps much of what the uncached loop's long steps freed (the whole sequence's
    activations: +70 MiB of RSS after 4,000 positions of the tiny model, of which all but 5 MiB
    is free), so an engine's RSS would climb run after run without it. Elsewhere than glibc, a
    no-op."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim` from the running process's own symbols; None without glibc."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def pick_device(name: str) -> torch.device:
    """`auto` is CUDA when present, else the CPU; `cuda` without a GPU is an `EngineError`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EngineError("--device cuda: no CUDA device is available (torch sees none)")
        return torch.device(name)
    raise EngineError(f"unknown device {name!r}: use auto, cpu or cuda")


def describe_device(device: torch.device) -> tuple[str, int | None, float | None]:
    """Where a run happens, in words; the device's memory; its peak bandwidth (NVML) if known."""
    if device.type != "cuda":
        return "cpu", None, None
    index = device.index or 0
    total = torch.cuda.get_device_properties(device).total_memory
    with open_probe(index) as probe:  # NVML: peak bandwidth from memory clock x bus width
        peak = probe.read().peak_bandwidth_bytes_per_s
    return f"cuda:{index} ({torch.cuda.get_device_name(device)})", total, peak


def device_ridge(device: torch.device, memory_bytes: int | None) -> tuple[float | None, str]:
    """The device's roofline ridge point (peak bf16 FLOP/s over peak bytes/s) and where it came
    from: a CUDA device's from the catalog GPU it matches (kvtui.sim.catalog.match_gpu); None,
    saying why, on a CPU (the catalog has no CPUs) or a GPU the catalog does not hold."""
    if device.type != "cuda":
        return None, "none: the catalog has no peak FLOP/s for a CPU"
    name = torch.cuda.get_device_name(device)
    gpu = match_gpu(name, memory_bytes)
    if gpu is None:
        return None, f"none: {name} is not in the GPU catalog"
    return gpu.ridge_flops_per_byte, f"the catalog's {gpu.display_name}"


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU, fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """kvtui.sim's name of a torch dtype: torch.bfloat16 -> "bf16"."""
    return normalize_dtype(str(dtype))


def spec_from_args(name: str, args: ModelArgs) -> ModelSpec:
    """The kvtui.sim view of a torch model's shape, so its formulas apply to it unchanged."""
    return ModelSpec(
        name=name,
        layers=args.n_layer,
        heads=args.n_head,
        kv_heads=args.n_kv_head,
        head_dim=args.head_dim,
        hidden_size=args.dim,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        params=args.params,
        max_context=args.max_positions,
        default_dtype="fp32",
    )


def load_tiny(device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple[Transformer, dict]:
    """The shipped model from assets/ (never through pickle), or, when the file is missing, the
    same architecture with seeded random weights, ready to decode on `device`. Returns the model
    and its metadata."""
    path = asset_path(TINY_WEIGHTS)
    if not path.exists():
        model = Transformer(TINY_ARGS, dtype=dtype, device=device)
        model.init_weights(seed)
        return ready_to_decode(model), {"name": "tiny-random", "weights": "random"}
    with safe_open(path, framework="pt") as f:
        metadata = dict(f.metadata() or {})
        args = ModelArgs.from_json(json.loads(metadata["config"]))
        model = Transformer(args, dtype=dtype, device=device)
        model.load_state_dict({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return ready_to_decode(model), metadata


def trained_context(metadata: dict) -> int | None:
    """The longest window the shipped weights were trained on, from their metadata: the
    `context_trained` of a long-context stage, else the training config's `context`."""
    if "context_trained" in metadata:
        return int(metadata["context_trained"])
    try:
        return int(json.loads(metadata.get("train", "{}"))["context"])
    except (KeyError, TypeError, ValueError):
        return None


def ready_to_decode(model: Transformer) -> Transformer:
    """In eval mode and, on a CPU, with its weights laid out for matrix-vector products and each
    layer's one-vector kernel chosen by timing them on this machine (`choose_matvec`)."""
    if model.output.weight.device.type == "cpu":
        model.store_weights_transposed()
    return model.eval()


def args_for_shape(spec: ModelSpec) -> ModelArgs:
    """Our decoder with a catalog model's exact attention and MLP shape."""
    if spec.is_mla or spec.active_params is not None:
        raise EngineError(
            f"shape:{spec.name} is not supported: its attention (MLA) or experts (MoE) are not "
            f"a dense grouped-query decoder; use sim:{spec.name}@GPU instead"
        )
    return ModelArgs(
        n_layer=spec.layers,
        n_head=spec.heads,
        n_kv_head=spec.kv_heads,
        dim=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_positions=min(spec.max_context, 131072),
        head_dim_override=spec.head_dim if spec.head_dim * spec.heads != spec.hidden_size else None,
    )


def _largest_weight(args: ModelArgs) -> int:
    """Elements of the model's largest linear weight."""
    q_dim, kv_dim = args.n_head * args.head_dim, args.n_kv_head * args.head_dim
    return args.dim * max(q_dim + 2 * kv_dim, q_dim, 2 * args.intermediate_size, args.vocab_size)


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Free memory where the model would live, and what that memory is, in words;
    `EngineError` when it cannot be read (a budget is not checked against a guess)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"free memory on {torch.cuda.get_device_name(device)}"
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host RAM"
    except (ValueError, OSError) as exc:
        raise EngineError(f"cannot read this machine's free memory: {exc}") from None


def build_shape(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    context: int,
    seed: int,
    batch: int = 1,
) -> Transformer:
    """Random weights in a catalog model's shape; `EngineError`, before allocating, if too big
    (the weights and the KV cache of `batch` sequences of `context` tokens)."""
    args = args_for_shape(spec)
    element = torch.empty((), dtype=dtype).element_size()
    need = args.params * element + kv_bytes(spec, context, batch, dtype_name(dtype))
    what = f"weights + KV cache for {context:,} tokens" + (f" x {batch}" if batch > 1 else "")
    if device.type == "cpu":  # `ready_to_decode` copies one weight at a time into a new layout
        need += _largest_weight(args) * element
        what += " + a copy of the largest weight"
    have, where = available_bytes(device)
    if need > have:
        raise EngineError(
            f"shape:{spec.name} needs {format_bytes(need)} ({what}) but only "
            f"{format_bytes(have)} of {where} is available"
        )
    model = Transformer(args, dtype=dtype, device=device)
    model.init_weights(seed)
    return ready_to_decode(model)


def open_pool(
    settings: RunSettings, device: torch.device, kv_bytes_per_token: int
) -> tuple[KVPool, str]:
    """The KV pool a run's cached loop takes its blocks from, and where its capacity came from:
    `--kv-budget`; else on a GPU its share (kvtui.sim.memory.gpu_pool_bytes, measured now, with
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


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of a loaded model's parameters, as they sit in memory (a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


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

    @property
    def dtype_name(self) -> str:
        return dtype_name(next(self.model.parameters()).dtype)

    def started(self) -> RunStarted:
        """What runs, and where: the model's shape, its measured weights, the device."""
        where, total, peak = describe_device(self.device)
        ridge, ridge_source = device_ridge(self.device, total)
        return RunStarted(
            engine=self.settings.engine,
            model=self.label,
            device=where,
            dtype=self.dtype_name,
            layers=self.spec.layers,
            kv_heads=self.spec.kv_heads,
            head_dim=self.spec.head_dim,
            kv_bytes_per_token=kv_bytes_per_token(self.spec, self.dtype_name),
            weights_bytes=parameter_bytes(self.model),
            prompt_tokens=self.prompt_ids().shape[1],
            tokens=self.settings.tokens,
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
        )

    def steps(self, loop: Loop) -> Iterator[StepSample | RunFinished]:
        s = self.settings
        B = s.batch
        prompt = self.prompt_ids().expand(B, -1)  # (B, P): the same prompt in every row
        P = prompt.shape[1]
        if P + s.tokens > self.max_positions:
            message = f"{P + s.tokens:,} positions is past the model's {self.max_positions:,}"
            yield RunFinished(loop, "error", 0, message)
            return
        sampling = Sampling(temperature=s.temperature, top_k=s.top_k, seed=s.seed, greedy=s.greedy)
        text = self.text_stream()
        allocated = filled = None
        done, stopped = 0, ""
        run: Iterator[Step] | None = None
        try:
            if loop == "cached":
                run = cached_loop(self.cached(P + s.tokens, B), prompt, s.tokens, sampling)
            else:
                run = recompute_loop(self.recompute, prompt, s.tokens, sampling)
            for step in run:
                if loop == "cached":
                    allocated, filled = step.kv_bytes_allocated, step.kv_bytes
                done += 1
                yield self._sample(loop, step, text(step.token_id))
                if loop == "uncached" and done % TRIM_EVERY_STEPS == 0:
                    trim_host_memory()  # between steps: never inside a timed one
        except KVCacheFull:
            stopped = self.pool.full_message(P, B) if self.pool else "the KV cache is full"
        except torch.OutOfMemoryError:  # reported below, once the traceback no longer pins tensors
            stopped = f"out of memory at {P + done:,} tokens"
        finally:
            if run is not None:
                run.close()  # a stopped run's loop lets go of its cache too
            run = None
            if loop == "cached":
                self.free_cache()
            trim_host_memory()  # after the loop, outside every timed step
        reason = "out_of_memory" if stopped else "done"
        yield RunFinished(
            loop, reason, done, stopped, kv_bytes_allocated=allocated, kv_bytes_filled=filled
        )

    def _sample(self, loop: Loop, step: Step, text: str) -> StepSample:
        """A measured step as the protocol's sample, with the FLOPs and bytes kvtui.sim counts
        for the whole batch."""
        dtype, B = self.dtype_name, self.settings.batch
        if loop == "cached" and step.index > 0:  # one new position per row against the cache
            flops = decode_step_flops(self.spec, step.position, B)
            read = decode_step_bytes(self.spec, step.position, dtype, dtype, B)
        else:  # an uncached step, or the cached loop's prefill: each row's `position` positions
            flops = uncached_step_flops(self.spec, step.position, B)
            read = uncached_step_bytes(self.spec, step.position, dtype, dtype, B)
        on_gpu = self.device.type == "cuda"
        return StepSample(
            loop=loop,
            step=step.index,
            position=step.position,
            token_id=step.token_id,
            text=text,
            positions_computed=step.positions_computed,
            flops=flops,
            bytes_read=read,
            step_seconds=step.step_seconds,
            kv_bytes=step.kv_bytes,
            kv_bytes_allocated=step.kv_bytes_allocated,
            device_memory_bytes=torch.cuda.memory_allocated(self.device) if on_gpu else None,
        )

    def close(self) -> None:
        self.free_cache()


class DecoderEngine(TorchEngine):
    """kvtui's own decoder: `tiny` (byte-level, the shipped weights) or `shape:NAME` (a catalog
    model's shape, random weights, random prompt ids as long as the prompt's bytes)."""

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
        self.pool, self.pool_source = open_pool(
            settings, device, kv_bytes_per_token(spec, self.dtype_name)
        )
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

    def prompt_ids(self) -> Tensor:
        return self._prompt

    def cached(self, max_len: int, batch: int) -> CachedModel:
        pool = self.pool
        self.model.setup_caches(
            batch=batch, max_len=max_len, block_tokens=pool.block_tokens, pool_blocks=pool.blocks
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


def open_torch_engine(settings: RunSettings, model_name: str | None) -> DecoderEngine:
    """`tiny` (`model_name` None) or `shape:model_name`, on the device the settings ask for."""
    torch.set_num_threads(max(1, settings.threads))
    device = pick_device(settings.device)
    dtype = default_dtype(device)
    if model_name is None:
        model, meta = load_tiny(device, dtype, settings.seed)
        label = meta.get("name", "tiny-austen")
        spec = spec_from_args(label, model.args)
        trained = trained_context(meta)
        return DecoderEngine(
            settings, model, spec, device, label, byte_level=True, trained_positions=trained
        )
    try:
        spec = get_model(model_name)
    except UnknownNameError as exc:
        raise EngineError(str(exc)) from exc
    context = len(encode_bytes(settings.prompt)) + settings.tokens
    model = build_shape(spec, device, dtype, context, settings.seed, settings.batch)
    label = f"shape:{spec.name}"
    return DecoderEngine(
        settings, model, spec, device, label, byte_level=False, trained_positions=spec.max_context
    )
