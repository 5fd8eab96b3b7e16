"""What a running job is waiting for (reported by the runtime, shown by `job list`).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE job ADD COLUMN waiting_for text")


def downgrade() -> None:
    op.execute("ALTER TABLE job DROP COLUMN waiting_for")
