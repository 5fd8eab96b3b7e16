"""Skips without the jobs (DESIGN.md, "Cost per barrier follows the jobs with work").

A job whose sources did not change since its progress owes a barrier only a row. The control
plane now completes such skips itself, set-wise, so that a barrier costs the server, Postgres
and the notices what the jobs with work cost, not what all jobs cost:

- ``skip_unchanged(p_from)``: every job that may skip (the same rule as ``plan_barrier``'s skip:
  no source changed since its progress, up to where its sources are; a root job whose external
  inputs are all *announced* and none announced since its progress) completes, one statement per
  wave down the DAG: the first wave over every job (``p_from`` NULL: after a barrier is issued),
  or over the readers of the tables ``p_from`` (after a completion moved them); each next wave over
  the readers of what the last one moved. A job is left alone while it has a session open, a
  recorded input range ahead, a revision under way, or sinks at different barriers, and when it
  reads the barrier itself (``job.skips_unchanged`` false: its last plan asked not to be skipped).
  Rows another transaction holds are left to it (``SKIP LOCKED``: the skipper never waits, so it
  never deadlocks); opening a session locks the job's sinks, and the skipper looks for sessions
  again once it holds them, so it never moves a job under a session being opened. What is recorded is what ``complete_barrier`` records for a skip: the sinks'
  watermarks move, their snapshots stay, a ``table_completion`` row each, from the progress.
- Its moves raise no notice each; afterwards one notice per moved table that a job *not* skipped
  with it reads (a job with work waits for it). ``icebarrier.quiet`` silences the trigger meanwhile.
- ``issue_barrier`` and ``issue_barrier_if_due`` run the first wave in the issuing transaction;
  ``complete_barrier`` runs a wave from the sinks it moved (whose own notices follow the same
  rule: raised only if a reader was not skipped with them).
- External inputs announced: ``external_input`` holds, per input, when data last arrived
  (``announced_us``, on the barrier clock: above every barrier committed when it was announced;
  announcing waits for a barrier being issued, so no skip misses it). ``announce_inputs`` (the
  admin, or a role acting for a job that reads the input) records it and raises ``input <name>``;
  ``forget_inputs`` (the admin) makes the input unannounced again: its jobs run every barrier.
- ``plan_barrier`` plans a root job whose inputs are all announced as a skip to the newest barrier
  when none was announced since its progress (nothing to wait for but an announcement), and
  returns ``announced`` (those inputs) and ``pending`` (one was announced since its progress).
  It records ``p_skip`` in ``job.skips_unchanged``.

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-28
"""

import importlib.util
import re
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

PLAN_BARRIER = "plan_barrier(text, boolean, boolean, bigint)"

