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
"""

DOWNGRADE = """
DROP VIEW table_maintenance;
DROP VIEW maintenance_policies;
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


def _earlier(file_name: str):
    """An earlier revision's module (alembic/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name(file_name)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _protection(*, whole_floor: bool) -> str:
    """0017's ``protection``; with ``whole_floor``, every commit at the floor's barrier kept."""
    text = _earlier("0017_read_committed_per_client.py")._protection(moments=True)
    assert text.count(_WINDOW) == 1
    return text.replace(_WINDOW, _WINDOW_WHOLE_FLOOR) if whole_floor else text


# 0020's policies view and 0019's table_maintenance view and functions, over both kinds of table
_TABLES = "FROM managed_table t LEFT JOIN maintenance_policy p USING (table_id);"
_BOTH_KINDS = (
    "FROM (SELECT table_id, name, true AS managed FROM managed_table\n"
    "      UNION ALL\n"
    "      SELECT u.table_id, u.name, false FROM unmanaged_table u\n"
    "      WHERE NOT EXISTS (SELECT 1 FROM managed_table m WHERE m.name = u.name)) t\n"
    "LEFT JOIN maintenance_policy p USING (table_id);"
)
_EDITS = (
    ("SELECT t.table_id, t.name AS table_name,", "SELECT t.table_id, t.name AS table_name, t.managed,"),
    (_TABLES, _BOTH_KINDS),
    (
        "        FROM maintenance_action a WHERE a.table_id = p.table_id) AS actions\n",
        "        FROM maintenance_action a WHERE a.table_id = p.table_id) AS actions,\n       p.managed\n",
    ),
    ("    v_table bigint;\n", "    v_table bigint := maintained_table_id(p_table);\n"),
    (
        "    SELECT table_id INTO v_table FROM managed_table WHERE name = p_table;\n    IF NOT FOUND THEN",
        "    IF v_table IS NULL THEN",
    ),
    (
        "    FROM managed_table t WHERE t.name = p_table\n",
        "    FROM (SELECT maintained_table_id(p_table) AS table_id) t WHERE t.table_id IS NOT NULL\n",
    ),
)


def _views_and_functions(*, both_kinds: bool) -> str:
    """The views and the two functions as 0019 and 0020 left them; with ``both_kinds``, over managed
    and unmanaged tables."""
    text_0019 = _earlier("0019_lake_maintains_itself.py").UPGRADE
    text = text_0019[text_0019.index("CREATE VIEW table_maintenance AS") :]
    text = _earlier("0020_retain_fifteen_seconds.py").VIEW.format(retain="15 seconds").replace(
        "CREATE OR REPLACE VIEW", "CREATE VIEW"
    ) + text.format(search_path=_search_path())
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("REVOKE EXECUTE")) + "\n"
    text = text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")  # their grants stay
    if both_kinds:
        for old, new in _EDITS:
            assert old in text, old
            text = text.replace(old, new)
    return text


def upgrade() -> None:
    op.execute(_protection(whole_floor=True))
    bind = op.get_bind()
    roles = [r[0] for r in bind.exec_driver_sql(_VIEW_ROLES).fetchall()]
    sequence = bind.exec_driver_sql("SELECT pg_get_serial_sequence('managed_table', 'table_id')").scalar()
    op.execute(UPGRADE.format(search_path=_search_path(), sequence=sequence.replace("'", "''")))
    op.execute(_views_and_functions(both_kinds=True))
    _grant_views(roles)


def downgrade() -> None:
    op.execute(_protection(whole_floor=False))
    bind = op.get_bind()
    roles = [r[0] for r in bind.exec_driver_sql(_VIEW_ROLES).fetchall()]
    op.execute(DOWNGRADE)
    op.execute(_views_and_functions(both_kinds=False))
    _grant_views(roles)
