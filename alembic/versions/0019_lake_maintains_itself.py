"""The lake maintains itself (DESIGN.md, "The lake maintains itself").

- ``maintenance_policy``: per table, what the maintenance service keeps and when it acts; a
  column left NULL takes the default. The defaults are written once, in the view
  ``maintenance_policies`` (every managed table with its effective policy): they hold a
  pipeline at 1-s barriers flat (docs/maintenance.md says why each is what it is). Set by the
  admin (``set_maintenance_policy``, audited).
- ``maintenance_action``: per table and action (expire, compact, rewrite-manifests,
  remove-orphans), the last run (when, its result: done, gave-way or failed, what it did) and
  how many of each result so far. Written with ``record_maintenance``, which also appends the
  action to the audit trail.
- ``maintenance_table``: per table, what the service saw at its last look (snapshots, data
  files, small files, manifests, metadata-file size) and what it will do next.
- ``maintenance_state``: who maintains (the holder of the service's advisory lock), since when.
- ``table_maintenance`` (view, for readers, beside ``maintenance_policies``: the status page, ``/metrics``, ``table show``):
  the three joined per table.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-26
"""

from psycopg import sql

from alembic import context, op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE maintenance_policy (
    table_id          bigint      CONSTRAINT maintenance_policy_pkey PRIMARY KEY
                                  REFERENCES managed_table (table_id) ON DELETE CASCADE,
    enabled           boolean,
    retain            interval    CONSTRAINT maintenance_policy_retain CHECK (retain >= interval '0'),
    retain_last       integer     CONSTRAINT maintenance_policy_retain_last CHECK (retain_last >= 1),
    target_file_size  bigint      CONSTRAINT maintenance_policy_target_file_size CHECK (target_file_size >= 1048576),
    compact_min_files integer     CONSTRAINT maintenance_policy_compact_min_files CHECK (compact_min_files >= 2),
    max_manifests     integer     CONSTRAINT maintenance_policy_max_manifests CHECK (max_manifests >= 2),
    orphan_grace      interval    CONSTRAINT maintenance_policy_orphan_grace CHECK (orphan_grace >= interval '1 minute'),
    metadata_grace    interval    CONSTRAINT maintenance_policy_metadata_grace CHECK (metadata_grace >= interval '1 minute'),
    updated_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE maintenance_action (
    table_id        bigint      NOT NULL REFERENCES managed_table (table_id) ON DELETE CASCADE,
    action          text        NOT NULL CONSTRAINT maintenance_action_kind
                                CHECK (action IN ('expire', 'compact', 'rewrite-manifests', 'remove-orphans')),
    last_at         timestamptz NOT NULL,
    last_result     text        NOT NULL CONSTRAINT maintenance_action_result CHECK (last_result IN ('done', 'gave-way', 'failed')),
    last_detail     jsonb       NOT NULL DEFAULT '{{}}',
    done_total      bigint      NOT NULL DEFAULT 0,
    gave_way_total  bigint      NOT NULL DEFAULT 0,
    failed_total    bigint      NOT NULL DEFAULT 0,
    CONSTRAINT maintenance_action_pkey PRIMARY KEY (table_id, action)
);

CREATE TABLE maintenance_table (
    table_id        bigint      CONSTRAINT maintenance_table_pkey PRIMARY KEY
                                REFERENCES managed_table (table_id) ON DELETE CASCADE,
    checked_at      timestamptz NOT NULL,
    snapshots       integer     NOT NULL,
    data_files      integer     NOT NULL,
    small_files     integer     NOT NULL,
    manifests       integer     NOT NULL,
    metadata_bytes  bigint      NOT NULL,
    next            text        NOT NULL
);

CREATE TABLE maintenance_state (
    singleton   boolean     CONSTRAINT maintenance_state_pkey PRIMARY KEY DEFAULT true CHECK (singleton),
    holder      text        NOT NULL,
    started_at  timestamptz NOT NULL,
    seen_at     timestamptz NOT NULL,
    plan        jsonb       NOT NULL DEFAULT '[]'
);
REVOKE ALL ON maintenance_policy, maintenance_action, maintenance_table, maintenance_state FROM PUBLIC;

-- Every managed table's effective policy: the defaults are these, and only these.
CREATE VIEW maintenance_policies AS
SELECT t.table_id, t.name AS table_name,
       coalesce(p.enabled, true)                      AS enabled,
       coalesce(p.retain, interval '1 minute')        AS retain,
       coalesce(p.retain_last, 10)                    AS retain_last,
       coalesce(p.target_file_size, 134217728)        AS target_file_size,
       coalesce(p.compact_min_files, 20)              AS compact_min_files,
       coalesce(p.max_manifests, 20)                  AS max_manifests,
       coalesce(p.orphan_grace, interval '3 days')    AS orphan_grace,
       coalesce(p.metadata_grace, interval '10 minutes') AS metadata_grace,
       (SELECT coalesce(jsonb_agg(k ORDER BY k), '[]') FROM jsonb_each(to_jsonb(p)) AS e(k, v)
        WHERE v <> 'null' AND k NOT IN ('table_id', 'updated_at')) AS own
FROM managed_table t LEFT JOIN maintenance_policy p USING (table_id);

CREATE VIEW table_maintenance AS
SELECT p.table_name, p.enabled, extract(epoch FROM p.retain) AS retain_s, p.retain_last, p.target_file_size,
       p.compact_min_files, p.max_manifests, extract(epoch FROM p.orphan_grace) AS orphan_grace_s,
       extract(epoch FROM p.metadata_grace) AS metadata_grace_s, p.own,
       s.checked_at, s.snapshots, s.data_files, s.small_files, s.manifests, s.metadata_bytes, s.next,
       (SELECT coalesce(jsonb_object_agg(a.action, jsonb_build_object(
                    'at', a.last_at, 'result', a.last_result, 'detail', a.last_detail,
                    'done', a.done_total, 'gave_way', a.gave_way_total, 'failed', a.failed_total)), '{{}}')
        FROM maintenance_action a WHERE a.table_id = p.table_id) AS actions
FROM maintenance_policies p LEFT JOIN maintenance_table s USING (table_id);

CREATE FUNCTION set_maintenance_policy(p_table text, p_policy jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = {search_path} AS $$
DECLARE
    v_table bigint;
    v_was jsonb;
    v_now jsonb;
BEGIN
    SELECT table_id INTO v_table FROM managed_table WHERE name = p_table;
    IF NOT FOUND THEN
        PERFORM fail('IB009', format('table %s is not managed by icebarrier', p_table),
                     jsonb_build_object('table', p_table));
    END IF;
    SELECT to_jsonb(p) - 'table_id' - 'updated_at' INTO v_was FROM maintenance_policy p WHERE table_id = v_table;
    INSERT INTO maintenance_policy AS p (table_id) VALUES (v_table) ON CONFLICT (table_id) DO NOTHING;
    UPDATE maintenance_policy AS p SET
        enabled           = CASE WHEN p_policy ? 'enabled' THEN (p_policy->>'enabled')::boolean ELSE p.enabled END,
        retain            = CASE WHEN p_policy ? 'retain_s' THEN make_interval(secs => (p_policy->>'retain_s')::float8) ELSE p.retain END,
        retain_last       = CASE WHEN p_policy ? 'retain_last' THEN (p_policy->>'retain_last')::int ELSE p.retain_last END,
        target_file_size  = CASE WHEN p_policy ? 'target_file_size' THEN (p_policy->>'target_file_size')::bigint ELSE p.target_file_size END,
        compact_min_files = CASE WHEN p_policy ? 'compact_min_files' THEN (p_policy->>'compact_min_files')::int ELSE p.compact_min_files END,
        max_manifests     = CASE WHEN p_policy ? 'max_manifests' THEN (p_policy->>'max_manifests')::int ELSE p.max_manifests END,
        orphan_grace      = CASE WHEN p_policy ? 'orphan_grace_s' THEN make_interval(secs => (p_policy->>'orphan_grace_s')::float8) ELSE p.orphan_grace END,
        metadata_grace    = CASE WHEN p_policy ? 'metadata_grace_s' THEN make_interval(secs => (p_policy->>'metadata_grace_s')::float8) ELSE p.metadata_grace END,
        updated_at        = now()
    WHERE p.table_id = v_table
    RETURNING to_jsonb(p) - 'table_id' - 'updated_at' INTO v_now;
    IF v_was IS DISTINCT FROM v_now THEN
        PERFORM audit_append('table maintenance', NULL, p_table, NULL, 'done',
                             jsonb_build_object('policy', jsonb_strip_nulls(v_now), 'was', jsonb_strip_nulls(v_was)));
    END IF;
END $$;
REVOKE EXECUTE ON FUNCTION set_maintenance_policy(text, jsonb) FROM PUBLIC;

CREATE FUNCTION record_maintenance(p_table text, p_action text, p_result text, p_detail jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = {search_path} AS $$
BEGIN
    INSERT INTO maintenance_action AS a (table_id, action, last_at, last_result, last_detail,
                                         done_total, gave_way_total, failed_total)
    SELECT t.table_id, p_action, now(), p_result, coalesce(p_detail, '{{}}'),
           (p_result = 'done')::int, (p_result = 'gave-way')::int, (p_result = 'failed')::int
    FROM managed_table t WHERE t.name = p_table
    ON CONFLICT (table_id, action) DO UPDATE SET last_at = EXCLUDED.last_at, last_result = EXCLUDED.last_result,
        last_detail = EXCLUDED.last_detail, done_total = a.done_total + EXCLUDED.done_total,
        gave_way_total = a.gave_way_total + EXCLUDED.gave_way_total, failed_total = a.failed_total + EXCLUDED.failed_total;
    PERFORM audit_append('maintenance ' || p_action, NULL, p_table, NULL, p_result, coalesce(p_detail, '{{}}'));
END $$;
REVOKE EXECUTE ON FUNCTION record_maintenance(text, text, text, jsonb) FROM PUBLIC;
"""

DOWNGRADE = """
DROP FUNCTION record_maintenance(text, text, text, jsonb);
DROP FUNCTION set_maintenance_policy(text, jsonb);
DROP VIEW table_maintenance;
DROP VIEW maintenance_policies;
DROP TABLE maintenance_state;
DROP TABLE maintenance_table;
DROP TABLE maintenance_action;
DROP TABLE maintenance_policy;
"""

# Roles already granted a reader's views see the new one.
_VIEW_ROLES = """
SELECT r.rolname FROM pg_roles r
WHERE NOT r.rolsuper AND r.oid <> (SELECT nspowner FROM pg_namespace WHERE nspname = current_schema())
  AND has_table_privilege(r.oid, 'managed_tables', 'SELECT')
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def upgrade() -> None:
    roles = [r[0] for r in op.get_bind().exec_driver_sql(_VIEW_ROLES).fetchall()]
    op.execute(UPGRADE.format(search_path=_search_path()))
    for role in roles:
        op.execute(f"GRANT SELECT ON maintenance_policies, table_maintenance TO {sql.Identifier(role).as_string(None)}")


def downgrade() -> None:
    op.execute(DOWNGRADE)
