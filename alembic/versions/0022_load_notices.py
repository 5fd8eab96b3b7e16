"""What a load reads announces its changes: a server process keeps it in memory.

A load reads who holds the token, whether the table is managed, the cut and where the table's
pointer is; they change rarely and are read on every load. Each change that could make a
remembered answer wrong is now announced on channel ``icebarrier_loads.<schema>`` when its
transaction commits (Postgres signals the listeners before the committer hears back), so a
server process answers most loads from memory (``apps/catalog/load_cache.py``):

- a token revoked, changed or deleted, or an access token's session ended: ``tokens``;
- what a cut S(T, B) already given could be undone by, or a table managed or not any more:
  ``cuts``. A revision rewinds a watermark and revokes commits; a table is registered or
  dropped. A watermark moving forward (every completion) does not change S(T, B) of a barrier T
  had completed, nor does a new coalesced range (it holds barriers after the watermark only),
  nor an expiry (it changes the pointer, whose metadata then lacks the snapshot: that load asks
  the database).

The SQL catalog's pointer rows announce themselves on a channel of the catalog's schema: that
trigger belongs to the catalog, which control planes may share, and is created with it
(``iceberg_ext.catalog.watch_pointers``).

``catalog_load`` also says what a server needs to keep an answer: the token's remaining life,
the read-committed session's moment and its age (the moment may be given from memory until it
is a tenth of the quiet interval old, when the database would write its time again), and
whether the cut was plain (S(T, B) of a valid, unexpired barrier: the same answer for as long
as no ``cuts`` notice comes).

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-26
"""

import importlib.util
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE FUNCTION notify_tokens_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('icebarrier_loads.' || TG_TABLE_SCHEMA, 'tokens');
    RETURN NULL;
END $$;
CREATE TRIGGER tokens_changed AFTER UPDATE OF kind, job_name, revoked_at OR DELETE ON catalog_token
    FOR EACH ROW EXECUTE FUNCTION notify_tokens_changed();
CREATE TRIGGER token_sessions_ended AFTER UPDATE OF client_id, expires_at OR DELETE ON catalog_session
    FOR EACH ROW EXECUTE FUNCTION notify_tokens_changed();  -- one notice a transaction (equal payloads fold)

CREATE FUNCTION notify_cuts_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('icebarrier_loads.' || TG_TABLE_SCHEMA, 'cuts');
    RETURN NULL;
END $$;
CREATE TRIGGER tables_changed AFTER INSERT OR DELETE ON managed_table
    FOR EACH ROW EXECUTE FUNCTION notify_cuts_changed();
CREATE TRIGGER cuts_rewound AFTER UPDATE ON managed_table
    FOR EACH ROW WHEN (NEW.watermark < OLD.watermark OR (NEW.watermark IS NULL AND OLD.watermark IS NOT NULL)
                       OR NEW.start_barrier IS DISTINCT FROM OLD.start_barrier
                       OR NEW.revision_id IS DISTINCT FROM OLD.revision_id OR NEW.name <> OLD.name)
    EXECUTE FUNCTION notify_cuts_changed();
CREATE TRIGGER commits_revoked AFTER UPDATE OF revoked_by, snapshot_id, barrier OR DELETE ON table_commit
    FOR EACH ROW EXECUTE FUNCTION notify_cuts_changed();

DROP FUNCTION catalog_load(text, text, text, text, text, text, text, text, bigint, text, integer);
CREATE FUNCTION catalog_load(
    p_token_hash text, p_job text, p_catalog_schema text, p_catalog text, p_namespace text,
    p_table text, p_name text, p_mode text, p_barrier bigint, p_scope text, p_quiet_ms integer)
RETURNS TABLE (who_client text, who_kind text, who_job text, staged_location text,
               managed boolean, location text, snapshot_id bigint, cut bigint,
               token_ttl_s double precision, moment bigint, moment_age_s double precision, plain boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_job text;
    v_asked bigint;
BEGIN
    PERFORM require_admin('serve the catalog');
    IF p_token_hash IS NOT NULL THEN
        SELECT t.client_id, t.kind, t.job_name, extract(epoch FROM s.expires_at - now())
        INTO who_client, who_kind, who_job, token_ttl_s
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
            SELECT extract(epoch FROM clock_timestamp() - t.rc_loaded_at) INTO moment_age_s
            FROM catalog_token t WHERE t.client_id = who_client;
        END IF;
        moment := v_asked;
        -- S(T, B) for one table: cut_at inlined, one index probe (resolve_cut plans its query
        -- for any number of tables at every call: 0.28 ms against 0.02). resolve_cut only where
        -- the cut is not plain, to say why or to find the newest valid one.
        SELECT x.barrier, x.snapshot_id, x.issued AND x.valid AND NOT x.expired INTO cut, snapshot_id, plain
        FROM cut_at(ARRAY[p_name], v_asked) x;
        IF plain IS NOT TRUE THEN
            plain := false;
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

DOWNGRADE = """
DROP FUNCTION catalog_load(text, text, text, text, text, text, text, text, bigint, text, integer);
DROP TRIGGER commits_revoked ON table_commit;
DROP TRIGGER cuts_rewound ON managed_table;
DROP TRIGGER tables_changed ON managed_table;
DROP FUNCTION notify_cuts_changed();
DROP TRIGGER token_sessions_ended ON catalog_session;
DROP TRIGGER tokens_changed ON catalog_token;
DROP FUNCTION notify_tokens_changed();
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def upgrade() -> None:
    op.execute(UPGRADE.format(search_path=_search_path()))


def downgrade() -> None:
    op.execute(DOWNGRADE)
    path = Path(__file__).with_name("0021_one_statement_per_load.py")  # its catalog_load again
    spec = importlib.util.spec_from_file_location(path.stem, path)
    earlier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(earlier)
    op.execute(earlier.UPGRADE.format(search_path=_search_path()))
