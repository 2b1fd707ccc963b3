"""`kvtui tricks`: the tricks that stretch the KV cache, each run on the live model under one KV
budget beside the plain cache, one row each, without a UI.

A row is one `kvtui bench` of the cached loop (kvtui.engine.bench, so its figures are folded as the
bench's and the screens' are) with one trick of kvtui.sim.tricks: its bytes per token measured
from the cache's tensors beside the formula's, where the pool stopped it against where the trick's
own C - P + 1 says it would, what it costs in quality (kvtui.gpu.quality, measured on held-out
text), and its speed (tokens per second, the first token's time, a later token's over the same
first SPEED_STEPS steps as the plain cache's). Multi-head attention is a row of formulas: the
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

from kvtui.engine.protocol import EngineError, RunSettings
from kvtui.engine.spec import check_run, parse_engine
from kvtui.sim.pool import KVPool
from kvtui.sim.tricks import (
    PUBLISHED,
    QUALITY_BYTES,
    KVLayout,
    layout_bytes_per_token,
    mha_spec,
    tokens_before_full,
)

TABLE_BUDGET_BYTES = 2**20
"""The KV budget every row shares by default: 1 MiB, 336 tokens of the shipped model's fp32 cache
(3,072 bytes a token), and room for a window of 256 (its 18 blocks of 16)."""
TABLE_TOKENS = 1536
"""Tokens each row asks for by default: past where fp8 and int8 stop on 1 MiB (1,360 and 1,280
positions), so each row's stop is measured."""
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
    TrickRow("window", "window 252 + 4 sinks", {"kv_window": 256, "kv_sinks": 4}, "window"),
    TrickRow("window-nosinks", "window 256, no sinks", {"kv_window": 256}, "window"),
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
    return replace(
        settings,
        loops=("cached",),
        greedy=True,
        batch=1,
        kv_cache_dtype="auto",
        kv_window=None,
        kv_sinks=0,
        enable_prefix_caching=False,
        kv_heads=None,
        kv_budget_bytes=settings.kv_budget_bytes or TABLE_BUDGET_BYTES,
    )


def check_table(base: RunSettings) -> None:
    """Refuse, before any row runs, a base run no row could make (`EngineError`, one line)."""
    spec = check_run(base)
    if spec.kind not in ("tiny", "shape", "sim"):
        raise EngineError(
            f"kvtui tricks runs kvtui's own engines (tiny, shape:, sim:), not {spec.kind}:"
        )
    for row in TABLE_ROWS:
        if not row.formula_only:
            check_run(row.settings(base))


def _speed(loop: dict[str, Any]) -> dict[str, Any]:
    return {
        "tokens_per_s": loop["tokens_per_s_per_sequence"],
        "ttft_s": loop["ttft_s"],
        "tpot_s": loop["tpot_s"],
        "tpot_first_steps_s": loop["tpot_first_steps_s"],
    }


