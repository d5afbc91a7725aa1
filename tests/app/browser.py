"""Headless Chromium for the console tests, driven by Playwright's sync API.

The server under test runs in the test's trio loop, so the browser is driven from a worker
thread (`in_browser`): Playwright's sync objects belong to the thread that made them, and
the thread reaches back into trio with `trio.from_thread.run` to look at the server.

Chromium is Debian's package (`make test` installs it when missing, as root). Without it,
or without Playwright, the tests skip on a developer's machine and fail under CI
(`CI` set), where the console must be tested.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import pytest
import trio

T = TypeVar("T")
VIEWPORT = {"width": 1280, "height": 800}


def chromium_path() -> str | None:
    return os.environ.get("SLUICE_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None)


def _unavailable(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the console's browser tests cannot run under CI: {why}")
    pytest.skip(why)


@contextmanager
def browser_page(console_errors: list[str]) -> Iterator[Any]:
    """A fresh page in a new headless Chromium; every console error, failed request and
    uncaught exception goes into `console_errors`."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed (pip install -e '.[dev]')")
    path = chromium_path()
    if path is None:
        _unavailable("Chromium is not installed (apt-get install chromium)")
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        except Exception as e:  # noqa: BLE001 - whatever stops it, say so
            _unavailable(f"Chromium at {path} did not start: {e}")
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.on("console", lambda m: console_errors.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: console_errors.append(f"uncaught: {e}"))
            yield page
        finally:
            browser.close()


async def in_browser(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` (which drives the browser) in a worker thread, trio serving on."""
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
