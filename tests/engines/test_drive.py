"""How `run_events` shares one engine between the loops: turns of measured time, not of steps."""

from kvtui.engines.drive import run_events
from kvtui.engines.protocol import RunFinished, RunSettings, RunStarted, StepSample

SETTINGS = RunSettings(engine="tiny", device="cpu", tokens=6, loops=("uncached", "cached"))


class TimedSteps:
    """An engine whose steps take the seconds it is given, per loop; nothing runs."""

    def __init__(self, seconds: dict[str, list[float]]) -> None:
        self.seconds = seconds

    def started(self) -> RunStarted:
        return RunStarted(
            engine="tiny",
            model="m",
            device="cpu",
            dtype="fp32",
            layers=1,
            kv_heads=1,
            head_dim=1,
            kv_bytes_per_token=8,
            weights_bytes=8,
            prompt_tokens=1,
            tokens=SETTINGS.tokens,
            timing="measured",
        )

    def steps(self, loop):
        for i, seconds in enumerate(self.seconds[loop]):
            yield StepSample(loop, i, 1 + i, 0, "x", 1, 1, 1, seconds, 0)

    def close(self) -> None:
        pass


def order(seconds: dict[str, list[float]], **kwargs) -> str:
    """The loops' steps in the order the run gave them: "u" uncached, "c" cached."""
    events = run_events(TimedSteps(seconds), SETTINGS, **kwargs)
    return "".join(e.loop[0] for e in events if isinstance(e, StepSample))


def test_a_turn_lasts_its_time_then_goes_to_the_loop_that_spent_least():
    tick = 1 / 16  # exact in binary: the sums below are exact
    seconds = {"uncached": [2 * tick, 2 * tick, 8 * tick], "cached": [tick] * 10}
    # u's turn (the tie goes to the first loop): 2 < 3, so a second step, 4. c's turns of 3 while
    # it is behind: 3, 6. u (4 < 6): one step is its turn, 12. c, behind again: 9, then 10, its
    # last step.
    assert order(seconds, turn_seconds=3 * tick) == "uu" + "c" * 6 + "u" + "c" * 4


def test_turns_of_no_time_are_a_step_each_to_the_loop_behind():
    seconds = {"uncached": [0.03, 0.03], "cached": [0.01] * 4}
    assert order(seconds, turn_seconds=0.0) == "u" + "ccc" + "u" + "c"


def test_sequential_runs_each_loop_to_its_end():
    seconds = {"uncached": [0.03, 0.03], "cached": [0.01] * 3}
    assert order(seconds, schedule="sequential") == "uuccc"


def test_every_loop_finishes_once():
    seconds = {"uncached": [0.02] * 3, "cached": [0.01] * 3}
    events = list(run_events(TimedSteps(seconds), SETTINGS))
    finished = [(e.loop, e.reason, e.steps) for e in events if isinstance(e, RunFinished)]
    assert sorted(finished) == [("cached", "done", 3), ("uncached", "done", 3)]
