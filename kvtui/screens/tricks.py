"""Screen 4: stretching the cache, each trick measured on the live model.

Above, the table of `kvtui tricks` (kvtui.reports.tricks), measured in a process of its own on the
running engine's model, each row landing as it is measured: what each trick keeps a token in,
how far the same pool goes with it (measured, against its own prediction), what it costs in
quality and speed. Below, one trick races the plain cache as screen 2 races the two loops: two
engines, each its own process, each its own pool of the same budget, their bars filling at their
own rates, the plain one turning red and stopping first while the trick goes on. The race is
another run, not another reader: its engines are made by the App's one owner of engine processes
(kvtui.run.process.Engines, handed to this screen) and read, each in a worker of this screen's,
by the one reader (kvtui.run.process), whose batches the worker posts back. The table's process
speaks another protocol (a line per row, a few a minute): a worker posts each line as it comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.message import Message
from textual.reactive import var
from textual.widgets import Static
from textual.worker import get_current_worker

from kvtui.engines.capabilities import OWN_ENGINES
from kvtui.engines.factory import parse_engine
from kvtui.engines.protocol import Event, RunSettings
from kvtui.format import format_bytes, format_int, safe_text
from kvtui.reports.table import TABLE_ROWS, TABLE_SINKS, TABLE_TOKENS, TABLE_WINDOW, default_budget
from kvtui.reports.tricks import reference_baseline
from kvtui.run.live import LiveRun
from kvtui.run.process import EngineHandle
from kvtui.screens.base import LessonScreen
from kvtui.sim.tricks import references
from kvtui.widgets.pool_line import PoolLine
from kvtui.widgets.stream import WAITING, TokenStream
from kvtui.widgets.tricks_table import TableState, cost_words, reach_words, short_name, tricks_table

if TYPE_CHECKING:
    from kvtui.run.process import Engines


class TableHandle(Protocol):
    """What the table needs of its process (kvtui.reports.table.TableProcess)."""

    def start(self) -> None: ...
    def lines(self) -> Iterator[dict[str, Any]]: ...
    def close(self, timeout: float = 1.0) -> None: ...


TableFactory = Callable[[RunSettings], TableHandle]


# --- what races ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RaceVariant:
    """One setting of a trick in the race."""

    words: str
    trick: dict[str, Any]
    """RunSettings fields the trick's engine sets."""
    both: dict[str, Any] = field(default_factory=dict)
    """Fields both engines set (a batch, for shared prefixes)."""
    tokens: int = TABLE_TOKENS
    reference: str = ""
    """Which published figures stand beside it (kvtui.sim.tricks.PUBLISHED)."""


RACE: tuple[tuple[str, tuple[RaceVariant, ...]], ...] = (
    (
        "a smaller element",
        (
            RaceVariant("fp8", {"kv_cache_dtype": "fp8"}, reference="fp8"),
            RaceVariant("int8", {"kv_cache_dtype": "int8"}, reference="int8"),
        ),
    ),
    (
        "a window",
        (
            RaceVariant(
                f"window {TABLE_WINDOW - TABLE_SINKS} + {TABLE_SINKS} sinks",
                {"kv_window": TABLE_WINDOW, "kv_sinks": TABLE_SINKS},
                tokens=6000,
                reference="window",
            ),
            RaceVariant(
                f"window {TABLE_WINDOW}, no sinks",
                {"kv_window": TABLE_WINDOW},
                tokens=6000,
                reference="window",
            ),
            RaceVariant(
                "window 1,020 + 4 sinks",
                {"kv_window": 1024, "kv_sinks": 4},
                tokens=6000,
                reference="window",
            ),
        ),
    ),
    (
        "shared prefixes",
        tuple(
            RaceVariant(f"prefix caching x{b}", {"enable_prefix_caching": True}, {"batch": b})
            for b in (4, 8, 2)
        ),
    ),
    ("fewer KV heads", (RaceVariant("1 KV head", {"kv_heads": 1}, reference="kv-heads"),)),
)
"""The tricks the race runs, each with its settings (k picks the trick, + and - the setting)."""

SIDES = ("plain", "trick")

NO_RACE = "No race on this engine: pick tiny, shape: or sim: (ctrl+p), then r."
"""A race pane's words where the run's engine has no race (a replay, hf:, vllm:)."""


# --- the screen ----------------------------------------------------------------------------------


