"""Known models, GPUs and number formats, looked up by name, without a UI.

The figures live in `assets/models.json` and `assets/gpus.json`, each with the URL it was copied
from; this module loads them once, on first use. `model_from_hf_config` reads a user's own Hugging
Face `config.json` into the same `ModelSpec`; `match_gpu` says which catalog GPU, if any, a probed
device is.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import Any

from kvtui.inputs import MIB, InputError, read_json
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
    "int4": Fraction(1, 2),
}
"""Bytes per element of each storage format; int4 is half a byte, kept exact."""

_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "int8": "fp8",
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


def gpu_from_probe(probe: dict[str, Any] | None) -> str | None:
    """The catalog GPU a device probe's summary found (kvtui.gpu.probe.probe_summary: its
    `name` and `total_bytes`, by `match_gpu`), by name; None if it is none."""
    probe = probe or {}
    gpu = match_gpu(str(probe.get("name") or ""), probe.get("total_bytes") or None)
    return gpu.name if gpu else None


# --- a user's own config.json --------------------------------------------------------------------


CONFIG_LIMIT = 16 * MIB
"""The largest config.json read (published ones are a few KiB; a few with label maps, 1 MiB)."""
MAX_LAYERS = 1024
"""The most layers a config may state: 8x the deepest published decoder (Llama 3.1 405B, 126).
Per-layer figures (sliding windows, cached positions) are kept per layer."""
MAX_SIZE = 2**24
"""The largest value any other size in a config may state (heads, widths, vocabulary, context,
experts, windows, ranks): 16,777,216, past the longest published context (Llama 4 Scout, 10M
tokens) and the largest vocabulary (Gemma's 262,144). So every figure derived from a config is
an exact integer that also converts to a float, and a budget takes microseconds."""
MAX_PARAMS = 2**50
"""The most parameters a config may state (about 1.1 quadrillion)."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _key(config: dict[str, Any], keys: tuple[str, ...]) -> str:
    """The first of `keys` the config sets (to a value other than null), else the first."""
    return next((key for key in keys if config.get(key) is not None), keys[0])


def _first(config: dict[str, Any], *keys: str) -> Any:
    return config.get(_key(config, keys))


def _int(
    config: dict[str, Any],
    where: str,
    *keys: str,
    default: Any = None,
    minimum: int = 1,
    maximum: int = MAX_SIZE,
) -> int:
    """The first of `keys` the config sets, else `default`: an integer from `minimum` to
    `maximum`; ConfigError (naming the file and the field) when missing or of another type."""
    value = _first(config, *keys)
    if value is None:
        value = default
    if value is None:
        raise ConfigError(f"{where}: missing {' or '.join(keys)}")
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        kind = "a positive integer" if minimum == 1 else f"an integer from {minimum:,}"
        raise ConfigError(
            f"{where}: {_key(config, keys)} must be {kind} up to {maximum:,}, not {_shown(value)}"
        )
    return value


def _positive_int(config: dict[str, Any], where: str, *keys: str, default: Any = None) -> int:
    return _int(config, where, *keys, default=default)


def _optional(
    config: dict[str, Any], where: str, key: str, kind: type | tuple[type, ...], words: str
) -> Any:
    """A field that may be missing or null, else of `kind`; ConfigError if it is not."""
    value = config.get(key)
    if value is not None and (
        not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)
    ):
        raise ConfigError(f"{where}: {key} must be {words}, not {_shown(value)}")
    return value


