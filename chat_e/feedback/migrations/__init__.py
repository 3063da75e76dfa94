"""The feedback database's schema versions, as Alembic migrations (``versions/``), and :func:`upgrade`.

Each change to :mod:`chat_e.feedback.store`'s tables is a new revision here, so that a database written by an older Chat-E is
upgraded in place when a newer one opens it (tests/unit/test_feedback.py checks that the migrated schema equals
the tables' declaration). The current version is in the database's ``alembic_version`` table.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from filelock import FileLock
from sqlalchemy import text
from sqlalchemy.engine import Engine

HERE = Path(__file__).parent
#: the PostgreSQL advisory lock every Chat-E process holds while it reads and migrates the schema ("chat" in ASCII)
ADVISORY_LOCK_KEY = 0x63686174


def alembic_config() -> Config:
    """Alembic's configuration for these migrations (no alembic.ini: the script location is this package)."""
    config = Config()
    config.set_main_option("script_location", str(HERE))
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database behind ``engine`` to ``revision`` (the newest by default); a no-op when it is there.

    Processes that open one fresh database together (several servers, ``chat-e feedback upgrade`` in a deploy script)
    migrate it one at a time: each reads the schema's version and migrates under a lock -- PostgreSQL's advisory lock
    for the transaction (its DDL is transactional, so a waiter then finds the schema current), or for a SQLite file a
    lock file beside it (``feedback.db.lock``). Other servers (MySQL...) get no lock: run ``chat-e feedback upgrade``
    once before starting them."""
    with migration_lock(engine), engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
        if current_revision(connection) == head_revision() and revision == "head":
            return
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def migration_lock(engine: Engine):
    """The lock file of a SQLite file database (a context manager), else a context that does nothing."""
    database = engine.url.database
    if engine.dialect.name == "sqlite" and database and database != ":memory:" and not database.startswith("file:"):
        return FileLock(f"{database}.lock")
    return nullcontext()


def head_revision() -> str:
    """The newest schema version these migrations know."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(connection) -> str | None:
    """The schema version of the database behind ``connection`` (None: empty)."""
    return MigrationContext.configure(connection).get_current_revision()
