"""The torch engines: the shipped tiny model (`tiny`) and catalog shapes (`shape:NAME`).

Both wrap kvtui.gpu.decode's loops in the engine protocol of kvtui.sim.steps: every step becomes a
`StepSample` with the FLOPs and bytes kvtui.sim counts for it, the measured wall time, the KV
bytes held and, on a GPU, the device memory in use. Out of memory on a GPU ends the loop with
"out of memory at N tokens", frees the cache, and the process goes on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open

from kvtui.format import format_bytes
from kvtui.gpu.decode import Sampling, Step, cached_loop, encode_text, uncached_loop
from kvtui.gpu.model import ModelArgs, Transformer
from kvtui.gpu.probe import open_probe
from kvtui.paths import asset_path
from kvtui.sim.catalog import ModelSpec, UnknownNameError, get_model
from kvtui.sim.memory import kv_bytes, kv_bytes_per_token
from kvtui.sim.steps import EngineError, Loop, RunFinished, RunSettings, RunStarted, StepSample
from kvtui.sim.work import (
    decode_step_bytes,
    decode_step_flops,
    uncached_step_bytes,
    uncached_step_flops,
)
from kvtui.text import Utf8Stream

TINY_WEIGHTS = "tiny-austen.safetensors"
TINY_ARGS = ModelArgs(n_layer=6, n_head=8, n_kv_head=2, dim=256, intermediate_size=512)
"""The tiny model's shape, used for seeded random weights when the shipped file is missing."""

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


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


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU, fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def spec_from_args(name: str, args: ModelArgs, params: int) -> ModelSpec:
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
        params=params,
        max_context=args.max_positions,
        default_dtype="fp32",
    )


def load_tiny(device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple[Transformer, dict]:
    """The shipped model from assets/ (never through pickle), or, when the file is missing, the
    same architecture with seeded random weights, ready to decode on `device`. Returns the model
    and its metadata."""
    path = asset_path(TINY_WEIGHTS)
    if not path.exists():
        model = Transformer(TINY_ARGS)
        model.init_weights(seed)
        metadata = {"name": "tiny-random", "weights": "random"}
    else:
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
            args = ModelArgs.from_json(json.loads(metadata["config"]))
            model = Transformer(args)
            model.load_state_dict({key: f.get_tensor(key).float() for key in f.keys()})  # noqa: SIM118
    return ready_to_decode(model.to(device=device, dtype=dtype)), metadata


def ready_to_decode(model: Transformer) -> Transformer:
    """In eval mode and, on a CPU, with its weights laid out for matrix-vector products."""
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


def _params_of(args: ModelArgs) -> int:
    attention = (
        args.dim * (args.n_head + 2 * args.n_kv_head) * args.head_dim
        + args.n_head * args.head_dim * args.dim
    )
    mlp = 3 * args.dim * args.intermediate_size
    return (
        args.n_layer * (attention + mlp + 2 * args.dim) + 2 * args.vocab_size * args.dim + args.dim
    )


def _largest_weight(args: ModelArgs) -> int:
    """Elements of the model's largest linear weight."""
    q_dim, kv_dim = args.n_head * args.head_dim, args.n_kv_head * args.head_dim
    return args.dim * max(q_dim + 2 * kv_dim, q_dim, 2 * args.intermediate_size, args.vocab_size)


def available_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"free memory on {torch.cuda.get_device_name(device)}"
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62, "host RAM"
    return pages, "free host RAM"


def build_shape(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, context: int, seed: int
) -> Transformer:
    """Random weights in a catalog model's shape; `EngineError`, before allocating, if too big."""
    args = args_for_shape(spec)
    element = torch.empty((), dtype=dtype).element_size()
    need = _params_of(args) * element + kv_bytes(spec, context, 1, _DTYPE_NAMES[dtype])
    what = f"weights + KV cache for {context:,} tokens"
    if device.type == "cpu":  # `ready_to_decode` copies one weight at a time into a new layout
        need += _largest_weight(args) * element
        what += " + a copy of the largest weight"
    have, where = available_bytes(device)
    if need > have:
        raise EngineError(
            f"shape:{spec.name} needs {format_bytes(need)} ({what}) but only "
            f"{format_bytes(have)} of {where} is available"
        )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in the run's dtype, on the device, once
    try:
        with torch.device(device):
            model = Transformer(args)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("weight"):
                p.fill_(1.0)
    return ready_to_decode(model)


def sampling_of(settings: RunSettings) -> Sampling:
    """How the run's settings choose each token."""
    s = settings
    return Sampling(temperature=s.temperature, top_k=s.top_k, seed=s.seed, greedy=s.greedy)


def too_long(loop: Loop, positions: int, max_positions: int) -> RunFinished | None:
    """The refusal of a run of `positions` (prompt + answer) past the model's, or None."""
    if positions <= max_positions:
        return None
    message = f"{positions:,} positions is past the model's {max_positions:,}"
    return RunFinished(loop, "error", 0, message)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of a loaded model's parameters, as they sit in memory (a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def torch_run_started(
    settings: RunSettings,
    label: str,
    spec: ModelSpec,
    device: torch.device,
    dtype: str,
    *,
    weights_bytes: int,
    prompt_tokens: int,
    max_positions: int,
) -> RunStarted:
    """What a torch engine runs, and where: the model's shape, its measured weights, the device."""
    where, total, peak = describe_device(device)
    return RunStarted(
        engine=settings.engine,
        model=label,
        device=where,
        dtype=dtype,
        layers=spec.layers,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        kv_bytes_per_token=kv_bytes_per_token(spec, dtype),
        weights_bytes=weights_bytes,
        prompt_tokens=prompt_tokens,
        tokens=settings.tokens,
        threads=torch.get_num_threads(),
        peak_bandwidth_bytes_per_s=peak,
        device_memory_total_bytes=total,
        max_positions=max_positions,
    )


