"""Alembic's entry point for chat_e's migrations: runs them on the connection :func:`chat_e.feedback.migrations.upgrade` hands
over (or, from the ``alembic`` command line, on ``sqlalchemy.url``)."""

from alembic import context
from sqlalchemy import create_engine

from chat_e.feedback.store import Base

config = context.config
target_metadata = Base.metadata


def run(connection) -> None:
    # batch mode: SQLite alters a table by copying it, which Alembic does for it
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run(connection)
else:
    with create_engine(config.get_main_option("sqlalchemy.url")).connect() as connection:
        run(connection)
        connection.commit()