UPGRADE = """
ALTER TABLE job ADD COLUMN skips_unchanged boolean NOT NULL DEFAULT true;

CREATE TABLE external_input (
    name         text        CONSTRAINT external_input_pkey PRIMARY KEY,
    announced_us bigint      NOT NULL,
    announced_at timestamptz NOT NULL,
    announced_by text        NOT NULL
);
CREATE VIEW external_inputs AS
SELECT e.name, e.announced_at, e.announced_by, e.announced_us,
       ARRAY(SELECT j.name FROM job j WHERE j.active AND e.name = ANY(j.external_inputs) ORDER BY 1) AS jobs
FROM external_input e;

CREATE FUNCTION notify_input_announced() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('icebarrier.' || TG_TABLE_SCHEMA, 'input ' || NEW.name);
    RETURN NULL;
END $$;
CREATE TRIGGER input_announced AFTER INSERT OR UPDATE ON external_input
    FOR EACH ROW EXECUTE FUNCTION notify_input_announced();

CREATE OR REPLACE FUNCTION notify_watermark_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('icebarrier.quiet', true) = 'on' THEN
        RETURN NULL;  -- skip_unchanged: it tells the jobs with work itself
    END IF;
    PERFORM pg_notify('icebarrier.' || TG_TABLE_SCHEMA, 'watermark ' || coalesce(NEW.watermark::text, '-') || ' ' || NEW.name);
    RETURN NULL;
END $$;

-- Data arrived in external inputs p_names: their root jobs run at the next barrier.
CREATE FUNCTION announce_inputs(p_names text[]) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_stranger text;
    v_us bigint;
BEGIN
    IF NOT caller_is_admin() THEN
        SELECT x INTO v_stranger FROM unnest(p_names) x
        WHERE NOT EXISTS (SELECT 1 FROM job j WHERE j.active AND x = ANY(j.external_inputs) AND caller_acts_for(j.name))
        ORDER BY 1 LIMIT 1;
        IF v_stranger IS NOT NULL THEN
            PERFORM fail('IB030', format('role %s may not announce input %s: no job it acts for reads it', session_user,
                                         v_stranger),
                         jsonb_build_object('role', session_user, 'action', 'announce input ' || v_stranger,
                                            'job', NULL));
        END IF;
    END IF;
    -- after every barrier committed, and after one being issued (its skips must see this)
    SELECT greatest(c.last_barrier + 1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint) INTO v_us
    FROM barrier_clock c FOR SHARE;
    INSERT INTO external_input AS e (name, announced_us, announced_at, announced_by)
    SELECT DISTINCT x, v_us, clock_timestamp(), session_user FROM unnest(p_names) x
    ON CONFLICT (name) DO UPDATE SET announced_us = greatest(e.announced_us, excluded.announced_us),
                                     announced_at = excluded.announced_at, announced_by = excluded.announced_by;
    RETURN v_us;
END $$;

-- Inputs p_names are no longer announced: the root jobs reading them run at every barrier.
CREATE FUNCTION forget_inputs(p_names text[]) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_n integer;
BEGIN
    PERFORM require_admin('forget announced inputs');
    DELETE FROM external_input WHERE name = ANY(p_names);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    PERFORM pg_notify('icebarrier.' || current_schema(), 'jobs');  -- their jobs plan again
    RETURN v_n;
END $$;

-- The announced inputs of a root job reading p_inputs (NULL unless every one is announced), and
-- whether one was announced at or after p_progress.
CREATE FUNCTION announced_inputs(p_inputs text[], p_progress bigint, OUT names text[], OUT pending boolean)
LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT CASE WHEN count(*) = cardinality(p_inputs) AND count(*) > 0 THEN array_agg(e.name ORDER BY e.name) END,
           coalesce(max(e.announced_us) >= p_progress, true)
    FROM external_input e WHERE e.name = ANY(p_inputs);
END;

CREATE FUNCTION skip_unchanged(p_from bigint[] DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_newest bigint := (SELECT max(b.barrier) FROM barrier b);
    v_from bigint[] := p_from;
    v_ids bigint[];
    v_targets bigint[];
    v_progress bigint[];
    v_moved bigint[];
    v_all bigint[] := coalesce(p_from, '{{}}');
    v_jobs integer := 0;
    v_n integer;
BEGIN
    PERFORM set_config('icebarrier.quiet', 'on', true);
    LOOP
        EXIT WHEN v_newest IS NULL OR cardinality(v_from) = 0;
        WITH cand AS (
            SELECT j.job_id, j.name, k.progress, k.n,
                   CASE WHEN src.ids IS NULL THEN v_newest
                        ELSE unchanged_until(src.ids, k.progress, src.sources_at) END AS target
            FROM job j
            CROSS JOIN LATERAL (
                SELECT max(t.watermark) AS progress, count(*) AS n,
                       bool_and(t.revision_id IS NULL) AND count(t.watermark) = count(*)
                       AND min(t.watermark) = max(t.watermark) AS even
                FROM job_sink x JOIN managed_table t USING (table_id) WHERE x.job_id = j.job_id) k
            CROSS JOIN LATERAL (
                SELECT array_agg(s.table_id) AS ids, min(m.watermark) AS sources_at,
                       bool_and(m.watermark IS NOT NULL) AS started
                FROM job_source s JOIN managed_table m USING (table_id) WHERE s.job_id = j.job_id) src
            WHERE j.active AND j.skips_unchanged AND k.even AND k.progress < v_newest
              AND (v_from IS NULL OR j.job_id IN (SELECT s.job_id FROM job_source s WHERE s.table_id = ANY(v_from)))
              AND CASE WHEN src.ids IS NULL
                       THEN v_from IS NULL AND NOT (announced_inputs(j.external_inputs, k.progress)).pending
                            AND (announced_inputs(j.external_inputs, k.progress)).names IS NOT NULL
                       ELSE src.started AND src.sources_at > k.progress END
              AND NOT EXISTS (SELECT 1 FROM job_session js WHERE js.job_name = j.name)
              AND NOT EXISTS (SELECT 1 FROM input_range r WHERE r.job_name = j.name AND r.barrier > k.progress)
        ),
        locked AS (
            SELECT c.job_id, t.table_id
            FROM cand c JOIN job_sink x ON x.job_id = c.job_id JOIN managed_table t ON t.table_id = x.table_id
            WHERE c.target > c.progress AND t.watermark = c.progress AND t.revision_id IS NULL
            FOR UPDATE OF t SKIP LOCKED
        ),
        chosen AS (
            SELECT c.* FROM cand c
            WHERE c.target > c.progress AND c.n = (SELECT count(*) FROM locked l WHERE l.job_id = c.job_id)
              AND NOT EXISTS (SELECT 1 FROM job_source s JOIN managed_table m ON m.table_id = s.table_id
                              WHERE s.job_id = c.job_id AND NOT has_completed(m, c.target))
        )
        SELECT array_agg(c.job_id), array_agg(c.target), array_agg(c.progress) INTO v_ids, v_targets, v_progress
        FROM chosen c;
        EXIT WHEN v_ids IS NULL;
        -- a statement of its own, so a snapshot taken with the sinks locked: a session opened
        -- meanwhile (open_session locks them) is seen, and its job left to it
        WITH whole AS (
            SELECT u.job_id, u.target, u.progress, j.name
            FROM unnest(v_ids, v_targets, v_progress) AS u(job_id, target, progress) JOIN job j ON j.job_id = u.job_id
            WHERE NOT EXISTS (SELECT 1 FROM job_session js WHERE js.job_name = j.name)
        ),
        moved AS (
            UPDATE managed_table t SET watermark = w.target
            FROM whole w JOIN job_sink x ON x.job_id = w.job_id
            WHERE t.table_id = x.table_id AND t.watermark = w.progress
            RETURNING t.table_id, w.target, w.name, w.progress
        ),
        recorded AS (
            INSERT INTO table_completion (table_id, barrier, job_name, completed_at, from_barrier, coalesced)
            SELECT m.table_id, m.target, m.name, clock_timestamp(), m.progress, false FROM moved m
        )
        SELECT array_agg(m.table_id), count(DISTINCT m.name) INTO v_moved, v_n FROM moved m;
        EXIT WHEN v_moved IS NULL;  -- every chosen job had a session opened meanwhile
        v_jobs := v_jobs + v_n;
        v_all := v_all || v_moved;
        v_from := v_moved;
    END LOOP;
    PERFORM set_config('icebarrier.quiet', 'off', true);
    -- a job not skipped with them (it has work, or waits on something else) hears of the moves,
    -- and of p_from's (complete_barrier moved them quietly)
    PERFORM pg_notify('icebarrier.' || current_schema(), 'watermark ' || t.watermark || ' ' || t.name)
    FROM managed_table t
    WHERE t.table_id = ANY(v_all)
      AND EXISTS (SELECT 1 FROM job_source s JOIN job j ON j.job_id = s.job_id AND j.active
                  WHERE s.table_id = t.table_id
                    AND NOT EXISTS (SELECT 1 FROM job_sink x JOIN managed_table o ON o.table_id = x.table_id
                                    WHERE x.job_id = j.job_id AND o.watermark >= t.watermark));
    RETURN v_jobs;
END $$;
REVOKE EXECUTE ON FUNCTION skip_unchanged(bigint[]) FROM PUBLIC;

{issue}
"""

