"""Known models, GPUs and number formats, looked up by name, without a UI.

The figures live in `assets/models.json` and `assets/gpus.json`, each with the URL it was copied
from; this module loads them once, on first use. `model_from_hf_config` reads a user's own Hugging
Face `config.json` into the same `ModelSpec`; `match_gpu` says which catalog GPU, if any, a probed
device is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from typing import Any

from kvtui.paths import asset_path

GIB = 2**30


class UnknownNameError(ValueError):
    """A model, GPU or dtype name that is not in the catalog; the message suggests close names."""


class ConfigError(ValueError):
    """A config.json that cannot be read as a model; the message is one line for a person."""


# --- number formats ------------------------------------------------------------------------------

DTYPE_BYTES: dict[str, Fraction] = {
    "fp32": Fraction(4),
    "fp16": Fraction(2),
    "bf16": Fraction(2),
    "fp8": Fraction(1),
    "int8": Fraction(1),
    "int4": Fraction(1, 2),
}
"""Bytes per element of each storage format; int4 is half a byte, kept exact. int8 (integers,
as bitsandbytes and 8-bit GPTQ store weights) is not fp8 (a float format), though both take a
byte. A KV cache in int8 also keeps a scale per vector (kvtui.sim.memory.KV_SCALE_BYTES); fp8
keeps one per tensor."""

_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "fp8_e4m3": "fp8",  # vLLM's --kv-cache-dtype names its two fp8 formats so
    "fp8_e5m2": "fp8",
    "4bit": "int4",
}


def dtype_names() -> list[str]:
    """The storage formats kvtui knows, largest first."""
    return list(DTYPE_BYTES)


def normalize_dtype(name: str) -> str:
    """The catalog name of a dtype (`bfloat16` -> `bf16`); UnknownNameError if there is none."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise UnknownNameError(_unknown("dtype", name, list(DTYPE_BYTES)))
    return key


def serving_dtypes(published: str) -> tuple[str, str]:
    """The (weights, KV cache) dtypes a server keeps a model published in `published` in, as
    vLLM does with dtype and kv_cache_dtype "auto": fp32 weights in bf16, fp16 and bf16 as they
    are, 8-bit and 4-bit weights as they are; the KV cache in the activations' dtype (the
    weights', or bf16 beside 8-bit and 4-bit weights, which are dequantised to compute). The
    `sim:` engine and screen 3's what-if both price a model so."""
    name = normalize_dtype(published)
    weights = "bf16" if name == "fp32" else name
    return weights, activation_dtype(weights)


def activation_dtype(weights: str) -> str:
    """The dtype a server computes (and keeps an `auto` KV cache) in beside weights stored in
    `weights`: theirs for fp32, fp16 and bf16; bf16 beside 8-bit and 4-bit weights, which are
    dequantised to compute."""
    name = normalize_dtype(weights)
    return name if name in ("fp32", "fp16", "bf16") else "bf16"


def compute_dtype(stored: str, *, gpu: bool, gpu_has_bf16: bool = True) -> tuple[str, str]:
    """The dtype kvtui's torch engines compute a model stored in `stored` in, and why, in
    words: on a GPU the weights' own where it can (bf16 where the GPU has it, else fp16; 8-bit
    and 4-bit weights in bf16, as kvtui's torch code has no kernels for them); on a CPU fp32
    (kvtui's CPU kernels are fp32). kvtui.gpu.device.run_dtype gives the torch dtype."""
    stored = normalize_dtype(stored)
    if not gpu:
        return (
            "fp32",
            "the weights' own" if stored == "fp32" else f"{stored} weights; a CPU computes fp32",
        )
    if stored in ("fp32", "fp16") or stored == "bf16" and gpu_has_bf16:
        return stored, "the weights' own"
    if stored == "bf16":
        return "fp16", "bf16 weights; this GPU has no bf16"
    return ("bf16" if gpu_has_bf16 else "fp16"), f"{stored} weights; no {stored} kernels here"


def dtype_bytes(name: str) -> Fraction:
    """Bytes per element of a dtype, exact (`int4` -> 1/2)."""
    return DTYPE_BYTES[normalize_dtype(name)]


