"""The feedback database shared by many Chat-E processes, on SQLite and on a real PostgreSQL server
(tests/app/postgres.py): processes that open a fresh database together all come up (the schema is migrated once,
under a lock), and PostgreSQL gives back exactly the rows SQLite does.

The oracles: the exit status and output of each real ``chat-e feedback upgrade`` process, Alembic's own reading of the
database's schema version and tables, and the export of the same rows from SQLite.
"""

from __future__ import annotations

import subprocess

import pytest
from sqlalchemy import inspect

from chat_e.feedback.migrations import current_revision, head_revision
from chat_e.feedback.store import Base, FeedbackStore, make_engine

from ..conftest import BIN, launch_env
from ..unit.test_feedback import FEEDBACK, VOTES

pytestmark = pytest.mark.slow

#: ``chat-e feedback upgrade`` processes started at once on one fresh database
UPGRADES = 20


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/feedback.db"
    return request.getfixturevalue("postgres").fresh_database(f"fresh_{tmp_path.name}".lower())


def test_twenty_upgrades_at_once_on_a_fresh_database_all_succeed(fresh_url):
    cmd = [str(BIN / "chat-e"), "feedback", "upgrade", "--feedback_db", fresh_url]
    procs = [subprocess.Popen(cmd, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(UPGRADES)]  # fmt: skip
    outputs = [(proc.wait(timeout=300), proc.stdout.read()) for proc in procs]
    failed = [output for code, output in outputs if code != 0]
    assert not failed, f"{len(failed)} of {UPGRADES} failed; the first:\n{failed[0][-2000:]}"
    assert all("is at the current schema" in output for _, output in outputs)
    engine = make_engine(fresh_url)
    try:
        with engine.connect() as connection:
            assert current_revision(connection) == head_revision()
            assert set(inspect(connection).get_table_names()) == set(Base.metadata.tables) | {"alembic_version"}
    finally:
        engine.dispose()


def test_postgresql_gives_back_the_rows_and_exports_that_sqlite_does(postgres, tmp_path):
    from chat_e.__main__ import main

    stores = {"sqlite": FeedbackStore(f"sqlite:///{tmp_path}/feedback.db"),
              "postgresql": FeedbackStore(postgres.fresh_database("same_rows"))}  # fmt: skip
    try:
        for store in stores.values():
            for row in FEEDBACK:
                store.add_feedback(**row)
            for row in VOTES:
                store.add_vote(**row)

        def stored(rows: list[dict]) -> list[dict]:  # each store stamped its rows with its own clock
            return [{k: v for k, v in row.items() if k != "created_at"} for row in rows]

        sqlite, postgresql = stores["sqlite"], stores["postgresql"]
        assert stored(postgresql.feedback()) == stored(sqlite.feedback())
        assert stored(postgresql.votes()) == stored(sqlite.votes())
        assert postgresql.counts() == sqlite.counts()
        for fmt in ("dpo", "kto", "sft"):
            files = {name: tmp_path / f"{name}.{fmt}.jsonl" for name in stores}
            for name, store in stores.items():
                assert main(["feedback", "export", "--format", fmt, "--out", str(files[name]),
                             "--feedback_db", store.url]) == 0  # fmt: skip
            assert files["postgresql"].read_bytes() == files["sqlite"].read_bytes(), fmt
    finally:
        for store in stores.values():
            store.close()
