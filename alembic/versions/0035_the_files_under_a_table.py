"""The files under a table, as the maintenance service last counted them (issue 67).

- ``maintenance_table`` gains ``metadata_files`` and ``data_files_under`` (the files under the
  table's metadata folder and the rest of its location, after its last orphan removal) and
  ``orphans_checked_at`` (when that removal listed them); ``table_maintenance`` shows them, so
  ``/metrics`` and ``table show`` say a table's growth between two looks at its files.
- The least ``metadata_grace`` is 2 minutes, was 1: the metadata grace now covers manifests and
  manifest lists too, and a commit on a managed table may retry (keeping the manifests it wrote
  first) for up to 2 minutes (``commit.retry.total-timeout-ms``). Tables set below it get it.

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-01
"""

import importlib.util
from pathlib import Path

from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None

COLUMNS = ", s.metadata_files, s.data_files_under, s.orphans_checked_at"

UPGRADE = """
ALTER TABLE maintenance_table ADD COLUMN metadata_files integer, ADD COLUMN data_files_under integer,
                              ADD COLUMN orphans_checked_at timestamptz;
UPDATE maintenance_policy SET metadata_grace = interval '2 minutes' WHERE metadata_grace < interval '2 minutes';
ALTER TABLE maintenance_policy DROP CONSTRAINT maintenance_policy_metadata_grace;
ALTER TABLE maintenance_policy ADD CONSTRAINT maintenance_policy_metadata_grace
    CHECK (metadata_grace >= interval '2 minutes');
"""

DOWNGRADE = """
ALTER TABLE maintenance_policy DROP CONSTRAINT maintenance_policy_metadata_grace;
ALTER TABLE maintenance_policy ADD CONSTRAINT maintenance_policy_metadata_grace
    CHECK (metadata_grace >= interval '1 minute');
ALTER TABLE maintenance_table DROP COLUMN metadata_files, DROP COLUMN data_files_under,
                              DROP COLUMN orphans_checked_at;
"""


def _0023():
    """0023's module (alembic/ is not a package): its view, and the roles granted it."""
    path = Path(__file__).with_name("0023_every_table_maintained.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _view() -> str:
    """0023's ``table_maintenance``, as CREATE OR REPLACE (new columns may only come last)."""
    text = _0023()._views_and_functions(both_kinds=True)
    start = text.index("CREATE VIEW table_maintenance AS")
    end = text.index(";", start)
    return "CREATE OR REPLACE" + text[start + len("CREATE") : end]


def upgrade() -> None:
    op.execute(UPGRADE)
    view = _view()
    last = "FROM maintenance_policies p LEFT JOIN maintenance_table s USING (table_id)"
    assert view.count(last) == 1, view
    op.execute(view.replace(f"\n{last}", f"{COLUMNS}\n{last}") + ";")


def downgrade() -> None:
    earlier = _0023()
    roles = [r[0] for r in op.get_bind().exec_driver_sql(earlier._VIEW_ROLES).fetchall()]
    op.execute("DROP VIEW table_maintenance;")  # fewer columns: not a replace
    op.execute(DOWNGRADE)
    op.execute(_view().replace("CREATE OR REPLACE VIEW", "CREATE VIEW") + ";")
    earlier._grant_views(roles)
