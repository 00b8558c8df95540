"""Shared by the dashboard's browser tests: Debian's Chromium through playwright, and a real
uvicorn server on a free loopback port in a background thread."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.live_coordinator import serve

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]

__all__ = ["Browser", "Page", "browser_fixture", "open_dashboard", "serve"]


@pytest.fixture(scope="module", name="browser")
def browser_fixture() -> Iterator[Browser]:
    """Debian's Chromium, one per test module (a launch costs about two seconds)."""
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing (scripts/install-browser.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it: a missing browser is a broken job, not a skip
        pytest.skip(message)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def open_dashboard(browser: Browser, base_url: str, token: str, *, refresh_s: int | None = None,
                   viewport: tuple[int, int] = (1280, 900)) -> tuple[Page, list[str]]:
    """A page on the dashboard, token passed in the fragment, loaded and rendered.

    Returns the page and a live list of problems: script errors, console errors, and any
    request that left the coordinator's origin (the page must work with no internet).
    """
    problems: list[str] = []
    page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)

    def guard(route, request) -> None:  # type: ignore[no-untyped-def]
        if request.url.startswith(base_url + "/"):
            route.continue_()
        else:
            problems.append(f"request outside the coordinator: {request.url}")
            route.abort()

    page.route("**/*", guard)
    query = f"?refresh={refresh_s}" if refresh_s else ""
    page.goto(f"{base_url}/{query}#token={token}")
    page.wait_for_selector("body[data-state=ready]")
    return page, problems
