"""Text from outside kvtui (a record, a model's config, the device probe, an engine's message) is
shown as text on every screen, never read as markup: a `[/dim]` in a record cannot crash the app,
and an `[@click=app.quit]` in a config's folder name cannot put an action on screen."""

from __future__ import annotations

import json
from dataclasses import replace

from conftest import PROBE, SETTINGS, screen_text, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from textual.content import Content

from kvtui.app import make_app
from kvtui.engines.drive import run_events
from kvtui.engines.factory import open_engine
from kvtui.engines.protocol import RunFailed, RunFinished, RunStarted
from kvtui.testing import ScriptedEngine

SIZE = (200, 50)
"""Wide enough for every title in full."""
MARKUP = [
    "measured[/dim]",
    "[@click=app.quit]quit[/]",
    "[link='https://example.com']x[/link]",
    "[$nope]v",
    "[B]b",
    "[ b]s",
    "tail\\",
]
"""Markup and action syntax a file may hold: each must show exactly as written."""
TEXT = " ".join(MARKUP)


def events_with(**started_fields) -> list:
    """A sim run whose start carries these fields (as a replay of an edited record would)."""
    run = list(run_events(open_engine(replace(SETTINGS, tokens=4)), replace(SETTINGS, tokens=4)))
    return [replace(e, **started_fields) if isinstance(e, RunStarted) else e for e in run]


async def test_a_records_strings_show_as_written_on_every_screen(text=TEXT):
    events = events_with(
        model=f"m{text}", device=f"d{text}", timing=text, kv_pool_source=f"k{text}"
    )
    probe = {**PROBE, "description": f"probe {text}", "label": f"probe {text}"}
    app = make_app(
        replace(SETTINGS, tokens=4),
        3,
        probe=probe,
        engine_factory=lambda s: ScriptedEngine(events, settings=s),
    )
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.live.state == "done")
        app.screen.redraw_now()
        await pilot.pause()
        shown = screen_text(app)
        assert f"k{text}" in shown  # the pool's source, in the bar's subtitle
        assert f"m{text}" in shown  # the model, in the bar's title
        for key in ("1", "2", "question_mark"):
            await pilot.press(key)
            await pilot.pause()
        assert f"probe {text}" in screen_text(app)  # help: the device in full
        assert app.is_running


async def test_an_engines_message_shows_as_written(text=TEXT):
    started = events_with()[0]
    events = [started, RunFinished("cached", "error", 0, f"stop {text}"), RunFailed(f"fail {text}")]
    app = make_app(
        replace(SETTINGS, tokens=4),
        1,
        probe=PROBE,
        engine_factory=lambda s: ScriptedEngine(events, settings=s),
    )
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_for(pilot, lambda: app.live.state == "failed")
        await pilot.pause()
        shown = screen_text(app)
        assert f"fail {text}" in shown  # the notification
        assert app.is_running


async def test_a_model_folder_named_in_markup_shows_as_named(tmp_path):
    """`--model DIR`: the what-if follows the folder's config.json, named after the folder."""
    folder = tmp_path / "[$nope][@click=app.quit]x"
    folder.mkdir()
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "vocab_size": 300,
    }
    (folder / "config.json").write_text(json.dumps(config))
    events = events_with()
    app = make_app(
        replace(SETTINGS, engine=f"hf:{folder}", tokens=4),
        3,
        probe=PROBE,
        engine_factory=lambda s: ScriptedEngine(events, settings=s),
    )
    async with app.run_test(size=(140, 42)) as pilot:
        await wait_for(pilot, lambda: app.live.state == "done")
        # The what-if reads the model's config.json off the UI thread: wait until it follows it.
        await wait_for(pilot, lambda: "(modelled): [$nope][@click=app.quit]x" in screen_text(app))
        await pilot.press("plus", "plus", "plus", "plus", "plus", "plus")  # past its 256 positions
        await pilot.pause()
        shown = screen_text(app)
        assert "(modelled): [$nope][@click=app.quit]x" in shown  # the what-if's title
        assert "[$nope][@click=app.quit]x (from config.json) was built" in shown  # its advice
        assert app.is_running


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(alphabet=st.sampled_from("[]/\\@$=ab :'\"#\x1b\n"), max_size=40))
def test_any_text_is_itself_in_a_template(text):
    """The helpers every screen uses for outside text: what is shown is the text, character for
    character (control characters escaped, as kvtui.format.safe_text has them)."""
    from kvtui.format import safe_text
    from kvtui.widgets.plain import plain, template

    assert plain(text).plain == safe_text(text)
    shown = template("[b]Live[/b] ($what) [dim]end[/dim]", what=text)
    assert isinstance(shown, Content)
    assert shown.plain == f"Live ({safe_text(text)}) end"


