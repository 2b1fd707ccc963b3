"""The decode engine in a process of its own, and the UI's handle on it. No torch in the parent.

A torch decode thread and a Textual UI in one process fight for the GIL: in a trial on a 2-core
machine decode fell from ~330 to ~157 tokens/s and the 99th-percentile step rose to 65 ms. So the
engine runs as `python -m kvtui.engines.drive`: the parent writes the `RunSettings` as one JSON
line on the child's stdin, then `pause`, `resume` or `stop` lines; the child writes each event as
one JSON line on its stdout. A CUDA failure stays in the child. (`multiprocessing` started from
inside a running Textual app failed with "bad value(s) in fds_to_keep"; `subprocess` does not.)

The child runs no code from where the app was started: it starts isolated (`python -I`: neither
the current directory nor PYTHONPATH on `sys.path`, no PYTHON* variables), in `/`, and imports
kvtui from the very folder this module came from (`child_command`). A `json.py` or `torch.py` in
the directory the app was started from is never imported; relative `replay:` and `hf:` paths are
made absolute before the settings are sent. The user's own site-packages (`pip install --user`),
which `-I` also drops, is added back when this process uses it: it is where torch may be, and
it does not depend on the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from kvtui.engines.drive import IDLE_LINE
from kvtui.engines.factory import parse_engine
from kvtui.engines.protocol import (
    Event,
    RunFailed,
    RunSettings,
    event_from_json,
)
from kvtui.format import safe_text
from kvtui.run.live import RUN_UPDATES_PER_SECOND

if TYPE_CHECKING:  # the load's module, a server's client with it, only once a load starts
    from kvtui.engines.vllm.load import LoadPlan

_PACKAGE = Path(__file__).resolve().parents[1]
"""The kvtui package this module belongs to: the child imports this one, whatever is installed."""

_BOOTSTRAP = """\
import importlib.util, site, sys
for folder in {user_sites!r}:
    site.addsitedir(folder)
spec = importlib.util.spec_from_file_location(
    "kvtui", {init!r}, submodule_search_locations=[{package!r}]
)
kvtui = importlib.util.module_from_spec(spec)
sys.modules["kvtui"] = kvtui
spec.loader.exec_module(kvtui)
{main}
"""

ENGINE_MAIN = "from kvtui.engines.drive import child_main\nraise SystemExit(child_main())"
"""What the engine's child runs, once kvtui is imported."""
WARM_ENGINE_MAIN = ENGINE_MAIN.replace("child_main()", "child_main(warm=True)")
"""What a spare engine child runs (`WarmChild`): a torch engine made ready before its settings."""


def child_command(main: str = ENGINE_MAIN) -> list[str]:
    """The engine's command line: isolated mode (`-I`), unbuffered (`-u`), and a bootstrap that
    imports kvtui from `_PACKAGE` by its path, not by searching `sys.path`, then runs `main`
    (the engine's loop; `kvtui load` for the app's load, kvtui.engines.vllm.load.LoadProcess)."""
    code = _BOOTSTRAP.format(
        init=str(_PACKAGE / "__init__.py"),
        package=str(_PACKAGE),
        user_sites=_user_sites(),
        main=main,
    )
    return [sys.executable, "-I", "-u", "-c", code]


def _user_sites() -> list[str]:
    """The user's site-packages, if this process has it on its path (never outside a venv's)."""
    import site

    if not site.ENABLE_USER_SITE:
        return []
    user = site.getusersitepackages()
    return [user] if isinstance(user, str) and user in sys.path else []


CHILD_CWD = os.path.abspath(os.sep)
"""The child's working directory: the file system's root, so nothing relative is found by luck."""


def absolute_paths(settings: RunSettings) -> RunSettings:
    """The settings with a relative `replay:` or `hf:` path made absolute (from this process's
    working directory), since the child runs in CHILD_CWD. A malformed name is left for the
    child to refuse."""
    try:
        spec = parse_engine(settings.engine)
    except ValueError:
        return settings
    if spec.path is None or spec.path.is_absolute():
        return settings
    return replace(settings, engine=spec.with_path(spec.path.absolute()))


