"""The read-committed moment belongs to the client (its token), not to one access token.

Trino's REST client (Iceberg's OAuth2 manager under Trino's ``session=NONE``) takes a new access
token for every table it loads, so a moment kept per access token gave each table of one Trino
query a moment of its own: a join could read two barriers. The moment now lives on the client's
token row, shared by every access token the client holds, and still moves only after the client
has been quiet for a moment. Independent readers get tokens of their own.

A moment in use is protected from expiry: the read window (``protection()``) reaches down to the
oldest moment of a client that loaded within the last minute. Before, it reached only the newest
valid cut, so a session that chose barrier B and loaded its next table after B' had become valid
could find S(table, B) expired between its own loads.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26
"""

import importlib.util
import re
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

SESSION_CUT = """
CREATE OR REPLACE FUNCTION session_cut(p_token_hash text, p_scope text, p_quiet_ms integer) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_barrier bigint;
BEGIN
    PERFORM require_admin('serve the catalog');
    UPDATE catalog_token t
    SET rc_barrier = CASE WHEN t.rc_scope IS NOT DISTINCT FROM p_scope AND t.rc_barrier IS NOT NULL
                               AND t.rc_loaded_at > clock_timestamp() - make_interval(secs => p_quiet_ms / 1000.0)
                          THEN t.rc_barrier ELSE latest_cut(p_scope) END,
        rc_scope = p_scope, rc_loaded_at = clock_timestamp()
    FROM catalog_session s
    WHERE s.token_hash = p_token_hash AND t.client_id = s.client_id
    RETURNING t.rc_barrier INTO v_barrier;
    RETURN v_barrier;
END $$;
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


# protection()'s lowest protected barrier: also the oldest read-committed moment in use (a client
# that loaded within the last minute; a moment is kept only while loads come less than the
# server's --session-quiet apart)
_LOWEST = "SELECT least(latest_valid(array_agg(m.table_id), NULL, false), (SELECT min(progress) FROM started)) AS b"
_LOWEST_WITH_MOMENTS = (
    "SELECT least(latest_valid(array_agg(m.table_id), NULL, false), (SELECT min(progress) FROM started),\n"
    "                     (SELECT min(ct.rc_barrier) FROM catalog_token ct\n"
    "                      WHERE ct.rc_loaded_at > clock_timestamp() - interval '1 minute')) AS b"
)


def _earlier(file_name: str):
    """An earlier revision's module (alembic/ is not a package)."""
    path = Path(__file__).with_name(file_name)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _session_cut_0008() -> str:
    """0008's ``session_cut`` (a moment per access token), as it created it."""
    upgrade_0008 = _earlier("0008_catalog_tokens.py").UPGRADE
    text = re.search(r"CREATE FUNCTION session_cut\(.*?END \$\$;", upgrade_0008, re.S).group(0)
    return text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION").format(search_path=_search_path())


def _protection(*, moments: bool) -> str:
    """0014's ``protection`` (0010's, first runs counted); with ``moments``, live moments protected."""
    text = _earlier("0014_retries_and_audit.py")._protection(first_runs=True)
    assert text.count(_LOWEST) == 1
    return text.replace(_LOWEST, _LOWEST_WITH_MOMENTS) if moments else text


def upgrade() -> None:
    op.execute(
        "ALTER TABLE catalog_token ADD COLUMN rc_scope text, ADD COLUMN rc_barrier bigint, "
        "ADD COLUMN rc_loaded_at timestamptz"
    )
    op.execute("ALTER TABLE catalog_session DROP COLUMN rc_scope, DROP COLUMN rc_barrier, DROP COLUMN rc_loaded_at")
    op.execute(SESSION_CUT.format(search_path=_search_path()))
    op.execute(_protection(moments=True))


def downgrade() -> None:
    op.execute(_protection(moments=False))
    op.execute(
        "ALTER TABLE catalog_session ADD COLUMN rc_scope text, ADD COLUMN rc_barrier bigint, "
        "ADD COLUMN rc_loaded_at timestamptz"
    )
    op.execute(_session_cut_0008())
    op.execute("ALTER TABLE catalog_token DROP COLUMN rc_scope, DROP COLUMN rc_barrier, DROP COLUMN rc_loaded_at")
