"""`kvtui tricks`: the tricks that stretch the KV cache, each run on the live model under one KV
budget beside the plain cache, one row each, without a UI.

A row is one `kvtui bench` of the cached loop (kvtui.reports.bench, so its figures are folded as the
bench's and the screens' are) with one trick of kvtui.sim.tricks: its bytes per token measured
from the cache's tensors beside the formula's, where the pool stopped it against where the trick's
own C - P + 1 says it would, what it costs in quality (kvtui.engines.quality, measured on held-out
text), and its speed (tokens per second, the first token's time, a later token's over the same
first bench.SPEED_STEPS steps as the plain cache's). Multi-head attention is a row of formulas: the
shipped model has 2 key/value heads, and a model with 8 would have to be trained.

`run_table` yields the rows as they are measured, so the app's screen 4 shows each as it lands
(`child_main` writes them as JSON lines from the engine's own process); `kvtui tricks --json`
prints them all. On `sim:` the same rows are modelled on a catalog model and GPU.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from kvtui.engines.capabilities import OWN_ENGINES
from kvtui.engines.factory import check_run, open_engine, parse_engine
from kvtui.engines.protocol import RunSettings
from kvtui.errors import EngineError
from kvtui.gpu.probe import cuda_visible
from kvtui.sim.pool import KVPool
from kvtui.sim.tricks import (
    PUBLISHED,
    QUALITY_BYTES,
    KVLayout,
    layout_bytes_per_token,
    mha_spec,
    tokens_before_full,
)

BUDGET_TOKENS = 160
"""The KV budget every row shares, by default: the power of two of bytes that holds this many
tokens of the model's plain cache (512 KiB for the shipped model's fp32 cache, 3,072 bytes a
token: 160 tokens of 16-token blocks), so the plain cache stops early and each trick's room
shows."""
TABLE_TOKENS = 768
"""Tokens each row asks for by default: past where fp8 and int8 stop on the shipped model's 512
KiB (672 and 640 positions), so each row's stop is measured."""
TABLE_WINDOW = 128
"""Positions the window rows keep: a window that fills and slides within the 1,024 bytes of text
each trick's quality is measured on, and whose blocks fit in the 512 KiB pool."""
TABLE_SINKS = 4
"""StreamingLLM's sinks."""
TABLE_BATCH = 4
"""Sequences of one prompt the prefix-caching row decodes together (and its plain baseline)."""


@dataclass(frozen=True)
class TrickRow:
    """One row of the table: a trick's settings over the base run's."""

    key: str
    label: str
    """The trick in a few words, for the table's first column."""
    changes: dict[str, Any] = field(default_factory=dict)
    """RunSettings fields the row sets."""
    reference: str = ""
    """Which published figures (kvtui.sim.tricks.PUBLISHED) stand beside it."""
    formula_only: bool = False
    """Priced by the formula alone (multi-head attention: no such model here)."""

    def settings(self, base: RunSettings) -> RunSettings:
        return replace(base, **self.changes)


TABLE_ROWS: tuple[TrickRow, ...] = (
    TrickRow("plain", "plain cache"),
    TrickRow("fp8", "fp8 cache", {"kv_cache_dtype": "fp8"}, "fp8"),
    TrickRow("int8", "int8 cache", {"kv_cache_dtype": "int8"}, "int8"),
    TrickRow(
        "window",
        f"window {TABLE_WINDOW - TABLE_SINKS} + {TABLE_SINKS} sinks",
        {"kv_window": TABLE_WINDOW, "kv_sinks": TABLE_SINKS},
        "window",
    ),
    TrickRow(
        "window-nosinks", f"window {TABLE_WINDOW}, no sinks", {"kv_window": TABLE_WINDOW}, "window"
    ),
    TrickRow(
        "prefix",
        f"prefix caching, {TABLE_BATCH} seqs",
        {"enable_prefix_caching": True, "batch": TABLE_BATCH},
    ),
    TrickRow("mqa", "1 KV head (MQA, averaged)", {"kv_heads": 1}, "kv-heads"),
    TrickRow("mha", "8 KV heads (MHA)", {}, "kv-heads", formula_only=True),
)
"""The rows, in the order the table shows them."""


