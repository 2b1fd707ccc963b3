"""Screen 3's live side as text and bars: the running engine's memory, measured (its KV pool's
bar, what the pool holds against what the run did, and the budget the next run will have), and
its live lines (dtype, KV held, rates, the formula's bytes and FLOPs over the step's time).

Pure: each function reads a run (kvtui.run.live.LiveRun) and the next run's choices and returns
what to draw; the screen puts it in its widgets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from rich.text import Text
from textual.content import Content

from kvtui.engines.capabilities import OWN_ENGINES, Capabilities
from kvtui.format import (
    format_bandwidth,
    format_bytes,
    format_count,
    format_int,
    format_percent,
    format_rate,
    safe_text,
)
from kvtui.run.live import LiveRun
from kvtui.run.pool import LivePool
from kvtui.sim.tricks import tokens_before_full
from kvtui.widgets.plain import plain
from kvtui.widgets.vram import Bar, Part

NO_POOL_WORDS = (
    "This run reports no KV pool: an hf: model keeps transformers' own cache (sized for the run), "
    f"and a replay shows what was recorded. The budget keys apply to {OWN_ENGINES}."
)
"""What the live status says of a run without a KV pool."""


def budget_refusal(run: LiveRun) -> str:
    """Why the budget keys do nothing for this run, by what its engine can do."""
    can = run.can
    if run.started is None:
        return "The engine has not started yet"
    if can.served:
        return (
            "The server sizes its own KV cache (its --gpu-memory-utilization or "
            f"--kv-cache-memory-bytes): the budget keys are for {OWN_ENGINES}"
        )
    if can.replay:
        return "A replay plays the pool it recorded: the budget keys are for live engines"
    return NO_POOL_WORDS


def budget_runs(can: Capabilities) -> str:
    """What `r` does with a new budget, for an engine that owns its pool (`can.own_cache`)."""
    if can.torch:
        return "r runs it: the pool resized in place, the model kept (no restart)"
    return "r runs it: a modelled pool of that size, at once"


def bar_view(live: LivePool) -> int:
    """The bytes of the pool a CPU's live bar spans: the whole pool, or, where this run would
    take less than a quarter of it, the smallest power of two of bytes that holds the run's
    blocks (what the first `[` asks for: kvtui.sim.pool.step_budget), so that the cache is seen
    to grow across the bar rather than as a sliver of an empty 256 MiB. Fixed for the run: the
    bar's scale does not move while the cache grows."""
    pool = live.pool
    whole = pool.blocks * pool.block_bytes
    need = pool.blocks_for(live.run_rows, live.batch) * pool.block_bytes
    view = 1 << max(0, need - 1).bit_length()
    return pool.capacity_bytes if 4 * need >= whole or view >= whole else view


def cache_words(live: LivePool) -> str:
    """The cache's element and its bytes a row ("int8, 816 B a row"): the run's own
    `kv_bytes_per_token` (RunStarted's, the engine's layout), the figure screen 2's picture
    gives each row."""
    dtype = safe_text(live.cache_dtype, one_line=True)
    return f"{dtype}, {format_int(live.pool.kv_bytes_per_token)} B a row"


