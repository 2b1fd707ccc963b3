"""Screen 3: the cache grows and eats memory.

Above, the running engine's memory, measured: its KV pool filling (and a vllm: run's server's
cache); below, a what-if budget of any model on any GPU. Its keys choose the next run's batch
(`n`) and KV budget (`[`, `]`, `\\`), which the App owns and `r` runs (the screen sets them
through the `NextRun` it is given), and put a load on a served run's server (`f`, a `kvtui load`
process this screen starts and ends).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.events import Resize
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Static
from textual_plotext.plot import Plot

from kvtui.commands import BudgetCommands
from kvtui.engines.capabilities import OWN_ENGINES
from kvtui.engines.factory import parse_engine
from kvtui.errors import EngineError
from kvtui.format import format_bytes, format_int, format_percent, safe_text
from kvtui.run.live import LiveRun
from kvtui.screens.base import LessonScreen
from kvtui.sim.budget import LESSON_BUDGET, Budget, budget, vram_split
from kvtui.sim.catalog import (
    ConfigError,
    GPUSpec,
    ModelSpec,
    UnknownNameError,
    dtype_names,
    get_gpu,
    get_model,
    gpu_names,
    model_names,
    serving_dtypes,
)
from kvtui.sim.hf_config import model_from_hf_config
from kvtui.sim.pool import step_budget
from kvtui.widgets.cards import StatCard
from kvtui.widgets.chart import Caption, Chart
from kvtui.widgets.fleet import FleetTable
from kvtui.widgets.live_pool import (
    NO_POOL_WORDS,
    budget_refusal,
    budget_runs,
    live_pool_bar,
    live_words,
    pool_words,
)
from kvtui.widgets.plain import plain
from kvtui.widgets.served import ServedCache
from kvtui.widgets.vram import VramBar, memory_curve, whatif_bar

if TYPE_CHECKING:
    from textual.timer import Timer

    from kvtui.run.process import LoadProcess

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
"""The what-if's batches (b)."""
LIVE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
"""The batches the next run's n steps through (`--batch` takes any up to 256)."""
MIN_CONTEXT, MAX_CONTEXT = 1, 16_777_216


def fine_step(context: int) -> int:
    """One press of left/right: 1,000 tokens, more on long contexts."""
    if context < 32_000:
        return 1_000
    if context < 128_000:
        return 4_000
    return 16_000


MEMORY_CAPTION = (
    "{memory} memory in use, by context   {capacity} the GPU's capacity   "
    "{marker} the context chosen"
)
MEMORY_CAPTION_NARROW = "{memory} memory in use  {capacity} capacity\n{marker} the context chosen"


class NextRun(Protocol):
    """The next run's batch and KV budget, which `r` runs: the App's (kvtui.app.KVApp), set by
    this screen's keys; the screen follows them back (`batch_next`, `kv_budget`)."""

    batch: int
    kv_budget: int | None