def spawn_child(main: str) -> tuple[subprocess.Popen[str], IO[str]]:
    """A child process running `main` (`child_command`): text pipes on its stdin and stdout, its
    stderr to a file (returned with it, for the last words of a child that dies), in CHILD_CWD
    and a session of its own. An engine's (`ENGINE_MAIN`) and the tricks table's."""
    stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8")  # noqa: SIM115
    proc = subprocess.Popen(
        child_command(main),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        encoding="utf-8",
        bufsize=1,
        cwd=CHILD_CWD,
        start_new_session=True,  # the terminal's Ctrl-C goes to the UI, which stops us cleanly
    )
    return proc, stderr


class WarmChild:
    """An engine's child process ready for a run: started ahead (it imports torch and readies
    the FLOP counter, seconds of a torch engine's start, while nothing runs), or kept after a
    run with its model loaded (`proc` and `stderr` given: kvtui.engines.drive's IDLE_LINE); it
    waits for settings on its stdin. `EngineProcess` adopts it for the next run."""

    def __init__(self, kept: tuple[subprocess.Popen[str], IO[str]] | None = None) -> None:
        self.proc, self.stderr = kept or spawn_child(WARM_ENGINE_MAIN)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """End it unused: EOF on its stdin ends it; it is killed if it does not go at once."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(0.5)
        end_process(self.proc, 0.5, (self.proc.stdout, self.stderr))


def end_process(proc: subprocess.Popen[Any], grace_s: float, streams: Iterable[Any] = ()) -> None:
    """End a child of kvtui's that is still running (SIGTERM, then SIGKILL after `grace_s`),
    reap it, and close its `streams`: the one way the engine, a spare, the tricks' table and a
    load are ended."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in streams:
        with contextlib.suppress(OSError, ValueError):
            if stream is not None:
                stream.close()


def runs_torch(settings: RunSettings) -> bool:
    """Whether `settings` name a torch engine, the ones a spare (`WarmChild`) speeds up (a
    malformed name: no)."""
    try:
        return parse_engine(settings.engine).can.torch
    except ValueError:
        return False


