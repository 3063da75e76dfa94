"""Fixtures of the app tests that need a server of their own."""

from __future__ import annotations

import pytest

from .postgres import PostgresServer, binaries


@pytest.fixture(scope="session")
def postgres():
    """One real PostgreSQL server for the session (tests/app/postgres.py); each test takes a fresh database."""
    if binaries() is None:
        pytest.skip("needs PostgreSQL's server (Debian's postgresql): run `make postgres`")
    server = PostgresServer()
    yield server
    server.stop()
