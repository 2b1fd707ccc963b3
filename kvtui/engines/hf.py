"""A local Hugging Face model as a decode engine (`hf:DIR`, `--model DIR`), without a UI.

The model, its config and its tokenizer are loaded from a directory on disk through transformers
(the optional `hf` extra): offline only, without remote code, from safetensors weights only. Before
transformers sees the folder, kvtui names the exact safetensors files it will load (from
`model.safetensors` or a shard index whose every entry stays inside the folder) and checks each
header (kvtui.engines.model_files); a folder of pickled weights, a `.bin` named by an
index, a link out of the folder or a FIFO among its files is one line, with nothing loaded. The
two loops are the lesson's, run through transformers' own forward pass:

- prefill runs the prompt into a `StaticCache` preallocated for prompt + answer (as the tiny
  engine's cache is), and each later step feeds one token at its cache position (`HFCache`);
- the uncached step runs the whole sequence with `use_cache=False`: the staircase.

They are kvtui.engines.loops' loops (greedy, or seeded top-k with one draw per step), so
with the same settings the two emit the same ids. KV bytes are measured from the cache's own key and
value tensors and match kvtui.sim's formula for the shape `model_from_hf_config` reads from the
same config.json, the reader `kvtui budget --config` uses.
"""

from __future__ import annotations

import gc
import logging as std_logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from os.path import commonprefix
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from kvtui.engines.capabilities import TRANSFORMERS
from kvtui.engines.loops import TorchEngine
from kvtui.engines.model_files import check_model_files, check_positions, read_model_config
from kvtui.engines.protocol import FLOP_COUNTER_PHRASE, Progress, RunSettings, quiet
from kvtui.errors import EngineError
from kvtui.format import error_line, format_bytes
from kvtui.gpu.counting import PositionCounter, count_flops, flop_counter_warm
from kvtui.gpu.device import available_bytes, dtype_name, out_of_memory, pick_device, run_dtype
from kvtui.sim.catalog import ConfigError, ModelSpec
from kvtui.sim.hf_config import model_from_hf_config
from kvtui.sim.memory import kv_bytes

NO_EXTRA = "--model needs the hf extra: pip install 'kvtui[hf]'"


# --- loading -------------------------------------------------------------------------------------


