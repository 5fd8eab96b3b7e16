"""The consistent catalog (``icebarrier serve``): client tokens and sessions.

A token (``icebarrier token create``) maps a client id and a secret (stored as its SHA-256;
secrets are 256 random bits) to a reader or to one job. A multi-sink job writing through the
catalog has its commits staged until it publishes the barrier (``catalog_pending``). A client exchanges it for an access
token (OAuth2 client credentials); the access token is a session, and a session reading
through ``read-committed`` keeps one barrier until it has been quiet for a moment. Sessions
live here, so any number of server processes give the same answers.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-22
"""

from psycopg import sql

from alembic import context, op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE catalog_token (
    client_id   text        CONSTRAINT catalog_token_pkey PRIMARY KEY,
    secret_hash text        NOT NULL,
    kind        text        NOT NULL CONSTRAINT catalog_token_kind_check CHECK (kind IN ('reader', 'job')),
    job_name    text,
    name        text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz,
    CONSTRAINT catalog_token_job_check CHECK ((kind = 'job') = (job_name IS NOT NULL))
);

CREATE TABLE catalog_session (
    token_hash   text        CONSTRAINT catalog_session_pkey PRIMARY KEY,
    client_id    text        CONSTRAINT catalog_session_token_fkey REFERENCES catalog_token ON DELETE CASCADE,
    issued_at    timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    rc_scope     text,
    rc_barrier   bigint,
    rc_loaded_at timestamptz
);
CREATE INDEX catalog_session_expiry ON catalog_session (expires_at);

-- Commits of a multi-sink job's barrier staged by the catalog until the job publishes the
-- barrier: then every sink's pointer swaps, and the barrier completes, in one transaction.
-- Only the job's own tokens see staged commits (to build on them); everyone else sees the
-- pointers.
CREATE TABLE catalog_pending (
    job_name          text        NOT NULL,
    table_name        text        NOT NULL,
    barrier           bigint      NOT NULL,
    base_location     text        NOT NULL,
    metadata_location text        NOT NULL,
    staged_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT catalog_pending_pkey PRIMARY KEY (job_name, table_name)
);

-- The newest barrier every tracked managed table has completed (p_namespace: only the
-- tables of catalog.namespace), NULL if there is none yet.
CREATE FUNCTION latest_cut(p_namespace text) RETURNS bigint
LANGUAGE sql STABLE
BEGIN ATOMIC
    WITH tracked AS (
        SELECT t.start_barrier, t.watermark FROM managed_table t
        WHERE (t.watermark IS NOT NULL OR EXISTS (SELECT 1 FROM job_sink k WHERE k.table_id = t.table_id))
          AND (p_namespace IS NULL OR t.name LIKE p_namespace || '.%'))
    SELECT CASE WHEN (SELECT bool_and(has_completed(t.start_barrier, t.watermark, m.b)) FROM tracked t) THEN m.b END
    FROM (SELECT min(watermark) AS b FROM tracked) m;
END;

-- The barrier a read-committed load of session p_token_hash sees: the session's barrier while
-- its loads keep coming (less than p_quiet_ms apart) over the same scope, else the newest cut.
CREATE FUNCTION session_cut(p_token_hash text, p_scope text, p_quiet_ms integer) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_barrier bigint;
BEGIN
    PERFORM require_admin('serve the catalog');
    UPDATE catalog_session s
    SET rc_barrier = CASE WHEN s.rc_scope IS NOT DISTINCT FROM p_scope AND s.rc_barrier IS NOT NULL
                               AND s.rc_loaded_at > clock_timestamp() - make_interval(secs => p_quiet_ms / 1000.0)
                          THEN s.rc_barrier ELSE latest_cut(p_scope) END,
        rc_scope = p_scope, rc_loaded_at = clock_timestamp()
    WHERE s.token_hash = p_token_hash
    RETURNING s.rc_barrier INTO v_barrier;
    RETURN v_barrier;
END $$;
REVOKE EXECUTE ON FUNCTION session_cut(text, text, integer) FROM PUBLIC;
"""


def upgrade() -> None:
    schema = context.config.attributes["schema"]
    op.execute(UPGRADE.format(search_path=f"{sql.Identifier(schema).as_string(None)}, pg_temp"))


def downgrade() -> None:
    op.execute("DROP FUNCTION session_cut(text, text, integer)")
    op.execute("DROP FUNCTION latest_cut(text)")
    op.execute("DROP TABLE catalog_pending")
    op.execute("DROP TABLE catalog_session")
    op.execute("DROP TABLE catalog_token")