def live_pool_bar(run: LiveRun) -> tuple[Bar, str | Sequence[str], str | Sequence[str]]:
    """The running engine's memory as a bar, with its titles and subtitles (fullest first): the
    weights, KV filled, the last block's unused tail, the free pool (and, on a GPU, the rest of
    the device), red once the pool ran out. On a CPU the bar spans the pool, or the part of it
    the run needs (`bar_view`), and says so."""
    started, live = run.started, run.pool()
    if started is None:
        return Bar((), 1), "LIVE: the running engine's memory, once it starts", ""
    device = safe_text(started.device, one_line=True)
    where = device.split(" (")[0] + (", per GPU" if device.endswith(", per GPU") else "")
    model = safe_text(started.model, one_line=True)
    title = (
        f"REPLAY ({safe_text(run.recorded, one_line=True)}): {model}"
        if run.replayed
        else f"LIVE ({run.how}): {model} on {where}"
    )
    if live is None:
        return Bar((), 1), f"{title}: no KV pool", ""
    pool = live.pool
    rows = f" x {live.batch}" if live.batch > 1 else ""
    kv = [
        Part(
            "KV filled",
            live.filled_bytes,
            "kv",
            f"({format_int(live.rows)} rows{rows})",
            short="KV",
        ),
        Part("block tail", live.tail_bytes, "tail", short="tail"),
        Part("free pool", live.free_bytes, "free", short="free"),
    ]
    total = started.device_memory_total_bytes
    view = pool.capacity_bytes
    if total:  # a GPU, real or modelled: the pool shares it with the weights
        # a budget's bytes past its last whole block hold no row: not for KV
        rest = max(0, total - started.weights_bytes - pool.capacity_bytes + live.spare_bytes)
        parts = (
            Part("weights", started.weights_bytes, "weights"),
            *kv,
            Part("not for KV", rest, "reserve", short="other"),
        )
        shown = Bar(parts, total, full=bool(live.full))
        capacity = [f"{format_bytes(total)} of device memory", format_bytes(total)]
        nvml = (run.probe or {}).get("total_bytes")
        if started.device.startswith("cuda") and isinstance(nvml, int) and nvml > 0:
            capacity.insert(0, f"{capacity[0]} (torch; NVML {format_bytes(nvml)})")
    else:  # a CPU: the pool is the budget; the weights sit beside it
        if live.spare_bytes:  # a budget that is not whole blocks: the rest holds no row
            kv.append(Part("not a block", live.spare_bytes, "reserve", short="rest"))
        view = bar_view(live)
        note = f"· weights {format_bytes(started.weights_bytes)} beside it"
        shown = Bar(tuple(kv), view, full=bool(live.full), note=note)
        capacity = ["its KV pool"]
    titles = [*(f"{title} · {c}" for c in capacity), title]
    if view < pool.capacity_bytes:  # zoomed: every wording says so, the shortest too
        v = format_bytes(view)
        head = "REPLAY" if run.replayed else f"LIVE ({run.how})"
        titles = [
            f"{title} · the bar: the first {v} of its KV pool, this run's room",
            f"{title} · the bar: the pool's first {v}",
            f"{title} · bar: first {v}",
            f"{head} · the bar: the KV pool's first {v}",
        ]
    size = f"KV pool {format_bytes(pool.capacity_bytes)}"
    blocks = f"blocks of {pool.block_tokens}"
    cache = cache_words(live)
    return (
        shown,
        titles,
        [
            f"{size} ({live.source}) · {cache} · {blocks}",
            f"{size} · {cache} · {blocks}",
            f"{size} · {cache}",
            size,
        ],
    )


HOW_WORDS = {"measured": "Measured", "modelled": "Modelled", "replayed": "Replayed"}
"""The word that opens a run's own figures on screen 3, by `LiveRun.how`."""


def pool_words(
    live: LivePool,
    *,
    how: str,
    kv_budget: int | None,
    batch: int,
    length: int,
    short: bool,
    budget_keys: bool = True,
) -> Text:
    """What the pool holds against what the run did (measured, modelled or replayed: `how`,
    `LiveRun.how`), and the budget the next run will have (`kv_budget`, None: this one's;
    `batch`, `length`), where the budget keys apply (`budget_keys`: not to a replay). `short`:
    two lines, for 80x24. Tokens, rows and slots as `LivePool` names them; where two are side
    by side, the relation between them is said."""
    pool, P = live.pool, live.prompt_tokens
    said = HOW_WORDS.get(how, how.capitalize() or "So far")
    budget = kv_budget if kv_budget is not None else pool.capacity_bytes
    B = batch
    changed = budget != pool.capacity_bytes or live.batch != B or length != live.run_tokens
    predicted = live.stops_at
    words = Text()
    t, rows = live.steps, live.rows  # tokens the cached loop generated; rows it holds
    # rows = P + t - 1, one per position before the newest, unless a window lets rows go or
    # sequences share their prompt's
    plain = live.layout.window is None and not live.layout.prefix_caching
    per = f" per sequence of {live.batch}" if live.batch > 1 else ""
    if live.full:
        # At 80x24 two lines, so that the side's live lines keep theirs: the pool's size
        # and blocks are on the bar's border.
        slots = format_int(pool.tokens_per_sequence(live.batch))
        why = (
            safe_text(live.full, one_line=True)  # not the pool: the device, say
            if t != live.tokens_before_full
            else f"{slots} slots{per} of {format_bytes(pool.capacity_bytes)} full"
            if short
            else f"the KV cache is full after token {format_int(t)}: "
            f"{format_bytes(pool.capacity_bytes)} holds {slots} rows{per} "
            f"({format_int(pool.blocks)} blocks of {pool.block_tokens} slots)"
        )
        words.append(f"Stopped: {why}. ", style="bold")
        relation = (
            f" = {format_int(rows)} rows - {format_int(P)} prompt + 1"
            if plain and t and rows - P + 1 == t
            else ""
        )
        words.append(
            f"{said}: {format_int(t)} tokens{relation}, predicted "
            f"{format_int(live.tokens_before_full or 0)}"
            + ("; ] and r: a larger pool. " if budget_keys and not changed else ". ")
        )
    else:
        held = (
            f"{format_int(rows)} rows = {format_int(P)} prompt + {format_int(t)} tokens - 1"
            if plain and t and rows == P + t - 1
            else f"{format_int(rows)} rows"
        )
        words.append(
            f"{said}: {held}{per}, in {format_int(live.blocks)} of "
            f"{format_int(pool.blocks)} blocks"
            + ("" if short else f" ({format_bytes(live.allocated_bytes)})")
            + ". "
        )
        if not (short and changed and budget_keys):  # at 80x24 the next run's line instead
            words.append(
                f"{format_int(pool.tokens_per_sequence(live.batch))} slots{per}: "
                + (
                    f"it stops after token {format_int(predicted)} of "
                    f"{format_int(live.run_tokens)} (predicted). "
                    if predicted is not None
                    else f"the run's {format_int(live.run_rows)} rows fit. "
                )
            )
    if not budget_keys:
        return words
    if changed:
        nxt = replace(pool, capacity_bytes=budget)
        room = tokens_before_full(nxt, live.layout, P, B)
        after = (
            f"it stops after token {format_int(room)}"
            if room is not None and room < length
            else f"{format_int(length)} tokens fit"
        )
        rows_b, each = (f", batch {B}", " each") if B > 1 else ("", "")
        holds = format_int(nxt.tokens_per_sequence(B))
        words.append(
            f"Next run: {format_bytes(budget)}{rows_b} holds {holds} rows{each}, {after}: r.",
            style="bold",
        )
    elif not live.full:
        words.append("[ ] a smaller or larger pool" + ("." if short else ", r runs it."))
    return words