class Engines:
    """The one owner of the app's engine processes, its run's and screen 4's race's alike: it
    makes each (an `EngineProcess`, or what `make` makes: a test's engines), keeps it until its
    reader has closed it (`read`), and `close` ends every one still open (quitting).

    Between runs, `prepare` starts a spare child for the next torch run to adopt, so that a torch
    engine after `l` or `r` skips importing torch (seconds of dead air). A spare is started only
    between runs, never beside a run's timed steps. A torch run's own child, once its run is over
    or stopped, is kept (`keep`) for the next torch run, which adopts it first: its model loaded,
    a run that changes only the budget, length, batch or sampling starts at once (the engine
    resizes its pool in place: kvtui.engines.torch_engine.DecoderEngine.reopen)."""

    def __init__(self, make: EngineFactory | None = None) -> None:
        self._make = make
        """What makes each engine; None: an `EngineProcess`, adopting the spare."""
        self._kept: WarmChild | None = None
        """The last torch run's child, idle, its model loaded: the next torch run's first."""
        self._kept_ready = threading.Condition()
        self._closed = False
        self._spare: WarmChild | None = None
        self._open: list[EngineHandle] = []
        """Engines made and not yet closed by their reader."""
        self._lock = threading.Lock()

    @property
    def spare(self) -> WarmChild | None:
        """The child started ahead for the next run, if there is one."""
        return self._spare

    def __call__(self, settings: RunSettings) -> EngineHandle:
        """The engine of a run of `settings`, made, not started (its reader starts it)."""
        if self._make is not None:
            engine = self._make(settings)
        elif runs_torch(settings) and (self._kept is not None or self._retiring()):
            engine = EngineProcess(settings, owner=self)  # it takes the kept child at its start
        else:
            spare, self._spare = self._spare, None
            if spare is not None and not (spare.alive and runs_torch(settings)):
                spare.close()
                spare = None
            if not runs_torch(settings):  # a kept model is not held beside another engine
                self.keep(None)
            engine = EngineProcess(settings, spare=spare, owner=self)
        with self._lock:
            self._open.append(engine)
        return engine

    def read(
        self,
        engine: EngineHandle,
        report: Callable[[list[Event]], None],
        stopped: Callable[[], bool],
        *,
        name: str = "kvtui-engine-pipe",
    ) -> bool:
        """Read an engine this made with the one reader (`kvtui.run.process.read_engine`: start
        it, hand on its events in batches until it ends or `stopped()`, close it), then forget
        it. True if its stream ended, False if stopped."""
        try:
            return read_engine(engine, report, stopped, name=name)
        finally:
            with self._lock:
                if engine in self._open:
                    self._open.remove(engine)

    def prepare(self, settings: RunSettings) -> None:
        """Start a spare for the next run, if `settings` name a torch engine and none is ready:
        no spare, no kept child and no torch run's child about to be kept (engines of their own
        `make` take none)."""
        if self._make is not None or self._spare is not None or not runs_torch(settings):
            return
        if self._kept is None and not self._retiring():
            self._spare = WarmChild()

    def _retiring(self) -> bool:
        """Whether a torch run's child is open and about to be kept (its run over or stopped)."""
        with self._lock:
            return any(isinstance(e, EngineProcess) and e.retiring for e in self._open)

    @property
    def keeping(self) -> bool:
        """Whether a child whose run is over is kept (not once `close` has begun: quitting)."""
        return not self._closed

    def keep(self, child: WarmChild | None) -> None:
        """Keep a torch run's idle child for the next torch run (the one kept before ends;
        None: end it, keeping none)."""
        with self._kept_ready:
            old, self._kept = self._kept, None if self._closed else child
            self._kept_ready.notify_all()
        for unused in (old, child if self._closed else None):
            if unused is not None:
                unused.close()

    def take(self, settings: RunSettings) -> WarmChild | None:
        """The child a starting run adopts: the kept one (waiting up to RETIRE_WAIT_S for one a
        stopped run is handing back), else the spare; None for a run that is no torch's."""
        if not runs_torch(settings):
            return None
        with self._kept_ready:
            self._kept_ready.wait_for(
                lambda: self._kept is not None or not self._retiring(), RETIRE_WAIT_S
            )
            kept, self._kept = self._kept, None
        if kept is not None and kept.alive:
            return kept
        if kept is not None:
            kept.close()
        spare, self._spare = self._spare, None
        return spare

    def close(self, timeout: float = 1.0) -> None:
        """End every engine still open, the kept child and the spare (quitting)."""
        self._closed = True
        with self._kept_ready:
            kept, self._kept = self._kept, None
        spare, self._spare = self._spare, None
        for child in (kept, spare):
            if child is not None:
                child.close()
        with self._lock:
            engines, self._open = self._open, []
        for engine in engines:
            engine.close(timeout=timeout)


RETIRE_WAIT_S = 2.0
"""How long a starting torch run waits for a stopped run's child to go idle, to adopt it."""