def run_row(
    row: TrickRow,
    base: RunSettings,
    *,
    quality_bytes: int = QUALITY_BYTES,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """One row, measured (or, for multi-head attention, priced by the formula)."""
    from kvtui.engine.bench import run_bench

    settings = row.settings(base)
    out: dict[str, Any] = {"key": row.key, "label": row.label, "reference": row.reference}
    if row.formula_only:
        return {**out, **_formula_row(base)}
    say = lambda line: progress(f"{row.label}: {line}")  # noqa: E731
    r = run_bench(settings, quality_bytes=0 if row.key == "plain" else quality_bytes, progress=say)
    cached = r["cached"]
    finished = cached["finished"] or {}
    out.update(
        how="measured" if r["timing"] == "measured" else "modelled",
        words=r["kv_layout"]["words"],
        batch=r["batch"],
        prompt_tokens=r["prompt_tokens"],
        tokens=r["tokens"],
        kv_capacity_bytes=r["kv_capacity_bytes"],
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
        plain = run_bench(replace(settings, enable_prefix_caching=False), quality_bytes=0)
        c = plain["cached"]
        out["baseline"] = {
            "steps": c["tokens"],
            "tokens_before_full_predicted": c["tokens_before_full_predicted"],
            "speed": _speed(c),
            "first_step_positions": plain["work_cached"] - (c["tokens"] - 1) * plain["batch"],
        }
        out["first_step_positions"] = r["work_cached"] - (cached["tokens"] - 1) * r["batch"]
    return out


def _formula_row(base: RunSettings) -> dict[str, Any]:
    """Multi-head attention's bytes and pool, by the formula: a key/value head per query head."""
    from kvtui.engine.spec import prompt_positions

    shape = _shape(base)
    if shape is None:
        return {"how": "formula", "words": "no shape known"}
    mha = mha_spec(shape[0])
    per_token = layout_bytes_per_token(mha, KVLayout(), shape[1])
    pool = KVPool(base.kv_budget_bytes or TABLE_BUDGET_BYTES, base.kv_block_tokens, per_token)
    P = prompt_positions(base)
    return {
        "how": "formula",
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
    model's from its header (fp32 on a CPU, as the engine runs it), a catalog model's."""
    from kvtui.engine.spec import _tiny_config
    from kvtui.sim.catalog import get_model

    spec = parse_engine(base.engine)
    if spec.kind == "tiny":
        from kvtui.paths import TINY_NAME

        model = get_model(TINY_NAME)
        heads = _tiny_config().get("n_kv_head", model.kv_heads)
        if isinstance(heads, int):
            model = replace(model, kv_heads=heads)
        return model, "fp32" if base.device in ("auto", "cpu") else "bf16"
    if spec.model:
        return get_model(spec.model), "fp32" if spec.kind == "shape" else "bf16"
    return None


def run_table(
    settings: RunSettings,
    *,
    quality_bytes: int = QUALITY_BYTES,
    progress: Callable[[str], None] = lambda line: None,
) -> Iterator[dict[str, Any]]:
    """Every row of the table, in order, as each is measured."""
    base = table_base(settings)
    check_table(base)
    for row in TABLE_ROWS:
        yield run_row(row, base, quality_bytes=quality_bytes, progress=progress)


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
        "cpu_capability": _cpu_capability() if parse_engine(base.engine).kind != "sim" else None,
        "rows": [{"key": r.key, "label": r.label} for r in TABLE_ROWS],
        "references": [{"trick": r.trick, "claim": r.claim, "source": r.source} for r in PUBLISHED],
    }


def _cpu_capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


# --- the app's child process ---------------------------------------------------------------------


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


# --- a table for a terminal ----------------------------------------------------------------------


def _stop_words(row: dict[str, Any]) -> str:
    """Where the pool stopped the row (measured) against its prediction: "1,317 / 1,317"."""
    predicted = row.get("tokens_before_full_predicted")
    shown = "never" if predicted is None else f"{predicted:,}"
    if row["how"] == "formula":
        return f"- / {shown}"
    steps = row["steps"]
    measured = f"{steps:,}" if row["stopped"] else f"{steps:,}+"
    return f"{measured} / {shown}"


def format_tricks(header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The table for a terminal, with what each column is and where its figures came from."""
    from kvtui.format import format_bytes, safe_text

    head = (
        "trick",
        "B/token",
        "formula",
        "stop/pred",
        "Δnats/B",
        "KL",
        "top-1",
        "1st diff",
        "tok/s",
        "TPOT",
    )
    lines_out = []
    for row in rows:
        q = row.get("quality") or {}
        speed = row.get("speed") or {}
        tpot = speed.get("tpot_first_steps_s")
        first = q.get("first_divergence")
        lines_out.append(
            (
                row["label"],
                "-" if row.get("kv_bytes_per_token") is None else f"{row['kv_bytes_per_token']:,}",
                f"{row.get('kv_bytes_per_token_formula') or 0:,}",
                _stop_words(row),
                f"{q['nats_per_byte'] - q['nats_per_byte_baseline']:+.4f}" if q else "-",
                f"{q['kl']:.4f}" if q else "-",
                f"{q['top1_agreement']:.1%}" if q else "-",
                ("none" if first is None else f"{first + 1:,}") if q else "-",
                f"{speed['tokens_per_s']:,.0f}" if speed.get("tokens_per_s") else "-",
                f"{tpot * 1e3:.2f} ms" if tpot else "-",
            )
        )
    widths = [max(len(r[i]) for r in (head, *lines_out)) for i in range(len(head))]
    budget = format_bytes(header["kv_budget_bytes"])
    baseline = next((r["quality"] for r in rows if r.get("quality")), None)
    lines = [
        f"{header['engine']}: every trick under a {budget} KV pool, {header['tokens']:,} tokens "
        f"asked, greedy, cached loop"
        + (f" (CPU {header['cpu_capability']})" if header.get("cpu_capability") else "")
    ]
    lines += [
        "  "
        + "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        for cells in (head, *lines_out)
    ]
    lines.append(
        "  B/token: measured from the cache's tensors (codes and scales); formula: kvtui.sim"
    )
    lines.append(
        "  stop/pred: tokens generated when the pool ran out (+: the run ended first), measured"
        " / predicted by the trick's own C - P + 1"
    )
    if baseline:
        lines.append(
            f"  Δnats/B, KL, top-1: against the plain cache, teacher-forced on "
            f"{baseline['positions']:,} held-out bytes (plain: "
            f"{baseline['nats_per_byte_baseline']:.3f} nats/byte; prefix caching: the second "
            f"half); 1st diff: the first greedy token of {baseline['greedy_tokens']:,} to differ"
        )
    lines.append("  TPOT: mean of the first 256 steps after the first (or all, if fewer)")
    for row in rows:
        if row.get("baseline"):
            b = row["baseline"]
            lines.append(
                f"  {row['label']}: plain at the same batch stops at {b['steps']:,} "
                f"(predicted {b['tokens_before_full_predicted']:,}); its prefill computed "
                f"{row['first_step_positions']:,} positions against {b['first_step_positions']:,}"
            )
        if row["how"] == "formula":
            lines.append(f"  {row['label']}: by the formula alone (no such model here)")
    lines.append("  Published (references, not measured here):")
    lines += [f"    {r['trick']}: {r['claim']} ({r['source']})" for r in header["references"]]
    return safe_text("\n".join(lines))
