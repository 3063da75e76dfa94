"""The feedback database's schema versions, as Alembic migrations (``versions/``), and :func:`upgrade`.

Each change to :mod:`chat_e.feedback`'s tables is a new revision here, so that a database written by an older Chat-E is
upgraded in place when a newer one opens it (tests/app/test_feedback_store.py checks that the migrated schema equals
the tables' declaration). The current version is in the database's ``alembic_version`` table.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

HERE = Path(__file__).parent


def alembic_config() -> Config:
    """Alembic's configuration for these migrations (no alembic.ini: the script location is this package)."""
    config = Config()
    config.set_main_option("script_location", str(HERE))
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database behind ``engine`` to ``revision`` (the newest by default); a no-op when it is there."""
    with engine.begin() as connection:
        if current_revision(connection) == head_revision() and revision == "head":
            return
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def head_revision() -> str:
    """The newest schema version these migrations know."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(connection) -> str | None:
    """The schema version of the database behind ``connection`` (None: empty)."""
    return MigrationContext.configure(connection).get_current_revision()
