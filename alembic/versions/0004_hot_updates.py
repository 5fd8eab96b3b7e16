"""Keep watermark updates HOT: room on each page for the new row versions.

Every completion rewrites its sinks' rows in managed_table (and every barrier the one row
of barrier_clock). With free space on the page those updates stay heap-only (no index
churn) and reads of the table stay compact between autovacuum runs.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE managed_table SET (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.02)")
    op.execute("ALTER TABLE barrier_clock SET (fillfactor = 10)")


def downgrade() -> None:
    op.execute("ALTER TABLE managed_table RESET (fillfactor, autovacuum_vacuum_scale_factor)")
    op.execute("ALTER TABLE barrier_clock RESET (fillfactor)")
