"""How each job computed its barriers: incrementally, or in full and why (DESIGN.md,
"Incremental SQL").

- ``job_computation``: per job, its last computation (barrier, incremental or not, the reason
  when in full, when) and how many of each it made. Written by the job
  (``record_computation``: the job's role, like its heartbeat); readers see it as the view
  ``job_computations`` (``job show``, ``/metrics``).

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26
"""

from psycopg import sql

from alembic import context, op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE job_computation (
    job_id      bigint      CONSTRAINT job_computation_pkey PRIMARY KEY REFERENCES job (job_id) ON DELETE CASCADE,
    barrier     bigint      NOT NULL,
    incremental boolean     NOT NULL,
    reason      text,       -- why in full (NULL when incremental)
    at          timestamptz NOT NULL DEFAULT now(),
    incremental_total bigint NOT NULL DEFAULT 0,
    full_total  bigint      NOT NULL DEFAULT 0,
    CONSTRAINT job_computation_reason CHECK (incremental = (reason IS NULL))
);
REVOKE ALL ON job_computation FROM PUBLIC;
CREATE VIEW job_computations AS
SELECT j.name AS job_name, c.barrier, c.incremental, c.reason, c.at, c.incremental_total, c.full_total
FROM job_computation c JOIN job j USING (job_id) WHERE j.active;

CREATE FUNCTION record_computation(p_job text, p_barrier bigint, p_incremental boolean, p_reason text)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_job(p_job, 'record the computations of');
    INSERT INTO job_computation AS c (job_id, barrier, incremental, reason, incremental_total, full_total)
    SELECT j.job_id, p_barrier, p_incremental, CASE WHEN p_incremental THEN NULL ELSE coalesce(p_reason, '') END,
           p_incremental::int, (NOT p_incremental)::int
    FROM job j WHERE j.name = p_job AND j.active
    ON CONFLICT (job_id) DO UPDATE SET barrier = EXCLUDED.barrier, incremental = EXCLUDED.incremental,
        reason = EXCLUDED.reason, at = now(),
        incremental_total = c.incremental_total + EXCLUDED.incremental_total,
        full_total = c.full_total + EXCLUDED.full_total;
END $$;
REVOKE EXECUTE ON FUNCTION record_computation(text, bigint, boolean, text) FROM PUBLIC;
"""

DOWNGRADE = """
DROP FUNCTION record_computation(text, bigint, boolean, text);
DROP VIEW job_computations;
DROP TABLE job_computation;
"""

# Roles already granted: readers (they read managed_tables) see the new view; job roles (they
# may report what they wait for) may record their computations.
_ROLES = """
SELECT r.rolname,
       has_function_privilege(r.oid, 'set_job_waiting(text, text)', 'EXECUTE') AS job
FROM pg_roles r
WHERE NOT r.rolsuper AND r.oid <> (SELECT nspowner FROM pg_namespace WHERE nspname = current_schema())
  AND has_table_privilege(r.oid, 'managed_tables', 'SELECT')
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def upgrade() -> None:
    roles = op.get_bind().exec_driver_sql(_ROLES).fetchall()
    op.execute(UPGRADE.format(search_path=_search_path()))
    for name, job in roles:
        role = sql.Identifier(name).as_string(None)
        op.execute(f"GRANT SELECT ON job_computations TO {role}")
        if job:
            op.execute(f"GRANT EXECUTE ON FUNCTION record_computation(text, bigint, boolean, text) TO {role}")


def downgrade() -> None:
    op.execute(DOWNGRADE)
