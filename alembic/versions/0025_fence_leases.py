"""The fence of a long-running service holds across a failover (DESIGN.md, "The control plane
survives losing its primary").

An advisory lock lives in the primary's memory: a promoted standby has none, and a holder whose
connection died with the old primary may still be acting (a compaction in Spark commits through
connections of its own). So the holder also keeps a lease in its state row, renewed at every
look and replicated like any commit: ``lease_until``. A new holder, once it has the lock, waits
until the lease it finds has lapsed; a holder acts only while its own lease runs (it measures it
from before it sent the renewal). NULL: none held (released, or from before this revision).

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-27
"""

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE schedule_state ADD COLUMN lease_until timestamptz;\n"
        "ALTER TABLE maintenance_state ADD COLUMN lease_until timestamptz;"
    )


def downgrade() -> None:
    op.execute(
        "ALTER TABLE schedule_state DROP COLUMN lease_until;\nALTER TABLE maintenance_state DROP COLUMN lease_until;"
    )
