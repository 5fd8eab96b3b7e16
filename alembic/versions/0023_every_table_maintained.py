"""Every table of the catalog is maintained, managed or not (DESIGN.md, "The lake maintains itself").

- ``unmanaged_table``: the catalog's tables no job writes, as the maintenance service found them
  (``enroll_unmanaged_tables``, at each of its passes; ``table maintenance`` enrolls one at once).
  Their ids come from ``managed_table``'s sequence, so one id names one table in the maintenance
  tables whichever kind it is; a table that becomes managed is the managed one from then on.
- The maintenance tables (policy, actions, what was seen) refer to either kind: their foreign
  keys to ``managed_table`` become triggers that delete a table's rows with it.
- ``maintained_table_id(name)``: the id of a managed or enrolled table (NULL: neither).
- The views ``maintenance_policies`` and ``table_maintenance`` list both kinds, with ``managed``.
- ``protection()``'s read window keeps every commit recorded at the barrier of S(T, floor), not
  only the newest: a second compaction recorded at the barrier of the first (a manifest rewrite
  after a file rewrite) made the first unprotected while a job that had resolved it read it
  (found by `icebarrier check --maintain` once manifest rewrites stopped giving way).

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-27
"""

from psycopg import sql

from alembic import context, op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE unmanaged_table (
    table_id  bigint      CONSTRAINT unmanaged_table_pkey PRIMARY KEY DEFAULT nextval('{sequence}'),
    name      text        NOT NULL CONSTRAINT unmanaged_table_name_key UNIQUE,
    found_at  timestamptz NOT NULL DEFAULT now()
);
REVOKE ALL ON unmanaged_table FROM PUBLIC;

ALTER TABLE maintenance_policy DROP CONSTRAINT maintenance_policy_table_id_fkey;
ALTER TABLE maintenance_action DROP CONSTRAINT maintenance_action_table_id_fkey;
ALTER TABLE maintenance_table DROP CONSTRAINT maintenance_table_table_id_fkey;

CREATE FUNCTION forget_maintenance() RETURNS trigger LANGUAGE plpgsql SET search_path = {search_path} AS $$
BEGIN
    DELETE FROM maintenance_policy WHERE table_id = OLD.table_id;
    DELETE FROM maintenance_action WHERE table_id = OLD.table_id;
    DELETE FROM maintenance_table WHERE table_id = OLD.table_id;
    RETURN NULL;
END $$;
CREATE TRIGGER managed_table_maintenance_forgotten AFTER DELETE ON managed_table
    FOR EACH ROW EXECUTE FUNCTION forget_maintenance();
CREATE TRIGGER unmanaged_table_maintenance_forgotten AFTER DELETE ON unmanaged_table
    FOR EACH ROW EXECUTE FUNCTION forget_maintenance();

CREATE FUNCTION maintained_table_id(p_name text) RETURNS bigint
LANGUAGE sql STABLE SET search_path = {search_path} AS $$
    SELECT coalesce((SELECT table_id FROM managed_table WHERE name = p_name),
                    (SELECT table_id FROM unmanaged_table WHERE name = p_name))
$$;

-- The catalog's unmanaged tables are exactly p_names (those a managed table has are ignored).
CREATE FUNCTION enroll_unmanaged_tables(p_names text[]) RETURNS void
LANGUAGE sql SET search_path = {search_path} AS $$
    DELETE FROM unmanaged_table u
    WHERE u.name <> ALL (p_names) OR EXISTS (SELECT 1 FROM managed_table m WHERE m.name = u.name);
    INSERT INTO unmanaged_table (name)
    SELECT DISTINCT n FROM unnest(p_names) AS n
    WHERE NOT EXISTS (SELECT 1 FROM managed_table m WHERE m.name = n)
    ON CONFLICT (name) DO NOTHING;
$$;
REVOKE EXECUTE ON FUNCTION enroll_unmanaged_tables(text[]) FROM PUBLIC;

CREATE FUNCTION enroll_unmanaged_table(p_name text) RETURNS void
LANGUAGE sql SET search_path = {search_path} AS $$
    INSERT INTO unmanaged_table (name) SELECT p_name
    WHERE NOT EXISTS (SELECT 1 FROM managed_table m WHERE m.name = p_name)
    ON CONFLICT (name) DO NOTHING;
