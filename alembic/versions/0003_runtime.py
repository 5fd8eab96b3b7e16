"""Job runtime: recorded input ranges (deterministic replay) and job liveness.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

UPGRADE = """
-- A root job records what input a barrier takes (file list, key interval, batch id) before
-- writing it; after a crash it re-reads exactly that range. range_key makes a range findable
-- by its source position (e.g. a streaming batch id).
CREATE TABLE input_range (
    job_name    text        NOT NULL,
    barrier     bigint      NOT NULL CONSTRAINT input_range_barrier_fkey REFERENCES barrier,
    range_key   text,
    spec        jsonb       NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT input_range_pkey PRIMARY KEY (job_name, barrier),
    CONSTRAINT input_range_key_unique UNIQUE (job_name, range_key)
);

ALTER TABLE job
    ADD COLUMN status text NOT NULL DEFAULT 'registered'
        CONSTRAINT job_status_check CHECK (status IN ('registered', 'running', 'stopped')),
    ADD COLUMN heartbeat_at timestamptz,
    ADD COLUMN runner text;
"""

DOWNGRADE = """
ALTER TABLE job DROP COLUMN runner, DROP COLUMN heartbeat_at, DROP COLUMN status;
DROP TABLE input_range;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
