"""Job sessions: any engine's job through the catalog (``icebarrier job exec``).

- ``job_session``: the plan a job follows through warehouse ``job`` (the barrier, exact, skip
  or coalesce, from its progress), held from the session's first request until the barrier
  is published or the session discarded. One session a job; only the catalog server (the
  admin) touches it. ``run_id`` fences: the run that opened it (``job exec``) holds it until
  ``held_until`` (renewed while the run lives); a later run takes it over only once the hold
  lapsed, and requests naming an older run are refused. ``succeeded_at`` marks a session
  whose command exited 0, so that a publish cut short is adopted by the next run instead of
  computed again.
- ``catalog_pending.base_location`` may be NULL: a sink the session created, inserted into the
  catalog when the barrier is published (until then nobody else sees it).
- ``catalog_token.kind`` may be ``admin``: a token that opens the session of any job
  (warehouse ``job:<NAME>``), for a scheduler running many jobs with one credential.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-23
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE job_session (
    job_name     text        CONSTRAINT job_session_pkey PRIMARY KEY,
    barrier      bigint      NOT NULL,
    plan         text        NOT NULL CONSTRAINT job_session_plan_check CHECK (plan IN ('exact', 'skip', 'coalesce')),
    from_barrier bigint,
    run_id       text        NOT NULL,
    opened_at    timestamptz NOT NULL DEFAULT now(),
    held_until   timestamptz,
    succeeded_at timestamptz
);
ALTER TABLE catalog_pending ALTER COLUMN base_location DROP NOT NULL;
ALTER TABLE catalog_token DROP CONSTRAINT catalog_token_kind_check;
ALTER TABLE catalog_token ADD CONSTRAINT catalog_token_kind_check CHECK (kind IN ('reader', 'job', 'admin'));
"""

DOWNGRADE = """
DELETE FROM catalog_token WHERE kind = 'admin';
ALTER TABLE catalog_token DROP CONSTRAINT catalog_token_kind_check;
ALTER TABLE catalog_token ADD CONSTRAINT catalog_token_kind_check CHECK (kind IN ('reader', 'job'));
DELETE FROM catalog_pending WHERE base_location IS NULL;
ALTER TABLE catalog_pending ALTER COLUMN base_location SET NOT NULL;
DROP TABLE job_session;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