$$;
REVOKE EXECUTE ON FUNCTION enroll_unmanaged_table(text) FROM PUBLIC;

DROP VIEW table_maintenance;
DROP VIEW maintenance_policies;
CREATE VIEW maintenance_policies AS
SELECT t.table_id, t.name AS table_name, t.managed,
       coalesce(p.enabled, true)                      AS enabled,
       coalesce(p.retain, interval '15 seconds')      AS retain,
       coalesce(p.retain_last, 10)                    AS retain_last,
       coalesce(p.target_file_size, 134217728)        AS target_file_size,
       coalesce(p.compact_min_files, 20)              AS compact_min_files,
       coalesce(p.max_manifests, 20)                  AS max_manifests,
       coalesce(p.orphan_grace, interval '3 days')    AS orphan_grace,
       coalesce(p.metadata_grace, interval '10 minutes') AS metadata_grace,
       (SELECT coalesce(jsonb_agg(k ORDER BY k), '[]') FROM jsonb_each(to_jsonb(p)) AS e(k, v)
        WHERE v <> 'null' AND k NOT IN ('table_id', 'updated_at')) AS own
FROM (SELECT table_id, name, true AS managed FROM managed_table
      UNION ALL
      SELECT u.table_id, u.name, false FROM unmanaged_table u
      WHERE NOT EXISTS (SELECT 1 FROM managed_table m WHERE m.name = u.name)) t
LEFT JOIN maintenance_policy p USING (table_id);

CREATE VIEW table_maintenance AS
SELECT p.table_name, p.enabled, extract(epoch FROM p.retain) AS retain_s, p.retain_last, p.target_file_size,
       p.compact_min_files, p.max_manifests, extract(epoch FROM p.orphan_grace) AS orphan_grace_s,
       extract(epoch FROM p.metadata_grace) AS metadata_grace_s, p.own,
       s.checked_at, s.snapshots, s.data_files, s.small_files, s.manifests, s.metadata_bytes, s.next,
       (SELECT coalesce(jsonb_object_agg(a.action, jsonb_build_object(
                    'at', a.last_at, 'result', a.last_result, 'detail', a.last_detail,
                    'done', a.done_total, 'gave_way', a.gave_way_total, 'failed', a.failed_total)), '{{}}')
        FROM maintenance_action a WHERE a.table_id = p.table_id) AS actions,
       p.managed
FROM maintenance_policies p LEFT JOIN maintenance_table s USING (table_id);

