"""Push, not poll (DESIGN.md, "Cost of waiting"): the control plane tells waiting jobs when
something they may wait for happened, on channel ``icebarrier.<schema>``:

- ``barrier <B>``: barrier B was issued (root jobs wait for it);
- ``watermark <B> <table>``: a managed table's watermark moved to B (a job completed,
  skipped, coalesced or published a barrier; a revision rewound it): the jobs reading the
  table wait for it;
- ``jobs``: a job was registered, replaced or unregistered (plans may change: everyone looks
  again).

Postgres delivers a notification when (and only if) the transaction that raised it commits;
a listener that was disconnected missed some, so it plans again once on reconnecting.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-24
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE FUNCTION notify_barrier_issued() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('icebarrier.' || TG_TABLE_SCHEMA, 'barrier ' || NEW.barrier);
    RETURN NULL;
END $$;
CREATE TRIGGER barrier_issued AFTER INSERT ON barrier
    FOR EACH ROW EXECUTE FUNCTION notify_barrier_issued();

CREATE FUNCTION notify_watermark_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('icebarrier.' || TG_TABLE_SCHEMA, 'watermark ' || coalesce(NEW.watermark::text, '-') || ' ' || NEW.name);
    RETURN NULL;
END $$;
CREATE TRIGGER watermark_moved AFTER UPDATE OF watermark ON managed_table
    FOR EACH ROW WHEN (NEW.watermark IS DISTINCT FROM OLD.watermark) EXECUTE FUNCTION notify_watermark_moved();

CREATE FUNCTION notify_jobs_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('icebarrier.' || TG_TABLE_SCHEMA, 'jobs');
    RETURN NULL;
END $$;
CREATE TRIGGER jobs_changed AFTER INSERT OR UPDATE OF active OR DELETE ON job
    FOR EACH STATEMENT EXECUTE FUNCTION notify_jobs_changed();
CREATE TRIGGER job_sources_changed AFTER INSERT OR DELETE ON job_source
    FOR EACH STATEMENT EXECUTE FUNCTION notify_jobs_changed();
"""

DOWNGRADE = """
DROP TRIGGER job_sources_changed ON job_source;
DROP TRIGGER jobs_changed ON job;
DROP FUNCTION notify_jobs_changed();
DROP TRIGGER watermark_moved ON managed_table;
DROP FUNCTION notify_watermark_moved();
DROP TRIGGER barrier_issued ON barrier;
DROP FUNCTION notify_barrier_issued();
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