# --- specs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer: what its KV cache and decode step cost."""

    name: str
    layers: int
    heads: int
    """Query heads per layer."""
    kv_heads: int
    """Key/value heads per layer (fewer than `heads` with grouped-query attention)."""
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    params: int
    """All parameters (every expert of a mixture of experts)."""
    max_context: int
    """The longest context the model was built for (max_position_embeddings)."""
    default_dtype: str = "bf16"
    """The dtype its weights are published in."""
    display_name: str = ""
    sliding_window: int | None = None
    """Tokens a sliding-window layer keeps; None when no layer slides."""
    sliding_layers: tuple[int, ...] = ()
    """Indices of the layers that use `sliding_window` (the others attend to everything)."""
    kv_lora_rank: int | None = None
    """Multi-head latent attention (DeepSeek): size of the cached latent; None without MLA."""
    qk_rope_head_dim: int | None = None
    """MLA: the rotary part of the key, cached beside the latent."""
    active_params: int | None = None
    """Parameters used per token by a mixture of experts; None for a dense model."""
    matrix_params: int | None = None
    """Parameters in the weight matrices each position is multiplied by (every parameter but
    the embedding lookups, norms and biases; the output head counts), where the shape states
    them exactly: kvtui's own decoder, a dense `config.json`. None: `params_per_token` stands in
    (the "about 2N" of Kaplan et al.)."""
    source: str = ""
    """Where the figures come from (a URL, or the config file read)."""
    notes: str = ""

    @property
    def label(self) -> str:
        return self.display_name or self.name

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def params_per_token(self) -> int:
        """Parameters one decode step reads and multiplies (only the active experts of an MoE)."""
        return self.active_params if self.active_params is not None else self.params

    @property
    def multiplied_params(self) -> int:
        """Parameters one position is multiplied by: `matrix_params` where known, else
        `params_per_token`. The FLOPs formula counts 2 per parameter per position."""
        return self.matrix_params if self.matrix_params is not None else self.params_per_token

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the tokens it keeps in its cache: the window, or None for all of them."""
        sliding = set(self.sliding_layers) if self.sliding_window is not None else set()
        return tuple(self.sliding_window if i in sliding else None for i in range(self.layers))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "display_name": self.label,
            "layers": self.layers,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "params": self.params,
            "active_params": self.active_params,
            "matrix_params": self.matrix_params,
            "max_context": self.max_context,
            "default_dtype": self.default_dtype,
            "sliding_window": self.sliding_window,
            "sliding_layers": list(self.sliding_layers),
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "source": self.source,
        }


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: how much it holds, how fast it reads, how fast it multiplies."""

    name: str
    display_name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    """Peak memory bandwidth from the datasheet (decimal: 3.35 TB/s is 3.35e12)."""
    peak_bf16_flops: float
    """Peak dense BF16 tensor FLOP/s (FP16 where the part has no BF16)."""
    source: str = ""
    notes: str = ""
    interconnect_bytes_per_s: float | None = None
    """GPU-to-GPU bandwidth one way (NVLink, Infinity Fabric or PCIe): half the vendor's figure,
    which counts both directions together. None where the catalog does not say."""
    interconnect: str = ""
    """Which link, and where its figure is from."""

    @property
    def ridge_flops_per_byte(self) -> float:
        """The roofline's ridge point: below this arithmetic intensity a kernel is memory-bound."""
        return self.peak_bf16_flops / self.bandwidth_bytes_per_s

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "display_name": self.display_name,
            "memory_bytes": self.memory_bytes,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "peak_bf16_flops": self.peak_bf16_flops,
            "interconnect_bytes_per_s": self.interconnect_bytes_per_s,
            "source": self.source,
        }


# --- catalogs ------------------------------------------------------------------------------------