def live_words(run: LiveRun) -> Content:
    """The running engine: its dtype and why; measured, KV held against the formula (and a
    GPU's memory in use), prefill and decode rates, tokens/s at its batch; then the formula's
    bytes and FLOPs over the step's time, against the peak and the ridge."""
    started = run.started
    if started is None:
        return Content("The running engine's memory appears here once it starts.")
    threads = format_count(started.threads, "thread") if started.threads > 0 else ""
    how = {"modelled": "modelled: roofline", "replayed": "measured then"}.get(run.how, run.how)
    head = "Replayed" if run.replayed else "Live"
    lines: list[Content | str] = [
        Content.from_markup(f"[b]{head}[/b] ({how}{', ' + threads if threads else ''}):")
    ]
    if started.dtype_source:  # a record's words: text, never markup
        lines.append(plain(f"{started.dtype}: {started.dtype_source}"))
    measured = run.kv_bytes_measured()
    last = run.loop("cached").last
    if measured:
        held, formula = measured
        mark = "= formula" if held == formula else f"formula {format_bytes(formula)}"
        line = f"KV held {format_bytes(held)} {mark}"
        if started.device.startswith("cuda") and last and last.device_memory_bytes:
            line += f"; {format_bytes(last.device_memory_bytes)} in use"
        lines.append(line)
    trace, B = run.loop("cached"), run.batch
    if trace.steps > 1 and trace.seconds_total > trace.seconds_cumulative[0] > 0:
        # prefill reads the prompt in one pass; decode writes one position per step
        first = trace.seconds_cumulative[0]
        later = (trace.seconds_total - first) / (trace.steps - 1)
        P = started.prompt_tokens
        lines.append(
            f"pos/s: prefill {format_rate(P * B / first)}, decode {format_rate(B / later)}"
        )
    if trace.steps > 1 and trace.seconds_total > 0:
        rate = trace.steps / trace.seconds_total  # steps per second: each a token per row
        lines.append(
            f"batch {B} (n): {format_rate(rate)} tok/s each, {format_rate(rate * B)} in all"
            if B > 1
            else f"batch 1 (n): {format_rate(rate)} tok/s"
        )
    achieved = run.achieved_bandwidth()
    intensity = last.flops / last.bytes_read if last and last.bytes_read else None
    if achieved or intensity:  # the formula's bytes and FLOPs: not measurements of them
        time = "modelled" if run.how == "modelled" else "measured"
        lines.append(Content.from_markup(f"[b]Formula[/b] bytes, FLOPs / {time} time:"))
    if achieved:
        peak = started.peak_bandwidth_bytes_per_s
        of = f", {format_percent(achieved / peak)} of peak" if peak else ", peak unknown"
        lines.append(f"{format_bandwidth(achieved)} read{of}")
    if intensity is not None and last is not None and last.step > 0:
        ridge = started.ridge_flops_per_byte
        if ridge:
            bound = "memory-bound" if intensity < ridge else "compute-bound"
            lines.append(f"{intensity:.1f} FLOPs/byte, ridge {ridge:.0f}: {bound}")
        else:
            lines.append(f"{intensity:.1f} FLOPs/byte (no ridge known)")
    return Content("\n").join(lines)