def _hf_sliding(
    config: dict[str, Any], where: str, layers: int, max_context: int
) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers that use it, as transformers would run the config."""
    use = _optional(config, where, "use_sliding_window", bool, "true or false")
    window = _int(config, where, "sliding_window", default=0, minimum=0)
    layer_types = _optional(config, where, "layer_types", list, "a list of layer types")
    if layer_types is not None and (
        len(layer_types) != layers or not all(isinstance(kind, str) for kind in layer_types)
    ):
        raise ConfigError(f"{where}: layer_types must name each of the {layers} layers' attention")
    if window == 0 or use is False or window >= max_context:
        return None, ()
    if layer_types is not None:
        sliding = tuple(i for i, kind in enumerate(layer_types) if "sliding" in kind)
    elif config.get("model_type") == "gemma2":
        sliding = tuple(range(0, layers, 2))
    elif use is True and "max_window_layers" in config:
        # Qwen2: layers from max_window_layers on use the window.
        first = _int(config, where, "max_window_layers", minimum=0, maximum=layers)
        sliding = tuple(range(first, layers))
    else:
        sliding = tuple(range(layers))
    return (window, sliding) if sliding else (None, ())


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


def _moe_params(
    config: dict[str, Any], where: str, hidden: int, layers: int, dense_mlp: int
) -> tuple[int, int]:
    """(all, active) MLP parameters of a mixture of experts, summed over layers."""
    experts = _int(config, where, *_EXPERTS)
    per_token = _int(config, where, "num_experts_per_tok", default=2, maximum=experts)
    shared = _int(config, where, "n_shared_experts", default=0, minimum=0)
    expert_size = _int(config, where, "moe_intermediate_size", "intermediate_size")
    dense_layers = _int(
        config, where, "first_k_dense_replace", default=0, minimum=0, maximum=layers
    )
    moe_layers = layers - dense_layers
    expert = 3 * hidden * expert_size
    all_mlp = dense_layers * dense_mlp + moe_layers * (
        (experts + shared) * expert + hidden * experts
    )
    active_mlp = dense_layers * dense_mlp + moe_layers * ((per_token + shared) * expert)
    return all_mlp, active_mlp


_EXPERTS = ("n_routed_experts", "num_local_experts", "num_experts")


def _mla_attention_params(config: dict[str, Any], where: str, hidden: int, heads: int) -> int:
    """Per-layer parameters of DeepSeek's multi-head latent attention (low-rank q and kv)."""
    rope = _int(config, where, "qk_rope_head_dim", default=0, minimum=0)
    nope = _int(config, where, "qk_nope_head_dim", default=0, minimum=0)
    v_dim = _int(config, where, "v_head_dim", default=nope, minimum=0)
    kv_rank = _int(config, where, "kv_lora_rank")
    q_rank = _int(config, where, "q_lora_rank", default=0, minimum=0)
    if q_rank:
        q = hidden * q_rank + q_rank + q_rank * heads * (nope + rope)
    else:
        q = hidden * heads * (nope + rope)
    kv = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
    return q + kv + heads * v_dim * hidden


def _quantized_dtype(config: dict[str, Any], where: str) -> str | None:
    """The weights' storage format a quantization_config states (fp8, int4); None without one."""
    quantization = _optional(config, where, "quantization_config", dict, "an object")
    if quantization is None:
        return None
    method = _optional(quantization, where, "quant_method", str, "a string") or ""
    bits = _optional(quantization, where, "bits", int, "an integer")
    if method.lower() == "fp8":
        return "fp8"
    if bits == 4 or method.lower() in ("awq", "gptq") and bits in (None, 4):
        return "int4"
    return None


