"""A catalog load is one statement: ``catalog_load``.

Before, a read-committed load made eight round trips to Postgres (the token; is the table
managed and where is it; BEGIN, SET LOCAL, the session's cut, S(T, B), COMMIT; the pointer
again) and a ``latest`` load two. ``catalog_load`` does all of it in one call, in the order
that keeps a load correct:

1. the token's principal (NULL ``who_client``: the token is unknown, expired or revoked), and
   through ``latest`` the staged commit of the table by the job acting (``p_job``, else the
   token's job), if any;
2. the cut: through ``barrier-<B>`` S(T, B); through ``read-committed`` the session's moment
   (``session_cut``: it writes the client's moment) and then S(T, moment), each in a statement
   of its own, so S(T, moment) sees every completion the moment's choice saw (a PL/pgSQL
   function takes a new snapshot for each statement);
3. the table's pointer last (a commit's metadata lands before its record, so a pointer read
   after the cut holds S(T, B)).

The moment is soft state (lost in a crash, the session takes the newest cut): its write commits
without waiting for the WAL flush (``synchronous_commit`` off for this transaction only), and
``session_cut`` writes it only when it changes or its time is older than a tenth of the quiet
interval (a load moments after the last one only reads it: no write, no transaction id, no row
lock for a client's parallel loads to queue on). Loads less than the quiet interval apart keep
the moment, as before; loads more than 1.1 times it apart move it (between: either).

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-26
"""

import importlib.util
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

SESSION_CUT = """
CREATE OR REPLACE FUNCTION session_cut(p_token_hash text, p_scope text, p_quiet_ms integer) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_client text;
    v_barrier bigint;
    v_scope text;
    v_loaded timestamptz;
    v_quiet interval := make_interval(secs => p_quiet_ms / 1000.0);
BEGIN
    PERFORM require_admin('serve the catalog');
    SELECT t.client_id, t.rc_barrier, t.rc_scope, t.rc_loaded_at INTO v_client, v_barrier, v_scope, v_loaded
    FROM catalog_session s JOIN catalog_token t ON t.client_id = s.client_id
    WHERE s.token_hash = p_token_hash;
    IF v_barrier IS NOT NULL AND v_scope IS NOT DISTINCT FROM p_scope
       AND v_loaded > clock_timestamp() - v_quiet / 10 THEN
        RETURN v_barrier;  -- the client loaded moments ago: its moment holds, its time is fresh
    END IF;
    UPDATE catalog_token t
    SET rc_barrier = CASE WHEN t.rc_scope IS NOT DISTINCT FROM p_scope AND t.rc_barrier IS NOT NULL
                               AND t.rc_loaded_at > clock_timestamp() - v_quiet * 1.1
                          THEN t.rc_barrier ELSE latest_cut(p_scope) END,
        rc_scope = p_scope, rc_loaded_at = clock_timestamp()
    WHERE t.client_id = v_client
    RETURNING t.rc_barrier INTO v_barrier;
    RETURN v_barrier;
END $$;
"""

UPGRADE = """
CREATE FUNCTION catalog_load(
    p_token_hash text, p_job text, p_catalog_schema text, p_catalog text, p_namespace text,
    p_table text, p_name text, p_mode text, p_barrier bigint, p_scope text, p_quiet_ms integer)
RETURNS TABLE (who_client text, who_kind text, who_job text, staged_location text,
               managed boolean, location text, snapshot_id bigint, cut bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_job text;
    v_asked bigint;
    v_plain boolean;
BEGIN
    PERFORM require_admin('serve the catalog');
    IF p_token_hash IS NOT NULL THEN
        SELECT t.client_id, t.kind, t.job_name INTO who_client, who_kind, who_job
        FROM catalog_session s JOIN catalog_token t ON t.client_id = s.client_id
        WHERE s.token_hash = p_token_hash AND s.expires_at > now() AND t.revoked_at IS NULL;
        IF who_client IS NULL THEN
            RETURN NEXT;  -- an unknown, expired or revoked token: nothing else is read
            RETURN;
        END IF;
    END IF;
    managed := p_name IS NOT NULL AND EXISTS (SELECT 1 FROM managed_table m WHERE m.name = p_name);
    v_job := coalesce(p_job, CASE WHEN who_kind = 'job' THEN who_job END);
    IF p_mode = 'latest' AND v_job IS NOT NULL AND p_name IS NOT NULL THEN
        SELECT p.metadata_location INTO staged_location FROM catalog_pending p
        WHERE p.job_name = v_job AND p.table_name = p_name;
        IF staged_location IS NOT NULL THEN
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    IF managed AND (p_mode = 'barrier' OR (p_mode = 'read-committed' AND p_token_hash IS NOT NULL)) THEN
        IF p_mode = 'barrier' THEN
            v_asked := p_barrier;
        ELSE
            PERFORM set_config('synchronous_commit', 'off', true);
            v_asked := session_cut(p_token_hash, p_scope, p_quiet_ms);  -- NULL: no cut yet, the table's own
        END IF;
        -- S(T, B) for one table: cut_at inlined, one index probe (resolve_cut plans its query
        -- for any number of tables at every call: 0.28 ms against 0.02). resolve_cut only where
        -- the cut is not plain, to say why or to find the newest valid one.
        SELECT x.barrier, x.snapshot_id, x.issued AND x.valid AND NOT x.expired INTO cut, snapshot_id, v_plain
        FROM cut_at(ARRAY[p_name], v_asked) x;
        IF v_plain IS NOT TRUE THEN
            SELECT r.barrier, r.snapshot_ids[1] INTO cut, snapshot_id
            FROM resolve_cut(ARRAY[p_name], v_asked, true) r;
        END IF;
    END IF;
    IF p_catalog_schema IS NOT NULL THEN  -- the SQL catalog's schema (NULL: the cut only)
        EXECUTE format('SELECT metadata_location FROM %I.iceberg_tables '
                       'WHERE catalog_name = $1 AND table_namespace = $2 AND table_name = $3', p_catalog_schema)
            INTO location USING p_catalog, p_namespace, p_table;
    END IF;
    RETURN NEXT;
END $$;
REVOKE EXECUTE ON FUNCTION catalog_load(text, text, text, text, text, text, text, text, bigint, text, integer) FROM PUBLIC;
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def _earlier(file_name: str):
    """An earlier revision's module (alembic/ is not a package)."""
    path = Path(__file__).with_name(file_name)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    op.execute(SESSION_CUT.format(search_path=_search_path()))
    op.execute(UPGRADE.format(search_path=_search_path()))


def downgrade() -> None:
    op.execute("DROP FUNCTION catalog_load(text, text, text, text, text, text, text, text, bigint, text, integer)")
    op.execute(_earlier("0017_read_committed_per_client.py").SESSION_CUT.format(search_path=_search_path()))