class TricksScreen(LessonScreen):
    """The tricks' table, measured, and one trick racing the plain cache on the same pool."""

    TITLE_TEXT = "4 · Stretching the cache: what each trick buys, and what it costs"

    BINDINGS = [
        Binding("k", "next_trick(1)", "Trick", key_display="k"),
        Binding("K", "next_trick(-1)", "Trick -", show=False),
        Binding("plus,equals_sign,right", "setting(1)", "Setting", key_display="+-"),
        Binding("minus,left", "setting(-1)", "Setting -", show=False),
        Binding("r", "race", "Race"),
        Binding("space", "pause_race", "Pause", show=False),
    ]

    trick: var[int] = var(0, init=False)
    """Which of RACE races the plain cache."""
    variant: var[int] = var(0, init=False)
    """Which of its settings."""

    @dataclass
    class RaceReported(Message, bubble=False):
        """A batch of one race engine's events arrived."""

        race_id: int
        side: str
        events: list[Event]

    @dataclass
    class TableLine(Message, bubble=False):
        """The table's process reported a line (a header, a row, a failure, its end)."""

        table_id: int
        line: dict[str, Any]

    def __init__(
        self,
        run: LiveRun,
        *,
        engines: Engines,
        table_factory: TableFactory,
        name: str | None = None,
    ) -> None:
        """`engines` makes the race's engines and reads them (the App's, which owns every
        engine process); `table_factory` makes the table's process."""
        super().__init__(run, name=name)
        self._engines, self._table_factory = engines, table_factory
        self.table = TableState()
        self.race: dict[str, LiveRun] = {}
        """The race's two runs, folded (this screen owns them)."""
        self._handles: dict[str, EngineHandle] = {}
        self._race_id = self._table_id = 0
        self._race_paused = False
        self._table_handle: TableHandle | None = None
        self._shown = False
        """Whether the screen has been shown: its race and table start then, not before."""

    def compose_body(self) -> ComposeResult:
        yield Static("", id="tricks-table")
        yield Static("", id="tricks-caption")
        yield Static("", id="race-title")
        with Horizontal(id="race"):
            for side in SIDES:
                with Vertical(classes="race-side"):
                    yield PoolLine(id=f"pool-{side}")
                    yield TokenStream("", id=f"stream-{side}")
        yield Static("", id="answer")
        yield Static("", id="answer-more")

    # --- what races, and starting it ---------------------------------------------------------

    @property
    def race_variant(self) -> RaceVariant:
        variants = RACE[self.trick][1]
        return variants[self.variant % len(variants)]

    def action_next_trick(self, step: int) -> None:
        self.variant = 0
        self.trick = (self.trick + step) % len(RACE)
        self.start_race()

    def action_setting(self, step: int) -> None:
        self.variant = (self.variant + step) % len(RACE[self.trick][1])
        self.start_race()

    def action_race(self) -> None:
        self.start_race()

    def action_pause_race(self) -> None:
        self._race_paused = not self._race_paused
        for handle in self._handles.values():
            (handle.pause if self._race_paused else handle.resume)()
        self.mark_dirty()

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        self._shown = True
        if not self.race or self._race_stale:
            self.start_race()
        self._table_when_quiet()

    @property
    def _race_stale(self) -> bool:
        """Whether the race shown is another engine's than the run's (ctrl+p picked one)."""
        plain = self.race.get("plain")
        return plain is not None and plain.settings.engine != self.run.settings.engine

    @property
    def racing(self) -> bool:
        """Whether a race engine is still going."""
        return any(run.state in ("starting", "running", "paused") for run in self.race.values())

    @property
    def quiet(self) -> bool:
        """Whether nothing else is decoding: no race, and the main run done (or paused)."""
        return not self.racing and self.run.state not in ("starting", "running")

    def _table_when_quiet(self) -> None:
        """Measure the table (again, for another engine) once nothing else decodes: its speeds
        want the CPU to themselves."""
        stale = not self.table.started or self.table.engine != self.run.settings.engine
        if stale and self.quiet and self.is_current:
            self.start_table()

    def follow_run(self, run: LiveRun) -> None:
        """Measure the table once the main run is done, and again when its engine changes
        (another model), once this screen has been shown and nothing else decodes; race again
        on the new engine."""
        if self._shown:
            if self._race_stale and self.is_current:
                self.start_race()
            self._table_when_quiet()

    def _race_settings(self) -> dict[str, RunSettings]:
        """The two engines' settings: the main run's engine, prompt and sampling, the cached
        loop only, one budget; the trick's fields on one of them."""
        base = self.run.settings
        variant = self.race_variant
        plain: dict[str, Any] = {
            "loops": ("cached",),
            "lesson": False,
            "batch": 1,
            "kv_cache_dtype": "auto",
            "kv_window": None,
            "kv_sinks": 0,
            "enable_prefix_caching": False,
            "kv_heads": None,
        }
        common = replace(base, **{**plain, **variant.both})
        common = replace(common, kv_budget_bytes=base.kv_budget_bytes or default_budget(common))
        started = self.run.started
        positions = started.max_positions if started and started.max_positions else None
        prompt = started.prompt_tokens if started else len(base.prompt.encode("utf-8"))
        plain_tokens = variant.tokens
        if positions is not None:
            plain_tokens = max(1, min(plain_tokens, positions - prompt))
        return {
            "plain": replace(common, tokens=plain_tokens),
            "trick": replace(common, tokens=variant.tokens, **variant.trick),
        }

    def start_race(self) -> None:
        """(Re)start both engines of the race."""
        self._close_race()
        if not self.run.can.own_cache:
            self.race = {}
            self.mark_dirty()
            return
        self._race_id += 1
        self._race_paused = False
        settings = self._race_settings()
        self.race = {side: LiveRun(settings[side]) for side in SIDES}
        for side in SIDES:
            handle = self._engines(settings[side])
            self._handles[side] = handle
            self._read_race(handle, side, self._race_id)
        self.mark_dirty()

    def _close_race(self) -> None:
        """Stop both race engines: the workers are told and close them as they leave."""
        self.workers.cancel_group(self, "race")
        self._handles.clear()

    def start_table(self) -> None:
        """(Re)measure the table on the main run's engine."""
        self._close_table()
        self._table_id += 1
        engine = self.run.settings.engine
        self.table = TableState(engine=engine, started=True)
        if not self.run.can.own_cache:
            self.table.failed = f"the tricks run on {OWN_ENGINES}"
            self.mark_dirty()
            return
        settings = replace(self.run.settings, tokens=TABLE_TOKENS)
        handle = self._table_factory(settings)
        self._table_handle = handle
        self._read_table(handle, self._table_id)
        self.mark_dirty()

    def on_unmount(self) -> None:
        self._close_race()
        self._close_table()

    def _close_table(self) -> None:
        """Stop measuring: the worker is told, and the process ended (its reader may be waiting
        on a line that would not come for a minute)."""
        self.workers.cancel_group(self, "table")
        handle, self._table_handle = self._table_handle, None
        if handle is not None:
            handle.close(timeout=0.5)

    # --- the workers -------------------------------------------------------------------------

    @work(thread=True, group="race", exit_on_error=False)
    def _read_race(self, engine: EngineHandle, side: str, race_id: int) -> None:
        """Read one race engine with the one reader, as the App reads its run's: it starts it,
        hands on its events in batches until it ends or the race is started again (this worker
        cancelled), then closes it; each batch is posted back."""
        worker = get_current_worker()

        def report(events: list[Event]) -> None:
            self.post_message(self.RaceReported(race_id, side, events))

        self._engines.read(engine, report, lambda: worker.is_cancelled, name=f"kvtui-race-{side}")

    @work(thread=True, group="table", exit_on_error=False)
    def _read_table(self, handle: TableHandle, table_id: int) -> None:
        worker = get_current_worker()
        try:
            handle.start()
            for line in handle.lines():
                if worker.is_cancelled:
                    return
                self.post_message(self.TableLine(table_id, line))
        except Exception as exc:  # the table's process could not start: say so in the table
            self.post_message(self.TableLine(table_id, {"kind": "failed", "message": str(exc)}))
        finally:
            handle.close(timeout=1.0)

    @on(RaceReported)
    def _race_reported(self, message: RaceReported) -> None:
        if message.race_id != self._race_id:
            return
        run = self.race[message.side]
        for event in message.events:
            run.apply(event)
        self._table_when_quiet()
        self.mark_dirty()

    @on(TableLine)
    def _table_line(self, message: TableLine) -> None:
        if message.table_id != self._table_id:
            return
        line, table = message.line, self.table
        kind = line.get("kind")
        if kind == "header":
            table.header = line
        elif kind == "row" and isinstance(line.get("key"), str):
            table.rows[line["key"]] = {**line, "raced": not self.quiet}
        elif kind == "failed":
            table.failed = str(line.get("message") or "the table could not be measured")
        elif kind == "done":
            table.done = True
        self.mark_dirty()

    # --- drawing -----------------------------------------------------------------------------

    def redraw(self) -> None:
        self.query_one("#tricks-table", Static).update(tricks_table(self.table))
        self.query_one("#tricks-caption", Static).update(self._caption())
        self.query_one("#race-title", Static).update(self._race_title())
        for side in SIDES:
            self._show_side(side)
        self.query_one("#answer", Static).update(self._answer())
        self.query_one("#answer-more", Static).update(self._references())

    def _caption(self) -> Text:
        table = self.table
        if table.failed:
            return Text(f"Table: {safe_text(table.failed, one_line=True)}")
        header = table.header or {}
        budget, cpu = header.get("kv_budget_bytes"), header.get("cpu_capability")
        if parse_engine(table.engine or "tiny").can.modelled:
            how = "modelled (sim:)"
        else:
            how = f"measured here{f' (CPU {cpu})' if cpu else ''}"
        pool = f"{format_bytes(budget)} pool" if isinstance(budget, int) else "one pool"
        raced = any(
            row.get("raced") and "in_turns" in (row.get("speed") or {})
            for row in table.rows.values()
        )
        if not table.started:
            return Text(f"{how}: measured once nothing else decodes (its speeds want the CPU)")
        timing = len(table.rows) == len(TABLE_ROWS) and not table.done
        plain = (table.rows.get("plain") or {}).get("kv_dtype")
        modelled = parse_engine(table.engine or "tiny").can.modelled
        return Text(
            f"{how}, {pool} · ✓ = formula, prediction · reach: vs plain"
            + (f" ({plain})" if isinstance(plain, str) else "")
            + " · Δ, top-1: held-out text · speed: vs plain, "
            + ("each row's own run" if modelled else "in turns")
            + (" (beside another run)" if raced else "")
            + (" · timing them…" if timing else "")
        )

    def _race_title(self) -> Text:
        words = Text()
        words.append("RACE", style="bold")
        if not self.race:
            words.append(f" on {OWN_ENGINES} only")
            return words
        how = self.race["plain"].how
        budget = self.race["plain"].settings.kv_budget_bytes or 0
        words.append(
            f"{f' ({how})' if how else ''}: plain vs {self.race_variant.words}, "
            f"{format_bytes(budget)} pool each"
        )
        if self._race_paused:
            words.append(" · paused", style="bold")
        return words

    def _show_side(self, side: str) -> None:
        pool_line = self.query_one(f"#pool-{side}", PoolLine)
        stream = self.query_one(f"#stream-{side}", TokenStream)
        run = self.race.get(side)
        title = "plain cache" if side == "plain" else self.race_variant.words
        placeholder = run is not None and run.how == "modelled"  # sim: decodes no text of its own
        stream.border_title = f"{title} · placeholder text" if placeholder else title
        stream.placeholder = NO_RACE if run is None else WAITING
        if run is None:
            pool_line.show(0, "", False)
            stream.show("", "", 0)
            return
        trace, live = run.loop("cached"), run.pool()
        full = bool(live and live.full)
        if live is None:
            pool_line.show(0, "waiting for the engine", False)
        else:
            held, cap = live.allocated_bytes, live.pool.capacity_bytes
            state = "FULL" if full else "done" if live.freed else f"{trace.steps:,} tok"
            words = f"{format_bytes(held)}/{format_bytes(cap)} {state}"
            pool_line.show(held / cap if cap else 0, words, full)
        # A placeholder is said in the title: the subtitle is the pool's (stopped at ...).
        stream.show(trace.text, trace.last_text, trace.steps, prompt=run.prompt_text)
        finished = trace.finished
        if full:
            stream.border_subtitle = f"stopped at {trace.steps:,}: pool full"
        elif finished is not None and finished.reason == "done":
            stream.border_subtitle = f"all {trace.steps:,} tokens"
        elif run.failure:
            stream.border_subtitle = Content(safe_text(run.failure, one_line=True)[:40])  # text
        limit = run.started.max_positions if run.started else None
        if limit and run.prompt_tokens + trace.steps > limit and not full:
            stream.border_subtitle = f"{trace.steps:,} tokens, past its {limit:,}"
        stream.set_class(full, "-full")

    def _answer(self) -> Text:
        """The lesson's closing question, followed up: what would you change to continue the
        chat? Answered with what was measured here."""
        words = Text()
        words.append("To continue the chat: ", style="bold")
        rows, plain = self.table.rows, self.table.rows.get("plain")
        parts = [
            f"{short_name(rows[key])} {reach_words(rows[key], plain)}{cost_words(rows[key])}"
            for key in ("int8", "fp8", "window", "mqa")
            if key in rows and plain is not None
        ]
        modelled = self.run.how == "modelled"  # sim: prices the tricks, it runs none
        if plain is None or not parts:
            words.append(
                "keep each token in fewer bytes, keep fewer tokens, or share them; the table "
                f"{'models' if modelled else 'measures'} what each buys on this pool, and what "
                "it costs."
            )
            return words
        words.append(
            f"where the plain cache stops at {format_int(plain.get('steps', 0))} tokens, "
            + "; ".join(parts)
            + (
                "."
                if self.table.done
                else "; modelling the rest."
                if modelled
                else "; measuring the rest."
            )
        )
        return words

    def _references(self) -> Text:
        """The published figures about the racing trick, labelled as references."""
        key = self.race_variant.reference
        refs = references(key) if key else []
        words = Text()
        if refs:
            words.append("Published, a reference (not measured here): ", style="italic")
            words.append("; ".join(r.short or r.claim for r in refs))
            against = reference_baseline(key or "", self.table.rows.values())
            if against:
                words.append(f" ({against})")
        return words