def _import_transformers() -> Any:
    """transformers, told never to reach a network; `EngineError` when the extra is missing."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import transformers
    except ImportError:
        raise EngineError(NO_EXTRA) from None
    return transformers


def _version(transformers: Any) -> tuple[int, int]:
    major, minor, *_ = (transformers.__version__.split(".") + ["0", "0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _one_line(exc: BaseException) -> str:
    """What transformers said, in a line: its message (type and all, where it says little)."""
    words = " ".join(str(exc).split())
    text = words if len(words) > 12 else error_line(exc)
    return text if len(text) <= 200 else text[:197] + "..."


LIBRARY_LOGGERS = ("kernels", "huggingface_hub")
"""The loggers of the libraries transformers calls while loading, quietened with its own: a config
asking for `flash_attention_2` has `kernels` say "Skipping publisher trust check ... offline mode"
on stderr before transformers refuses it (kvtui's refusal is then a second line)."""


@contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' warnings and progress bars off while loading, and the warnings of the
    libraries it calls (LIBRARY_LOGGERS): errors are ours to report, in one line."""
    logging = transformers.utils.logging
    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    loggers = [std_logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    for logger in loggers:
        logger.setLevel(std_logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()
        for logger, was in zip(loggers, levels, strict=True):
            logger.setLevel(was)


def _read_config(directory: Path) -> dict[str, Any]:
    return read_model_config(directory)


def check_architecture(transformers: Any, directory: Path, config: dict[str, Any]) -> None:
    """`EngineError` unless transformers knows the model type, without remote code, as a
    decoder-only causal LM (BERT-like encoders also have causal-LM heads: they are refused)."""
    # Not re-exported in transformers' stubs (and unused where the hf extra is not installed).
    from transformers.models.auto.configuration_auto import (  # type: ignore[attr-defined, unused-ignore]
        CONFIG_MAPPING_NAMES,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = config.get("model_type")
    where = f"{directory}/config.json"
    if not isinstance(model_type, str) or not model_type:
        raise EngineError(f"{where} has no model_type: unsupported architecture")
    if model_type not in CONFIG_MAPPING_NAMES:
        remote = " (it needs remote code, which kvtui never runs)" if "auto_map" in config else ""
        raise EngineError(
            f"unsupported architecture {model_type!r}: transformers "
            f"{transformers.__version__} does not know it{remote}"
        )
    if (
        model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        or config.get("is_encoder_decoder")
    ):
        raise EngineError(
            f"unsupported architecture {model_type!r}: not a decoder-only causal language model"
        )


def model_label(directory: Path, config: dict[str, Any]) -> str:
    """The config's hub name (`org/name`) when it has one, else the directory's name."""
    name = config.get("_name_or_path")
    if isinstance(name, str) and name and not name.startswith(("/", ".", "~")):
        return name
    return directory.resolve().name


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids as the tokenizer adds them (BOS included); never empty."""
    ids = list(tokenizer(prompt)["input_ids"])
    if not ids:
        start = tokenizer.bos_token_id
        ids = [start if start is not None else tokenizer.eos_token_id or 0]
    return ids


def check_fits(
    spec: ModelSpec, directory: Path, device: torch.device, dtype: torch.dtype, context: int
) -> None:
    """`EngineError`, before anything is allocated, when the weights (estimated from the config)
    and the KV cache for `context` tokens do not fit in free device memory or host RAM."""
    element = torch.empty((), dtype=dtype).element_size()
    kv_dtype = dtype_name(dtype)
    need = spec.params * element + kv_bytes(spec, context, 1, kv_dtype)
    have, where = available_bytes(device)
    if need > have:
        raise EngineError(
            f"{directory.name} needs {format_bytes(need)} (weights + KV cache for {context:,} "
            f"tokens) but only {format_bytes(have)} of {where} is available"
        )


def _free(device: torch.device, *, collect: bool = False) -> None:
    """Hand freed memory back: on a GPU to the driver (after collecting cycles that may pin
    tensors); on the CPU dropping the references was enough, unless `collect` (a failed load)."""
    if collect or device.type == "cuda":
        gc.collect()  # about 0.3 s with transformers loaded, so not after every CPU run
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_model(
    transformers: Any, directory: Path, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """The causal LM from `directory`'s safetensors, offline, in `dtype`, on `device`, in eval
    mode; `EngineError` (with nothing left allocated) when it cannot be loaded."""
    check_model_files(directory, _read_config(directory))  # the weights it loads, checked
    dtype_key = "dtype" if _version(transformers) >= (4, 56) else "torch_dtype"
    kwargs: dict[str, Any] = {
        "local_files_only": True,
        "trust_remote_code": False,
        "use_safetensors": True,
        dtype_key: dtype,
    }
    if device.type != "cpu" and _version(transformers) >= (5, 0):
        kwargs["device_map"] = {"": device}
    model = None
    try:
        model, report = transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), output_loading_info=True, **kwargs
        )
        mismatch = weights_mismatch(report)
        if mismatch:  # transformers would run random weights in their place: never decode them
            raise EngineError(
                f"{directory.name}: its weights are not the model its config.json describes "
                f"({mismatch}); kvtui never decodes randomly initialised weights"
            )
        model = model.to(device).eval()
    except EngineError:
        del model
        _free(device, collect=True)
        raise
    except Exception as exc:  # transformers' own checks raise all kinds: one line, whichever
        del model
        oom = out_of_memory(exc)
        words = "out of memory while loading the weights" if oom else _one_line(exc)
        _free(device, collect=True)
        raise EngineError(f"cannot load {directory}: {words}") from None
    return cast(torch.nn.Module, model)


