"""Names with dots (DESIGN.md, "The server on a network": names), and views.

A namespace level or a table name may hold a '.', as the REST spec allows. The SQL catalog keeps
a namespace in one column, its levels joined by '.', so a '.' inside a level is stored as ``%2E``
(and '%' as ``%25``); icebarrier writes names with such parts quoted in backticks
(``lake.`new.db`.`ta.ble```, a backtick doubled), as Spark SQL quotes identifiers.

- ``catalog_table_name(catalog, namespace, table)``: the managed table a row of the SQL catalog
  (its namespace as stored) would be, as the row-level security compares it: a part of letters,
  digits and '_' lower-cased, as before (a job may not write ``RLS.B`` beside another job's
  ``rls.b``: engines that match names case-insensitively would read one for the other), any
  other part quoted as ``str(TableName)`` quotes it.
- The row-level security of the catalog's pointer table (``may_write_catalog_table``,
  ``check_catalog_write``) names the table that way, so a managed table with a dotted name is
  protected like any other.

And views (the REST spec's view endpoints): a view is a row of ``iceberg_tables`` with
``iceberg_type = 'VIEW'``, as Iceberg's JDBC catalog stores it. ``catalog_load`` reads a table's
pointer only from a table's row, so a load of a view's name as a table finds no table.

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-27
"""

import importlib.util
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

NAME = """
CREATE FUNCTION quote_name_part(p_part text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_part ~ '^[A-Za-z_][A-Za-z0-9_]*$' THEN lower(p_part)
                ELSE '`' || replace(p_part, '`', '``') || '`' END
$$;

-- %2E is replaced first: in an escaped level every '%' starts %2E or %25, so neither replace
-- can meet what the other made.
CREATE FUNCTION catalog_table_name(p_catalog text, p_namespace text, p_table text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT quote_name_part(p_catalog) || '.'
        || (SELECT string_agg(quote_name_part(replace(replace(l, '%2E', '.'), '%25', '%')), '.' ORDER BY n)
            FROM unnest(string_to_array(p_namespace, '.')) WITH ORDINALITY AS u(l, n))
        || '.' || quote_name_part(p_table)
$$;
"""

RLS = """
CREATE OR REPLACE FUNCTION may_write_catalog_table(p_catalog text, p_namespace text, p_table text) RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    RETURN caller_is_admin() OR NOT EXISTS (
        SELECT 1 FROM managed_table m
        WHERE m.name = {name}
          AND NOT EXISTS (SELECT 1 FROM job_sink k JOIN job j USING (job_id)
                          WHERE k.table_id = m.table_id AND j.active AND caller_acts_for(j.name)));
END $$;

CREATE OR REPLACE FUNCTION check_catalog_write(p_catalog text, p_namespace text, p_table text) RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_name text := {name};
    v_writer text;
BEGIN
    IF may_write_catalog_table(p_catalog, p_namespace, p_table) THEN
        RETURN true;
    END IF;
    SELECT j.name INTO v_writer FROM managed_table m JOIN job_sink k USING (table_id) JOIN job j USING (job_id)
    WHERE m.name = v_name AND j.active;
    PERFORM fail('IB030', format('role %s may not commit to %s: it is %s; a job role commits only to its own '
                                 'job''s sinks', session_user, v_name,
                                 coalesce('written by job ' || v_writer, 'managed by icebarrier without a writer')),
                 jsonb_build_object('role', session_user, 'action', 'commit to ' || v_name, 'job', v_writer));
    RETURN false;
END $$;
"""

NEW_NAME = "catalog_table_name(p_catalog, p_namespace, p_table)"
OLD_NAME = "lower(p_catalog || '.' || p_namespace || '.' || p_table)"


ALL_ROWS = "'WHERE catalog_name = $1 AND table_namespace = $2 AND table_name = $3', p_catalog_schema)"
TABLE_ROWS = (
    "'WHERE catalog_name = $1 AND table_namespace = $2 AND table_name = $3 "
    "AND coalesce(iceberg_type, ''TABLE'') = ''TABLE''', p_catalog_schema)"
)
LOAD_SIGNATURE = "catalog_load(text, text, text, text, text, text, text, text, bigint, text, integer)"


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def _catalog_load(rows: str) -> str:
    """0024's ``catalog_load`` (0022's, returning the token's reach), reading ``rows``."""
    path = Path(__file__).with_name("0024_grants.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    earlier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(earlier)
    text = earlier._catalog_load_0022()
    for old, new in (*earlier._EDITS, (ALL_ROWS, rows)):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return f"DROP FUNCTION {LOAD_SIGNATURE};\n" + text.format(search_path=_search_path())


def upgrade() -> None:
    op.execute(NAME)
    op.execute(RLS.format(search_path=_search_path(), name=NEW_NAME))
    op.execute(_catalog_load(TABLE_ROWS))


def downgrade() -> None:
    op.execute(_catalog_load(ALL_ROWS))
    op.execute(RLS.format(search_path=_search_path(), name=OLD_NAME))
    op.execute("DROP FUNCTION catalog_table_name(text, text, text);\nDROP FUNCTION quote_name_part(text);")