class EngineProcess:
    """A run in a child process: start it, read its events, pause, resume, stop, close."""

    def __init__(
        self,
        settings: RunSettings,
        *,
        spare: WarmChild | None = None,
        owner: Engines | None = None,
    ) -> None:
        self.settings = settings
        self._spare = spare
        """A child started ahead, warm, for `start` to adopt instead of starting one."""
        self._owner = owner
        """The `Engines` that made it: `start` takes a kept child from it (where no spare was
        given), and `close` hands it back an idle one, model and all."""
        self.keepable = owner is not None and runs_torch(settings)  # kept after its run
        self._idle = threading.Event()
        """The child said its run is over and it waits for another (drive's IDLE_LINE)."""
        self._stopping = False
        self._proc: subprocess.Popen[str] | None = None
        self._stderr: IO[str] | None = None
        """The child's stderr, for the reason it died: made with the child, closed with it (an
        engine made and never started holds no file)."""
        self._lock = threading.Lock()

    def start(self) -> None:
        spare, self._spare = self._spare, None
        if spare is None and self._owner is not None:
            spare = self._owner.take(self.settings)
        if spare is not None and spare.alive:
            self._proc, self._stderr = spare.proc, spare.stderr
        else:
            if spare is not None:
                spare.close()
            self._proc, self._stderr = spawn_child(ENGINE_MAIN)
        self._send(json.dumps(absolute_paths(self.settings).to_json()))

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """The child's exit status once it has exited (negative: killed by that signal)."""
        return self._proc.poll() if self._proc else None

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.stdin is None:
                return
            with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                self._proc.stdin.write(line + "\n")
                self._proc.stdin.flush()

    def pause(self) -> None:
        self._send("pause")

    def resume(self) -> None:
        self._send("resume")

    def stop(self) -> None:
        self._stopping = True
        self._send("stop")

    @property
    def retiring(self) -> bool:
        """A torch run's child, alive, whose run is over or was stopped: about to be kept."""
        return self.keepable and self.alive and (self._stopping or self._idle.is_set())

    def events(self) -> Iterator[Event]:
        """Events as the child writes them; ends when it exits. A child that dies without
        finishing yields a last `RunFailed` with the reason."""
        if self._proc is None or self._proc.stdout is None:
            raise RuntimeError("start() first")
        finished = False
        for line in self._proc.stdout:
            if line.strip() == IDLE_LINE:  # the run is over; the child waits for another
                self._idle.set()
                return
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue  # stray output (a library's print below Python): not ours
            try:
                event = event_from_json(data)
            except ValueError as exc:  # ours, but not what this UI reads: the run is lost
                self.stop()
                why = safe_text(str(exc), one_line=True)
                yield RunFailed(f"the engine sent an event this kvtui cannot read: {why}")
                return
            finished = finished or isinstance(event, RunFailed)
            yield event
        code = self._proc.wait()
        if code != 0 and not finished:
            yield RunFailed(self._death_message(code))

    def _death_message(self, code: int) -> str:
        lines = []
        if self._stderr is not None:
            self._stderr.seek(0)
            lines = [line.strip() for line in self._stderr.read().splitlines() if line.strip()]
        why = lines[-1] if lines else ""
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"decode engine {how}" + (f": {safe_text(why, one_line=True)}" if why else "")

    def close(self, timeout: float = 1.0) -> None:
        """Stop the child and reap it: a polite stop, then terminate, then kill (a run closed
        before it started ends the spare it was given)."""
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()
        proc = self._proc
        if proc is None:
            return
        owner = self._owner
        if self.keepable and owner is not None and owner.keeping and proc.poll() is None:
            if not self._idle.is_set():  # a run stopped: its reader sees the child go idle
                self.stop()
                self._idle.wait(timeout)
            stderr = self._stderr
            if self._idle.is_set() and proc.poll() is None and owner.keeping and stderr:
                self._proc = None
                owner.keep(WarmChild((proc, stderr)))
                return
        if proc.poll() is None:
            self.stop()
            with contextlib.suppress(OSError, ValueError):
                if proc.stdin is not None:  # always a pipe (`start`)
                    proc.stdin.close()  # EOF stops the child too
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout / 2)
        end_process(proc, timeout / 2, (proc.stdout, proc.stdin, self._stderr))


