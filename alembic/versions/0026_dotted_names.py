"""Names with dots (DESIGN.md, "The server on a network": names).

A namespace level or a table name may hold a '.', as the REST spec allows. The SQL catalog keeps
a namespace in one column, its levels joined by '.', so a '.' inside a level is stored as ``%2E``
(and '%' as ``%25``); icebarrier writes names with such parts quoted in backticks
(``lake.`new.db`.`ta.ble```, a backtick doubled), as Spark SQL quotes identifiers.

- ``catalog_table_name(catalog, namespace, table)``: the name icebarrier gives a row of the SQL
  catalog (its namespace as stored), as ``TableName.from_sql_catalog`` and ``str`` give it. A
  part other than a lower-case identifier is quoted: the catalog is case-sensitive, so a row
  ``Orders`` is not the managed table ``orders`` (until now both were lower-cased here).
- The row-level security of the catalog's pointer table (``may_write_catalog_table``,
  ``check_catalog_write``) names the table that way, so a managed table with a dotted name is
  protected like any other.

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-27
"""

from psycopg import sql

from alembic import context, op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

NAME = """
CREATE FUNCTION quote_name_part(p_part text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_part ~ '^[a-z_][a-z0-9_]*$' THEN p_part ELSE '`' || replace(p_part, '`', '``') || '`' END
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


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def upgrade() -> None:
    op.execute(NAME)
    op.execute(RLS.format(search_path=_search_path(), name=NEW_NAME))


def downgrade() -> None:
    op.execute(RLS.format(search_path=_search_path(), name=OLD_NAME))
    op.execute("DROP FUNCTION catalog_table_name(text, text, text);\nDROP FUNCTION quote_name_part(text);")
