"""The clock's barrier, issued once however many ask for it.

``icebarrier schedule`` read when the next barrier was due, then issued one unconditionally. A
root job asking for the next barrier may issue the clock's barrier too (``issue_barrier_if_due``),
and since 0027 an issuing transaction runs the first skip wave, so it commits ~0.1 s after it
took the clock at 2,000 jobs. A schedule that read "due" inside that window waited for the row
lock and issued a second barrier right behind the job's: 1.4–1.5 barriers a second at 1-s
barriers (benchmarks/scale.py), each with its wave. ``issue_due_barrier`` is the admin's clock
rule, decided under the clock's row lock as the jobs' is: one barrier per interval between them.

Revision ID: 0030
Revises: 0029
Create Date: 2026-11-28
"""

from psycopg import sql

from alembic import context, op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE FUNCTION issue_due_barrier(p_issued_by text) RETURNS SETOF barrier
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_admin('issue the clock''s barriers');
    RETURN QUERY SELECT * FROM tick_barrier(p_issued_by, (SELECT value::bigint * 1000 FROM setting
                                                          WHERE key = 'barrier_interval_ms'));
    IF FOUND THEN  -- a barrier was issued: the first wave, over every job
        PERFORM skip_unchanged();
    END IF;
END $$;

REVOKE EXECUTE ON FUNCTION issue_due_barrier(text) FROM PUBLIC;
"""


def upgrade() -> None:
    search_path = f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"
    op.execute(UPGRADE.format(search_path=search_path))


def downgrade() -> None:
    op.execute("DROP FUNCTION issue_due_barrier(text)")