def step_sample(
    spec: ModelSpec, loop: Loop, step: Step, dtype: str, text: str, device: torch.device
) -> StepSample:
    """A measured step as the protocol's sample, with the FLOPs and bytes kvtui.sim counts."""
    if loop == "cached" and step.index > 0:  # one new position against the cache
        flops = decode_step_flops(spec, step.position)
        read = decode_step_bytes(spec, step.position, dtype, dtype)
    else:  # an uncached step, or the cached loop's prefill: many positions in one pass
        flops = uncached_step_flops(spec, step.positions_computed)
        read = uncached_step_bytes(spec, step.positions_computed, dtype, dtype)
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
        device_memory_bytes=(
            torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        ),
    )


@dataclass
class TorchEngine:
    settings: RunSettings
    model: Transformer
    spec: ModelSpec
    device: torch.device
    label: str
    byte_level: bool
    """Token ids are UTF-8 bytes (the tiny model); else they are shown as ids."""

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.model.output.weight.dtype]

    def _prompt(self) -> torch.Tensor:
        if self.byte_level:
            return encode_text(self.settings.prompt, self.device)
        gen = torch.Generator().manual_seed(self.settings.seed)
        n = max(1, len(self.settings.prompt.encode("utf-8")))
        return torch.randint(0, self.spec.vocab_size, (1, n), generator=gen).to(self.device)

    def started(self) -> RunStarted:
        return torch_run_started(
            self.settings,
            self.label,
            self.spec,
            self.device,
            self.dtype_name,
            weights_bytes=parameter_bytes(self.model),
            prompt_tokens=self._prompt().shape[1],
            max_positions=self.model.args.max_positions,
        )

    def steps(self, loop: Loop) -> Iterator[StepSample | RunFinished]:
        s = self.settings
        prompt = self._prompt()
        P = prompt.shape[1]
        if refused := too_long(loop, P + s.tokens, self.model.args.max_positions):
            yield refused
            return
        sampling = sampling_of(s)
        run = cached_loop if loop == "cached" else uncached_loop
        text = Utf8Stream()
        allocated, done = None, 0
        try:
            for step in run(self.model, prompt, s.tokens, sampling):
                if loop == "cached":
                    allocated = self.model.kv_bytes_allocated
                done += 1
                token_text = text.push(step.token_id) if self.byte_level else f" {step.token_id}"
                yield step_sample(self.spec, loop, step, self.dtype_name, token_text, self.device)
        except torch.OutOfMemoryError:
            self.model.drop_caches()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            yield RunFinished(loop, "out_of_memory", done, f"out of memory at {P + done:,} tokens")
            return
        yield RunFinished(loop, "done", done, kv_bytes_allocated=allocated)

    def close(self) -> None:
        self.model.drop_caches()


def open_torch_engine(settings: RunSettings) -> TorchEngine:
    """`tiny` or `shape:NAME`, on the device the settings ask for."""
    torch.set_num_threads(max(1, settings.threads))
    device = pick_device(settings.device)
    dtype = default_dtype(device)
    if settings.tokens < 1:
        raise EngineError("tokens must be at least 1")
    if settings.engine == "tiny":
        model, meta = load_tiny(device, dtype, settings.seed)
        label = meta.get("name", "tiny-austen")
        spec = spec_from_args(label, model.args, model.num_params())
        return TorchEngine(settings, model, spec, device, label, byte_level=True)
    name = settings.engine.partition(":")[2]
    try:
        spec = get_model(name)
    except UnknownNameError as exc:
        raise EngineError(str(exc)) from exc
    context = len(settings.prompt.encode("utf-8")) + settings.tokens
    model = build_shape(spec, device, dtype, context, settings.seed)
    return TorchEngine(settings, model, spec, device, f"shape:{spec.name}", byte_level=False)