DOWNGRADE = """
{issue}
DROP FUNCTION skip_unchanged(bigint[]);
DROP FUNCTION announced_inputs(text[], bigint);
DROP FUNCTION forget_inputs(text[]);
DROP FUNCTION announce_inputs(text[]);
CREATE OR REPLACE FUNCTION notify_watermark_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('icebarrier.' || TG_TABLE_SCHEMA, 'watermark ' || coalesce(NEW.watermark::text, '-') || ' ' || NEW.name);
    RETURN NULL;
END $$;
DROP TRIGGER input_announced ON external_input;
DROP FUNCTION notify_input_announced();
DROP VIEW external_inputs;
DROP TABLE external_input;
ALTER TABLE job DROP COLUMN skips_unchanged;
"""

# the two functions that issue barriers, as 0007 wrote them, with {wave} after the barrier
ISSUE = """
CREATE OR REPLACE FUNCTION issue_barrier(p_issued_by text DEFAULT 'operator') RETURNS SETOF barrier
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_admin('issue barriers by hand');
    RETURN QUERY SELECT * FROM tick_barrier(p_issued_by, NULL);{wave}
END $$;

CREATE OR REPLACE FUNCTION issue_barrier_if_due(p_job text) RETURNS SETOF barrier
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_job(p_job, 'ask for the next barrier of');
    RETURN QUERY SELECT * FROM tick_barrier(p_job, (SELECT value::bigint * 1000 FROM setting
                                                     WHERE key = 'barrier_interval_ms'));{wave}
END $$;
"""
WAVE = "\n    IF FOUND THEN  -- a barrier was issued: the first wave, over every job\n        PERFORM skip_unchanged();\n    END IF;"

