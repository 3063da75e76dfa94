"""Fixtures of the app tests that need a server of their own."""

from __future__ import annotations

import pytest

from .browser import CHROMIUM, CHROMIUM_ARGS
from .postgres import PostgresServer, binaries


@pytest.fixture(scope="session")
def postgres():
    """One real PostgreSQL server for the session (tests/app/postgres.py); each test takes a fresh database."""
    if binaries() is None:
        pytest.skip("needs PostgreSQL's server (Debian's postgresql): run `make postgres`")
    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture
def page(tmp_path):
    """A page of a fresh headless Chromium (tests/app/browser.py)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=str(CHROMIUM),
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1280, "height": 860},
        )
        try:
            yield browser.new_page()
        finally:
            browser.close()