def _unknown(kind: str, name: str, known: list[str]) -> str:
    import difflib  # only for a name not known

    close = difflib.get_close_matches(str(name).lower(), known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown {kind} {name!r}{hint} (known: {', '.join(known)})"


def _sliding_layers(value: Any, layers: int) -> tuple[int, ...]:
    if value == "all":
        return tuple(range(layers))
    if value == "even":
        return tuple(range(0, layers, 2))
    if value is None:
        return ()
    return tuple(int(i) for i in value)


def _model_from_entry(entry: dict[str, Any]) -> ModelSpec:
    layers = int(entry["layers"])
    window = entry.get("sliding_window")
    return ModelSpec(
        name=entry["name"],
        display_name=entry.get("display_name", ""),
        layers=layers,
        heads=int(entry["heads"]),
        kv_heads=int(entry["kv_heads"]),
        head_dim=int(entry["head_dim"]),
        hidden_size=int(entry["hidden_size"]),
        intermediate_size=int(entry["intermediate_size"]),
        vocab_size=int(entry["vocab_size"]),
        params=int(entry["params"]),
        active_params=entry.get("active_params"),
        max_context=int(entry["max_context"]),
        default_dtype=normalize_dtype(entry.get("default_dtype", "bf16")),
        sliding_window=window,
        sliding_layers=_sliding_layers(entry.get("sliding_layers"), layers) if window else (),
        kv_lora_rank=entry.get("kv_lora_rank"),
        qk_rope_head_dim=entry.get("qk_rope_head_dim"),
        source=entry.get("source", ""),
        notes=entry.get("notes", ""),
    )


@cache
def _models() -> dict[str, ModelSpec]:
    data = json.loads(asset_path("models.json").read_text(encoding="utf-8"))
    return {entry["name"]: _model_from_entry(entry) for entry in data["models"]}


@cache
def _gpus() -> dict[str, GPUSpec]:
    data = json.loads(asset_path("gpus.json").read_text(encoding="utf-8"))
    return {
        entry["name"]: GPUSpec(
            name=entry["name"],
            display_name=entry["display_name"],
            memory_bytes=int(entry["memory_gib"] * GIB),
            bandwidth_bytes_per_s=float(entry["bandwidth_bytes_per_s"]),
            peak_bf16_flops=float(entry["peak_bf16_flops"]),
            source=entry.get("source", ""),
            notes=entry.get("notes", ""),
            interconnect_bytes_per_s=(
                float(entry["interconnect_bytes_per_s"])
                if entry.get("interconnect_bytes_per_s") is not None
                else None
            ),
            interconnect=entry.get("interconnect", ""),
        )
        for entry in data["gpus"]
    }


def model_names() -> list[str]:
    """Names of the catalog's models, in catalog order."""
    return list(_models())


def gpu_names() -> list[str]:
    """Names of the catalog's GPUs, in catalog order (smallest memory first)."""
    return list(_gpus())


def get_model(name: str) -> ModelSpec:
    """A catalog model by name (case-insensitive); UnknownNameError suggests close names."""
    models = _models()
    try:
        return models[str(name).strip().lower()]
    except KeyError:
        raise UnknownNameError(_unknown("model", name, list(models))) from None


def get_gpu(name: str) -> GPUSpec:
    """A catalog GPU by name (case-insensitive); UnknownNameError suggests close names."""
    gpus = _gpus()
    try:
        return gpus[str(name).strip().lower()]
    except KeyError:
        raise UnknownNameError(_unknown("GPU", name, list(gpus))) from None


# --- which catalog GPU a probed device is --------------------------------------------------------

MEMORY_MATCH = (0.90, 1.01)
"""A probed total matches a catalog capacity from 90% to 101% of it. Drivers report a little under
the label (H100 80GB HBM3: 79.6 GiB; A100 80GB: exactly 80 GiB), and GDDR with ECC on gives up a
sixteenth (L40S: 45 GiB of 48); the next size of the same part is far outside (A100 40 and 80 GB,
V100 16 and 32 GB, a 94 GB H100 NVL against the 80 GB H100)."""

_VENDOR_WORDS = frozenset({"nvidia", "amd", "tesla", "geforce", "quadro", "instinct", "radeon"})
_FORM_FACTORS = ("sxm", "pcie", "nvl")


def _words(text: str) -> list[str]:
    """Lower-case words of a GPU name: "NVIDIA A100-SXM4-40GB" -> nvidia, a100, sxm4, 40gb."""
    return re.findall(r"[a-z0-9]+", text.lower())


def _form_factor(words: Iterable[str]) -> str | None:
    """The form factor a word names, "sxm", "pcie" or "nvl" (sxm2/4/5 are SXM); else None."""
    for word in words:
        stem = word.rstrip("0123456789")
        if stem in _FORM_FACTORS:
            return stem
    return None


@cache
def _gpu_name_keys() -> list[tuple[GPUSpec, frozenset[str], str | None]]:
    """Per catalog GPU: the words a device name must contain, and the entry's form factor.

    The words are those of the display name outside its parentheses, less the vendor's words, the
    memory size (`80GB`: memory is matched against the probed total) and the form factor."""
    keys = []
    for gpu in _gpus().values():
        outside = _words(re.sub(r"\([^)]*\)", " ", gpu.display_name))
        required = frozenset(
            word
            for word in outside
            if word not in _VENDOR_WORDS
            and not re.fullmatch(r"\d+gb?", word)
            and _form_factor([word]) is None
        )
        keys.append((gpu, required, _form_factor(_words(gpu.display_name))))
    return keys


def match_gpu(name: str, total_bytes: int | None) -> GPUSpec | None:
    """The catalog GPU a probed device is, from its driver name and memory; None if it is none.

    A catalog entry matches when every word of its display name outside the parentheses (less
    vendor, memory size and form factor) is a word of `name`, so an L4 never matches "NVIDIA L40S",
    nor an A10 "NVIDIA A10G"; when the form factors agree (a name without one is taken for SXM, as
    NVML names H100 SXM "NVIDIA H100 80GB HBM3"); and when `total_bytes` is within MEMORY_MATCH of
    its capacity. Of several, the entry with most words wins, then the nearest capacity; with the
    total unknown, only a single candidate matches. A MIG slice is a share of a GPU, so None.
    """
    words = set(_words(name or ""))
    if not words or "mig" in words:
        return None
    form = _form_factor(words)
    low, high = MEMORY_MATCH
    candidates: list[tuple[int, GPUSpec]] = []
    for gpu, required, entry_form in _gpu_name_keys():
        if not required <= words:
            continue
        if entry_form is not None and form != entry_form and (form, entry_form) != (None, "sxm"):
            continue
        if total_bytes is not None and not (
            low * gpu.memory_bytes <= total_bytes <= high * gpu.memory_bytes
        ):
            continue
        candidates.append((len(required), gpu))
    if not candidates:
        return None
    most = max(count for count, _ in candidates)
    best = [gpu for count, gpu in candidates if count == most]
    if total_bytes is None:
        return best[0] if len(best) == 1 else None
    return min(best, key=lambda gpu: abs(gpu.memory_bytes - total_bytes))


def gpu_from_probe(probe: dict[str, Any] | None) -> GPUSpec | None:
    """The GPU a device probe's summary found (kvtui.gpu.probe.probe_summary): its catalog
    entry (by `match_gpu`, from its `name` and `total_bytes`); else, for a GPU the catalog does
    not hold, the device itself by its own name and memory, its peak bandwidth NVML's estimate
    (0 where unknown) and its peak FLOP/s unknown (0), its `notes` saying so; None where the
    probe read no GPU."""
    probe = probe or {}
    name, total = str(probe.get("name") or ""), probe.get("total_bytes") or None
    gpu = match_gpu(name, total)
    if gpu is not None or not name or not isinstance(total, int) or total <= 0:
        return gpu
    bandwidth = probe.get("peak_bandwidth_bytes_per_s")
    return GPUSpec(
        name=name.lower(),
        display_name=name,
        memory_bytes=total,
        bandwidth_bytes_per_s=float(bandwidth) if isinstance(bandwidth, int | float) else 0.0,
        peak_bf16_flops=0.0,
        source="this machine's device, as NVML reads it",
        notes="not in the catalog: its peak FLOP/s is unknown",
    )


# --- a shape's parameters -----------------------------------------------------------------------


def estimate_params(
    *,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    tied_embeddings: bool,
    gpt2_style: bool = False,
    max_context: int = 0,
    attention_params: int | None = None,
) -> int:
    """Parameters of a dense decoder from its shape.

    Llama style: q, k, v, o projections without bias, a gated MLP (3 matrices), two RMSNorm weights
    per layer, a final norm, token embeddings and an LM head unless tied. GPT-2 style: biases,
    LayerNorm weight and bias, a 2-matrix MLP, learned position embeddings, tied head. Exact for
    the Llama 2/3 and GPT-2 catalog entries. `attention_params` replaces the per-layer attention
    count where projections differ (multi-head latent attention).
    """
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    attention = hidden_size * q_size + 2 * hidden_size * kv_size + q_size * hidden_size
    if attention_params is not None:
        attention = attention_params
    if gpt2_style:
        attention += q_size + 2 * kv_size + hidden_size  # biases
        mlp = 2 * hidden_size * intermediate_size + intermediate_size + hidden_size
        norms = 4 * hidden_size
        extra = max_context * hidden_size + 2 * hidden_size  # wpe, ln_f
    else:
        mlp = 3 * hidden_size * intermediate_size
        norms = 2 * hidden_size
        extra = hidden_size  # final norm
    embeddings = vocab_size * hidden_size * (1 if tied_embeddings else 2)
    return layers * (attention + mlp + norms) + embeddings + extra


def estimate_matrix_params(
    *,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    gpt2_style: bool = False,
) -> int:
    """Parameters of a dense decoder's weight matrices (`ModelSpec.matrix_params`): q, k, v, o,
    the MLP's matrices (3 gated, 2 in GPT-2's) and the output head (the embedding table again,
    when tied), without the lookups, norms and biases that `estimate_params` also counts."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    attention = 2 * hidden_size * q_size + 2 * hidden_size * kv_size
    mlp = (2 if gpt2_style else 3) * hidden_size * intermediate_size
    return layers * (attention + mlp) + vocab_size * hidden_size


def spec_matrix_params(spec: ModelSpec) -> int:
    """`estimate_matrix_params` of a dense Llama-style spec's own shape."""
    return estimate_matrix_params(
        layers=spec.layers,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
    )