# plan_barrier, as 0010 wrote it, and what this revision changes in it
_PLAN_EDITS = (
    (
        "               waiting jsonb, root boolean)\nLANGUAGE plpgsql STABLE SECURITY DEFINER",
        "               waiting jsonb, root boolean, announced text[], pending boolean)\n"
        "LANGUAGE plpgsql SECURITY DEFINER",
    ),
    ("    v_limit bigint;\nBEGIN\n", "    v_limit bigint;\n    v_inputs record;\nBEGIN\n"),
    (
        "    SELECT x.job_id, x.sources, x.progress,",
        "    SELECT x.job_id, x.sources, x.progress, x.external_inputs,",
    ),
    (
        "      FROM (SELECT jb.job_id,\n",
        "      FROM (SELECT jb.job_id, jb.external_inputs,\n",
    ),
    (
        "    v_next := (SELECT min(b.barrier) FROM barrier b WHERE b.barrier > j.progress);\n",
        "    v_next := (SELECT min(b.barrier) FROM barrier b WHERE b.barrier > j.progress);\n"
        "    UPDATE job SET skips_unchanged = p_skip WHERE job_id = j.job_id AND skips_unchanged <> p_skip;\n"
        "    SELECT * INTO v_inputs FROM announced_inputs(CASE WHEN cardinality(j.sources) = 0 THEN j.external_inputs\n"
        "                                                      ELSE '{{}}' END, j.progress);\n",
    ),
    (
        "    ELSIF cardinality(j.sources) = 0 THEN  -- a root job",
        "    ELSIF cardinality(j.sources) = 0 AND j.progress IS NOT NULL AND p_skip AND v_inputs.names IS NOT NULL\n"
        "          AND NOT v_inputs.pending THEN  -- announced inputs, none since: skip to the newest (or wait)\n"
        "        v_target := CASE WHEN v_next IS NOT NULL THEN (SELECT max(b.barrier) FROM barrier b) END;\n"
        "        v_plan := 'skip';\n"
        "    ELSIF cardinality(j.sources) = 0 THEN  -- a root job",
    ),
    (
        "    root := cardinality(j.sources) = 0;\n",
        "    root := cardinality(j.sources) = 0;\n    announced := v_inputs.names;\n"
        "    pending := coalesce(v_inputs.pending, false);\n",
    ),
)

