"""`kvtui tricks` and screen 4's table: one speed per trick, its figures of one timing, so that no
row's tok/s and speed contradict; a published ratio says what the plain cache here is."""

from kvtui.engines.protocol import RunSettings
from kvtui.reports.table import table_header
from kvtui.reports.tricks import format_tricks, row_speed, timed_in_turns
from kvtui.widgets.tricks_table import speed

# Each row's run alone put int8 ahead of the plain cache (663 against 493 tok/s: another job
# slowed the plain run), where the layouts timed in turns put it at half the plain step's speed.


def _row(key: str, alone_ms: float, turns_ms: float | None, plain_ms: float = 2.0, **kw) -> dict:
    speed: dict = {"alone": {"tokens_per_s": 1e3 / alone_ms, "tpot_first_steps_s": alone_ms / 1e3}}
    if turns_ms is not None:
        speed["in_turns"] = {
            "step_s": turns_ms / 1e3,
            "tokens_per_s": 1e3 / turns_ms,
            "vs_plain": plain_ms / turns_ms,
            "rounds": 7,
            "steps": 128,
        }
    return {
        "key": key,
        "label": key,
        "how": "measured",
        "batch": 1,
        "kv_dtype": "fp32" if key == "plain" else key,
        "kv_bytes_per_token": 3072,
        "kv_bytes_per_token_formula": 3072,
        "steps": 117,
        "stopped": True,
        "tokens_before_full_predicted": 117,
        "quality": None,
        "speed": speed,
        **kw,
    }


ROWS = [
    _row("plain", 1e3 / 493, 2.0),
    _row("int8", 1e3 / 663, 4.0),
    _row("prefix", 3.0, None, batch=4),
]


def test_each_rows_tok_s_and_speed_are_of_one_timing_and_agree():
    header = {**table_header(RunSettings(engine="tiny")), "cpu_capability": "AVX512"}
    out = format_tricks(header, ROWS)
    lines = {line.split()[0]: line.split() for line in out.splitlines()[2:5]}
    # trick, B/token, formula, stop, /, pred, Δ, KL, top-1, 1st diff, step, ms, tok/s, speed
    plain, int8, prefix = lines["plain"], lines["int8"], lines["prefix"]
    assert plain[-4:] == ["2.00", "ms", "500", "1.00x"]
    assert int8[-4:] == ["4.00", "ms", "250", "0.50x"]  # half the plain tok/s: 0.50x
    assert "663" not in out and "493" not in out  # the runs alone are not beside the turns
    assert prefix[-3:] == ["-", "-", "-"]  # not timed in turns: no speed, not another timing's
    assert "prefix: not timed in turns (a batch of 4); its run alone took 3.00 ms a step" in out
    assert "taking turns (7 rounds of 128 steps" in out


def test_a_table_without_turns_takes_every_speed_from_the_runs_alone():
    rows = [{**r, "speed": {"alone": r["speed"]["alone"]}} for r in ROWS[:2]]
    assert not timed_in_turns(rows)
    s = row_speed(rows[1], rows[0], in_turns=False)
    assert s.tokens_per_s == 663 and s.vs_plain == 663 / 493 and s.step_s == 1 / 663


def test_screen_4s_speed_column_is_the_turns_ratio():
    assert str(speed(ROWS[1], ROWS[0])) == "0.50x"
    assert str(speed(ROWS[2], ROWS[0])) == ""  # the batch row: not timed in turns


def test_the_published_fp8_ratio_says_the_plain_cache_here_is_fp32():
    header = table_header(RunSettings(engine="tiny"))
    out = format_tricks(header, ROWS)
    fp8 = next(line for line in out.splitlines() if line.strip().startswith("fp8:"))
    assert "about 2x" in fp8 and "16-bit" in fp8
    assert "the plain cache here is fp32, 4 bytes a value, so fp8's 1 byte is 4x" in fp8
