"""Readers and job roles see the views, never the base tables.

Up to 0008 ``db grant-reader``/``grant-job`` granted ``SELECT ON ALL TABLES``: a reader could
read token and session hashes, other jobs' grants and the staged commits of multi-sink jobs
(``catalog_pending``: a way around "all sinks or none"). Now a role gets SELECT on the views
(and ``alembic_version``, which every client checks) and EXECUTE on its functions; what the library reads as such a role
goes through those views (a read-only projection of each table that is not secret; a job's
input ranges only to the roles granted that job) or through SECURITY DEFINER functions. Only
the admin (the schema owner) reads base tables. This revision takes back what earlier grants gave and gives the
views instead; the views a role reads run with their owner's rights.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23
"""

from psycopg import sql

from alembic import context, op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# table_versions as 0007 defined it, S(T, now) read by {current} (0007: snapshot_at, as the caller).
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
LEFT JOIN LATERAL {current} c ON true;
"""
CURRENT_0007 = "snapshot_at(t.table_id, 9223372036854775807)"

# The model's state as read-only views (each a projection of one table, inlined by the planner):
# what the library reads, whichever role it runs as. Not here: catalog_token, catalog_session,
# catalog_pending, job_grant, barrier_clock, revision (the admin's alone).
VIEWS = """
CREATE VIEW barriers AS SELECT barrier, issued_at, issued_by FROM barrier;
CREATE VIEW jobs AS SELECT * FROM job;
CREATE VIEW job_source_tables AS SELECT * FROM job_source;
CREATE VIEW job_sink_tables AS SELECT * FROM job_sink;
CREATE VIEW managed_tables AS SELECT * FROM managed_table;
CREATE VIEW table_commits AS SELECT * FROM table_commit;
CREATE VIEW table_completions AS SELECT * FROM table_completion;
CREATE VIEW expired_snapshots AS SELECT * FROM expired_snapshot;
CREATE VIEW settings AS SELECT key, value FROM setting;
CREATE VIEW leases AS SELECT * FROM lease;
CREATE VIEW lease_snapshots AS SELECT * FROM lease_snapshot;
-- A job's recorded input ranges are its own: the admin and roles granted the job see them.
CREATE VIEW input_ranges AS SELECT * FROM input_range WHERE caller_acts_for(job_name);

-- Views call functions with the caller's rights: what they read must be the owner's to read.
ALTER FUNCTION caller_acts_for(text) SECURITY DEFINER SET search_path = {search_path};
CREATE FUNCTION current_commit(p_table_id bigint) RETURNS TABLE (snapshot_id bigint, recorded_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = {search_path}
AS $$ SELECT snapshot_id, recorded_at FROM snapshot_at(p_table_id, 9223372036854775807) $$;
{table_versions}

-- Resolving a cut reads table_commit: readers call it, so it runs as the owner.
ALTER FUNCTION resolve_cut(text[], bigint, boolean) SECURITY DEFINER;
REVOKE EXECUTE ON FUNCTION resolve_cut(text[], bigint, boolean) FROM PUBLIC;
"""

READABLE = (
    "job_sources",
    "job_sinks",
    "table_versions",
    "topology_edges",
    "consistent_barrier",
    "barrier_delay",
    "job_delay",
    "active_leases",
    "barriers",
    "jobs",
    "job_source_tables",
    "job_sink_tables",
    "managed_tables",
    "table_commits",
    "table_completions",
    "expired_snapshots",
    "settings",
    "leases",
    "lease_snapshots",
    "input_ranges",
    "alembic_version",
)


def _grantees(schema: str) -> list[str]:
    """Roles (other than the owner) that were granted anything on the schema's tables."""
    bind = op.get_bind()
    rows = bind.exec_driver_sql(
        "SELECT DISTINCT g.grantee FROM information_schema.role_table_grants g "
        "JOIN pg_namespace n ON n.nspname = g.table_schema "
        "WHERE g.table_schema = %(schema)s AND g.grantee <> pg_get_userbyid(n.nspowner) "
        "AND g.grantee <> 'PUBLIC' ORDER BY 1",
        {"schema": schema},
    ).fetchall()
    return [r[0] for r in rows]


def upgrade() -> None:
    schema = context.config.attributes["schema"]
    s = sql.Identifier(schema)
    grantees = _grantees(schema)
    op.execute(
        VIEWS.format(
            search_path=f"{s.as_string(None)}, pg_temp",
            table_versions=TABLE_VERSIONS.format(current="current_commit(t.table_id)"),
        )
    )
    for role in grantees:
        r = sql.Identifier(role)
        op.execute(sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM {}").format(s, r).as_string(None))
        for relation in READABLE:
            op.execute(sql.SQL("GRANT SELECT ON {}.{} TO {}").format(s, sql.Identifier(relation), r).as_string(None))
        op.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {}.resolve_cut TO {}").format(s, r).as_string(None))


def downgrade() -> None:
    schema = context.config.attributes["schema"]
    s = sql.Identifier(schema)
    grantees = _grantees(schema)
    op.execute("GRANT EXECUTE ON FUNCTION resolve_cut(text[], bigint, boolean) TO PUBLIC")
    op.execute("ALTER FUNCTION resolve_cut(text[], bigint, boolean) SECURITY INVOKER")
    op.execute(TABLE_VERSIONS.format(current=CURRENT_0007))
    op.execute("DROP FUNCTION current_commit(bigint)")
    op.execute("ALTER FUNCTION caller_acts_for(text) SECURITY INVOKER RESET search_path")
    for view in (
        "input_ranges",
        "lease_snapshots",
        "leases",
        "settings",
        "expired_snapshots",
        "table_completions",
        "table_commits",
        "managed_tables",
        "job_sink_tables",
        "job_source_tables",
        "jobs",
        "barriers",
    ):
        op.execute(f"DROP VIEW {view}")
    for role in grantees:
        op.execute(
            sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(s, sql.Identifier(role)).as_string(None)
        )