_COMPLETE_EDITS = (
    (
        "    UPDATE managed_table t\n    SET watermark = p_barrier,",
        "    PERFORM set_config('icebarrier.quiet', 'on', true);  -- skip_unchanged says who must hear of it\n"
        "    UPDATE managed_table t\n    SET watermark = p_barrier,",
    ),
    (
        "    sinks := s.names;\n    noop := false;\n",
        "    PERFORM skip_unchanged(s.ids);  -- its readers that may skip now, and theirs\n"
        "    sinks := s.names;\n    noop := false;\n",
    ),
)

_ROLES_WITH = """
SELECT r.rolname FROM pg_roles r
WHERE NOT r.rolsuper AND r.oid <> (SELECT nspowner FROM pg_namespace WHERE nspname = current_schema())
  AND has_function_privilege(r.oid, (SELECT p.oid FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace
                                     AND p.proname = 'plan_barrier' LIMIT 1), 'EXECUTE')
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def _revision(stem: str):
    path = Path(__file__).with_name(f"{stem}.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _edited(text: str, edits, *, forward: bool) -> str:
    for old, new in edits:
        old, new = (old, new) if forward else (new, old)
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def _plan_barrier(*, skipping: bool) -> str:
    earlier = _revision("0010_cost_follows_change")
    text = re.search(r"CREATE FUNCTION plan_barrier\(.*?END \$\$;", earlier.FUNCTIONS, re.S).group(0)
    return (_edited(text, _PLAN_EDITS, forward=True) if skipping else text).format(search_path=_search_path())


def _complete_barrier(*, skipping: bool) -> str:
    text = _revision("0014_retries_and_audit")._complete_barrier(reporting_coalesced=True)
    text = text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")
    return _edited(text, _COMPLETE_EDITS, forward=True) if skipping else text


def _replace_plan_barrier(*, skipping: bool) -> None:
    """Drop and create ``plan_barrier`` (its result type changes), keeping its grants; the roles
    that plan (job roles) may announce the inputs their jobs read."""
    roles = [sql.Identifier(r[0]).as_string(None) for r in op.get_bind().exec_driver_sql(_ROLES_WITH).fetchall()]
    op.execute(f"DROP FUNCTION {PLAN_BARRIER}")
    op.execute(_plan_barrier(skipping=skipping))
    op.execute(f"REVOKE EXECUTE ON FUNCTION {PLAN_BARRIER} FROM PUBLIC")
    for role in roles:
        op.execute(f"GRANT EXECUTE ON FUNCTION {PLAN_BARRIER} TO {role}")
        if skipping:
            op.execute(f"GRANT EXECUTE ON FUNCTION announce_inputs(text[]) TO {role}")


def _issue(wave: str) -> str:
    return ISSUE.format(search_path=_search_path(), wave=wave)


def upgrade() -> None:
    op.execute(UPGRADE.format(search_path=_search_path(), issue=_issue(WAVE)))
    op.execute("REVOKE EXECUTE ON FUNCTION announce_inputs(text[]), forget_inputs(text[]) FROM PUBLIC")
    _replace_plan_barrier(skipping=True)
    op.execute(_complete_barrier(skipping=True))


def downgrade() -> None:
    op.execute(_complete_barrier(skipping=False))
    _replace_plan_barrier(skipping=False)
    op.execute(DOWNGRADE.format(search_path=_search_path(), issue=_issue("")))
