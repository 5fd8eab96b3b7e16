"""A server process tells the database when its read-committed sessions last used their moments,
all of them in one statement (issue 69: consistency at no cost).

A server answers most read-committed loads from memory, but until 0037 it kept a session's moment
only until it was a tenth of the quiet interval old (``session_cut`` writes its time no more
often): a client loading without pause went to the database ten times a second, in a
statement that writes. ``session_touch`` is what a process's memory sends instead, every
twentieth of the quiet interval: for each session it answered since, the moment it gave and
how long ago it last gave it. The client's row takes that time (never an earlier one) if its
moment is still the one given; the sessions whose moment was not (another process moved it
after a quiet interval, the token ended) come back unconfirmed, and memory forgets them. So the
database knows each session's last load within a twentieth of the quiet interval (plus the
statement's own time), as before within a tenth; a moment memory gives is one the database
confirmed no longer ago than before. The time written is the statement's start less how long
ago the process gave the moment, as the process measured it when it sent the statement.

Soft state, as ``session_cut``'s write: it commits without waiting for the WAL flush.

Revision ID: 0037
Revises: 0036
Create Date: 2026-12-02
"""

from psycopg import sql

from alembic import context, op

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE FUNCTION session_touch(p_token_hashes text[], p_scopes text[], p_barriers bigint[], p_ago double precision[])
RETURNS TABLE (token_hash text, scope text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_admin('serve the catalog');
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY
    WITH used AS (
        SELECT s.client_id, u.token_hash, u.scope, u.barrier, u.ago
        FROM unnest(p_token_hashes, p_scopes, p_barriers, p_ago) AS u(token_hash, scope, barrier, ago)
        JOIN catalog_session s ON s.token_hash = u.token_hash
        WHERE s.expires_at > now()
    ), newest AS (  -- a client's row is written once: its most recent use
        SELECT DISTINCT ON (used.client_id) used.client_id, used.scope, used.barrier, used.ago
        FROM used ORDER BY used.client_id, used.ago
    ), touched AS (
        UPDATE catalog_token t
        SET rc_loaded_at = greatest(t.rc_loaded_at, statement_timestamp() - make_interval(secs => n.ago))
        FROM newest n
        WHERE t.client_id = n.client_id AND t.rc_barrier = n.barrier AND t.rc_scope IS NOT DISTINCT FROM n.scope
          AND t.revoked_at IS NULL
        RETURNING t.client_id, t.rc_scope, t.rc_barrier
    )
    SELECT used.token_hash, used.scope FROM used JOIN touched x
        ON x.client_id = used.client_id AND x.rc_barrier = used.barrier AND x.rc_scope IS NOT DISTINCT FROM used.scope;
END $$;
REVOKE EXECUTE ON FUNCTION session_touch(text[], text[], bigint[], double precision[]) FROM PUBLIC;
"""


def upgrade() -> None:
    search_path = f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"
    op.execute(UPGRADE.format(search_path=search_path))


def downgrade() -> None:
    op.execute("DROP FUNCTION session_touch(text[], text[], bigint[], double precision[])")
