"""A headless chromium for the tests of the web page (Debian's /usr/bin/chromium, driven by
Playwright): fixture ``browser``, one per session (starting one costs seconds), skipped where
either is missing; ``Tab``, a page of it that fails the test on any script error or dialog
(an injected ``alert``) and keeps screenshots.

``PREEMPTIBLE_SCREENSHOTS=DIR``: the screenshots also go to DIR (``make screenshots``
refreshes the pictures of docs/sweeps.md that way).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = os.environ.get("PREEMPTIBLE_SCREENSHOTS")

BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless chromium for the session's browser tests."""
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with playwright.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            yield launched
        finally:
            launched.close()


class Tab:
    """A page of the browser that records script errors and dialogs (an injected alert)."""

    def __init__(self, browser: Any) -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))

    def wait(self, expression: str, arg: Any = None) -> None:
        """Until ``expression`` (of ``arg``) is true in the page; a function, not a string
        to evaluate, which the page's Content-Security-Policy refuses."""
        self.page.wait_for_function(f"(arg) => ({expression})", arg=arg, timeout=15_000)

    def shoot(self, tmp_path: Path, name: str, *, readme: bool = False) -> None:
        """A screenshot kept with the test's files; one of the README's pictures (``readme``)
        also in $PREEMPTIBLE_SCREENSHOTS, when set."""
        path = tmp_path / name
        self.page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 1000
        if SCREENSHOTS and readme:
            Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, Path(SCREENSHOTS) / name)

    def close(self) -> None:
        assert self.errors == [] and self.dialogs == []  # no script error, no injected alert
        self.page.close()
