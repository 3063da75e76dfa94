"""Chat-E's feedback and arena votes, stored for good in a SQL database through SQLAlchemy.

What people tell Chat-E -- a thumb up or down on a reply, a corrected reply ("what it should have said"), the better of
a reply and its regeneration, a blind arena vote -- becomes a row with everything needed to train on it: the context
mode and its text, the history as the model saw it (plain turns, oldest first), the user's message, the reply, the
model's id and generation settings, the time (UTC) and the session. :mod:`chat_e.feedback.export` turns the rows into what the
recipes read.

Storage is any SQLAlchemy URL: by default a SQLite file in the run directory (``runs/chat-e/feedback.db``), in WAL
mode with full synchronous commits, so that a row is on disk before its request is answered and a killed server loses
nothing it acknowledged; ``postgresql://...`` (or another server) for a database several Chat-E processes share. The
schema carries a version: Alembic's migrations in :mod:`chat_e.feedback.migrations` create and upgrade it whenever a store is
opened (``chat-e feedback upgrade`` does it by hand, e.g. before several servers start on a shared database).

Rows are appended, never rewritten: a rating changed later is a newer row for the same reply, and the newest wins at
export. Retention: rows are kept until deleted; ``chat-e feedback purge --older_than_days N`` deletes older ones.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    Integer,
    String,
    Text,
    TypeDecorator,
    create_engine,
    delete,
    event,
    func,
    select,
    update,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

logger = logging.getLogger(__name__)

#: where feedback goes when no ``--feedback_db`` is given: a SQLite file in the run directory
DEFAULT_RUN_DIR = Path("runs") / "chat-e"
DEFAULT_DB_NAME = "feedback.db"
#: the kinds of a feedback row
RATING, EDIT, CHOICE = "rating", "edit", "choice"
FEEDBACK_KINDS = (RATING, EDIT, CHOICE)
#: a vote's winner, FastChat's kinds: model A (the left side) better, model B better, a tie, both bad
WINNERS = ("model_a", "model_b", "tie", "bothbad")
#: a training run's states: accepted and not started yet; its process running; asked to stop (saving a checkpoint);
#: cancelled with a checkpoint (it can be resumed); cancelled before a step had a checkpoint to keep (nothing to
#: resume); its process ended with an error or vanished; finished with its model saved
QUEUED, RUNNING, CANCELLING, STOPPED, CANCELLED, FAILED, DONE = (
    "queued", "running", "cancelling", "stopped", "cancelled", "failed", "done"
)  # fmt: skip
RUN_STATES = (QUEUED, RUNNING, CANCELLING, STOPPED, CANCELLED, FAILED, DONE)
#: the states of a run whose process may still be alive
ACTIVE_STATES = (RUNNING, CANCELLING)
#: how long SQLite waits for another writer's lock before it gives up (seconds)
SQLITE_BUSY_SECONDS = 30


def default_url(run_dir: str | Path = DEFAULT_RUN_DIR) -> str:
    """The SQLite URL of ``run_dir``'s feedback database."""
    return f"sqlite:///{Path(run_dir) / DEFAULT_DB_NAME}"


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class UTCDateTime(TypeDecorator):
    """A time stored in UTC and read back as UTC on every backend (SQLite keeps no time zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return value.astimezone(datetime.timezone.utc) if value is not None and value.tzinfo else value

    def process_result_value(self, value, dialect):
        return value.replace(tzinfo=datetime.timezone.utc) if value is not None and value.tzinfo is None else value


class Base(DeclarativeBase):
    pass


class _Exchange:
    """What every row holds: who, when, which model and settings, and the exchange as the model saw it."""

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime.datetime] = mapped_column(UTCDateTime, index=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    #: a context mode as chat_e.data.dialogue names it (persona, emotion, domain, topic, none)
    mode: Mapped[str] = mapped_column(String(16))
    context: Mapped[str] = mapped_column(Text, default="")
    #: the earlier turns as the model saw them (plain strings, oldest first, speakers alternating)
    history: Mapped[list] = mapped_column(JSON)
    message: Mapped[str] = mapped_column(Text)
    #: the generation settings the reply was made with (chat_e.data.settings.GenerationSettings' fields)
    settings: Mapped[dict] = mapped_column(JSON)


class Feedback(_Exchange, Base):
    """A rating, a correction or a choice between a reply and its regeneration.

    * ``rating``: ``rating`` +1 (thumb up), -1 (thumb down) or 0 (taken back), on ``reply``.
    * ``edit``: ``edited`` is what the bot should have said instead of ``reply``.
    * ``choice``: ``reply`` was preferred over ``other_reply`` (a reply and its regeneration, same prompt).
    """

    __tablename__ = "chat_e_feedback"

    kind: Mapped[str] = mapped_column(String(16))
    #: the rated (edited, preferred) reply's id: one per generated reply, so later rows about it supersede earlier ones
    reply_id: Mapped[str] = mapped_column(String(64), index=True)
    model: Mapped[str] = mapped_column(Text)
    reply: Mapped[str] = mapped_column(Text)
    rating: Mapped[int | None] = mapped_column(Integer, nullable=True)
    edited: Mapped[str | None] = mapped_column(Text, nullable=True)
    other_reply_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    other_reply: Mapped[str | None] = mapped_column(Text, nullable=True)


class Vote(_Exchange, Base):
    """A blind arena vote: the same message went to ``model_a`` (left) and ``model_b`` (right)."""

    __tablename__ = "chat_e_votes"

    battle_id: Mapped[str] = mapped_column(String(64), index=True)
    #: 1 for a battle's first exchange (both models saw the same history)
    turn: Mapped[int] = mapped_column(Integer)
    model_a: Mapped[str] = mapped_column(Text)
    model_b: Mapped[str] = mapped_column(Text)
    winner: Mapped[str] = mapped_column(String(16))
    reply_a: Mapped[str] = mapped_column(Text)
    reply_b: Mapped[str] = mapped_column(Text)


class TrainingRun(Base):
    """A training run the app started from its feedback: what it trained on and with, where it writes, how it ended."""

    __tablename__ = "chat_e_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime.datetime] = mapped_column(UTCDateTime, index=True)
    #: sft, dpo or kto (chat_e.training.launch.METHODS)
    method: Mapped[str] = mapped_column(String(8))
    #: the form's values and the command that ran
    settings: Mapped[dict] = mapped_column(JSON)
    #: the exported rows it trained on: how many, and the SHA-256 of the file
    rows: Mapped[int] = mapped_column(Integer)
    rows_sha256: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), index=True)
    started_at: Mapped[datetime.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    ended_at: Mapped[datetime.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    #: the training's process (the launcher) and its start time, which tells it from a later process with its pid
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    pid_started: Mapped[float | None] = mapped_column(Float, nullable=True)
    output_dir: Mapped[str] = mapped_column(Text)
    log_path: Mapped[str] = mapped_column(Text)
    #: held-out metrics before and after training (the preference training's report)
    metrics_before: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    metrics_after: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    #: why it stopped or failed: the exit status and the log's last lines
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)


def _row(obj: Base) -> dict[str, Any]:
    return {c.key: getattr(obj, c.key) for c in obj.__table__.columns}


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    """WAL (readers never block the writer, a crash loses no committed row), every commit synced to disk, and a
    wait for the lock instead of an immediate 'database is locked'."""
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_SECONDS * 1000}")  # first: switching to WAL takes the lock too
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


def make_engine(url: str) -> Engine:
    """A SQLAlchemy engine for ``url``; a SQLite file's directory is created, and its connections set up by
    :func:`_sqlite_pragmas`."""
    parsed = make_url(url)
    sqlite = parsed.get_backend_name() == "sqlite"
    if sqlite and parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, pool_pre_ping=not sqlite)
    if sqlite:
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


class FeedbackStore:
    """Feedback rows and arena votes in the database at ``url`` (upgraded to the current schema when opened).

    Every ``add_*`` commits before it returns: a caller that got an answer knows the row is stored.
    """

    def __init__(self, url: str):
        from .migrations import upgrade  # noqa: PLC0415 (deliberate deferral: Alembic's import is only needed to open a store)

        self.url = url
        self.engine = make_engine(url)
        upgrade(self.engine)
        self._session = sessionmaker(self.engine, expire_on_commit=False)

    def describe(self) -> str:
        """The database's URL without its password, for logs."""
        return make_url(self.url).render_as_string(hide_password=True)

    def _add(self, row: Base) -> int:
        with self._session() as session, session.begin():
            session.add(row)
            session.flush()
            return row.id

    def add_feedback(self, **fields: Any) -> int:
        """Store one :class:`Feedback` row (its columns as keywords; ``created_at`` defaults to now); its id."""
        if fields.get("kind") not in FEEDBACK_KINDS:
            raise ValueError(f"kind={fields.get('kind')!r}: choose one of {', '.join(FEEDBACK_KINDS)}.")
        return self._add(Feedback(**{"created_at": utcnow(), **fields}))

    def add_vote(self, **fields: Any) -> int:
        """Store one :class:`Vote` row (its columns as keywords; ``created_at`` defaults to now); its id."""
        if fields.get("winner") not in WINNERS:
            raise ValueError(f"winner={fields.get('winner')!r}: choose one of {', '.join(WINNERS)}.")
        return self._add(Vote(**{"created_at": utcnow(), **fields}))

    def feedback(self) -> list[dict[str, Any]]:
        """Every feedback row, oldest first, as dicts of its columns."""
        with self._session() as session:
            return [_row(r) for r in session.scalars(select(Feedback).order_by(Feedback.id))]

    def votes(self) -> list[dict[str, Any]]:
        """Every arena vote, oldest first, as dicts of its columns."""
        with self._session() as session:
            return [_row(r) for r in session.scalars(select(Vote).order_by(Vote.id))]

    def vote_outcomes(self) -> list[tuple[str, str, str]]:
        """``(model_a, model_b, winner)`` of every arena vote, oldest first: what a leaderboard needs, read without
        the rows' texts and histories."""
        with self._session() as session:
            rows = session.execute(select(Vote.model_a, Vote.model_b, Vote.winner).order_by(Vote.id))
            return [tuple(row) for row in rows]

    def counts(self) -> dict[str, int]:
        """Rows per feedback kind, and ``vote``."""
        with self._session() as session:
            kinds = dict(session.execute(select(Feedback.kind, func.count()).group_by(Feedback.kind)).all())
            kinds["vote"] = session.scalar(select(func.count()).select_from(Vote)) or 0
        return {kind: int(kinds.get(kind, 0)) for kind in (*FEEDBACK_KINDS, "vote")}

    def add_run(self, **fields: Any) -> int:
        """Store one :class:`TrainingRun` (its columns as keywords; ``created_at`` defaults to now, ``status`` to
        queued); its id."""
        fields = {"created_at": utcnow(), "status": QUEUED, **fields}
        if fields["status"] not in RUN_STATES:
            raise ValueError(f"status={fields['status']!r}: choose one of {', '.join(RUN_STATES)}.")
        return self._add(TrainingRun(**fields))

    def update_run(self, run_id: int, **fields: Any) -> None:
        """Set some of run ``run_id``'s columns (committed before it returns)."""
        if "status" in fields and fields["status"] not in RUN_STATES:
            raise ValueError(f"status={fields['status']!r}: choose one of {', '.join(RUN_STATES)}.")
        with self._session() as session, session.begin():
            session.execute(update(TrainingRun).where(TrainingRun.id == run_id).values(**fields))

    def runs(self) -> list[dict[str, Any]]:
        """Every training run, newest first, as dicts of its columns."""
        with self._session() as session:
            return [_row(r) for r in session.scalars(select(TrainingRun).order_by(TrainingRun.id.desc()))]

    def run(self, run_id: int) -> dict[str, Any] | None:
        """Run ``run_id``'s columns, or None."""
        with self._session() as session:
            found = session.get(TrainingRun, run_id)
            return _row(found) if found is not None else None

    def purge(self, older_than: datetime.timedelta) -> int:
        """Delete the rows stored more than ``older_than`` ago; how many went."""
        cutoff = utcnow() - older_than
        deleted = 0
        with self._session() as session, session.begin():
            for table in (Feedback, Vote):
                deleted += session.execute(delete(table).where(table.created_at < cutoff)).rowcount or 0
        return deleted

    def close(self) -> None:
        self.engine.dispose()
