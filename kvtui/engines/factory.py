"""Engine names, parsed once: `tiny`, `shape:MODEL`, `sim:MODEL@GPU` (or `@NxGPU`, tensor
parallel), `replay:FILE`, `hf:DIR`, `vllm:URL` (a running vLLM server, watched).

`parse_engine` turns a name into an `EngineSpec` (or one `EngineError` line); `check_run` refuses,
cheaply and without torch, settings no engine can run (a CUDA device where there is none, more
positions than the model has), and `check_engine` also looks at the files a run needs, so that
the CLI can say so before a UI opens; `open_engine` builds the engine a spec names, importing
torch only for the torch engines (kvtui.engines.torch_engine, kvtui.engines.hf), never for `sim:`
(kvtui.engines.roofline), `replay:` (kvtui.engines.replay) or `vllm:` (kvtui.engines.vllm.engine,
plain HTTP to the URL given and nowhere else).

What an engine can do is asked of its capabilities, never of its name: `EngineSpec.can` before a
run (kvtui.engines.capabilities' one table), `RunStarted.can` once it runs; `recorded_start`
gives a record written before starts said what their engine can do its engine's.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

from kvtui.engines.capabilities import CAPABILITIES, NOTHING, OWN_ENGINES, Capabilities, EngineKind
from kvtui.engines.model_files import check_model_files, check_positions, read_model_config
from kvtui.engines.protocol import (
    MAX_RUN_BATCH,
    MAX_TOKENS,
    Progress,
    RunSettings,
    RunStarted,
    StepSource,
    quiet,
)
from kvtui.engines.vllm.url import ServerURL
from kvtui.errors import EngineError
from kvtui.inputs import InputError, user_path
from kvtui.paths import TINY_NAME

ENGINE_FORMS = (
    "tiny, shape:MODEL, sim:MODEL@GPU, sim:MODEL@NxGPU, replay:FILE, hf:DIR, vllm:URL[,URL...]"
)


@dataclass(frozen=True)
class EngineSpec:
    """An engine name, parsed."""

    kind: EngineKind
    model: str | None = None
    """The catalog model of `shape:` and `sim:`."""
    gpu: str | None = None
    """The catalog GPU of `sim:`."""
    gpus: int = 1
    """How many of that GPU `sim:` splits the model over (tensor parallel): N of `MODEL@NxGPU`."""
    path: Path | None = None
    """The record of `replay:`, the model directory of `hf:`."""
    url: ServerURL | None = None
    """The server of `vllm:`, checked (http or https, a host, no credentials): the first of
    `urls`, the replica the decode itself runs on."""
    urls: tuple[ServerURL, ...] = ()
    """Every server of `vllm:URL1,URL2,...` (a fleet of replicas, all watched), in the order
    given; one for `vllm:URL` (kvtui.engines.vllm.fleet.parse_urls)."""

    @property
    def can(self) -> Capabilities:
        """What this kind of engine can do (kvtui.engines.capabilities.CAPABILITIES)."""
        return CAPABILITIES[self.kind]

    @property
    def model_dir(self) -> Path | None:
        """The model directory `hf:` loads (its config.json says the model's shape); None for
        the others (a replay's path is a record)."""
        return self.path if self.kind == "hf" else None

    def with_path(self, path: Path) -> str:
        """This engine's name with `path` for its record or model directory (`replay:`, `hf:`)."""
        return f"{self.kind}:{path}"


def parse_engine(name: str) -> EngineSpec:
    """The spec of an engine name; `EngineError` with one line for a malformed one."""
    name = name.strip()
    kind, colon, arg = name.partition(":")
    arg = arg.strip()
    if name == "tiny":
        return EngineSpec("tiny")
    if not colon or kind not in ("shape", "sim", "replay", "hf", "vllm"):
        raise EngineError(f"unknown engine {name!r}: use one of {ENGINE_FORMS}")
    if kind == "shape":
        if not arg:
            raise EngineError("shape: needs a model name, e.g. shape:llama-3.2-1b")
        return EngineSpec("shape", model=arg)
    if kind == "sim":
        model, at, gpu = arg.partition("@")
        if not (model and at and gpu.strip()):
            raise EngineError(
                "sim: needs MODEL@GPU or MODEL@NxGPU, e.g. sim:llama-3.1-8b@h100 or "
                "sim:llama-3.1-70b@4xh100"
            )
        gpus, gpu = _gpu_count(gpu.strip())
        return EngineSpec("sim", model=model.strip(), gpu=gpu, gpus=gpus)
    if kind == "vllm":
        from kvtui.engines.vllm.fleet import parse_urls

        if not arg:
            raise EngineError("vllm: needs the server's URL, e.g. vllm:http://127.0.0.1:8000")
        urls = parse_urls(arg, "vllm:")
        return EngineSpec("vllm", url=urls[0], urls=urls)
    if not arg:
        example = "replay:runs/h100.jsonl" if kind == "replay" else "hf:~/models/Llama-3.2-1B"
        raise EngineError(f"{kind}: needs a path, e.g. {example}")
    try:
        path = user_path(arg)
    except InputError as exc:
        raise EngineError(f"{kind}: {exc}") from None
    return EngineSpec(kind, path=path)  # type: ignore[arg-type]


_GPU_COUNT = re.compile(r"(\d+)\s*[x×]\s*(.+)", re.IGNORECASE)


def _gpu_count(text: str) -> tuple[int, str]:
    """`4xh100` -> (4, "h100"); `h100` -> (1, "h100"); `EngineError` for a count out of range."""
    from kvtui.sim.parallel import MAX_TENSOR_PARALLEL

    match = _GPU_COUNT.fullmatch(text)
    if match is None:
        return 1, text
    digits, gpu = match.group(1), match.group(2).strip()
    count = int(digits) if len(digits) <= 9 else MAX_TENSOR_PARALLEL + 1  # int() of any length
    if not 1 <= count <= MAX_TENSOR_PARALLEL:
        shown = digits if len(digits) <= 12 else digits[:9] + "..."
        raise EngineError(
            f"sim: the GPU count must be from 1 to {MAX_TENSOR_PARALLEL:,}, not {shown}"
        )
    return count, gpu


def open_engine(settings: RunSettings, progress: Progress | None = None) -> StepSource:
    """The engine `settings.engine` names; `EngineError` for a bad name or a run that can't fit
    (`check_run` first, so before anything is loaded when that can be known). `progress` hears
    what a slow engine is doing while it gets ready, in a phrase at a time."""
    spec = check_run(settings)
    say = progress or quiet
    if spec.kind == "hf":  # its config first: torch and transformers take seconds to import
        assert spec.path is not None  # parse_engine sets it for hf:
        read_model_config(spec.path)
    if spec.can.torch and "torch" not in sys.modules:
        say("importing torch")
    if spec.can.torch:
        import_torch()
    if spec.kind in ("tiny", "shape"):
        from kvtui.engines.torch_engine import open_torch_engine

        return open_torch_engine(settings, spec.model, say)
    if spec.kind == "sim":
        from kvtui.engines.roofline import SimEngine

        assert spec.model is not None and spec.gpu is not None  # parse_engine sets both for sim:
        return SimEngine.open(settings, spec.model, spec.gpu, spec.gpus)
    if spec.kind == "replay":
        from kvtui.engines.replay import ReplayEngine

        assert spec.path is not None  # parse_engine sets it for replay:
        return ReplayEngine.open(spec.path, settings, upgrade=recorded_start)
    if spec.kind == "vllm":
        from kvtui.engines.vllm.engine import VLLMEngine

        assert spec.url is not None  # parse_engine sets it for vllm:
        return VLLMEngine.open(settings, spec.url, spec.urls[1:])
    from kvtui.engines.hf import open_hf_engine

    assert spec.path is not None  # parse_engine sets it for hf:
    return open_hf_engine(settings, spec.path, say)


def reopen_engine(
    engine: StepSource, settings: RunSettings, progress: Progress | None = None
) -> StepSource | None:
    """`engine` for another run in its process, where it can take `settings` (its `reopen`: a
    torch model kept, its KV pool resized: no load, no restart); else None, `engine` closed, for
    the caller to drop before it opens a fresh one (two models never held at once). `EngineError`
    as `open_engine`'s, the checks first."""
    check_run(settings)
    reopen = getattr(engine, "reopen", None)
    kept = reopen(settings) if reopen is not None else None
    engine.close()  # a kept model's engine hands its cache and hooks back; the model stays
    if kept is None:
        return None
    (progress or quiet)("the model is loaded: a new KV pool, no restart")
    return cast(StepSource, kept)


def import_torch() -> None:
    """Import torch, or say in one line (`EngineError`) why it would not: a setting it reads
    from the environment that it refuses (`TORCH_LOGS=evil` is a ValueError listing every valid
    setting), or a broken install."""
    try:
        import torch  # noqa: F401
    except Exception as exc:  # torch raises all kinds at import: one line, whichever
        words = " ".join(str(exc).split())
        first = words.split(". ")[0].rstrip(".") or type(exc).__name__
        named = set(re.findall(r"\b[A-Z][A-Z0-9_]{3,}\b", words))  # TORCH_LOGS, say
        settings = [f"{k}={v!r:.40}" for k, v in sorted(os.environ.items()) if k in named]
        said = f" (the environment sets {', '.join(settings)})" if settings else ""
        raise EngineError(f"torch does not import: {first[:200]}{said}") from None


def check_engine(settings: RunSettings) -> None:
    """Refuse a run that cannot start, before a UI opens: `EngineError` with one clear line.

    Cheap and torch-free: `check_run`, then names are looked up in the catalogs, a replay file is
    read, a model directory's config and weight headers are checked, and a `shape:` model that
    does not fit in this machine's free memory is refused naming those that do
    (`check_shape_fits`); whether an hf: model fits is still the engine's to say.
    """
    spec = check_run(settings)
    if spec.kind in ("sim", "replay", "vllm"):  # vllm: asks the server what it serves
        open_engine(settings).close()
    elif spec.kind == "shape":
        check_shape_fits(settings, spec)
    elif spec.kind == "hf":
        from kvtui.sim.catalog import ConfigError
        from kvtui.sim.hf_config import model_from_hf_config

        assert spec.path is not None  # parse_engine sets it for hf:
        config = read_model_config(spec.path)
        try:
            limit = model_from_hf_config(spec.path / "config.json").max_context
        except ConfigError as exc:
            raise EngineError(str(exc)) from None
        if settings.tokens + 1 > limit:  # the prompt is at least one token
            raise EngineError(
                f"{settings.tokens:,} tokens after the prompt is past the model's "
                f"{limit:,} positions"
            )
        check_model_files(spec.path, config)


def recorded_start(started: RunStarted) -> RunStarted:
    """A recorded start as engines send one now: a record written before starts said what their
    engine can do gets that (`can`), and its model's sliding windows, from its engine's name, in
    the replay's process (the fold reads no file). A start that says is as it was recorded."""
    if started.can is not None:
        return started
    try:
        spec = parse_engine(started.engine)
    except EngineError:
        return replace(started, can=NOTHING)
    window, layers = _recorded_windows(spec, started)
    return replace(started, can=spec.can, sliding_window=window, sliding_layers=layers)


def _recorded_windows(spec: EngineSpec, started: RunStarted) -> tuple[int | None, tuple[int, ...]]:
    """The sliding windows of the model a recorded run ran, from its engine's name: `sim:`'s
    catalog model (one GPU's share), `hf:`'s config.json where it still is; none for kvtui's own
    decoder, which keeps every position in every layer, for a model that no longer resolves, or
    for one whose cache is not the run's (other KV bytes per token in the run's dtype)."""
    from kvtui.sim.catalog import get_model
    from kvtui.sim.hf_config import model_from_hf_config
    from kvtui.sim.memory import kv_bytes_per_token
    from kvtui.sim.parallel import shard

    try:
        if spec.kind == "sim" and spec.model:
            model = shard(get_model(spec.model), spec.gpus)
        elif spec.model_dir is not None:
            model = model_from_hf_config(spec.model_dir / "config.json")
        else:
            return None, ()
        same = kv_bytes_per_token(model, started.dtype) == started.kv_bytes_per_token
    except (ValueError, KeyError, OSError):  # ConfigError, UnknownNameError, an unknown dtype
        return None, ()
    if model.sliding_window is None or not same or model.layers != started.layers:
        return None, ()
    return model.sliding_window, model.sliding_layers


# --- cheap checks, without torch -----------------------------------------------------------------

TINY_POSITIONS = 4096
"""The tiny model's positions when its file is missing (kvtui.gpu.model.ModelArgs' default)."""
_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")


def prompt_positions(settings: RunSettings) -> int:
    """The prompt's positions for the byte-level engines (tiny, shape, sim): its UTF-8 bytes
    (a lone newline for an empty prompt), or 1 in lesson mode."""
    if settings.lesson:
        return 1
    try:
        return len(settings.prompt.encode("utf-8")) or 1
    except UnicodeEncodeError:
        raise EngineError(
            "the prompt holds characters that are not text (lone surrogates)"
        ) from None


def tiny_config() -> dict[str, object]:
    """The shipped model's config from its safetensors metadata (read without torch: the header
    only); empty when the file is missing (the engine then makes the default shape)."""
    from kvtui.inputs import InputError, parse_json, safetensors_header
    from kvtui.paths import TINY_WEIGHTS, asset_path

    path = asset_path(TINY_WEIGHTS)
    if not path.exists():
        return {}
    try:
        metadata = safetensors_header(path).get("__metadata__") or {}
        config = parse_json(metadata.get("config", "{}"))
    except (InputError, ValueError) as exc:
        raise EngineError(f"the shipped model is damaged ({exc}); reinstall kvtui") from None
    if not isinstance(config, dict):
        raise EngineError("the shipped model is damaged (no max_positions); reinstall kvtui")
    return config


def tiny_positions() -> int:
    """The shipped model's positions, from the config in its safetensors metadata."""
    config = tiny_config()
    positions = config.get("max_positions", TINY_POSITIONS)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise EngineError("the shipped model is damaged (no max_positions); reinstall kvtui")
    return positions


def model_positions(spec: EngineSpec) -> tuple[str, int] | None:
    """The model's name and the most positions it runs, where that is cheap to know (tiny,
    shape, sim); None otherwise (replay runs what was recorded; hf needs its tokenizer)."""
    if spec.kind == "tiny":
        return TINY_NAME, tiny_positions()
    if spec.kind in ("shape", "sim"):
        from kvtui.sim.catalog import UnknownNameError, get_model

        assert spec.model is not None  # parse_engine sets it for shape: and sim:
        try:
            model = get_model(spec.model)
        except UnknownNameError as exc:
            raise EngineError(str(exc)) from None
        return model.name, model.max_context
    return None


TINY_KV_HEADS = 2
"""The tiny model's key/value heads when its file is missing (kvtui.gpu.model.ModelArgs')."""


def model_kv_heads(spec: EngineSpec) -> int | None:
    """The key/value heads of the model a `tiny`, `shape:` or `sim:` engine runs (None for an
    MLA model, which caches a latent, or for another engine)."""
    if spec.kind == "tiny":
        heads = tiny_config().get("n_kv_head", TINY_KV_HEADS)
        return heads if isinstance(heads, int) and not isinstance(heads, bool) else None
    if spec.kind in ("shape", "sim") and spec.model:
        from kvtui.sim.catalog import UnknownNameError, get_model

        try:
            model = get_model(spec.model)
        except UnknownNameError as exc:
            raise EngineError(str(exc)) from None
        return None if model.is_mla else model.kv_heads
    return None


def layout_flags(settings: RunSettings) -> str:
    """The KV-cache flags a run was given, as typed: "--kv-cache-dtype fp8 --kv-window 256"."""
    layout = settings.layout
    flags = []
    if layout.cache_dtype != "auto":
        flags.append(f"--kv-cache-dtype {layout.cache_dtype}")
    if layout.window is not None:
        flags.append(f"--kv-window {layout.window}")
    if layout.sinks:
        flags.append(f"--kv-sinks {layout.sinks}")
    if layout.prefix_caching:
        flags.append("--enable-prefix-caching")
    if layout.kv_heads is not None:
        flags.append(f"--kv-heads {layout.kv_heads}")
    return " ".join(flags)


def check_layout(settings: RunSettings, spec: EngineSpec) -> None:
    """Refuse a KV-cache layout (kvtui.sim.tricks) the engine cannot run, in one line: any on an
    engine that keeps its own cache or replays one; a layout that makes no sense (sinks without
    a window, more heads than the model has, a window with shared prefixes); a prompt longer
    than its window (a window holds the prompt whole)."""
    layout = settings.layout
    if layout.is_plain:
        return
    if not spec.can.own_cache:
        why = {
            "hf": "transformers keeps its own cache there",
            "replay": "a replay shows the run as it was recorded",
        }.get(spec.kind, "it keeps its own cache")
        raise EngineError(
            f"{layout_flags(settings)}: {OWN_ENGINES} keep these caches, not {spec.kind}: ({why})"
        )
    heads = model_kv_heads(spec)
    if layout.kv_heads is not None and heads is None:
        raise EngineError(
            f"--kv-heads: {spec.model} caches a latent (MLA), not key/value heads to average"
        )
    problem = layout.problem(heads)
    if problem:
        raise EngineError(problem)
    if layout.window is not None:
        prompt = prompt_positions(settings)
        if prompt > layout.window:
            raise EngineError(
                f"the prompt's {prompt:,} positions do not fit in --kv-window {layout.window:,}: "
                "a window holds the prompt whole (a longer window, or a shorter prompt)"
            )


def check_run(settings: RunSettings) -> EngineSpec:
    """Refuse, cheaply and without torch, settings no engine can run: an engine name that does
    not parse, tokens out of 1..MAX_TOKENS, a batch out of 1..MAX_RUN_BATCH or asked of an engine
    that decodes one sequence (hf:, replay:), a device that is not auto, cpu or cuda[:N], CUDA
    asked for on a machine that shows none (torch engines only), or more positions (prompt +
    tokens) than the model has. Returns the parsed engine name."""
    spec = parse_engine(settings.engine)
    if not 1 <= settings.tokens <= MAX_TOKENS:
        raise EngineError(f"tokens must be from 1 to {MAX_TOKENS:,}, not {settings.tokens:,}")
    if not 1 <= settings.batch <= MAX_RUN_BATCH:
        raise EngineError(f"batch must be from 1 to {MAX_RUN_BATCH}, not {settings.batch:,}")
    if not spec.can.own_cache and settings.batch != 1:
        raise EngineError(
            f"--batch applies to {OWN_ENGINES}, not to {spec.kind}:"
            + {
                "hf": " it decodes one sequence through transformers' own cache",
                "replay": " a replay shows the run as it was recorded, batch and all",
                "vllm": " it streams one completion (kvtui load puts many on the server)",
            }[spec.kind]
        )
    if spec.can.torch:
        device = settings.device
        if device not in ("auto", "cpu") and not _CUDA_DEVICE.fullmatch(device):
            raise EngineError(f"unknown device {device!r}: use auto, cpu or cuda")
        if device not in ("auto", "cpu"):
            from kvtui.gpu.probe import cuda_visible

            if not cuda_visible():
                raise EngineError(f"--device {device}: this machine shows no CUDA device")
    if not spec.can.own_cache and settings.kv_budget_bytes is not None:
        raise EngineError(
            f"--kv-budget applies to {OWN_ENGINES}, not to {spec.kind}:"
            + {
                "hf": " transformers keeps its own cache there",
                "replay": " a replay shows the run as it was recorded",
                "vllm": " the server sized its own cache (--kv-cache-memory-bytes is vLLM's)",
            }[spec.kind]
        )
    check_layout(settings, spec)
    known = model_positions(spec)
    if known is not None:
        label, limit = known
        window = settings.kv_window
        if window is not None and window > limit:
            raise EngineError(
                f"--kv-window {window:,} is past {label}'s {limit:,} positions: a window's "
                "positions are counted within it, and RoPE has no angle past the model's"
            )
        if window is None or "uncached" in settings.loops:
            try:
                check_positions(label, prompt_positions(settings), settings.tokens, limit)
            except EngineError as exc:
                if window is None:
                    raise
                raise EngineError(
                    f"{exc}: the uncached loop keeps no window (only the cached loop goes on "
                    "past it: kvtui bench --loops cached, or the app's screen 4 race)"
                ) from None
    return spec


def fit_tokens(settings: RunSettings) -> tuple[RunSettings, str]:
    """The settings with their tokens capped to what the model's positions hold past the
    prompt, and a line saying so ("" when they fit, or where that is not cheap to know): so
    that leaving lesson mode after a 4,095-token lesson runs 4,052 tokens on the 44-byte
    prompt, where it asked for 4,139 positions of 4,096 and failed."""
    try:
        known = model_positions(parse_engine(settings.engine))
        prompt = prompt_positions(settings)
    except EngineError:  # check_run says why, as the run starts
        return settings, ""
    if known is None or (settings.kv_window is not None and "uncached" not in settings.loops):
        return settings, ""
    label, limit = known
    room = limit - prompt
    if settings.tokens <= room or room < 1:
        return settings, ""
    said = (
        f"{settings.tokens:,} tokens capped to {room:,}: {label} holds {limit:,} positions, "
        f"{prompt:,} of them the prompt"
    )
    return replace(settings, tokens=room), said


# --- whether a shape: model fits here, without torch -----------------------------------------


def free_memory(settings: RunSettings) -> tuple[int, str, bool] | None:
    """This machine's free memory where a torch engine would run (bytes, what it is, whether
    a GPU), torch-free: a GPU's as NVML reads it, else the host's (kvtui.gpu.host.host_room);
    None where it cannot be read (a GPU without NVML)."""
    if settings.device != "cpu":
        from kvtui.gpu.probe import cuda_visible, probe_summary

        if cuda_visible():
            free = probe_summary().get("free_bytes")
            return (free, "free GPU memory", True) if isinstance(free, int) else None
    from kvtui.gpu.host import host_room

    try:
        room, where = host_room()  # a container's or a shell's limit too
    except EngineError:
        return None
    return room, where, False


def check_shape_fits(settings: RunSettings, spec: EngineSpec) -> None:
    """`EngineError`, before any app opens, when `shape:MODEL` needs more than this machine's
    free memory (`shape_bytes` against `free_memory`), naming the catalog shapes that fit."""
    from kvtui.format import format_bytes
    from kvtui.sim.catalog import get_model, model_names
    from kvtui.sim.memory import shape_bytes

    assert spec.model is not None  # parse_engine sets it for shape:
    model = get_model(spec.model)  # check_run has looked it up
    free = free_memory(settings)
    if free is None or model.is_mla or model.active_params is not None:
        return  # unknown here, or a shape the engine refuses with its own words
    have, where, gpu = free
    context, batch = prompt_positions(settings) + settings.tokens, settings.batch
    need, what = shape_bytes(model, context, batch, gpu=gpu)
    if need <= have:
        return
    fits = [
        f"shape:{name}"
        for name in model_names()
        if not get_model(name).is_mla
        and get_model(name).active_params is None
        and shape_bytes(get_model(name), context, batch, gpu=gpu)[0] <= have
    ]
    here = f"fit here: {', '.join(fits)}" if fits else "no catalog shape fits here"
    raise EngineError(
        f"shape:{model.name} needs {format_bytes(need)} ({what}) but this machine has "
        f"{format_bytes(have)} of {where}; {here} (or tiny, or sim:{model.name}@h100 on paper)"
    )
