"""A keyed commit's answer is kept by reference: the metadata file the commit wrote.

A commit's answer is its table's whole metadata (tens of KB, growing with the table's history);
writing it into ``idempotency_key`` in the commit's transaction cost a keyed commit more than the
rest of the key's handling together. The metadata file holds the same content, and the catalog
wrote it before the commit: ``metadata_location`` names it, ``body`` stays NULL, and a retry's
answer is read back from the file (DESIGN.md, "Retries are safe").

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-25
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE idempotency_key ALTER COLUMN body DROP NOT NULL,
            ADD COLUMN metadata_location text,
            ADD CONSTRAINT idempotency_key_answer CHECK ((body IS NULL) <> (metadata_location IS NULL))
        """
    )


def downgrade() -> None:
    op.execute("DELETE FROM idempotency_key WHERE body IS NULL")  # answers a downgraded server cannot give
    op.execute(
        """
        ALTER TABLE idempotency_key DROP CONSTRAINT idempotency_key_answer, DROP COLUMN metadata_location,
            ALTER COLUMN body SET NOT NULL
        """
    )
