"""Presenter mode in Chromium at 1280x800 and 1920x1080: the page is the title card at once,
then the app fills the window, each node is screenshotted (into the test's artifacts folder,
and KVTUI_SCREENSHOT_DIR where set), and the figures' large type is measured in pixels."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from .harness import ENGINE, TerminalPage, start_server, wait_for

pytestmark = pytest.mark.browser

NODES = (  # the words each node shows once all of it is shown, and the spaces that reveal it
    ("1 · Without a cache", 4, "WASTED"),
    ("2 · With the cache", 4, "TIME"),
    ("3 · The cache grows", 4, "FULL AT TOKEN"),
    ("ran out?", 2, "ANSWER"),
)
FIGURE_PX = {(1280, 800): 120, (1920, 1080): 160}
"""The least height in pixels of node 1's figures (Textual's Digits drew ~50 px at 1280x800)."""

CELL_HEIGHT = """() => {
  const term = window.__kvtuiTerm;
  return document.querySelector(".xterm-screen").getBoundingClientRect().height / term.rows;
}"""


@pytest.fixture(scope="module")
def server(browser):
    server = start_server("--present", "--lesson", "--engine", ENGINE, "--max-sessions", "1")
    try:
        yield server
    finally:
        server.stop()


def figure_rows(text: str, label: str) -> int:
    """Rows of large type under a figure's `label`, down to its caption ("measured: ...")."""
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if re.search(rf"\b{label}\b", line))
    column = lines[top].index(label)
    rows = 0
    for line in lines[top + 1 :]:
        part = line[column:]
        if part.lstrip().startswith(("measured", "modelled", "formula")):
            break
        rows += any(ch in "█▀▄░" for ch in part)
    return rows


@pytest.mark.parametrize("size", sorted(FIGURE_PX))
def test_each_node_fills_the_page_and_its_figures_are_large(browser, server, size, tmp_path):
    width, height = size
    folders = [tmp_path / "presenter"]
    if extra := os.environ.get("KVTUI_SCREENSHOT_DIR"):
        folders.append(Path(extra))
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": width, "height": height})
    try:
        tab = TerminalPage(context.new_page(), server.url).open()
        card = tab.page.locator(".kvtui-card")
        assert "why LLM decoding needs a KV cache" in card.inner_text()  # the page, at once
        tab.wait_for_text("A model decodes", "done · step 24/24", timeout=60)
        shot(tab, folders, f"{width}x{height}-0-title.png")
        columns, rows = tab.page.evaluate(
            "() => [window.__kvtuiTerm.cols, window.__kvtuiTerm.rows]"
        )
        cell = tab.page.evaluate(CELL_HEIGHT)
        assert columns * 9 >= width * 0.9 and rows * cell >= height * 0.9  # it fills the page
        for number, (title, presses, last) in enumerate(NODES, start=1):
            for _ in range(presses):
                tab.press("Space")
            text = tab.wait_for_text(title, last, timeout=30)
            if number < 4:
                text = tab.wait_for_text("all shown", timeout=30)
            shot(tab, folders, f"{width}x{height}-{number}.png")
            if number == 1:
                figure_px = figure_rows(text, "TOTAL") * cell
                assert figure_px >= FIGURE_PX[size], (figure_px, text)
                print(f"{width}x{height}: node 1's figures {figure_px:.0f} px tall")
        tab.press("q")
        wait_for(tab.session_ended, 15, 'the page to say "Session ended."')
        wait_for(lambda: not server.sessions(), 15, "the app and its engine to end")
    finally:
        context.close()


def shot(tab: TerminalPage, folders: list[Path], name: str) -> None:
    tab.page.screenshot(path=str(folders[0] / name))
    for folder in folders[1:]:
        shutil.copy(folders[0] / name, folder / name)
