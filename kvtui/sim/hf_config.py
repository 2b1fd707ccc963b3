"""A user's own Hugging Face `config.json` as a `ModelSpec`, without a UI: read bounded, every
field checked for its type and its bound, in one `ConfigError` line naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtui.inputs import MIB, InputError, read_json, safetensors_header
from kvtui.sim.catalog import (
    DTYPE_BYTES,
    ConfigError,
    ModelSpec,
    UnknownNameError,
    estimate_matrix_params,
    estimate_params,
    normalize_dtype,
)

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
    if bits == 8 or quantization.get("load_in_8bit") is True:
        return "int8"
    return None


_SAFETENSORS_DTYPES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "I8": "int8"}


def safetensors_dtype(path: Path) -> str | None:
    """The dtype (a kvtui name) of the first tensor of a known dtype in a safetensors file,
    read from its header alone; None when there is none or the file cannot be read."""
    try:
        header = safetensors_header(path)
    except (InputError, OSError):
        return None
    for name, tensor in header.items():
        if name != "__metadata__" and isinstance(tensor, dict):
            kind = str(tensor.get("dtype", ""))
            if kind.startswith("F8"):
                return "fp8"
            if kind in _SAFETENSORS_DTYPES:
                return _SAFETENSORS_DTYPES[kind]
    return None


def _config_dtype(config: dict[str, Any], where: str, folder: Path) -> str:
    """The dtype the config's weights are stored in; ConfigError naming the field if unknown.

    A config without one is the dtype of the weights beside it (`model.safetensors`), else
    fp32, the dtype transformers loads a model in when nothing says another."""
    field = next((key for key in ("torch_dtype", "dtype") if config.get(key) is not None), None)
    if field is None:
        # what transformers' dtype "auto" loads a config without a dtype in
        return safetensors_dtype(folder / "model.safetensors") or "fp32"
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

    default_dtype = _quantized_dtype(config, where) or _config_dtype(config, where, path.parent)
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
