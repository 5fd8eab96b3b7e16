"""Revisions (cascade roll-back to a barrier) and compaction/revision snapshots in the map.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# table_versions' current snapshot must skip revoked commits after this migration.
TABLE_VERSIONS = """
CREATE OR REPLACE VIEW table_versions AS
SELECT t.name AS table_name,
       CASE WHEN w.job_id IS NULL THEN 'unowned'
            WHEN EXISTS (SELECT 1 FROM job_source s WHERE s.job_id = w.job_id) THEN 'intermediate'
            ELSE 'root' END                                    AS table_kind,
       j.name                                                  AS writer_job,
       t.start_barrier                                         AS start_barrier,
       t.watermark                                             AS watermark_barrier,
       b.issued_at                                             AS watermark_issued_at,
       c.snapshot_id                                           AS current_snapshot_id,
       c.recorded_at                                           AS last_commit_at,
       now() - b.issued_at                                     AS freshness,
       (SELECT count(*) FROM barrier x
         WHERE x.barrier > coalesce(t.watermark,
               (extract(epoch FROM t.created_at) * 1000000)::bigint)) AS barriers_behind
FROM managed_table t
LEFT JOIN job_sink w ON w.table_id = t.table_id
LEFT JOIN job j ON j.job_id = w.job_id
LEFT JOIN barrier b ON b.barrier = t.watermark
LEFT JOIN LATERAL (
    SELECT snapshot_id, recorded_at FROM table_commit c
    WHERE c.table_id = t.table_id{commit_filter}
    ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1) c ON true;
"""

UPGRADE = """
CREATE TABLE revision (
    revision_id bigint GENERATED ALWAYS AS IDENTITY CONSTRAINT revision_pkey PRIMARY KEY,
    root_table  text        NOT NULL,
    to_barrier  bigint      NOT NULL CONSTRAINT revision_barrier_fkey REFERENCES barrier,
    state       text        NOT NULL DEFAULT 'applying'
                CONSTRAINT revision_state_check CHECK (state IN ('applying', 'done')),
    plan        jsonb       NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);

-- Set while a revision is being applied to the table: its writer may not complete barriers.
ALTER TABLE managed_table
    ADD COLUMN revision_id bigint CONSTRAINT managed_table_revision_fkey REFERENCES revision;

-- Commits undone by a revision stay for audit, marked with the revision that undid them.
ALTER TABLE table_commit
    ADD COLUMN revoked_by bigint CONSTRAINT table_commit_revoked_fkey REFERENCES revision,
    DROP CONSTRAINT table_commit_operation_check,
    ADD CONSTRAINT table_commit_operation_check CHECK (operation IN ('data', 'compaction', 'revision'));
DROP INDEX table_commit_one_data_commit;
CREATE UNIQUE INDEX table_commit_one_data_commit ON table_commit (table_id, barrier)
    WHERE operation = 'data' AND revoked_by IS NULL;
DROP INDEX table_commit_at_barrier;
CREATE INDEX table_commit_at_barrier ON table_commit (table_id, barrier DESC, commit_id DESC)
    WHERE revoked_by IS NULL;

"""

DOWNGRADE = """
DELETE FROM table_commit WHERE revoked_by IS NOT NULL OR operation = 'revision';
DROP INDEX table_commit_at_barrier;
CREATE INDEX table_commit_at_barrier ON table_commit (table_id, barrier DESC, commit_id DESC);
DROP INDEX table_commit_one_data_commit;
CREATE UNIQUE INDEX table_commit_one_data_commit ON table_commit (table_id, barrier) WHERE operation = 'data';
ALTER TABLE table_commit
    DROP COLUMN revoked_by,
    DROP CONSTRAINT table_commit_operation_check,
    ADD CONSTRAINT table_commit_operation_check CHECK (operation IN ('data', 'compaction'));
ALTER TABLE managed_table DROP COLUMN revision_id;
DROP TABLE revision;
"""


def upgrade() -> None:
    op.execute(UPGRADE)
    op.execute(TABLE_VERSIONS.format(commit_filter=" AND c.revoked_by IS NULL"))


def downgrade() -> None:
    op.execute(TABLE_VERSIONS.format(commit_filter=""))
    op.execute(DOWNGRADE)