class LoadProcess:
    """`kvtui load` in a process of its own, started from the app (`f` on screen 3): the load's
    threads never share the UI's interpreter, it is bounded as the command is, and closing it
    (a restart, quitting) ends it and, with its connections, its requests on the server."""

    def __init__(self, plan: LoadPlan) -> None:
        self.plan = plan
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: IO[bytes] | None = None
        self._err: IO[bytes] | None = None

    def argv(self) -> list[str]:
        """The `kvtui load` command line of the plan."""
        p = self.plan
        return [
            "load",
            str(p.url),
            f"--concurrency={p.concurrency}",
            f"--prompt-tokens={p.prompt_tokens}",
            f"--max-tokens={p.max_tokens}",
            f"--requests={p.requests}",
            f"--seconds={p.seconds:g}",
            f"--shared-prefix={p.shared_prefix_tokens}",
            f"--seed={p.seed}",
            "--json",
        ]

    def start(self) -> None:
        main = f"from kvtui.cli import main\nraise SystemExit(main({self.argv()!r}))"
        self._out = tempfile.TemporaryFile()  # noqa: SIM115
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            child_command(main),
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=self._err,
            cwd=CHILD_CWD,
            start_new_session=True,
        )

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def outcome(self) -> str:
        """What the load did, in a line, once it has ended (its JSON's figures, or why it
        failed); empty while it runs."""
        proc = self._proc
        if proc is None or proc.poll() is None or self._out is None or self._err is None:
            return ""
        self._out.seek(0)
        try:
            r = json.loads(self._out.read(MAX_OUTPUT_BYTES))
            return (
                f"{r['done']:,} of {r['requests']:,} requests done ({r['cut']:,} cut short, "
                f"{r['failed']:,} failed), {r['tokens']:,} tokens in {r['seconds']:.1f} s"
            )
        except (ValueError, KeyError, TypeError):
            self._err.seek(0)
            lines = self._err.read(MAX_OUTPUT_BYTES).decode("utf-8", "replace").splitlines()
            return lines[-1].strip() if lines else f"the load exited with status {proc.returncode}"

    def close(self, timeout: float = 2.0) -> None:
        """End the load now (its requests are closed) and reap it."""
        if self._proc is not None:
            end_process(self._proc, timeout, (self._out, self._err))
        self._out = self._err = None


MAX_OUTPUT_BYTES = 2**20
"""The most of a load process's output read back."""


# --- the one reader ------------------------------------------------------------------------------

BATCH_INTERVAL_S = 1 / RUN_UPDATES_PER_SECOND
"""The reader hands on at most one batch of events per this many seconds, and checks `stopped` at
least this often."""


class EngineHandle(Protocol):
    """A running engine as the app sees it (`kvtui.run.process.EngineProcess` is one;
    `kvtui.testing.ScriptedEngine` another): start it, read its events, pause, resume, stop and
    close it."""

    def start(self) -> None: ...
    def events(self) -> Iterator[Event]: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def stop(self) -> None: ...
    def close(self, timeout: float = 1.0) -> None: ...
    @property
    def alive(self) -> bool: ...


EngineFactory = Callable[[RunSettings], EngineHandle]
"""What makes a run's engine from its settings (`kvtui.run.process.Engines`, in the app)."""

_END = object()
"""The helper thread's last item: the engine's stream has ended."""


def read_engine(
    engine: EngineHandle,
    report: Callable[[list[Event]], None],
    stopped: Callable[[], bool],
    *,
    name: str = "kvtui-engine-pipe",
) -> bool:
    """Start `engine`, then hand its events to `report` in batches until its stream ends or
    `stopped()` says to stop (checked at least every BATCH_INTERVAL_S; what arrived since the last
    batch is then dropped); then close it, however the read ended (`start` raising included).
    True if the stream ended (the engine is done, or its process exited), False if stopped.

    A helper thread (`name`) blocks on the engine's stream and feeds a queue, so this loop wakes
    every BATCH_INTERVAL_S to check `stopped` and to hand on what has arrived: a batch at most
    every BATCH_INTERVAL_S, and the last one at once. A stream that breaks ends with a `RunFailed`
    that says so."""
    inbox: queue.Queue[object] = queue.Queue()

    def pump() -> None:
        try:
            for event in engine.events():
                inbox.put(event)
        except Exception as exc:  # the pipe broke: say so as the run's failure
            inbox.put(RunFailed(f"engine stream broke: {exc}"))
        finally:
            inbox.put(_END)

    try:
        engine.start()
        threading.Thread(target=pump, name=name, daemon=True).start()
        pending: list[Event] = []
        last_report = 0.0
        ended = False
        while not ended and not stopped():
            try:
                item = inbox.get(timeout=BATCH_INTERVAL_S)
                while True:
                    if item is _END:
                        ended = True
                        break
                    pending.append(item)  # type: ignore[arg-type]
                    item = inbox.get_nowait()
            except queue.Empty:
                pass
            now = time.monotonic()
            if pending and (ended or now - last_report >= BATCH_INTERVAL_S):
                report(pending)
                pending, last_report = [], now
        return ended
    finally:
        engine.close(timeout=1.0)