def weights_mismatch(report: dict[str, Any], shown: int = 3) -> str:
    """What transformers' loading report says the checkpoint lacks, holds beyond the model, or
    holds in another shape, naming the first `shown` tensors of each; empty when it matches.
    (transformers leaves out what a model may lack by design: tied heads, buffers.)"""
    words = []
    for key, what in (
        ("missing_keys", "missing"),
        ("unexpected_keys", "unexpected"),
        ("mismatched_keys", "of another shape"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in report.get(key) or ())
        if names:
            more = f" and {len(names) - shown:,} more" if len(names) > shown else ""
            words.append(f"{len(names):,} {what}: {', '.join(names[:shown])}{more}")
    return "; ".join(words)


def check_runnable(directory: Path, config: dict[str, Any], ids: list[int], vocab: int) -> None:
    """`EngineError` for what would fail inside the forward, checked before anything loads: a
    prompt id past the vocabulary (`IndexError` in the embedding), a sliding window of no
    positions (transformers runs a window of 0, and its cache cannot hold a token)."""
    past = max(ids)
    if past >= vocab:
        raise EngineError(
            f"{directory.name}: the tokenizer gives this prompt id {past:,}, past the model's "
            f"{vocab:,} (vocab_size in config.json): the tokenizer is not this model's"
        )
    window = config.get("sliding_window")
    if isinstance(window, int | float) and not isinstance(window, bool) and window < 1:
        raise EngineError(
            f"{directory}/config.json: sliding_window {window!r} is a window of no positions "
            "(null turns the window off)"
        )


# --- the KV cache --------------------------------------------------------------------------------


def new_cache(transformers: Any, model: torch.nn.Module, max_len: int) -> Any:
    """A StaticCache for `max_len` positions (allocated on the first forward)."""
    if _version(transformers) >= (4, 56):
        return transformers.StaticCache(config=model.config, max_cache_len=max_len)
    param = next(model.parameters())
    return transformers.StaticCache(
        config=model.config,
        batch_size=1,
        max_cache_len=max_len,
        device=param.device,
        dtype=param.dtype,
    )


def cache_tensors(cache: Any) -> list[Tensor]:
    """Every key and value tensor of a transformers cache, newer (`layers[i].keys`) and older
    (`key_cache[i]`) APIs alike; tensors not yet allocated are left out."""
    if hasattr(cache, "layers"):
        pairs = [(getattr(lay, "keys", None), getattr(lay, "values", None)) for lay in cache.layers]
    else:
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    return [t for pair in pairs for t in pair if isinstance(t, Tensor) and t.dim() == 4]


def cache_bytes(cache: Any, positions: int | None = None) -> int:
    """Bytes of the cache's key and value tensors `(B, kv_heads, L, head_dim)`: all of them, or
    those holding the first `positions` positions (a sliding layer holds at most its L)."""
    total = 0
    for t in cache_tensors(cache):
        length = t.shape[-2]
        held = length if positions is None else min(positions, length)
        total += t.nbytes // length * held if length else 0
    return total


# --- the loops -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardArgs:
    """How this transformers version's forward takes a cache and is told to skip logits."""

    cache: str
    """The cache's keyword: `cache` (transformers 5.x) or `past_key_values` (before)."""
    positions: bool
    """Whether forward takes `cache_position` (else the cache counts its own length)."""
    extra: dict[str, Any]
    """Only the last position's logits, where forward can be told so."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> ForwardArgs:
        import inspect

        names = inspect.signature(model.forward).parameters
        extra: dict[str, Any] = {}
        if "logits_to_keep" in names:
            extra["logits_to_keep"] = 1
        elif "num_logits_to_keep" in names:
            extra["num_logits_to_keep"] = 1
        return cls(
            cache="cache" if "cache" in names else "past_key_values",
            positions="cache_position" in names,
            extra=extra,
        )

    def with_cache(
        self, cache: Any, start: int, length: int, device: torch.device
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {self.cache: cache, "use_cache": True, **self.extra}
        if self.positions:
            kwargs["cache_position"] = torch.arange(start, start + length, device=device)
        return kwargs


@dataclass
class HFCache:
    """A transformers model with its own cache, as the cached loop's `CachedModel`."""

    model: torch.nn.Module
    cache: Any
    fwd: ForwardArgs

    def prefill(self, prompt: Tensor) -> Tensor:
        kwargs = self.fwd.with_cache(self.cache, 0, prompt.shape[1], prompt.device)
        logits: Tensor = self.model(prompt, **kwargs).logits
        return logits[:, -1]

    def decode_one_token(self, token: Tensor, position: int) -> Tensor:
        kwargs = self.fwd.with_cache(self.cache, position, 1, token.device)
        logits: Tensor = self.model(token, **kwargs).logits
        return logits[:, -1]

    def kv_bytes_filled(self, positions: int) -> int:
        return cache_bytes(self.cache, positions)

    def kv_bytes_allocated(self) -> int:
        return cache_bytes(self.cache)

    def kv_bytes_per_position(self) -> int | None:
        """Not reported: transformers' cache is measured as a whole (`cache_bytes`)."""
        return None

    def replay_flops(self, call: Callable[[], Tensor], start: int) -> int | None:
        """A step again, each layer's own count of its length (transformers 5's
        `cumulative_length`) set back to `start` for it and put back after; None where a layer
        keeps a sliding window's ring, which a second write would roll on."""
        layers = list(getattr(self.cache, "layers", ()))
        if any("Sliding" in type(layer).__name__ for layer in layers):
            return None
        lengths = [
            (layer.cumulative_length, layer.cumulative_length.clone())
            for layer in layers
            if isinstance(getattr(layer, "cumulative_length", None), Tensor)
        ]
        for length, _ in lengths:
            length.fill_(start)
        try:
            return count_flops(call)
        finally:
            for length, before in lengths:
                length.copy_(before)


class TextStream:
    """Token ids in, text out: decodes the growing sequence and emits what it adds, holding back
    while the text ends in an incomplete character (U+FFFD)."""

    def __init__(self, tokenizer: Any, prompt: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt)
        self._text = self._decode()  # the prompt's text, never emitted

    def _decode(self) -> str:
        text: str = self._tokenizer.decode(
            self._ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return text

    def push(self, token_id: int) -> str:
        """The text `token_id` completes: empty in the middle of a character."""
        self._ids.append(token_id)
        text = self._decode()
        if text.endswith("\ufffd"):
            return ""
        shown = self._text if text.startswith(self._text) else commonprefix([self._text, text])
        self._text = text
        return text[len(shown) :]


# --- the engine ----------------------------------------------------------------------------------


MAX_PROMPT_PIECES = 2048
"""Prompts up to this many tokens get each token's text for the cache picture (decoding the
prompt token by token costs time that grows with its square)."""


class HFEngine(TorchEngine):
    """A local transformers model: the same loops, through transformers' forward and its
    `StaticCache`."""

    can = TRANSFORMERS

    def __init__(
        self,
        settings: RunSettings,
        transformers: Any,
        model: torch.nn.Module,
        tokenizer: Any,
        spec: ModelSpec,
        device: torch.device,
        label: str,
        prompt: list[int],
    ) -> None:
        self.settings, self.transformers, self.model = settings, transformers, model
        self.tokenizer, self.spec, self.device, self.label = tokenizer, spec, device, label
        self.prompt = prompt[:1] if settings.lesson else prompt
        self.prompt_text = tokenizer.decode(self.prompt, skip_special_tokens=True)
        if len(self.prompt) <= MAX_PROMPT_PIECES:  # each piece decodes the prompt so far again
            pieces = TextStream(tokenizer, [])
            self.prompt_pieces = tuple(pieces.push(token) for token in self.prompt)
        self.max_positions = spec.max_context
        self.trained_positions = spec.max_context
        self.fwd = ForwardArgs.of(model)
        self._cache: Any = None
        self.counter = PositionCounter(model)

    def prompt_ids(self) -> Tensor:
        return torch.tensor([self.prompt], dtype=torch.long, device=self.device)

    def cached(self, max_len: int, batch: int) -> HFCache:
        if batch != 1:  # kvtui.engines.factory.check_run refuses --batch for hf: before loading
            raise EngineError("hf: decodes one sequence; --batch is for kvtui's own engines")
        self._cache = new_cache(self.transformers, self.model, max_len)
        return HFCache(self.model, self._cache, self.fwd)

    def recompute(self, ids: Tensor) -> Tensor:
        logits: Tensor = self.model(ids, use_cache=False, **self.fwd.extra).logits
        return logits[:, -1]

    def text_stream(self) -> Callable[[int], str]:
        return TextStream(self.tokenizer, self.prompt).push

    def free_cache(self) -> None:
        self._cache = None
        _free(self.device)


def open_hf_engine(settings: RunSettings, directory: Path, progress: Progress = quiet) -> HFEngine:
    """The model in `directory`, loaded offline; `EngineError` for a directory kvtui cannot run,
    before anything is allocated when that can be known. `progress` hears each slow part."""
    config = _read_config(directory)
    transformers = _import_transformers()
    check_architecture(transformers, directory, config)
    try:
        spec = model_from_hf_config(directory / "config.json")
    except ConfigError as exc:
        raise EngineError(f"unsupported architecture: {exc}") from None
    check_model_files(directory, config)  # before the tokenizer reads a file of the folder
    torch.set_num_threads(max(1, settings.threads))
    device = pick_device(settings.device)
    dtype, dtype_source = run_dtype(device, spec.default_dtype)  # torch_dtype, where it can
    label = model_label(directory, config)
    with _quiet(transformers):
        try:  # what transformers makes of config.json, before the tokenizer reads it too
            transformers.AutoConfig.from_pretrained(
                str(directory), local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:  # its validators raise all kinds: one line, whichever
            raise EngineError(f"{directory}/config.json: {_one_line(exc)}") from None
        progress("loading the tokenizer")
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(directory), local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:  # as for the model: whatever the tokenizer's loader raises
            raise EngineError(
                f"cannot load the tokenizer in {directory}: {_one_line(exc)}"
            ) from None
        ids = prompt_ids(tokenizer, settings.prompt)
        check_runnable(directory, config, ids, spec.vocab_size)
        prompt = 1 if settings.lesson else len(ids)
        check_positions(label, prompt, settings.tokens, spec.max_context)
        check_fits(spec, directory, device, dtype, len(ids) + settings.tokens)
        progress(f"loading {label}'s weights")
        model = load_model(transformers, directory, device, dtype)
    if spec.active_params is None:  # the measured count, for the bytes each step reads
        spec = replace(spec, params=sum(p.numel() for p in model.parameters()))
    spec = replace(spec, name=label, display_name=label)
    if not flop_counter_warm():
        progress(FLOP_COUNTER_PHRASE)
    engine = HFEngine(settings, transformers, model, tokenizer, spec, device, label, ids)
    engine.dtype_source = dtype_source
    return engine
