"""Least privilege in the catalog (DESIGN.md, "Least privilege, end to end").

- ``catalog_token.whole_lake``: a token that reaches every table (reads all; a job's token also
  writes every unmanaged table), only where it was created so (``token create --whole-lake``).
  Tokens made before this revision do not: a reader then reaches only what it is granted.
- ``catalog_grant``: a token's grants, each a namespace (and the namespaces under it) or a
  table, to read, or (a job's token) to read and write the unmanaged tables there.
- ``token_reach(client_id)``: what a token reaches, as text (``read:namespace:a.b``,
  ``write:table:lake.a.t``, a job's ``write:sink:…`` and ``read:source:…``, a whole-lake token's
  ``read:lake:`` and a job's ``write:lake:``); NULL: everything (an admin).
- ``catalog_load`` returns it (``who_reach``), so a load is still one statement; grants changed
  or a token's reach changed are announced as ``tokens`` (a server drops the tokens it keeps).

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-27
"""

import importlib.util
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE catalog_token ADD COLUMN whole_lake boolean NOT NULL DEFAULT false;

CREATE TABLE catalog_grant (
    client_id  text        NOT NULL CONSTRAINT catalog_grant_token_fkey REFERENCES catalog_token ON DELETE CASCADE,
    kind       text        NOT NULL CONSTRAINT catalog_grant_kind_check CHECK (kind IN ('namespace', 'table')),
    object     text        NOT NULL,
    privilege  text        NOT NULL CONSTRAINT catalog_grant_privilege_check CHECK (privilege IN ('read', 'write')),
    granted_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT catalog_grant_pkey PRIMARY KEY (client_id, kind, object)
);
REVOKE ALL ON catalog_grant FROM PUBLIC;

CREATE TRIGGER grants_changed AFTER INSERT OR UPDATE OR DELETE ON catalog_grant
    FOR EACH ROW EXECUTE FUNCTION notify_tokens_changed();
DROP TRIGGER tokens_changed ON catalog_token;
CREATE TRIGGER tokens_changed AFTER UPDATE OF kind, job_name, revoked_at, whole_lake OR DELETE ON catalog_token
    FOR EACH ROW EXECUTE FUNCTION notify_tokens_changed();

CREATE FUNCTION token_reach(p_client text) RETURNS text[]
LANGUAGE sql STABLE SET search_path = {search_path} AS $$
    SELECT CASE WHEN t.kind = 'admin' THEN NULL ELSE ARRAY(
        SELECT 'read:lake:' WHERE t.whole_lake
        UNION ALL
        SELECT 'write:lake:' WHERE t.whole_lake AND t.kind = 'job'
        UNION ALL
        SELECT g.privilege || ':' || g.kind || ':' || g.object FROM catalog_grant g WHERE g.client_id = t.client_id
        UNION ALL
        SELECT 'write:sink:' || m.name FROM job j JOIN job_sink s USING (job_id) JOIN managed_table m USING (table_id)
        WHERE j.name = t.job_name
        UNION ALL
        SELECT 'read:source:' || m.name FROM job j JOIN job_source s USING (job_id) JOIN managed_table m USING (table_id)
        WHERE j.name = t.job_name) END
    FROM catalog_token t WHERE t.client_id = p_client
$$;
REVOKE EXECUTE ON FUNCTION token_reach(text) FROM PUBLIC;
"""

DOWNGRADE = """
DROP FUNCTION catalog_load(text, text, text, text, text, text, text, text, bigint, text, integer);
DROP FUNCTION token_reach(text);
DROP TRIGGER tokens_changed ON catalog_token;
CREATE TRIGGER tokens_changed AFTER UPDATE OF kind, job_name, revoked_at OR DELETE ON catalog_token
    FOR EACH ROW EXECUTE FUNCTION notify_tokens_changed();
DROP TABLE catalog_grant;
ALTER TABLE catalog_token DROP COLUMN whole_lake;
"""

# catalog_load of 0022, returning the token's reach too.
_EDITS = (
    (
        "token_ttl_s double precision, moment bigint, moment_age_s double precision, plain boolean)",
        "token_ttl_s double precision, moment bigint, moment_age_s double precision, plain boolean,\n"
        "               who_reach text[])",
    ),
    (
        "            RETURN NEXT;  -- an unknown, expired or revoked token: nothing else is read\n"
        "            RETURN;\n"
        "        END IF;\n",
        "            RETURN NEXT;  -- an unknown, expired or revoked token: nothing else is read\n"
        "            RETURN;\n"
        "        END IF;\n"
        "        who_reach := token_reach(who_client);\n",
    ),
)


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def _earlier(file_name: str):
    path = Path(__file__).with_name(file_name)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _catalog_load_0022() -> str:
    """0022's ``CREATE FUNCTION catalog_load`` (after its DROP of 0021's), through its REVOKE."""
    text = _earlier("0022_load_notices.py").UPGRADE
    start = text.index("CREATE FUNCTION catalog_load(")
    return text[start:]


def upgrade() -> None:
    op.execute(UPGRADE.format(search_path=_search_path()))
    text = _catalog_load_0022()
    for old, new in _EDITS:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    op.execute(
        "DROP FUNCTION catalog_load(text, text, text, text, text, text, text, text, bigint, text, integer);\n"
        + text.format(search_path=_search_path())
    )


def downgrade() -> None:
    op.execute(DOWNGRADE)
    op.execute(_catalog_load_0022().format(search_path=_search_path()))