def table_base(settings: RunSettings) -> RunSettings:
    """The run every row varies: the cached loop only, greedy, the tricks off, on the settings'
    engine, prompt, device and threads, with the table's budget and length unless given."""
    plain = replace(
        settings,
        loops=("cached",),
        greedy=True,
        batch=1,
        kv_cache_dtype="auto",
        kv_window=None,
        kv_sinks=0,
        enable_prefix_caching=False,
        kv_heads=None,
    )
    return replace(plain, kv_budget_bytes=settings.kv_budget_bytes or default_budget(plain))


def default_budget(settings: RunSettings) -> int:
    """The table's and the race's KV budget: the power of two of bytes at or above
    BUDGET_TOKENS tokens of the model's plain cache, by the formula (one GPU's share on `sim:`);
    512 KiB for the shipped model."""
    shape = _shape(settings)
    per_token = 3072 if shape is None else layout_bytes_per_token(shape[0], KVLayout(), shape[1])
    need = BUDGET_TOKENS * per_token
    return 1 << (need - 1).bit_length()


def check_table(base: RunSettings) -> None:
    """Refuse, before any row runs, a base run no row could make (`EngineError`, one line): on
    `sim:` each row's engine is opened too (arithmetic, no torch), so that an unknown GPU or a
    model it cannot hold is refused here, not taken for a pool that stopped every row at once."""
    spec = check_run(base)
    if not spec.can.own_cache:
        raise EngineError(f"kvtui tricks runs {OWN_ENGINES}, not {spec.kind}:")
    for row in TABLE_ROWS:
        if not row.formula_only:
            try:
                check_run(row.settings(base))
            except EngineError as exc:  # the table's own setting: say whose
                raise EngineError(f"the {row.label} row: {exc}") from None
            if spec.can.modelled:
                open_engine(row.settings(base)).close()


def _speed(loop: dict[str, Any]) -> dict[str, Any]:
    """A row's speed: its own run's, by itself at whatever moment it ran (`alone`); a torch
    table adds the layouts' steps timed in turns (`in_turns`, run_table)."""
    return {
        "alone": {
            "tokens_per_s": loop["tokens_per_s_per_sequence"],
            "ttft_s": loop["ttft_s"],
            "tpot_s": loop["tpot_s"],
            "tpot_first_steps_s": loop["tpot_first_steps_s"],
        }
    }


