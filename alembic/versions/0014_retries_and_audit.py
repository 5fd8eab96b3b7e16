"""Retries are safe, and every administrative and write action leaves a row.

- ``idempotency_key``: a mutating request's ``Idempotency-Key`` (the REST spec's header)
  with the caller, the request's fingerprint and its final response, written in the
  transaction of the action; a retry finds it and gets the first response. Kept for the
  advertised lifetime (``expires_at``; rows past it are deleted as new keys arrive).
- ``audit_event``: who (the Postgres role, and the application's actor: a catalog token, the
  OS user of an admin command), what, when, on which job or table, with what result. Rows
  are appended by triggers on the tables whose changes are the actions (jobs registered and
  unregistered, revisions, catalog tokens, settings, job sessions, leases taken by hand), so
  that no action commits without its row; an action that is no row of its own appends
  through ``audit_append``. Only the admin reads it (view ``audit``): no grant to
  reader or job roles, and the table is written by the owner's functions only.
- ``complete_barrier`` also returns ``coalesced``: whether the completion it recorded (or, for
  a repeat, the one recorded before) coalesced barriers; ``--coalesce`` over an empty range
  records an exact completion, and now says so.
- ``protection`` protects what a job's session reads from the start: a job with no progress
  yet (its first run) counts as at its session's barrier while the session lives, so its
  sources' ``S(T, B)`` is kept as a job's progress is.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25
"""

import importlib.util
import re
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE idempotency_key (
    key         uuid        CONSTRAINT idempotency_key_pkey PRIMARY KEY,
    client_id   text,
    fingerprint text        NOT NULL,
    status      integer     NOT NULL,
    media_type  text,
    body        bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);
