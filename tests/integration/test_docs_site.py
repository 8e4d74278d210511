"""The docs site as a reader gets it: built with mkdocs (strict, as `make docs` does) into a
temporary directory, served by a local http.server on 127.0.0.1, opened in the session's
headless chromium (tests/support/browser.py). The navigation leads from the index to a front
end's page, and the search box finds a name from its index, which Material builds into the
site: no request leaves 127.0.0.1."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import ROOT
from tests.support.browser import Tab

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built from this checkout in strict mode."""
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    return out


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """``site`` over HTTP on 127.0.0.1 (a free port): the address of its root."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_the_site_s_navigation_and_search_work_offline(
    served: str, browser: Any, tmp_path: Path
) -> None:
    tab = Tab(browser)
    page = tab.page
    elsewhere: list[str] = []  # a font, a script or a style from the network: not offline

    def seen(request: Any) -> None:
        if urlsplit(request.url).hostname != "127.0.0.1":
            elsewhere.append(request.url)

    page.on("request", seen)
    page.goto(served + "index.html")
    assert page.title().startswith("preemptible")
    nav = page.locator("nav.md-nav--primary")
    for title in ("Getting started", "Lightning", "Hugging Face Trainer", "SLURM", "Sweeps"):
        assert nav.get_by_role("link", name=title, exact=True).count() >= 1, title

    nav.get_by_role("link", name="Lightning", exact=True).first.click()
    page.wait_for_url("**/frontends/lightning.html")
    assert page.locator("article h1").inner_text().strip().startswith("Lightning")
    article = page.locator("article").inner_text()
    assert "GracefulInterruptCallback" in article and "readme-test" not in article
    assert page.locator("article pre code").count() >= 1
    tab.shoot(tmp_path, "docs-lightning.png")

    # the search: Material's index (search/search_index.json), searched in a web worker
    query = page.locator("input.md-search__input")  # in the header at this width
    query.click()
    query.press_sequentially("requeue", delay=20)  # key by key, as a reader types
    results = page.locator(".md-search-result__item a")
    results.first.wait_for(timeout=15_000)
    found = [results.nth(i).get_attribute("href") or "" for i in range(results.count())]
    assert any("slurm.html" in href for href in found), found
    assert elsewhere == [], f"requests that left 127.0.0.1: {elsewhere}"
    tab.close()


def test_the_site_loads_nothing_from_the_network(site: Path) -> None:
    """No page, style or script of the built site names a resource on another host (Material
    loads Google Fonts unless ``font: false``): the browser test sees one page's requests,
    this sees every page's."""
    import re

    remote = re.compile(r"""<(?:link|script|img)\b[^>]*\b(?:href|src)=["']?(?:https?:)?//""", re.I)
    css_remote = re.compile(r"@import\s+url\(\s*[\"']?(?:https?:)?//|url\(\s*[\"']?https?://")
    found = [
        str(path.relative_to(site))
        for path in site.rglob("*")
        if (path.suffix == ".html" and remote.search(path.read_text()))
        or (path.suffix == ".css" and css_remote.search(path.read_text()))
    ]
    assert not found, f"pages that load from another host: {found}"