def run_row(
    row: TrickRow,
    base: RunSettings,
    *,
    quality_bytes: int = QUALITY_BYTES,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """One row, measured (or, for multi-head attention, priced by the formula)."""
    from kvtui.reports.bench import run_bench

    settings = row.settings(base)
    out: dict[str, Any] = {"key": row.key, "label": row.label, "reference": row.reference}
    if row.formula_only:
        return {**out, **_formula_row(base)}
    say = lambda line: progress(f"{row.label}: {line}")  # noqa: E731
    try:
        r = run_bench(
            settings, quality_bytes=0 if row.key == "plain" else quality_bytes, progress=say
        )
    except EngineError as exc:  # no step at all: the pool cannot hold the prompt
        return {**out, **_no_steps(settings, str(exc))}
    cached = r["cached"]
    finished = cached["finished"] or {}
    out.update(
        how="measured" if r["timing"] == "measured" else "modelled",
        words=r["kv_layout"]["words"],
        batch=r["batch"],
        prompt_tokens=r["prompt_tokens"],
        tokens=r["tokens"],
        kv_capacity_bytes=r["kv_capacity_bytes"],
        kv_dtype=settings.layout.storage_dtype(r["dtype"]),
        kv_bytes_per_token=cached["kv_bytes_per_token"],
        kv_bytes_per_token_formula=cached["kv_bytes_per_token_formula"],
        steps=cached["tokens"],
        stopped=finished.get("reason") == "out_of_memory",
        stop_message=finished.get("message", ""),
        tokens_before_full_predicted=cached["tokens_before_full_predicted"],
        kv_bytes_allocated=r["kv_bytes_allocated"],
        quality=cached["quality"],
        speed=_speed(cached),
        text=r["text"][:160],
    )
    if row.key == "prefix":  # the same batch without sharing, for its pool and speed
        out["first_step_positions"] = cached["first_step_positions"]  # the prefill's own count
        unshared = replace(settings, enable_prefix_caching=False)
        try:
            plain = run_bench(unshared, quality_bytes=0)
        except EngineError as exc:  # the pool cannot hold every sequence's prompt unshared
            out["baseline"] = _no_steps(unshared, str(exc))
            return out
        c = plain["cached"]
        out["baseline"] = {
            "steps": c["tokens"],
            "tokens_before_full_predicted": c["tokens_before_full_predicted"],
            "speed": _speed(c),
            "first_step_positions": c["first_step_positions"],
        }
    return out


def _no_steps(settings: RunSettings, message: str) -> dict[str, Any]:
    """A row whose run made no step: the pool could not hold the prompt (of every sequence).
    Its bytes per token and its prediction are still the formula's (the layout's, on the
    table's pool)."""
    from kvtui.engines.factory import prompt_positions

    shape = _shape(settings)
    per_token = predicted = None
    if shape is not None:
        per_token = layout_bytes_per_token(shape[0], settings.layout, shape[1])
        budget = settings.kv_budget_bytes or default_budget(settings)
        pool = KVPool(budget, settings.kv_block_tokens, per_token)
        P = prompt_positions(settings)
        predicted = tokens_before_full(pool, settings.layout, P, settings.batch)
    sim = parse_engine(settings.engine).can.modelled
    return {
        "how": "modelled" if sim else "measured",
        "words": settings.layout.words(),
        "batch": settings.batch,
        "tokens": settings.tokens,
        "kv_bytes_per_token_formula": per_token,
        "steps": 0,
        "stopped": True,
        "stop_message": message,
        "tokens_before_full_predicted": predicted,
        "first_step_positions": 0,
        "quality": None,
        "speed": {},
    }


def _formula_row(base: RunSettings) -> dict[str, Any]:
    """Multi-head attention's bytes and pool, by the formula: a key/value head per query head."""
    from kvtui.engines.factory import prompt_positions

    shape = _shape(base)
    if shape is None:
        return {"how": "formula", "words": "no shape known"}
    mha = mha_spec(shape[0])
    per_token = layout_bytes_per_token(mha, KVLayout(), shape[1])
    pool = KVPool(base.kv_budget_bytes or default_budget(base), base.kv_block_tokens, per_token)
    P = prompt_positions(base)
    return {
        "how": "formula",
        "label": f"{mha.kv_heads} KV heads (MHA)",  # the model's query heads, not the shipped 8
        "words": f"{mha.kv_heads} KV heads",
        "kv_bytes_per_token_formula": per_token,
        "tokens_before_full_predicted": tokens_before_full(pool, KVLayout(), P, 1),
        "kv_capacity_bytes": pool.capacity_bytes,
        "prompt_tokens": P,
        "tokens": base.tokens,
        "batch": 1,
    }


def _shape(base: RunSettings) -> tuple[Any, str] | None:
    """The model's shape and the dtype its cache is kept in, cheaply (no torch): the shipped
    model's from its header, a catalog model's; in the dtype kvtui's engine computes it in
    (kvtui.sim.catalog.compute_dtype: fp32 on a CPU, the weights' own on a GPU where it can),
    or on `sim:` as a server keeps it."""
    from kvtui.engines.factory import tiny_config
    from kvtui.sim.catalog import compute_dtype, get_model, serving_dtypes
    from kvtui.sim.parallel import shard

    spec = parse_engine(base.engine)
    on_gpu = base.device not in ("cpu", "auto") or (base.device == "auto" and cuda_visible())
    if spec.can.own_cache and spec.model is None:  # the shipped model (tiny): its own header
        from kvtui.paths import TINY_NAME, TINY_WEIGHTS, asset_path
        from kvtui.sim.hf_config import safetensors_dtype

        model = get_model(TINY_NAME)
        heads = tiny_config().get("n_kv_head", model.kv_heads)
        if isinstance(heads, int):
            model = replace(model, kv_heads=heads)
        stored = safetensors_dtype(asset_path(TINY_WEIGHTS)) or "fp32"
        return model, compute_dtype(stored, gpu=on_gpu)[0]
    if spec.model:
        model = get_model(spec.model)
        if spec.can.modelled:
            return shard(model, spec.gpus), serving_dtypes(model.default_dtype)[1]
        return model, compute_dtype(model.default_dtype, gpu=on_gpu)[0]
    return None


SPEED_ROUNDS = 7
SPEED_STEPS = 128
"""The layouts' steps timed in turns after the rows: rounds of this many cached steps each."""


def speeds_in_turns(base: RunSettings) -> dict[str, dict[str, Any]]:
    """Each row's cached step against the plain cache's, the layouts taking turns so that a
    shared machine's drift falls on all alike (kvtui.engines.quality.step_ms_in_turns): row key ->
    the median round's step time (`step_s`), its tokens per second and the plain step's time over
    the row's (`vs_plain`, above 1: faster), all of the same rounds, so they agree. kvtui's own
    torch engines only."""
    import statistics

    from kvtui.engines.quality import step_ms_in_turns
    from kvtui.engines.torch_engine import open_torch_engine
    from kvtui.gpu.load import ready_to_decode
    from kvtui.gpu.tricks import average_kv_heads

    spec = parse_engine(base.engine)
    engine = open_torch_engine(base, spec.model)
    try:
        model = engine.model
        ways = {
            "plain": (model, None),
            "fp8": (model, KVLayout(cache_dtype="fp8")),
            "int8": (model, KVLayout(cache_dtype="int8")),
            "window": (model, KVLayout(window=TABLE_WINDOW, sinks=TABLE_SINKS)),
            "window-nosinks": (model, KVLayout(window=TABLE_WINDOW)),
        }
        if model.args.n_kv_head > 1:
            ways["mqa"] = (ready_to_decode(average_kv_heads(model, 1)), None)
        times = step_ms_in_turns(ways, rounds=SPEED_ROUNDS, steps=SPEED_STEPS)
    finally:
        engine.close()
    plain = statistics.median(times["plain"])
    return {
        key: {
            "step_s": statistics.median(t) / 1e3,
            "tokens_per_s": 1e3 / statistics.median(t),
            "vs_plain": plain / statistics.median(t),
            "rounds": SPEED_ROUNDS,
            "steps": SPEED_STEPS,
        }
        for key, t in times.items()
    }


def run_table(
    settings: RunSettings,
    *,
    quality_bytes: int = QUALITY_BYTES,
    progress: Callable[[str], None] = lambda line: None,
) -> Iterator[dict[str, Any]]:
    """Every row of the table, in order, as each is measured; then, on a torch engine, the rows
    again with their speed timed in turns against the plain cache's (`speed.in_turns`): a row's
    own speed (`speed.alone`) is of its run alone, at whatever moment it ran."""
    base = table_base(settings)
    check_table(base)
    rows = []
    for row in TABLE_ROWS:
        rows.append(run_row(row, base, quality_bytes=quality_bytes, progress=progress))
        yield rows[-1]
    if parse_engine(base.engine).can.torch:  # kvtui's decoder (check_table: its own engines)
        progress(f"the layouts' steps in turns ({SPEED_ROUNDS} rounds of {SPEED_STEPS})")
        timed = speeds_in_turns(base)
        for measured in rows:
            if measured["key"] in timed:
                measured["speed"] = {
                    **measured.get("speed", {}),
                    "in_turns": timed[measured["key"]],
                }
                yield measured


def table_header(settings: RunSettings) -> dict[str, Any]:
    """What every row shares: the engine, budget and length; where the machine's speed came
    from; the published references."""
    base = table_base(settings)
    return {
        "engine": base.engine,
        "kv_budget_bytes": base.kv_budget_bytes,
        "tokens": base.tokens,
        "prompt": base.prompt,
        "kv_block_tokens": base.kv_block_tokens,
        "cpu_capability": _cpu_capability() if not parse_engine(base.engine).can.modelled else None,
        "rows": [{"key": r.key, "label": r.label} for r in TABLE_ROWS],
        "references": [{"trick": r.trick, "claim": r.claim, "source": r.source} for r in PUBLISHED],
    }


def _cpu_capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


# --- the app's child process ---------------------------------------------------------------------

TABLE_MAIN = "from kvtui.reports.table import child_main\nraise SystemExit(child_main())"
"""What the table's child runs, once kvtui is imported (kvtui.run.process.child_command)."""
TABLE_LINE_KINDS = ("header", "row", "failed", "done")
"""What a table's lines say: what every row shares, a row, why it could not run, the end."""


class TableProcess:
    """The table measured in a child process of its own (torch there, never in the UI), its lines
    read back one at a time: for the app's screen 4. `lines` yields dicts with a `kind` of
    TABLE_LINE_KINDS; a child that dies without its last line yields a `failed` one saying so."""

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self._proc: Any = None
        self._stderr: Any = None

    def start(self) -> None:
        from kvtui.run.process import absolute_paths, spawn_child

        self._proc, self._stderr = spawn_child(TABLE_MAIN)
        try:
            self._proc.stdin.write(json.dumps(absolute_paths(self.settings).to_json()) + "\n")
            self._proc.stdin.close()
        except OSError:
            pass  # the child died at once: `lines` says why

    def lines(self) -> Iterator[dict[str, Any]]:
        proc = self._proc
        if proc is None or proc.stdout is None:
            raise RuntimeError("start() first")
        ended = False
        for line in proc.stdout:
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue  # a library's stray output
            if not isinstance(data, dict) or data.get("kind") not in TABLE_LINE_KINDS:
                continue
            ended = ended or data["kind"] in ("failed", "done")
            yield data
        code = proc.wait()
        if not ended:
            self._stderr.seek(0)
            said = [x.strip() for x in self._stderr.read().splitlines() if x.strip()]
            why = said[-1] if said else f"it exited with status {code}"
            yield {"kind": "failed", "message": f"the table's process stopped: {why}"[:200]}

    def close(self, timeout: float = 1.0) -> None:
        from kvtui.run.process import end_process

        proc = self._proc
        if proc is not None:
            end_process(proc, timeout, (proc.stdout, self._stderr))


class InProcessTable:
    """The table measured in this process, as `TableProcess` reports it: for `sim:` engines
    (no torch), in tests and kvtui.testing. A torch engine's table says it runs elsewhere."""

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self._closed = False

    def start(self) -> None:
        pass

    def lines(self) -> Iterator[dict[str, Any]]:
        if not parse_engine(self.settings.engine).can.modelled:
            yield {"kind": "failed", "message": "the table of a torch engine runs in its process"}
            return
        try:
            yield {"kind": "header", **table_header(self.settings)}
            for row in run_table(replace(self.settings, replay_speed=0)):
                if self._closed:
                    return
                yield {"kind": "row", **row}
        except EngineError as exc:
            yield {"kind": "failed", "message": str(exc)}
            return
        yield {"kind": "done"}

    def close(self, timeout: float = 1.0) -> None:
        self._closed = True


def child_main() -> int:
    """Run the table for the app: one JSON line of settings on stdin, then on stdout a header
    line, one line per row as it is measured, and a last line saying it is done (or why not)."""
    out = sys.stdout
    sys.stdout = sys.stderr  # a library's print must not corrupt the lines

    def emit(kind: str, data: dict[str, Any]) -> None:
        out.write(json.dumps({"kind": kind, **data}, separators=(",", ":")) + "\n")
        out.flush()

    try:
        settings = RunSettings.from_json(json.loads(sys.stdin.readline()))
        check_table(table_base(settings))  # a run no row could make costs no torch import
        emit("header", table_header(settings))
        for row in run_table(settings):
            emit("row", row)
    except (EngineError, ValueError, json.JSONDecodeError) as exc:
        emit("failed", {"message": str(exc).splitlines()[0] if str(exc) else "bad settings"})
        return 2
    except BrokenPipeError:
        return 0
    emit("done", {})
    return 0
