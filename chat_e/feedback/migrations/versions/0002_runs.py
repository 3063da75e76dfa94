"""Schema 0002: training runs (what the app trained from its feedback, and how each run ended).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-27 14:55:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "chat_e_runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("method", sa.String(length=8), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("rows_sha256", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("pid_started", sa.Float(), nullable=True),
        sa.Column("output_dir", sa.Text(), nullable=False),
        sa.Column("log_path", sa.Text(), nullable=False),
        sa.Column("metrics_before", sa.JSON(), nullable=True),
        sa.Column("metrics_after", sa.JSON(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("chat_e_runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_chat_e_runs_created_at"), ["created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_chat_e_runs_status"), ["status"], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("chat_e_runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_chat_e_runs_status"))
        batch_op.drop_index(batch_op.f("ix_chat_e_runs_created_at"))
    op.drop_table("chat_e_runs")
