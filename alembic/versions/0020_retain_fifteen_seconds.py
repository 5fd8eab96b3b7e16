"""A snapshot's default retention: 15 seconds, not a minute (docs/maintenance.md, "Policies").

What readers use is protected whatever its age (leases, job progress, the read window, tags,
staged sessions); ``retain`` only keeps time travel to unprotected snapshots. At 1-s barriers a
minute of them made every commit and load pay for 60 snapshots, and the table grew for a
minute before it was flat; 15 s of them: 15, flat from the 15th second.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

VIEW = """
CREATE OR REPLACE VIEW maintenance_policies AS
SELECT t.table_id, t.name AS table_name,
       coalesce(p.enabled, true)                      AS enabled,
       coalesce(p.retain, interval '{retain}')        AS retain,
       coalesce(p.retain_last, 10)                    AS retain_last,
       coalesce(p.target_file_size, 134217728)        AS target_file_size,
       coalesce(p.compact_min_files, 20)              AS compact_min_files,
       coalesce(p.max_manifests, 20)                  AS max_manifests,
       coalesce(p.orphan_grace, interval '3 days')    AS orphan_grace,
       coalesce(p.metadata_grace, interval '10 minutes') AS metadata_grace,
       (SELECT coalesce(jsonb_agg(k ORDER BY k), '[]') FROM jsonb_each(to_jsonb(p)) AS e(k, v)
        WHERE v <> 'null' AND k NOT IN ('table_id', 'updated_at')) AS own
FROM managed_table t LEFT JOIN maintenance_policy p USING (table_id);
"""


def upgrade() -> None:
    op.execute(VIEW.format(retain="15 seconds"))


def downgrade() -> None:
    op.execute(VIEW.format(retain="1 minute"))
