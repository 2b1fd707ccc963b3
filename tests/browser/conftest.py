"""Fixtures of the browser tests: Chromium (or a skip that says why) and tabs in it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .harness import CHROMIUM, CHROMIUM_ARGS, TerminalPage


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium, or a skip that says what is missing."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="needs Playwright for Python (pip install -e '.[test]')"
    )
    pytest.importorskip("textual_serve", reason="needs textual-serve (pip install 'kvtui[serve]')")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"needs Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def new_tab(browser: Any) -> Iterator[Callable[[str], TerminalPage]]:
    """Open tabs on a server; every tab still open at the end is closed."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        yield lambda url: TerminalPage(context.new_page(), url)
    finally:
        context.close()