class MemoryScreen(LessonScreen):
    """A VRAM bar, a budget's cards and a memory-against-context chart, plus the live engine."""

    TITLE_TEXT = "3 · The cache grows and eats memory"
    COMMANDS = LessonScreen.COMMANDS | {BudgetCommands}

    BINDINGS = [
        Binding("right", "context(1)", "Context", key_display="←→ -+"),
        Binding("left_square_bracket", "budget(-1)", "Budget", key_display="[ ]"),
        Binding("right_square_bracket", "budget(1)", "Budget +", show=False),
        Binding("backslash", "budget(0)", "Default budget", show=False),
        Binding("n", "batch", "Batch", show=False),
        Binding("f", "fill", "Fill"),
        Binding("left", "context(-1)", "Context -", show=False),
        Binding("plus,equals_sign", "context_scale(2)", "Context x2", show=False),
        Binding("minus", "context_scale(0.5)", "Context /2", show=False),
        Binding("m", "next_model", "Model", show=False),
        Binding("g", "next_gpu", "GPU", show=False),
        Binding("k", "next_kv_dtype", "KV dtype", show=False),
        Binding("b", "next_batch", "Batch", show=False),
    ]

    model: reactive[str] = reactive(LESSON_BUDGET.model, init=False)
    gpu: reactive[str] = reactive(LESSON_BUDGET.gpu, init=False)
    kv_dtype: reactive[str] = reactive(LESSON_BUDGET.kv_dtype, init=False)
    batch: reactive[int] = reactive(LESSON_BUDGET.batch, init=False)
    context: reactive[int] = reactive(LESSON_BUDGET.context_tokens, init=False)
    device_gpu: reactive[GPUSpec | None] = reactive(None, init=False)
    """This machine's GPU, catalogued or not (the App's, followed)."""
    tp: reactive[int] = reactive(1, init=False)
    """GPUs the what-if splits the model over: the running `sim:` engine's split, followed."""
    kv_budget: reactive[int | None] = reactive(None, init=False)
    """The KV pool the next run asks for (the App's, followed); None: the engine's default."""
    length: reactive[int] = reactive(256, init=False)
    """The answer length the next run generates (the App's, followed)."""
    batch_next: reactive[int] = reactive(1, init=False)
    """The batch the next run decodes (the App's `batch`, followed; `batch` is the what-if's)."""

    def __init__(self, run: LiveRun, *, next_run: NextRun, name: str | None = None) -> None:
        super().__init__(run, name=name)
        self._next_run = next_run
        self._default_pool: int | None = None
        """The pool an engine took without a budget, once one has run: the budget keys' top."""
        self._pool_engine = ""
        """The engine `_default_pool` is of."""
        self._served = False
        """Whether the run has a server to fill (f shows then)."""
        self._load: LoadProcess | None = None
        """The load `f` put on a vllm: run's server, while it runs (kvtui.engines.vllm.load)."""
        self._load_timer: Timer | None = None
        self._gpu_chosen = self._model_chosen = False
        self._followed = ""
        """The engine the what-if last followed."""
        self._followed_kv = ("", "auto")
        """The run's engine and --kv-cache-dtype the what-if's KV dtype last followed."""
        self._kv_chosen = False
        self._own_model: ModelSpec | None = None
        """The running `--model DIR`'s shape, read from its config.json, once it has run."""

    def compose_body(self) -> ComposeResult:
        yield ServedCache(id="served")  # a vllm: run's server, in place of the live pool
        yield FleetTable(id="fleet")  # and every replica of a vllm:URL1,URL2,... fleet
        yield VramBar(id="live-bar")
        yield Static("", id="live-status")
        yield Static("", id="whatif-title")
        with Horizontal(classes="cards"):
            yield StatCard("KV CACHE", id="kv")
            yield StatCard("ALL IN USE", id="share")
            yield StatCard("STATUS", id="status")
            yield StatCard("MAX CONTEXT", id="max-context")
        yield VramBar(id="whatif-bar")
        with Horizontal(classes="middle"):
            with Vertical(classes="chart-box"):
                yield Chart(id="memory-chart")
                yield Caption(MEMORY_CAPTION, classes="caption -wide-caption")
                yield Caption(MEMORY_CAPTION_NARROW, classes="caption -narrow-caption")
            with Vertical(classes="side"):
                yield Static("", id="scenario")
                yield Static("", id="live-line")
        yield Static("", classes="narrative", id="advice")
        yield Static("", classes="narrative", id="advice-more")

    # --- the scenario ------------------------------------------------------------------------

    def validate_context(self, context: int) -> int:
        return max(MIN_CONTEXT, min(MAX_CONTEXT, int(context)))

    def validate_batch(self, batch: int) -> int:
        return max(1, int(batch))

    def _changed(self) -> None:
        self.show_budget()
        self.mark_dirty()

    watch_model = watch_gpu = watch_kv_dtype = watch_batch = watch_context = watch_tp = _changed

    def choose(self, *, model: str | None = None, gpu: str | None = None) -> None:
        """Set the model or GPU (from the command palette)."""
        if model is not None:
            self._model_chosen = True
            self.tp = 1  # the run's split was the run's model's
            self.model = get_model(model).name
        if gpu is not None:
            self._gpu_chosen = True
            self.gpu = get_gpu(gpu).name

    def action_context(self, direction: int) -> None:
        if direction > 0:
            self.context = self.context + fine_step(self.context)
        else:
            self.context = self.context - fine_step(self.context - 1)

    def action_context_scale(self, factor: float) -> None:
        self.context = round(self.context * factor)

    @staticmethod
    def _next(values: list, current: object) -> object:
        return values[(values.index(current) + 1) % len(values)] if current in values else values[0]

    def action_next_model(self) -> None:
        self._model_chosen = True
        self.tp = 1  # the run's split was the run's model's
        self.model = self._next(model_names(), self.model)

    def action_next_gpu(self) -> None:
        self._gpu_chosen = True
        self.gpu = self._next(gpu_names(), self.gpu)

    def action_next_kv_dtype(self) -> None:
        self._kv_chosen = True
        self.kv_dtype = self._next(dtype_names(), self.kv_dtype)

    def action_next_batch(self) -> None:
        self.batch = self._next(list(BATCHES), self.batch)

    def model_spec(self) -> ModelSpec:
        """The what-if's model: a catalog entry, or the running `--model DIR`'s own config."""
        own = self._own_model
        return own if own is not None and own.name == self.model else get_model(self.model)

    def gpu_spec(self) -> GPUSpec:
        """The what-if's GPU: a catalog entry, or this machine's own (`device_gpu`)."""
        own = self.device_gpu
        return own if own is not None and own.name == self.gpu else get_gpu(self.gpu)

    def budget(self) -> Budget:
        """The what-if, its weights as a server keeps them (`serving_dtypes`, as `sim:` does),
        split as the running `sim:` engine is."""
        spec = self.model_spec()
        return budget(
            spec,
            self.gpu_spec(),
            self.context,
            self.batch,
            self.kv_dtype,
            serving_dtypes(spec.default_dtype)[0],
            tp=self.tp,
        )

    # --- the next run (n, the budget keys) and a load on its server (f) -----------------------

    def action_batch(self) -> None:
        """n: the next run's batch, doubling from 1 to 64 and round again; r runs it."""
        if not self.run.can.own_cache:
            self.notify(f"A batch runs on {OWN_ENGINES}", timeout=4)
            return
        batch = self.batch_next
        self._next_run.batch = 1 if batch >= LIVE_BATCHES[-1] else batch * 2

    def action_budget(self, direction: int) -> None:
        """The budget keys: a smaller (-1) or larger (1) KV pool for the next run, or the
        engine's default (0); `r` runs it. Budgets are powers of two of bytes (see
        `kvtui.sim.pool.step_budget`)."""
        live, can = self.run.pool(), self.run.can
        if live is None or not can.own_cache:
            self.notify(budget_refusal(self.run), timeout=4)
            return
        runs = budget_runs(can)
        if direction == 0:
            self._next_run.kv_budget = None
            self.notify(f"Next run: the engine's default KV pool. {runs}", timeout=3)
            return
        pool = live.pool
        current = self.kv_budget if self.kv_budget is not None else pool.capacity_bytes
        rows = live.prompt_tokens + self.length - 1  # the whole run's, per sequence
        need = pool.blocks_for(rows, self.batch_next) * pool.block_bytes
        budget = step_budget(current, need, direction, smallest=pool.block_bytes)
        if self._default_pool is not None:
            budget = min(budget, self._default_pool)
        self._next_run.kv_budget = budget
        if direction > 0 and budget <= current:
            self.notify(f"{format_bytes(current)}: the engine's own pool, the keys' largest")
        if direction < 0 and budget < current // 2:  # not a halving: say why it lands there
            self.notify(
                f"Next run: {format_bytes(budget)}, the smallest power of two that holds this "
                f"run's {format_int(rows)} rows; [ halves it, ] doubles it. {runs}",
                timeout=6,
            )

    def _follow_next_run(self, run: LiveRun) -> None:
        """What the budget keys and f follow of the run: the pool an engine took without a
        budget (the keys' top; forgotten with another engine), and whether it has a server."""
        if run.settings.engine != self._pool_engine:
            self._pool_engine, self._default_pool = run.settings.engine, None
        if run.started is not None and run.settings.kv_budget_bytes is None:
            self._default_pool = run.started.kv_capacity_bytes
        if self._served != (run.server is not None):
            self._served = run.server is not None
            self.refresh_bindings()  # f (fill) with a served run's server

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """`f` (fill) only with a vllm: run's server to fill."""
        return self.run.server is not None if action == "fill" else True

    def action_fill(self) -> None:
        """With vllm:, put a load on the server that asks for twice its KV cache
        (kvtui.engines.vllm.load.fill_plan), in a `kvtui load` process of its own; once at a
        time."""
        from kvtui.engines.vllm.load import fill_plan
        from kvtui.run.process import LoadProcess

        server, url = self.run.server, parse_engine(self.run.settings.engine).url
        latest = server.latest if server is not None else None
        if url is None or latest is None or not latest.kv_capacity_tokens:
            self.notify("No KV-cache figures from the server yet: f waits for them", timeout=4)
            return
        if self._load is not None and self._load.running:
            self.notify("A load is already on the server (it stops by itself)", timeout=4)
            return
        started = self.run.started
        plan = fill_plan(url, latest.kv_capacity_tokens, started and started.max_positions)
        self.close_load()
        if self._load_timer is not None:
            self._load_timer.stop()
        self._load = LoadProcess(plan)
        self._load.start()
        self.notify(
            f"kvtui load: {plan.requests} requests of {plan.prompt_tokens:,} + "
            f"{plan.max_tokens:,} tokens, {plan.concurrency} at a time (at most "
            f"{plan.seconds:.0f} s)",
            title="Filling vLLM's KV cache",
            timeout=5,
        )
        self._load_timer = self.set_interval(0.5, self._check_load)

    def _check_load(self) -> None:
        load = self._load
        if load is not None and load.running:
            return
        if self._load_timer is not None:
            self._load_timer.stop()
            self._load_timer = None
        if load is None:
            return
        self.notify(safe_text(load.outcome()), title="The load ended", markup=False, timeout=8)
        self.close_load()

    def close_load(self) -> None:
        """End the load `f` started, if it still runs."""
        load, self._load = self._load, None
        if load is not None:
            load.close()

    def on_unmount(self) -> None:
        self.close_load()

    # --- drawing -----------------------------------------------------------------------------

    def on_mount(self) -> None:
        super().on_mount()
        self.show_budget()

    def show_budget(self) -> None:
        if not self.ready:
            return
        b = self.budget()
        over = not b.fits
        kv = self.query_one("#kv", StatCard)
        kv.value = format_bytes(b.kv_bytes_per_gpu)  # one GPU's: every figure here is
        kv.note = f"{format_bytes(b.kv_bytes_per_token_per_gpu)}/token"
        share = self.query_one("#share", StatCard)
        share.value = format_percent(b.used_bytes / b.vram_bytes)
        share.note = f"of {format_bytes(b.vram_bytes)}"
        status = self.query_one("#status", StatCard)
        status.value = "OVERFLOW" if over else "FITS"
        status.note = "it stops" if over else f"{format_bytes(b.free_bytes)} free"
        status.set_class(over, "-bad")
        status.set_class(not over, "-good")
        longest = self.query_one("#max-context", StatCard)
        if b.longest_context_tokens is None:
            longest.value, longest.note = "no limit", ("every layer slides", "all slide")
        elif b.longest_context_limit == "positions":
            longest.value = format_int(b.longest_context_tokens)
            longest.note = ("the model's own limit", "model's limit")
        else:
            longest.value = format_int(b.longest_context_tokens)
            longest.note = f"tokens x {b.batch}"
        wanted = (b.weights_bytes_per_gpu, b.kv_bytes_per_gpu, b.reserve_bytes)
        self.query_one("#whatif-bar", VramBar).show(
            whatif_bar(vram_split(b), (*wanted, max(0, b.free_bytes))),
            f"{b.gpu_label}: {format_bytes(b.vram_bytes)}" + (", one GPU's" if b.tp > 1 else ""),
        )
        self._show_title(b)
        self.set_class(over, "-overflow")
        context = format_int(b.context_tokens)
        self.query_one("#scenario", Static).update(
            f"[b]What-if[/b] {context} tok ←→ · batch {b.batch} b · {b.kv_dtype} k"
            if self.has_class("-short")  # one line: the live lines below keep theirs
            else f"[b]What-if:[/b] {context} tokens (←→ -+)\n"
            f"batch {b.batch} (b) · KV {b.kv_dtype} (k) · m g"
        )
        advice = self.query_one("#advice", Static)
        more = self.query_one("#advice-more", Static)
        first, rest = " ".join(b.advice[:1]), " ".join(b.advice[1:])
        if over:  # the advice names the model: a --model folder's name
            advice.update(
                plain(
                    "Past capacity the next token has nowhere to keep its keys and values: "
                    f"generation stops. {first}"
                )
            )
        else:
            advice.update(
                plain(
                    "Each token keeps its keys and values in every layer, for every sequence in "
                    f"the batch: the cache grows until memory, not compute, runs out. {first}"
                )
            )
        more.update(plain(rest))
        more.set_class(not rest, "-empty")

    def _show_title(self, b: Budget) -> None:
        """WHAT-IF, the model and its weights' dtype on the GPU (and why that GPU), in the
        longest wording that fits the line."""
        title = self.query_one("#whatif-title", Static)
        each = ", per GPU" if b.tp > 1 else ""
        names = [(f"{b.tp}x " if b.tp > 1 else "") + name for name in (b.gpu_label, b.gpu)]
        full, short = self._gpu_why(), self._gpu_why(short=True)
        what = f"{b.model_label} ({b.weights_dtype}) on"
        wordings = [
            f"{what} {names[0]}{each}{full}",
            f"{what} {names[0]}{each}{short}",
            f"{what} {names[1]}{each}{short}",
            f"{what} {names[1]}{each}",
        ]
        room = title.content_size.width - len("WHAT-IF (modelled): ")
        words = next((w for w in wordings if len(w) <= room), wordings[-1])
        title.update(Text.assemble(("WHAT-IF", "bold"), " (modelled): ", words))

    def on_resize(self, event: Resize) -> None:
        super().on_resize(event)
        self.call_after_refresh(self.show_budget)  # the title's wording follows the width

    def watch_device_gpu(self, device_gpu: GPUSpec | None) -> None:
        """The probe read this machine's GPU: budget it, unless one was chosen by hand."""
        if device_gpu is not None and not self._gpu_chosen:
            self.gpu = device_gpu.name
            self.show_budget()

    def watch_kv_budget(self) -> None:
        self.mark_dirty()

    watch_batch_next = watch_kv_budget

    def follow_run(self, run: LiveRun) -> None:
        """Start the what-if from the running model (and a `sim:` engine's GPU), unless the
        presenter chose them by hand; once per run's engine; its KV dtype from the run's
        --kv-cache-dtype, unless k chose one. A watcher of the run, not part of drawing."""
        self._follow_next_run(run)
        self._follow_engine(run)
        followed = (run.settings.engine, run.settings.kv_cache_dtype)
        if followed != self._followed_kv and not self._kv_chosen:
            self._followed_kv = followed
            if followed[1] != "auto":  # auto: as the model is served (above)
                self.kv_dtype = followed[1]

    def _follow_engine(self, run: LiveRun) -> None:
        engine = run.settings.engine
        if engine == self._followed:
            return
        self._followed = engine
        try:
            spec = parse_engine(engine)
        except EngineError:
            return
        if spec.model_dir is not None:
            if not self._model_chosen:
                self._read_own_model(spec.model_dir / "config.json")
            return
        # The tiny model would fill 1% of any GPU: the what-if starts from the catalog model
        # the room knows (LESSON_BUDGET's) instead; shape: and sim: from their own model.
        name = spec.model or LESSON_BUDGET.model  # tiny names no catalog model
        if spec.can.own_cache and name and not self._model_chosen:
            with contextlib.suppress(UnknownNameError):
                model = get_model(name)
                self.tp = spec.gpus  # the run's split (sim:'s; 1 for the others)
                self.model = model.name
                self.kv_dtype = serving_dtypes(model.default_dtype)[1]
                self.context = min(self.context, model.max_context)
        if spec.gpu and not self._gpu_chosen and self.device_gpu is None:  # sim:'s GPU
            with contextlib.suppress(UnknownNameError):
                self.gpu = get_gpu(spec.gpu).name

    @work(thread=True, exclusive=True, group="own-model", exit_on_error=False)
    def _read_own_model(self, config: Path) -> None:
        """An hf: run's own model for the what-if, read off the UI thread (`OwnModelRead`)."""
        with contextlib.suppress(ConfigError, OSError):
            self.post_message(self.OwnModelRead(model_from_hf_config(config)))

    @dataclass
    class OwnModelRead(Message, bubble=False):
        model: ModelSpec

    @on(OwnModelRead)
    def _own_model_read(self, message: OwnModelRead) -> None:
        if not self._model_chosen:
            self._own_model, self.tp, self.model = message.model, 1, message.model.name
            self.kv_dtype = serving_dtypes(message.model.default_dtype)[1]
            self.context = min(self.context, message.model.max_context)

    def _gpu_why(self, *, short: bool = False) -> str:
        """Why the what-if budgets this GPU, in a few words (fewer, if `short`)."""
        if self._gpu_chosen:
            return ""
        own = self.device_gpu
        if own is not None and own.name == self.gpu:
            if own.peak_bf16_flops <= 0:  # not in the catalog: its own name and memory
                return (
                    " (this GPU, not in the catalog)"
                    if short
                    else (" (this machine's GPU, not in the catalog)")
                )
            return " (this GPU)" if short else " (this machine's GPU)"
        with contextlib.suppress(EngineError):
            if parse_engine(self._followed).gpu:  # a sim: engine's, followed
                return " (the sim's GPU)" if short else " (the sim engine's GPU)"
        if own is None and str((self.run.probe or {}).get("label", "")).startswith("GPU"):
            return " (an example)" if short else " (an example: NVML cannot read this GPU)"
        if own is None:
            return " (an example)" if short else " (an example GPU: none here)"
        return ""

    def redraw(self) -> None:
        server, started = self.run.server, self.run.started
        self.set_class(server is not None, "-served")
        if server is not None:
            self.query_one("#served", ServedCache).show(server, started, self.run.settings.engine)
        fleet = self.run.fleet
        self.set_class(fleet is not None and fleet.size > 1, "-fleet")
        if fleet is not None and fleet.size > 1:
            self.query_one("#fleet", FleetTable).show(fleet, started, self.run.settings.engine)
        self._show_live_pool()
        self.query_one("#live-line", Static).update(live_words(self.run))
        self.query_one("#memory-chart", Chart).draw(self._draw_memory)

    # --- the live pool -----------------------------------------------------------------------

    def _show_live_pool(self) -> None:
        """The running engine's memory, measured (kvtui.widgets.live_pool), and what its pool
        holds against what the run did."""
        self.query_one("#live-bar", VramBar).show(*live_pool_bar(self.run))
        status = self.query_one("#live-status", Static)
        live = self.run.pool()
        if self.run.started is None:
            status.update("")
        elif live is None:
            status.update(NO_POOL_WORDS)
        else:
            status.update(
                pool_words(
                    live,
                    how=self.run.how,
                    budget_keys=self.run.can.own_cache,
                    kv_budget=self.kv_budget,
                    batch=self.batch_next,
                    length=self.length,
                    short=self.has_class("-short"),
                )
            )
            status.set_class(bool(live.full), "-bad")

    def _draw_memory(self, plt: Plot, points: int) -> None:
        memory_curve(
            plt,
            self.query_one("#memory-chart", Chart),
            self.budget(),
            self.model_spec(),
            self.context,
            points,
        )
