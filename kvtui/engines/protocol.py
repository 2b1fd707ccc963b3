"""The engine protocol: what a decode engine is and the records it emits. No UI, no torch.

A `StepSource` (the torch `tiny` model, a `shape:` or `hf:` model, the roofline `sim:` engine, a
`replay:` file) turns `RunSettings` into a stream of events, and `kvtui.engines.drive.run_events`
drives any of them:
one `RunStarted`, then `StepSample`s of one or both loops, then one `RunFinished` per loop.
Screens and `kvtui bench` only ever see these records, so they never care which engine produced
them. Each record round-trips through a JSON dict (`to_json` / `event_from_json`) so that it can
cross a pipe from the engine's own process.

The counting rule, the one every engine, formula and test in kvtui uses: the step that emits token
t (1-based) after a P-token prompt computes

- without a cache: P + t - 1 positions (the whole sequence so far, again);
- with a cache: P on the first step (the prefill) and 1 on every later step.

With a one-token prompt this is the lesson exactly: 24 tokens cost 300 positions without a cache
and 24 with it (276 wasted); 4,096 tokens cost 8,390,656 against 4,096. kvtui.sim.work computes
the same counts in closed form.

The rule is per sequence. A run of `batch` B decodes B sequences of the same prompt together, one
token of each per step, and a step of it counts the whole batch: B times those positions, B times
the FLOPs, the weights read once plus every sequence's keys and values (kvtui.sim.work's functions
with their `batch`), and B sequences' KV cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from kvtui.engines.attention import check_attention
from kvtui.engines.capabilities import Capabilities
from kvtui.engines.typed_json import is_number, typed_fields
from kvtui.sim.tricks import KVLayout

Loop = Literal["cached", "uncached"]
LOOPS: tuple[Loop, ...] = ("uncached", "cached")

DEFAULT_PROMPT = "It is a truth universally acknowledged, that"

MAX_RUN_BATCH = 256
"""The most sequences one run decodes together: vLLM's default `max_num_seqs`, the most sequences
its scheduler puts in one step. A bound, not a promise that they fit: the cached loop stops where
the KV pool runs out (kvtui.sim.pool.KVPool.tokens_before_full), and a batch's activations grow
with it. Row r's seed, `seed + r`, stays within torch's 64-bit seeds for any seed up to 2^63 - 1."""

MAX_TOKENS = 2**18
"""The most tokens one run generates: 262,144, past every catalog model's context (DeepSeek-V3's
163,840 is the longest). A run keeps each step's figures for its summary, and its record (about
300 bytes a step, two loops) must stay under the 256 MiB a replay reads."""


Progress = Callable[[str], None]
"""Hears, a phrase at a time, what an engine is doing while it gets ready (`RunProgress`)."""

FLOP_COUNTER_PHRASE = "setting up torch's FLOP counter"
"""Said while kvtui.gpu.counting warms FlopCounterMode (it imports torch's compiler: seconds)."""


def quiet(phrase: str) -> None:
    """A `Progress` that tells no one."""


@dataclass(frozen=True)
class RunSettings:
    """What to run: plain values, so a run can be started in another process."""

    engine: str = "tiny"
    """`tiny`, `shape:NAME`, `sim:NAME@GPU` or `replay:FILE`."""
    device: str = "auto"
    """`auto` (CUDA when present, else CPU), `cpu` or `cuda`."""
    tokens: int = 256
    """Tokens to generate after the prompt."""
    prompt: str = DEFAULT_PROMPT
    seed: int = 0
    greedy: bool = False
    temperature: float = 0.8
    top_k: int = 40
    loops: tuple[Loop, ...] = LOOPS
    """Which loops to run."""
    threads: int = 1
    """torch intra-op threads in the engine's process (1 beside a busy UI: more threads there
    made decode slower, not faster, on a 2-core machine)."""
    replay_speed: float = 1.0
    """For `replay:`: 1.0 is the recorded pace, 0 (or less) means as fast as possible."""
    lesson: bool = False
    """Run on a one-token prompt (the prompt's first token): the counts are then exactly the
    lesson's (24 tokens: 300 positions without a cache, 24 with it)."""
    kv_budget_bytes: int | None = None
    """The KV pool's capacity (`--kv-budget`); None: the engine's default (on a GPU, its share
    of the device as `gpu_memory_utilization` says; on a CPU, kvtui.sim.pool's
    CPU_KV_BUDGET_BYTES; for `sim:`, the modelled GPU's share)."""
    kv_block_tokens: int = 16
    """Token slots per block of the KV pool (`--kv-block`; vLLM's default block size)."""
    gpu_memory_utilization: float = 0.9
    """The share of a GPU's memory the engine may fill, as vLLM's flag of that name."""
    batch: int = 1
    """Sequences decoded together (`--batch`), 1 to MAX_RUN_BATCH: the same prompt in every row,
    row r sampling with seed `seed + r` (so greedy rows are equal), all through one model call per
    step and one KV pool."""
    kv_cache_dtype: str = "auto"
    """`--kv-cache-dtype` (vLLM's): auto (the model's dtype), fp8 or int8 (kvtui.sim.tricks)."""
    kv_window: int | None = None
    """`--kv-window`: positions kept per sequence, sinks included (StreamingLLM); None: all."""
    kv_sinks: int = 0
    """`--kv-sinks`: the first positions a window always keeps."""
    enable_prefix_caching: bool = False
    """`--enable-prefix-caching` (vLLM's): full prompt blocks another sequence holds are shared."""
    kv_heads: int | None = None
    """`--kv-heads`: average the model's key/value heads into this many (1: multi-query)."""

    @property
    def layout(self) -> KVLayout:
        """How the run keeps its KV cache (kvtui.sim.tricks.KVLayout)."""
        return KVLayout(
            cache_dtype=self.kv_cache_dtype,
            window=self.kv_window,
            sinks=self.kv_sinks,
            prefix_caching=self.enable_prefix_caching,
            kv_heads=self.kv_heads,
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "loops": list(self.loops)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSettings:
        """The settings a `to_json` dict holds; ValueError naming the first field of the wrong
        type (or out of range: tokens and threads at least 1, batch 1 to MAX_RUN_BATCH, loops
        distinct and known)."""
        values = typed_fields(cls, data, "run settings")
        if "loops" in values:
            loops = values["loops"] = tuple(values["loops"])
            if not loops or len(set(loops)) != len(loops):
                raise ValueError(f"run settings: loops must be distinct loops, not {loops}")
        for name in ("tokens", "threads", "kv_block_tokens"):
            if name in values and values[name] < 1:
                raise ValueError(f"run settings: {name} must be at least 1, not {values[name]}")
        if "batch" in values and not 1 <= values["batch"] <= MAX_RUN_BATCH:
            raise ValueError(
                f"run settings: batch must be from 1 to {MAX_RUN_BATCH}, not {values['batch']}"
            )
        if values.get("kv_budget_bytes") is not None and values["kv_budget_bytes"] < 0:
            raise ValueError("run settings: kv_budget_bytes must not be negative")
        utilization = values.get("gpu_memory_utilization", 0.9)
        if not 0 < utilization <= 1:
            raise ValueError(
                f"run settings: gpu_memory_utilization must be above 0 and at most 1, not "
                f"{utilization}"
            )
        settings = cls(**values)
        problem = settings.layout.problem()
        if problem:
            raise ValueError(f"run settings: {problem}")
        return settings


@dataclass(frozen=True)
class RunStarted:
    """Sent once, before the first step: what is running, and where."""

    engine: str
    model: str
    device: str
    """Where the steps run, in words: `cpu`, `cuda:0 (NVIDIA H100 80GB HBM3)`, `sim: h100`."""
    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    """Keys and values of one position of one sequence, every layer."""
    weights_bytes: int
    prompt_tokens: int
    """The prompt's positions, per sequence."""
    tokens: int
    """Tokens to generate, per sequence."""
    timing: str
    """How step times were had: "measured" (wall time after device sync) or "modelled
    (roofline)" (the `sim:` engine's arithmetic). Required: every engine says which, and a
    record without it is refused rather than read as measured."""
    threads: int = 1
    peak_bandwidth_bytes_per_s: float | None = None
    device_memory_total_bytes: int | None = None
    max_positions: int | None = None
    """The most positions (prompt + answer) the model can run, where it has a limit."""
    trained_positions: int | None = None
    """The longest sequence the model was trained on, where known: past it, text may degrade."""
    prompt_text: str = ""
    """The prompt as text, for showing before the generated text (dimmed)."""
    kv_capacity_bytes: int | None = None
    """The KV pool's capacity (kvtui.sim.pool.KVPool), or None where the engine keeps a cache
    of its own with no pool (`hf:`: transformers' StaticCache, sized for the run)."""
    kv_block_tokens: int | None = None
    """Token slots per block of the pool."""
    kv_pool_source: str = ""
    """Where the capacity came from, in words: "--kv-budget", the GPU's share, the CPU default."""
    batch: int = 1
    """Sequences decoded together; each step's figures count all of them."""
    ridge_flops_per_byte: float | None = None
    """The device's roofline ridge point, peak FLOP/s over peak bytes/s, where known: the catalog
    GPU's (`sim:`'s, or the one a CUDA device matches); None on a CPU or an unknown GPU."""
    ridge_source: str = ""
    """Where the ridge point came from, or why there is none, in words."""
    modelled_gpu: str = ""
    """The catalog GPU a modelled run's figures are of (`sim:`'s, by catalog name); empty for a
    measured run."""
    modelled_gpus: int = 1
    """How many of that GPU the model is split over (tensor parallel): each figure is one's."""
    served_by: str = ""
    """The serving engine a `vllm:` run watches, in words ("vLLM 0.32.0 at http://..."); empty
    for kvtui's own engines. Such a run's steps are streamed tokens timed on kvtui's clock: the
    server's positions computed, FLOPs and KV bytes cannot be observed from here, and its
    StepSamples carry 0 for them (the server's own figures come as `ServerMetrics`)."""
    dtype_source: str = ""
    """Why the run computes in `dtype`, in words: "the weights' own", "fp16 weights; a CPU
    computes fp32" (kvtui.gpu.device.run_dtype), "as vLLM serves fp32 weights" (`sim:`,
    kvtui.sim.catalog.serving_dtypes); empty where the engine did not say (an older record)."""
    recorded_at: str = ""
    """When the run was recorded (ISO 8601, local time with its offset), set in a record by
    `kvtui bench --record` (and by a replay of an older record, from its header): a replay says
    "recorded on DEVICE, DATE", never "live". Empty for a run happening now."""
    prompt_pieces: tuple[str, ...] = ()
    """The text of each prompt token, one per position (empty where the engine does not say):
    the rows of the cache picture. A piece may be empty (a byte in the middle of a character)."""
    attention_layer: int | None = None
    """The layer (0-based) whose newest query's attention the steps carry
    (kvtui.engines.attention); None where the engine does not observe attention."""
    attention_heads: int | None = None
    """The query heads of that layer the attention is the mean of."""
    kv_cache_dtype: str = "auto"
    """What the cached loop's cache stores (kvtui.sim.tricks): auto (the model's dtype), fp8 or
    int8; `kv_bytes_per_token` counts its codes and scales."""
    kv_window: int | None = None
    """Positions the cached loop keeps per sequence (a window, sinks included); None: all."""
    kv_sinks: int = 0
    prefix_caching: bool = False
    """Whether the batch's sequences share full blocks of their prompt."""
    kv_shared_tokens: int = 0
    """Prompt positions each sequence after the first shares rather than holds (prefix caching:
    whole blocks, never the last prompt token)."""
    kv_heads_model: int | None = None
    """The model's own key/value heads where the run averaged them (`kv_heads` is what runs)."""
    can: Capabilities | None = None
    """What the engine can do (kvtui.engines.capabilities); a replay's says what the recorded
    run could do, and that it is a replay. None where the event does not say: a record written
    before engines said (its replay finds them from its engine's name) or an event made by hand."""
    sliding_window: int | None = None
    """Positions a sliding-window layer of the model itself keeps (Mistral's, Gemma 2's), as the
    KV formula caps them (kvtui.sim.memory.kv_bytes); None where no layer slides, as in kvtui's
    own decoder, which keeps every position in every layer. Not `kv_window`, the run's layout."""
    sliding_layers: tuple[int, ...] = ()
    """The layers (0-based) that keep `sliding_window`; the others keep every position."""
    kind: str = field(default="started", init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= MAX_RUN_BATCH:  # every step's counts are divided by it
            raise ValueError(
                f"started event: batch must be from 1 to {MAX_RUN_BATCH}, not {self.batch}"
            )
        object.__setattr__(self, "prompt_pieces", tuple(self.prompt_pieces))
        if self.prompt_pieces and len(self.prompt_pieces) != self.prompt_tokens:
            raise ValueError(
                f"started event: {len(self.prompt_pieces)} prompt pieces for "
                f"{self.prompt_tokens} prompt tokens"
            )
        problem = self.layout.problem()  # as a live run's layout is checked (a record's too)
        if problem:
            raise ValueError(f"started event: {problem}")
        if self.kv_shared_tokens > self.prompt_tokens:
            raise ValueError(
                f"started event: {self.kv_shared_tokens} shared of {self.prompt_tokens} prompt "
                "tokens"
            )
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"started event: a sliding window of {self.sliding_window} positions")
        if any(not 0 <= layer < self.layers for layer in self.sliding_layers):
            raise ValueError(
                f"started event: sliding layers {self.sliding_layers[:8]} are not all among its "
                f"{self.layers} layers"
            )

    @property
    def layout(self) -> KVLayout:
        """How the cached loop keeps its cache (fewer heads: `kv_heads` against
        `kv_heads_model`)."""
        return KVLayout(
            cache_dtype=self.kv_cache_dtype,
            window=self.kv_window,
            sinks=self.kv_sinks,
            prefix_caching=self.prefix_caching,
            kv_heads=self.kv_heads if self.kv_heads_model is not None else None,
        )


@dataclass(frozen=True)
class StepSample:
    """One decode step of one loop, as measured: one sample per step for the whole batch.

    The token and its text are row 0's (every row's is the same prompt; with greedy decoding every
    row's token too). The counts are the whole batch's: `batch` times one sequence's positions,
    FLOPs and KV bytes; the bytes read count the weights once and every sequence's cache."""

    loop: Loop
    step: int
    """0-based index of the generated token."""
    position: int
    """Position of the new token in the sequence (prompt_tokens + step)."""
    token_id: int
    """Row 0's token."""
    text: str
    """The text row 0's token completes (UTF-8 safe: may be empty mid-character)."""
    positions_computed: int
    """Positions whose keys and values this step computed, every sequence's. The torch engines
    observe it (the rows of keys the model's layers produced in the step), so it can disagree
    with the counting rule: with a cache, prompt_tokens on the first step (the prefill) and 1
    after; without, every position so far (position itself); times the batch. The `sim:` engine
    models it by that rule."""
    flops: int
    """FLOPs of the step by the formula (kvtui.sim.work.step_cost), every sequence's."""
    bytes_read: int
    """Bytes the step reads by the formula: the weights once, and every sequence's keys and
    values."""
    step_seconds: float
    """Wall time of the step, measured after synchronising the device."""
    kv_bytes: int
    """KV-cache bytes filled after the step: every sequence's positions' keys and values (0 for
    the uncached loop, which keeps none)."""
    device_memory_bytes: int | None = None
    kv_bytes_allocated: int = 0
    """KV-cache bytes allocated after the step, every sequence's: the blocks taken from the pool,
    each whole (the last one's unused slots too), or the buffers of an engine's own cache."""
    flops_counted: int | None = None
    """FLOPs torch's FlopCounterMode counted over the step's model call, every sequence's, on
    the steps the torch engines sample (kvtui.engines.loops.counts_flops); None elsewhere and for
    `sim:`. Beside `flops`, the formula's, it is the check that the model computed what the
    lesson says."""
    attention_spans: tuple[int, ...] | None = None
    """Where the engine sent the step's attention (kvtui.engines.attention: at most
    ATTENTION_PER_SECOND steps a second, the first and the last always): the first position of
    each span of keys its newest query (at `position - 1`) read; None on other steps."""
    attention: tuple[int, ...] | None = None
    """The share of that query's attention each span got, in millionths (row 0; the layer and
    heads `RunStarted` names), read outside the timed step."""
    kind: str = field(default="step", init=False)

    def __post_init__(self) -> None:
        if (self.attention is None) != (self.attention_spans is None):
            raise ValueError("step event: attention and attention_spans go together")
        if self.attention is not None and self.attention_spans is not None:
            object.__setattr__(self, "attention", tuple(self.attention))
            object.__setattr__(self, "attention_spans", tuple(self.attention_spans))
            check_attention(self.attention_spans, self.attention, self.position)


@dataclass(frozen=True)
class RunFinished:
    """Sent once per loop when it ends."""

    loop: Loop
    reason: Literal["done", "cancelled", "out_of_memory", "error"]
    steps: int
    message: str = ""
    kv_bytes_allocated: int | None = None
    """Bytes of the KV cache this loop held at its end (before it was freed), every sequence's,
    measured from the tensors: whole blocks of the pool, or an engine's own buffers."""
    kv_bytes_filled: int | None = None
    """Bytes of keys and values of the positions it had written by then, every sequence's."""
    kv_bytes_per_position: int | None = None
    """Keys and values of one position of one sequence, every layer, measured from the cache's
    tensors (codes and scales: their bytes over their slots); None without a cache."""
    kind: str = field(default="finished", init=False)


@dataclass(frozen=True)
class RunFailed:
    """The run could not start or the engine died: one line for a person to read."""

    message: str
    kind: str = field(default="failed", init=False)


@dataclass(frozen=True)
class ServerMetrics:
    """One poll of a serving engine's Prometheus `/metrics` (the `vllm:` engine), sent at a
    bounded rate while the run streams and after it: every figure is the server's own, as it
    reported it, never kvtui's measurement (kvtui.engines.vllm.metrics reads them). None where the
    server reported no metric of that quantity; `found` says which name each was read from
    ("kv_usage=vllm:kv_cache_usage_perc"), since names change between releases. A poll that got
    no figures says why in `error` (the server did not answer, or has no such metrics)."""

    seconds: float
    """When the poll answered, in seconds after the engine opened (kvtui's clock)."""
    error: str = ""
    found: tuple[str, ...] = ()
    kv_usage: float | None = None
    """The share of the server's KV-cache blocks in use, 0 to 1."""
    kv_blocks: int | None = None
    """Blocks of the server's KV cache (vLLM's num_gpu_blocks: all its engines')."""
    kv_block_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    """Token slots of the KV cache (vLLM's kv_cache_size_tokens)."""
    kv_cache_memory_bytes: int | None = None
    """The memory the server sized its KV cache from (vLLM's kv_cache_memory_bytes)."""
    kv_cache_dtype: str = ""
    """The server's cache dtype ("auto": the model's)."""
    kv_blocks_override: int | None = None
    """vLLM's --num-gpu-blocks-override, when set: the blocks are then not what memory holds."""
    max_concurrency: float | None = None
    """vLLM's "maximum concurrency" of max_model_len-token requests (each engine's)."""
    engines: int | None = None
    """Data-parallel engines that reported their cache (vLLM's `engine` label): `kv_blocks` is
    all of theirs, `kv_cache_memory_bytes` each one's."""
    prefix_caching: bool | None = None
    """Whether the server caches prefixes (vLLM's enable_prefix_caching); None: not said."""
    kv_used_tokens: int | None = None
    """Token slots running requests hold (SGLang's kv_used_tokens; vLLM says only a share)."""
    kv_evictable_tokens: int | None = None
    """Token slots holding prefix-cached keys and values no request holds, freed when needed
    (SGLang's kv_evictable_tokens)."""
    kv_free_tokens: int | None = None
    """Token slots holding nothing (SGLang's kv_available_tokens)."""
    requests_running: int | None = None
    requests_waiting: int | None = None
    waiting_reasons: tuple[str, ...] = ()
    """Requests waiting by reason, as "reason=count" ("capacity=3")."""
    preemptions: int | None = None
    """Requests preempted since the server started (a counter)."""
    prefix_queries_tokens: int | None = None
    """Prompt tokens looked up in the prefix cache since the server started."""
    prefix_hits_tokens: int | None = None
    """Of those, tokens found cached."""
    prefix_hit_rate: float | None = None
    """A hit rate the server reports directly (SGLang), 0 to 1."""
    ttft_seconds_sum: float | None = None
    """The server's time-to-first-token histogram: its sum of seconds and count of requests."""
    ttft_count: int | None = None
    itl_seconds_sum: float | None = None
    """The server's inter-token latency histogram: its sum of seconds and count of gaps."""
    itl_count: int | None = None
    replica: int = 0
    """Which server of a fleet (`vllm:URL1,URL2,...`) this poll read, by its place in the list
    from 0; 0 for a single server (the one the decode runs on)."""
    model: str = ""
    """The model the server says it serves in its metrics' `model_name` label ("": not said)."""
    kind: str = field(default="server", init=False)


MAX_PROGRESS_CHARS = 120
"""The longest phrase a progress event carries."""


@dataclass(frozen=True)
class RunProgress:
    """Sent by the engine's process before `RunStarted` while it gets ready (importing torch,
    loading the weights, ...): a phrase for the waiting line."""

    phrase: str
    kind: str = field(default="progress", init=False)

    def __post_init__(self) -> None:
        if len(self.phrase) > MAX_PROGRESS_CHARS:
            raise ValueError(
                f"progress event: a phrase of more than {MAX_PROGRESS_CHARS} characters"
            )


Event = RunStarted | StepSample | RunFinished | RunFailed | ServerMetrics | RunProgress

_KINDS: dict[str, type[Event]] = {
    "started": RunStarted,
    "step": StepSample,
    "finished": RunFinished,
    "failed": RunFailed,
    "server": ServerMetrics,
    "progress": RunProgress,
}


def to_json(event: Event) -> dict[str, Any]:
    """A JSON-ready dict of an event, with its `kind`."""
    return asdict(event)


def event_from_json(data: dict[str, Any]) -> Event:
    """The event a `to_json` dict describes; ValueError if it is not one: every field must be of
    its declared type, and every number in an event is finite and not negative (a count, a size,
    a time), an integer within 64 bits."""
    try:
        cls = _KINDS[data["kind"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a kvtui event: {str(data)[:80]}") from exc
    what = f"{data['kind']} event"
    values = typed_fields(cls, data, what)
    for name, value in values.items():
        if is_number(value) and value < 0:
            raise ValueError(f"{what}: {name} is negative ({value})")
    try:
        return cls(**values)
    except TypeError as exc:
        raise ValueError(f"malformed {what}: {exc}") from exc


class RunControl:
    """Pause and stop, set from another thread, honoured between steps."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._running.set()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def wait_while_paused(self) -> None:
        self._running.wait()


# --- what an engine is -------------------------------------------------------------------------


class StepSource(Protocol):
    """A decode engine: what it runs, then the steps of each loop."""

    def started(self) -> RunStarted:
        """What runs, and where; sent before the first step."""
        ...

    def steps(self, loop: Loop) -> Generator[StepSample | RunFinished | ServerMetrics, None, None]:
        """The steps of one loop; may end with its own `RunFinished` (out of memory, say). A
        served engine (`vllm:`) also yields its server's `ServerMetrics` between them."""
        ...

    def close(self) -> None: ...