CREATE OR REPLACE FUNCTION set_maintenance_policy(p_table text, p_policy jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = {search_path} AS $$
DECLARE
    v_table bigint := maintained_table_id(p_table);
    v_was jsonb;
    v_now jsonb;
BEGIN
    IF v_table IS NULL THEN
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

CREATE OR REPLACE FUNCTION record_maintenance(p_table text, p_action text, p_result text, p_detail jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = {search_path} AS $$
BEGIN
    INSERT INTO maintenance_action AS a (table_id, action, last_at, last_result, last_detail,
                                         done_total, gave_way_total, failed_total)
    SELECT t.table_id, p_action, now(), p_result, coalesce(p_detail, '{{}}'),
           (p_result = 'done')::int, (p_result = 'gave-way')::int, (p_result = 'failed')::int
    FROM (SELECT maintained_table_id(p_table) AS table_id) t WHERE t.table_id IS NOT NULL
    ON CONFLICT (table_id, action) DO UPDATE SET last_at = EXCLUDED.last_at, last_result = EXCLUDED.last_result,
        last_detail = EXCLUDED.last_detail, done_total = a.done_total + EXCLUDED.done_total,
        gave_way_total = a.gave_way_total + EXCLUDED.gave_way_total, failed_total = a.failed_total + EXCLUDED.failed_total;
    PERFORM audit_append('maintenance ' || p_action, NULL, p_table, NULL, p_result, coalesce(p_detail, '{{}}'));
END $$;
"""

DOWNGRADE = """
DROP VIEW table_maintenance;
DROP VIEW maintenance_policies;
DROP FUNCTION record_maintenance(text, text, text, jsonb);
DROP FUNCTION set_maintenance_policy(text, jsonb);
DROP FUNCTION maintained_table_id(text);
DROP FUNCTION enroll_unmanaged_table(text);
DROP FUNCTION enroll_unmanaged_tables(text[]);
DROP TRIGGER managed_table_maintenance_forgotten ON managed_table;
DROP TABLE unmanaged_table;
DROP FUNCTION forget_maintenance();
DELETE FROM maintenance_policy p WHERE NOT EXISTS (SELECT 1 FROM managed_table m WHERE m.table_id = p.table_id);
DELETE FROM maintenance_action p WHERE NOT EXISTS (SELECT 1 FROM managed_table m WHERE m.table_id = p.table_id);
DELETE FROM maintenance_table p WHERE NOT EXISTS (SELECT 1 FROM managed_table m WHERE m.table_id = p.table_id);
ALTER TABLE maintenance_policy ADD CONSTRAINT maintenance_policy_table_id_fkey
    FOREIGN KEY (table_id) REFERENCES managed_table (table_id) ON DELETE CASCADE;
ALTER TABLE maintenance_action ADD CONSTRAINT maintenance_action_table_id_fkey
    FOREIGN KEY (table_id) REFERENCES managed_table (table_id) ON DELETE CASCADE;
ALTER TABLE maintenance_table ADD CONSTRAINT maintenance_table_table_id_fkey
    FOREIGN KEY (table_id) REFERENCES managed_table (table_id) ON DELETE CASCADE;
"""

# Roles already granted a reader's views see the new ones.
_VIEW_ROLES = """
SELECT r.rolname FROM pg_roles r
WHERE NOT r.rolsuper AND r.oid <> (SELECT nspowner FROM pg_namespace WHERE nspname = current_schema())
  AND has_table_privilege(r.oid, 'managed_tables', 'SELECT')
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def _grant_views(roles: list[str]) -> None:
    for role in roles:
        op.execute(f"GRANT SELECT ON maintenance_policies, table_maintenance TO {sql.Identifier(role).as_string(None)}")


# protection()'s read window: commits above the floor barrier, then S(T, floor) alone
_WINDOW = "AND c.barrier > (SELECT b FROM lo) AND c.barrier <= t.watermark"
_WINDOW_WHOLE_FLOOR = (
    "AND c.barrier >= coalesce((SELECT max(f.barrier) FROM table_commit f WHERE f.table_id = t.table_id\n"
    "                                             AND f.revoked_by IS NULL AND f.barrier <= (SELECT b FROM lo)),\n"
    "                                            (SELECT b FROM lo) + 1)\n"
    "                  AND c.barrier <= t.watermark"
)


def _protection(*, whole_floor: bool) -> str:
    """0017's ``protection``; with ``whole_floor``, every commit at the floor's barrier kept."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name("0017_read_committed_per_client.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    earlier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(earlier)
    text = earlier._protection(moments=True)
    assert text.count(_WINDOW) == 1
    return text.replace(_WINDOW, _WINDOW_WHOLE_FLOOR) if whole_floor else text


def upgrade() -> None:
    op.execute(_protection(whole_floor=True))
    bind = op.get_bind()
    roles = [r[0] for r in bind.exec_driver_sql(_VIEW_ROLES).fetchall()]
    sequence = bind.exec_driver_sql("SELECT pg_get_serial_sequence('managed_table', 'table_id')").scalar()
    op.execute(UPGRADE.format(search_path=_search_path(), sequence=sequence.replace("'", "''")))
    _grant_views(roles)


def downgrade() -> None:
    from pathlib import Path

    op.execute(_protection(whole_floor=False))
    bind = op.get_bind()
    roles = [r[0] for r in bind.exec_driver_sql(_VIEW_ROLES).fetchall()]
    op.execute(DOWNGRADE)
    import importlib.util

    for name, formatter in (("0019_lake_maintains_itself.py", "functions"), ("0020_retain_fifteen_seconds.py", "view")):
        path = Path(__file__).with_name(name)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        earlier = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(earlier)
        if formatter == "functions":  # 0019's views and functions (the functions replaced in place)
            text = earlier.UPGRADE[earlier.UPGRADE.index("-- Every managed table's effective policy") :]
            op.execute(text.format(search_path=_search_path()))
        else:
            op.execute(earlier.VIEW.format(retain="15 seconds"))
    _grant_views(roles)
