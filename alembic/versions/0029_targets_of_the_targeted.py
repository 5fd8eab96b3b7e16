"""Targets computed for the tables that have one.

``table_targets`` ranked every table's inherited targets (a ``DISTINCT ON`` over every table
joined to the inherited ones): ~90 ms at 100,000 tables, paid twice by each of the status
page's polls (its list and ``table_versions``), though a lake has targets on a few tables. Now
``targeted_tables`` ranks only the tables with an effective target (their own, or inherited from
a table downstream), and ``table_targets`` is every table joined to it: the same rows, and a
query for a few tables probes the few.

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-28
"""

import re
from importlib import util
from pathlib import Path

from psycopg import sql

from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

UPGRADE = """
-- The tables with an effective target: their own, else the lowest of the tables downstream
-- that declare one (through the jobs between), with the table it comes from.
CREATE VIEW targeted_tables AS
WITH RECURSIVE inherited (table_id, from_id, target_lag) AS (
    SELECT t.table_id, t.table_id, t.target_lag FROM managed_table t WHERE t.target_lag IS NOT NULL
  UNION
    SELECT s.table_id, i.from_id, i.target_lag
    FROM inherited i
    JOIN job_sink k ON k.table_id = i.table_id
    JOIN job_source s ON s.job_id = k.job_id
    JOIN managed_table u ON u.table_id = s.table_id AND u.target_lag IS NULL
)
SELECT DISTINCT ON (i.table_id) i.table_id, i.target_lag AS effective_target_lag, f.name AS target_from
FROM inherited i
LEFT JOIN managed_table f ON f.table_id = i.from_id
ORDER BY i.table_id, i.target_lag, f.name;

CREATE OR REPLACE VIEW table_targets AS
SELECT t.name AS table_name, t.table_id, t.target_lag, e.effective_target_lag, e.target_from
FROM managed_table t
LEFT JOIN targeted_tables e ON e.table_id = t.table_id;

CREATE INDEX managed_table_target_idx ON managed_table (table_id) WHERE target_lag IS NOT NULL;
"""


def _previous() -> str:
    """0015's table_targets, verbatim."""
    path = Path(__file__).with_name("0015_declared_freshness.py")
    spec = util.spec_from_file_location(path.stem, path)
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    view = re.search(r"CREATE VIEW table_targets AS.*?;\n", module.UPGRADE, re.S).group(0)
    return view.replace("CREATE VIEW", "CREATE OR REPLACE VIEW")


# the roles that read the views (readers, job roles): they read the new one too
_VIEW_ROLES = """
SELECT r.rolname FROM pg_roles r
WHERE NOT r.rolsuper AND r.oid <> (SELECT nspowner FROM pg_namespace WHERE nspname = current_schema())
  AND has_table_privilege(r.oid, 'table_targets', 'SELECT')
"""


def upgrade() -> None:
    roles = [r[0] for r in op.get_bind().exec_driver_sql(_VIEW_ROLES).fetchall()]
    op.execute(UPGRADE)
    for role in roles:
        op.execute(f"GRANT SELECT ON targeted_tables TO {sql.Identifier(role).as_string(None)}")


def downgrade() -> None:
    op.execute(_previous())
    op.execute("DROP VIEW targeted_tables")
    op.execute("DROP INDEX managed_table_target_idx")
