"""`kvtui serve` as a person meets it: a page in Chromium, keys pressed, tabs opened and closed.

The sim engine needs no torch and starts at once. The shared server paces it at a tenth of the
roofline, so that a run lasts for the whole test and a closed tab has a running engine to end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .harness import ENGINE, start_server, wait_for

pytestmark = pytest.mark.browser

SCREEN_1 = ("1 · Without a cache", "PER STEP", "WASTED")
SCREEN_2 = ("2 · With the cache", "WITHOUT", "With a cache")
SCREEN_3 = ("3 · The cache grows", "KV CACHE")


@pytest.fixture(scope="module")
def server(browser):
    """One slow-paced server for the module, two sessions at most (none without a browser)."""
    server = start_server("--engine", ENGINE, "--replay-speed", "0.1", "--max-sessions", "2")
    try:
        yield server
    finally:
        server.stop()


def app_and_engine(server, count: int = 1) -> set[int]:
    """Wait until `count` sessions run, each an app and its engine; their pids."""
    processes = wait_for(
        lambda: len(found := server.sessions()) == 2 * count and found,
        30,
        lambda: f"{count} app(s) and engine(s); found {server.sessions()}",
    )
    apps = server.apps()
    engines = [pid for pid, (ppid, _) in processes.items() if ppid in apps]
    assert (len(apps), len(engines)) == (count, count), processes
    return set(processes)


def test_a_tab_shows_the_three_screens_and_q_ends_its_session(server, new_tab):
    tab = new_tab(server.url).open()
    tab.wait_for_text(*SCREEN_1)
    app_and_engine(server)

    tab.press("2")
    assert "1 · Without a cache" not in tab.wait_for_text(*SCREEN_2)
    tab.press("3")
    assert "2 · With the cache" not in tab.wait_for_text(*SCREEN_3)

    tab.press("q")
    wait_for(tab.session_ended, 15, 'the page to say "Session ended."')
    wait_for(lambda: not server.sessions(), 15, "the app and its engine to end")


def test_each_tab_has_its_own_session_and_closing_a_tab_ends_it(server, new_tab):
    first = new_tab(server.url).open()
    first.wait_for_text(*SCREEN_1)
    first_processes = app_and_engine(server)
    second = new_tab(server.url).open()
    second.wait_for_text(*SCREEN_1)
    both = app_and_engine(server, 2)

    first.press("2")  # a key goes to its own tab's session only
    first.wait_for_text(*SCREEN_2)
    assert "1 · Without a cache" in second.text()

    third = new_tab(server.url).open()  # one more than --max-sessions 2
    assert "all sessions in use" in third.page.locator("body").inner_text()
    assert set(server.sessions()) == both

    first.page.close()
    wait_for(lambda: not first_processes & set(server.sessions()), 15, "the closed tab's processes")
    assert set(server.sessions()) == both - first_processes  # the other tab runs on

    def reloaded_onto_a_terminal() -> int:
        third.page.reload(wait_until="domcontentloaded")
        return third.page.locator("#terminal").count()

    # A session is free again: the third tab gets the terminal page, and its app starts.
    wait_for(reloaded_onto_a_terminal, 10, "the third tab to get a session")
    second.page.close()
    third.page.close()  # closed while its app may still be starting
    wait_for(lambda: not server.sessions(), 15, "every app and engine to end")


def test_stopping_the_server_ends_every_session(new_tab):
    """At full pace: screen 2 after a whole run (the screenshot), then a new run cut short."""
    server = start_server("--engine", ENGINE)
    try:
        tab = new_tab(server.url).open()
        tab.wait_for_text(*SCREEN_1)
        tab.press("2")
        tab.wait_for_text(*SCREEN_2)
        if folder := os.environ.get("KVTUI_SCREENSHOT_DIR"):
            wait_for(lambda: tab.text().lstrip().startswith("✓"), 60, "the run to finish")
            tab.page.screenshot(path=str(Path(folder) / "serve.png"))
        tab.press("r")  # restart the run, so there is an engine to stop
        app_and_engine(server)
    finally:
        code = server.stop()
    assert code == 0, server.output()
    wait_for(tab.session_ended, 15, 'the page to say "Session ended."')
    wait_for(lambda: not server.sessions(), 15, "the app and its engine to end")


def test_presenter_mode_steps_through_the_lesson_on_the_live_model_in_a_tab(new_tab):
    """`kvtui serve --present --lesson` on the shipped model, decoding in the served app's own
    engine: the title while the run goes, then space by space the first node, its staircase of
    uncached work shown at a room's pace, and its first figure."""
    server = start_server("--present", "--lesson", "--engine", "tiny", "--max-sessions", "1")
    try:
        tab = new_tab(server.url).open()
        tab.wait_for_text("A model decodes", "done · step 24/24", timeout=90)
        tab.press("Space")
        text = tab.wait_for_text("Without a cache, every step", "positions each step computes")
        assert "PER STEP" not in text  # one idea at a time
        tab.wait_for_text("shown at a room's pace: all shown", timeout=30)
        tab.press("Space")
        tab.wait_for_text("PER STEP", "measured: positions step 24 computed")
        tab.press("q")
        wait_for(tab.session_ended, 15, 'the page to say "Session ended."')
    finally:
        server.stop()