def _config_dtype(config: dict[str, Any], where: str, gpt2_style: bool) -> str:
    """The dtype the config's weights are stored in; ConfigError naming the field if unknown.

    A config without one is float32 for GPT-2 (its checkpoints are) and bf16 otherwise."""
    field = next((key for key in ("torch_dtype", "dtype") if config.get(key) is not None), None)
    if field is None:
        return "fp32" if gpt2_style else "bf16"
    value = config[field]
    try:
        return normalize_dtype(value)
    except UnknownNameError:
        known = ", ".join(DTYPE_BYTES)
        raise ConfigError(
            f"{where}: {field} {_shown(value)} is not a dtype kvtui knows (known: {known})"
        ) from None


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """A config.json as a JSON object: a regular file of at most CONFIG_LIMIT bytes; its
    `text_config` (the language model inside a multimodal wrapper) when it has one. ConfigError,
    one line naming the file, otherwise."""
    path = Path(path)
    try:
        config = read_json(path, CONFIG_LIMIT)
    except InputError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a model config (expected a JSON object)")
    text_config = _optional(config, str(path), "text_config", dict, "an object")
    if text_config is not None:  # multimodal wrappers keep the LM inside
        config = {**text_config, "torch_dtype": config.get("torch_dtype")}
    return config


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """A ModelSpec from a Hugging Face `config.json` (Llama/Mistral/Qwen/Gemma/DeepSeek/GPT-2).

    Parameters are estimated from the shape (see `estimate_params`) unless the config states
    them. ConfigError, with one line that names the file, when it cannot be read, is incomplete,
    has a field of the wrong type, or states a size past its bound (MAX_LAYERS layers, MAX_SIZE
    for every other size, MAX_PARAMS parameters).
    """
    path = Path(path)
    where = str(path)
    config = read_hf_config(path)

    gpt2_style = "n_layer" in config and "num_hidden_layers" not in config
    layers = _int(config, where, "num_hidden_layers", "n_layer", maximum=MAX_LAYERS)
    heads = _positive_int(config, where, "num_attention_heads", "n_head")
    hidden = _positive_int(config, where, "hidden_size", "n_embd", "d_model")
    kv_heads = _positive_int(config, where, "num_key_value_heads", default=heads)
    vocab = _positive_int(config, where, "vocab_size")
    max_context = _positive_int(config, where, "max_position_embeddings", "n_positions")
    intermediate = _positive_int(
        config, where, "intermediate_size", "n_inner", "ffn_dim", default=min(4 * hidden, MAX_SIZE)
    )
    kv_lora_rank = config.get("kv_lora_rank")
    qk_rope = None
    if kv_lora_rank is not None:
        kv_lora_rank = _positive_int(config, where, "kv_lora_rank")
        qk_rope = _int(config, where, "qk_rope_head_dim", default=0, minimum=0)
        nope = _int(config, where, "qk_nope_head_dim", default=0, minimum=0)
        head_dim = nope + qk_rope or hidden // heads or 1
    elif config.get("head_dim") is not None:
        head_dim = _positive_int(config, where, "head_dim")
    elif hidden % heads:
        raise ConfigError(f"{where}: hidden size {hidden} is not a multiple of {heads} heads")
    else:
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ConfigError(f"{where}: {heads} attention heads do not group into {kv_heads} kv heads")

    default_dtype = _quantized_dtype(config, where) or _config_dtype(config, where, gpt2_style)
    window, sliding = _hf_sliding(config, where, layers, max_context)

    tied = _optional(config, where, "tie_word_embeddings", bool, "true or false")
    tied = True if tied is None else tied
    stated = _first(config, "num_parameters", "n_params")
    params = (
        _int(config, where, "num_parameters", "n_params", maximum=MAX_PARAMS)
        if stated is not None
        else None
    )
    active = matrix = None
    if params is None:
        if kv_lora_rank is None:
            matrix = estimate_matrix_params(
                layers=layers,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                hidden_size=hidden,
                intermediate_size=intermediate,
                vocab_size=vocab,
                gpt2_style=gpt2_style,
            )
        params = estimate_params(
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            intermediate_size=intermediate,
            vocab_size=vocab,
            tied_embeddings=tied or gpt2_style,
            gpt2_style=gpt2_style,
            max_context=max_context,
            attention_params=(
                _mla_attention_params(config, where, hidden, heads)
                if kv_lora_rank is not None
                else None
            ),
        )
        if _int(config, where, *_EXPERTS, default=0, minimum=0):
            dense_mlp = 3 * hidden * intermediate
            all_mlp, active_mlp = _moe_params(config, where, hidden, layers, dense_mlp)
            params, active = (
                params - layers * dense_mlp + all_mlp,
                params - layers * dense_mlp + active_mlp,
            )
            matrix = None  # the experts a token takes: active_params, approximately

    return ModelSpec(
        name=path.parent.name or path.stem,
        display_name=f"{path.parent.name or path.stem} (from {path.name})",
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
        params=params,
        active_params=active,
        matrix_params=matrix,
        max_context=max_context,
        default_dtype=default_dtype,
        sliding_window=window,
        sliding_layers=sliding,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope if kv_lora_rank is not None else None,
        source=where,
    )