async def test_presenter_mode_shows_a_records_strings_as_written(text=TEXT):
    """Presenter mode's status line (the model, the device) and node 3's pool bar (the pool's
    source) show a record's strings as text: a `[/dim]` there crashed the app."""
    from kvtui.widgets.slides import TallBar

    events = events_with(model=f"m{text}", device=f"d{text}", kv_pool_source=f"k{text}")
    app = make_app(
        replace(SETTINGS, tokens=4),
        probe=PROBE,
        present=True,
        engine_factory=lambda s: ScriptedEngine(events, settings=s),
    )
    async with app.run_test(size=(320, 60)) as pilot:  # wide enough for both in full
        await wait_for(pilot, lambda: app.live.state == "done")
        await pilot.press(*["space"] * 12)  # to node 3, its figures shown: the pool's source
        await wait_for(pilot, lambda: app.live.state == "done")
        app.screen.redraw_now()
        await pilot.pause()
        shown = screen_text(app)
        assert app.screen.query_one("#present-pool", TallBar).border_subtitle
        assert f"(k{MARKUP[0]} {MARKUP[1]} {MARKUP[2]}" in shown  # in the bar's border, as written
        assert f"m{MARKUP[0]} {MARKUP[1]}" in shown.splitlines()[-2]
        assert f"d{MARKUP[0]} {MARKUP[1]}" in shown.splitlines()[-2]


ESCAPES = "\x1b]0;PWNED\x07\x1b]52;c;aGk=\x07\x9b2J\r\nFAKE-LINE: all good"
"""What a record handed over may name things with: an OSC 0 (the terminal's title), an OSC 52 (the
clipboard), a C1 CSI and a line break that starts a line of its own in a table."""


def _record_with_escapes(tmp_path, settings):
    """A record of a sim run whose start's names, steps' text and loops' messages hold ESCAPES."""
    from kvtui.cli import main

    path = tmp_path / "escapes.jsonl"
    assert main(["bench", "--engine", settings.engine, "--tokens", "4", "--record", str(path)]) == 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        if line.get("kind") == "started":
            for key in ("model", "device", "timing", "kv_pool_source", "ridge_source"):
                line[key] = f"{key} {ESCAPES}"
            line["prompt_text"] = ESCAPES
        elif line.get("kind") == "step":
            line["text"] = ESCAPES
        elif line.get("kind") == "finished":
            line["message"] = ESCAPES
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _controls(text: str) -> list[str]:
    return [c for c in text if ord(c) < 32 and c != "\n" or 0x7F <= ord(c) < 0xA0]


async def test_a_records_escape_codes_never_reach_the_terminal(tmp_path, capsys):
    """A replay whose names hold escape codes drew them raw on screens 1-4 (the terminal took the
    OSC 0 as its title), and bench's table printed a loop's message's `\\r\\n` as a line of its own
    ("FAKE-LINE: all good"): every string of a record is made safe as it is read."""
    path = _record_with_escapes(tmp_path, SETTINGS)
    capsys.readouterr()
    from kvtui.cli import main

    assert main(["bench", "--engine", f"replay:{path}", "--replay-speed", "0"]) == 0
    out = capsys.readouterr().out
    assert not _controls(out) and "\\x1b]0;PWNED\\x07" in out
    assert not any(line.startswith("FAKE-LINE") for line in out.splitlines())
    app = make_app(
        replace(SETTINGS, tokens=4),
        1,
        probe=PROBE,
        engine_factory=lambda s: ScriptedEngine.from_record(path),
    )
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.live.state == "done")
        for key in ("1", "2", "3", "4"):
            await pilot.press(key)
            await pilot.pause()
            assert not _controls(screen_text(app)), key
        assert app.is_running