CREATE INDEX idempotency_key_expiry ON idempotency_key (expires_at);
-- answers are written once and read only by a retry: kept uncompressed, out of line (a commit's
-- answer, its table's metadata, is tens of KB: compressing it cost each keyed commit 0.1 ms)
ALTER TABLE idempotency_key ALTER COLUMN body SET STORAGE EXTERNAL;

CREATE TABLE audit_event (
    event_id   bigint GENERATED ALWAYS AS IDENTITY CONSTRAINT audit_event_pkey PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    role_name  name        NOT NULL,
    actor      text,
    action     text        NOT NULL,
    job_name   text,
    table_name text,
    object     text,
    result     text        NOT NULL,
    detail     jsonb       NOT NULL DEFAULT '{{}}'
);
CREATE INDEX audit_event_at ON audit_event (at);
CREATE INDEX audit_event_job ON audit_event (job_name, at) WHERE job_name IS NOT NULL;
CREATE INDEX audit_event_table ON audit_event (table_name, at) WHERE table_name IS NOT NULL;
REVOKE ALL ON audit_event, idempotency_key FROM PUBLIC;

-- Append one event: who is the session's role and the actor the application named
-- (setting icebarrier.actor: a catalog token, the OS user of an admin command).
CREATE FUNCTION audit_append(p_action text, p_job text, p_table text, p_object text, p_result text,
                             p_detail jsonb) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = {search_path}
BEGIN ATOMIC
    INSERT INTO audit_event (role_name, actor, action, job_name, table_name, object, result, detail)
    VALUES (session_user, nullif(current_setting('icebarrier.actor', true), ''), p_action, p_job, p_table,
            p_object, p_result, coalesce(p_detail, '{{}}'::jsonb));
END;
REVOKE EXECUTE ON FUNCTION audit_append(text, text, text, text, text, jsonb) FROM PUBLIC;

CREATE FUNCTION audit_row() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_action text;
    v_job text;
    v_table text;
    v_object text;
    v_detail jsonb := '{{}}';
BEGIN
    IF TG_TABLE_NAME = 'job' THEN
        v_job := NEW.name;
        v_detail := jsonb_build_object('external_inputs', NEW.external_inputs);
        IF TG_OP = 'INSERT' OR NOT OLD.active AND NEW.active THEN
            v_action := 'job register';
        ELSIF OLD.active AND NOT NEW.active THEN
            v_action := 'job unregister';
        ELSIF NEW.active THEN
            v_action := 'job replace';
        END IF;
    ELSIF TG_TABLE_NAME = 'revision' THEN
        v_table := NEW.root_table;
        v_object := 'revision ' || NEW.revision_id;
        v_detail := jsonb_build_object('revision', NEW.revision_id, 'to_barrier', NEW.to_barrier);
        v_action := CASE WHEN TG_OP = 'INSERT' THEN 'revise' WHEN NEW.state = 'done' AND OLD.state <> 'done'
                         THEN 'revise done' END;
    ELSIF TG_TABLE_NAME = 'catalog_token' THEN
        v_object := NEW.client_id;
        v_job := NEW.job_name;
        v_detail := jsonb_build_object('kind', NEW.kind, 'name', NEW.name);
        v_action := CASE WHEN TG_OP = 'INSERT' THEN 'token create'
                         WHEN NEW.revoked_at IS NOT NULL AND OLD.revoked_at IS NULL THEN 'token revoke' END;
    ELSIF TG_TABLE_NAME = 'setting' THEN
        v_object := NEW.key;
        v_detail := jsonb_build_object('value', NEW.value,
                                       'was', CASE WHEN TG_OP = 'UPDATE' THEN OLD.value END);
        v_action := CASE WHEN TG_OP = 'INSERT' OR OLD.value IS DISTINCT FROM NEW.value THEN 'setting' END;
    ELSIF TG_TABLE_NAME = 'lease' THEN
        -- a lease someone took by hand (an admin command, a catalog client), not a job's or
        -- reader's own (those name no actor and come and go with every run)
        IF nullif(current_setting('icebarrier.actor', true), '') IS NULL THEN
            RETURN NULL;
        END IF;
        v_object := 'lease ' || NEW.lease_id;
        v_detail := jsonb_build_object('holder', NEW.holder, 'barrier', NEW.barrier, 'expires_at', NEW.expires_at);
        v_action := CASE WHEN TG_OP = 'INSERT' THEN 'lease acquire'
                         WHEN NEW.released_at IS NOT NULL AND OLD.released_at IS NULL THEN 'lease release' END;
    END IF;
    IF v_action IS NOT NULL THEN
        PERFORM audit_append(v_action, v_job, v_table, v_object, 'done', v_detail);
    END IF;
    RETURN NULL;
END $$;

-- Job sessions: opened, taken over (a new run of a session whose hold lapsed), released (the
-- command failed), published (deleted after its command succeeded) or discarded (stale).
CREATE FUNCTION audit_session() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_row job_session := CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
    v_action text;
BEGIN
    IF TG_OP = 'INSERT' THEN
        v_action := 'session open';
    ELSIF TG_OP = 'DELETE' THEN
        v_action := CASE WHEN OLD.succeeded_at IS NOT NULL THEN 'session publish' ELSE 'session discard' END;
    ELSIF NEW.run_id <> OLD.run_id THEN
        v_action := CASE WHEN NEW.held_until IS NULL THEN 'session release' ELSE 'session takeover' END;
    END IF;
    IF v_action IS NOT NULL THEN
        PERFORM audit_append(v_action, v_row.job_name, NULL, v_row.run_id, 'done',
                             jsonb_build_object('barrier', v_row.barrier, 'plan', v_row.plan,
                                                'run', v_row.run_id,
                                                'previous_run', CASE WHEN TG_OP = 'UPDATE' THEN OLD.run_id END));
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER audit_job AFTER INSERT OR UPDATE OF active, external_inputs ON job
    FOR EACH ROW EXECUTE FUNCTION audit_row();
CREATE TRIGGER audit_revision AFTER INSERT OR UPDATE OF state ON revision
    FOR EACH ROW EXECUTE FUNCTION audit_row();
CREATE TRIGGER audit_token AFTER INSERT OR UPDATE OF revoked_at ON catalog_token
    FOR EACH ROW EXECUTE FUNCTION audit_row();
CREATE TRIGGER audit_setting AFTER INSERT OR UPDATE ON setting
    FOR EACH ROW EXECUTE FUNCTION audit_row();
CREATE TRIGGER audit_lease AFTER INSERT OR UPDATE OF released_at ON lease
    FOR EACH ROW EXECUTE FUNCTION audit_row();
CREATE TRIGGER audit_job_session AFTER INSERT OR UPDATE OF run_id OR DELETE ON job_session
    FOR EACH ROW EXECUTE FUNCTION audit_session();

-- The admin's view of the trail (no grant to reader or job roles).
CREATE VIEW audit AS
SELECT event_id, at, role_name, actor, action, job_name, table_name, object, result, detail FROM audit_event;
"""

DOWNGRADE = """
DROP VIEW audit;
DROP TRIGGER audit_job_session ON job_session;
DROP TRIGGER audit_lease ON lease;
DROP TRIGGER audit_setting ON setting;
DROP TRIGGER audit_token ON catalog_token;
DROP TRIGGER audit_revision ON revision;
DROP TRIGGER audit_job ON job;
DROP FUNCTION audit_session();
DROP FUNCTION audit_row();
DROP FUNCTION audit_append(text, text, text, text, text, jsonb);
DROP TABLE audit_event;
DROP TABLE idempotency_key;
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


COMPLETE_BARRIER = "complete_barrier(text, bigint, text[], bigint[], text, boolean)"
_JOB_ROLES = """
SELECT r.rolname FROM pg_roles r
WHERE NOT r.rolsuper AND r.oid <> (SELECT nspowner FROM pg_namespace WHERE nspname = current_schema())
  AND has_function_privilege(r.oid, (SELECT p.oid FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace
                                     AND p.proname = 'complete_barrier' LIMIT 1), 'EXECUTE')
"""


def _from_0010(pattern: str) -> str:
    """The statement of revision 0010's definitions or functions that ``pattern`` (a regular
    expression) matches."""
    path = Path(__file__).with_name("0010_cost_follows_change.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    earlier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(earlier)
    return re.search(pattern, earlier.DEFINITIONS + earlier.FUNCTIONS, re.S).group(0)


_FIRST_RUN = (
    "(SELECT min(r.barrier) FROM input_range r WHERE r.job_name = j.name)) AS progress",
    "(SELECT min(r.barrier) FROM input_range r WHERE r.job_name = j.name),\n"
    "                        (SELECT js.barrier FROM job_session js WHERE js.job_name = j.name)) AS progress",
)


def _protection(*, first_runs: bool) -> str:
    """0010's ``protection``; with ``first_runs``, a session's barrier counting as its job's progress."""
    text = _from_0010(r"CREATE FUNCTION protection\(.*?\nEND;").replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")
    if first_runs:
        assert text.count(_FIRST_RUN[0]) == 1
        text = text.replace(*_FIRST_RUN)
    return text.format(search_path=_search_path())


def _complete_barrier(*, reporting_coalesced: bool) -> str:
    """0010's ``complete_barrier``; with ``reporting_coalesced``, also returning what it recorded."""
    text = _from_0010(r"CREATE FUNCTION complete_barrier\(.*?END \$\$;")
    if reporting_coalesced:
        edits = [
            (
                "RETURNS TABLE (sinks text[], noop boolean)",
                "RETURNS TABLE (sinks text[], noop boolean, coalesced boolean)",
            ),
            (
                "        noop := true;\n",
                "        noop := true;\n        coalesced := coalesce((SELECT bool_or(tc.coalesced) FROM table_completion tc\n"
                "            WHERE tc.table_id = (s.first_sink).table_id AND tc.barrier = p_barrier), false);\n",
            ),
            ("    noop := false;\n", "    noop := false;\n    coalesced := v_between AND p_coalesce;\n"),
        ]
        for old, new in edits:
            assert text.count(old) == 1, old
            text = text.replace(old, new)
    return text.format(search_path=_search_path())


def _replace_complete_barrier(*, reporting_coalesced: bool) -> None:
    """Drop and create ``complete_barrier`` (its result type changes), keeping its grants."""
    job_roles = [r[0] for r in op.get_bind().exec_driver_sql(_JOB_ROLES).fetchall()]
    op.execute(f"DROP FUNCTION {COMPLETE_BARRIER}")
    op.execute(_complete_barrier(reporting_coalesced=reporting_coalesced))
    op.execute(f"REVOKE EXECUTE ON FUNCTION {COMPLETE_BARRIER} FROM PUBLIC")
    for role in job_roles:
        op.execute(f"GRANT EXECUTE ON FUNCTION {COMPLETE_BARRIER} TO {sql.Identifier(role).as_string(None)}")


def upgrade() -> None:
    op.execute(UPGRADE.format(search_path=_search_path()))
    _replace_complete_barrier(reporting_coalesced=True)
    op.execute(_protection(first_runs=True))


def downgrade() -> None:
    op.execute(_protection(first_runs=False))
    _replace_complete_barrier(reporting_coalesced=False)
    op.execute(DOWNGRADE)
