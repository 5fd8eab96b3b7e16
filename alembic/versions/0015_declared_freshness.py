"""Declared freshness: a table's target lag, how a job runs itself, and the schedule that runs
the pipeline to meet the targets (DESIGN.md, "Declared freshness").

- ``managed_table.target_lag``: at any moment the table's watermark was issued at most this
  long ago. Set by the admin (``set_target_lag``, audited).
- ``table_targets`` (view): each table's own target and its effective one: a table without
  its own inherits the tightest target of the tables that read it (downstream, through
  tables without targets of their own), and which table that is.
- ``table_versions`` gains ``target_lag``, ``effective_target_lag`` and ``target_met``.
- ``target_misses`` (view): each stretch in which a table was staler than its target: from
  its watermark's issue time plus the target until the completion that recovered it (NULL:
  still missing), measured against the target as it is now.
- ``job_runner``: how a job runs itself: a command (under ``job exec``) or a PySpark file (the
  runtime), with its environment; set by the admin (``set_job_runner``, audited; the admin's
  only, as its environment may hold secrets).
- ``schedule_run``: each run the schedule started (job, when, how long, exit code, barriers
  before and after): its measured durations survive a takeover, and they are the record of
  what the schedule did. ``schedule_state``: who schedules (the holder of the schedule's
  advisory lock writes it), since when, and its plan; readers see it as ``schedule_plan``
  (the status page shows it).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25
"""

import importlib.util
import re
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE managed_table ADD COLUMN target_lag interval
    CONSTRAINT managed_table_target_lag_positive CHECK (target_lag > interval '0');

CREATE TABLE job_runner (
    job_id     bigint      CONSTRAINT job_runner_pkey PRIMARY KEY REFERENCES job (job_id) ON DELETE CASCADE,
    kind       text        NOT NULL CONSTRAINT job_runner_kind CHECK (kind IN ('command', 'file')),
    spec       text        NOT NULL CONSTRAINT job_runner_spec CHECK (spec <> ''),
    env        jsonb       NOT NULL DEFAULT '{{}}' CONSTRAINT job_runner_env CHECK (jsonb_typeof(env) = 'object'),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE schedule_run (
    run_id        bigint      GENERATED ALWAYS AS IDENTITY CONSTRAINT schedule_run_pkey PRIMARY KEY,
    job_name      text        NOT NULL,
    reason        text        NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at   timestamptz,
    exit_code     integer,
    progress_from bigint,
    progress_to   bigint,
    seconds       double precision  -- its measured duration, if it counts as the job's (not a warm-up)
);
CREATE INDEX schedule_run_job ON schedule_run (job_name, started_at);

CREATE TABLE schedule_state (
    singleton   boolean     CONSTRAINT schedule_state_pkey PRIMARY KEY DEFAULT true CHECK (singleton),
    holder      text        NOT NULL,
    started_at  timestamptz NOT NULL,
    seen_at     timestamptz NOT NULL,
    plan        jsonb       NOT NULL DEFAULT '[]'
);
REVOKE ALL ON job_runner, schedule_run, schedule_state FROM PUBLIC;
-- Who schedules and what it plans (the status page); the runners and runs stay the admin's.
CREATE VIEW schedule_plan AS SELECT holder, started_at, seen_at, plan FROM schedule_state;

CREATE FUNCTION set_target_lag(p_table text, p_target_lag interval) RETURNS interval
LANGUAGE plpgsql SET search_path = {search_path} AS $$
DECLARE
    v_was interval;
BEGIN
    SELECT target_lag INTO v_was FROM managed_table WHERE name = p_table FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM fail('IB009', format('table %s is not managed by icebarrier', p_table),
                     jsonb_build_object('table', p_table));
    END IF;
    IF p_target_lag <= interval '0' THEN
        PERFORM fail('IB014', format('the target lag of %s must be positive (got %s); give e.g. 5m', p_table, p_target_lag),
                     jsonb_build_object('table', p_table));
    END IF;
    UPDATE managed_table SET target_lag = p_target_lag WHERE name = p_table;
    IF v_was IS DISTINCT FROM p_target_lag THEN
        PERFORM audit_append('table target-lag', NULL, p_table, NULL, 'done',
                             jsonb_build_object('target_lag_s', extract(epoch FROM p_target_lag),
                                                'was_s', extract(epoch FROM v_was)));
    END IF;
    RETURN p_target_lag;
END $$;
REVOKE EXECUTE ON FUNCTION set_target_lag(text, interval) FROM PUBLIC;

CREATE FUNCTION set_job_runner(p_job text, p_kind text, p_spec text, p_env jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = {search_path} AS $$
DECLARE
    v_job bigint;
BEGIN
    SELECT job_id INTO v_job FROM job WHERE name = p_job AND active;
    IF NOT FOUND THEN
        PERFORM fail('IB001', format('job %s is not registered', p_job), jsonb_build_object('job', p_job));
    END IF;
    IF p_kind IS NULL THEN
        DELETE FROM job_runner WHERE job_id = v_job;
    ELSE
        INSERT INTO job_runner (job_id, kind, spec, env) VALUES (v_job, p_kind, p_spec, coalesce(p_env, '{{}}'))
        ON CONFLICT (job_id) DO UPDATE SET kind = EXCLUDED.kind, spec = EXCLUDED.spec, env = EXCLUDED.env,
                                           updated_at = now()
        WHERE (job_runner.kind, job_runner.spec, job_runner.env) IS DISTINCT FROM (EXCLUDED.kind, EXCLUDED.spec, EXCLUDED.env);
    END IF;
    -- the environment's values are not in the trail (they may be secrets), its names are
    PERFORM audit_append('job runner', p_job, NULL, NULL, 'done',
                         jsonb_build_object('kind', p_kind, 'spec', p_spec,
                                            'env', (SELECT coalesce(jsonb_agg(k ORDER BY k), '[]')
                                                    FROM jsonb_object_keys(coalesce(p_env, '{{}}')) AS k)));
END $$;
REVOKE EXECUTE ON FUNCTION set_job_runner(text, text, text, jsonb) FROM PUBLIC;

-- A table's effective target: its own, else the tightest of the tables downstream that reach
-- it through tables without targets of their own (and which table that is).
CREATE VIEW table_targets AS
WITH RECURSIVE inherited (table_id, from_id, target_lag) AS (
    SELECT t.table_id, t.table_id, t.target_lag FROM managed_table t WHERE t.target_lag IS NOT NULL
  UNION
    SELECT s.table_id, i.from_id, i.target_lag
    FROM inherited i
    JOIN job_sink k ON k.table_id = i.table_id
    JOIN job_source s ON s.job_id = k.job_id
    JOIN managed_table u ON u.table_id = s.table_id AND u.target_lag IS NULL
)
SELECT DISTINCT ON (t.table_id)
       t.name AS table_name, t.table_id, t.target_lag, i.target_lag AS effective_target_lag,
       f.name AS target_from
FROM managed_table t
LEFT JOIN inherited i ON i.table_id = t.table_id
LEFT JOIN managed_table f ON f.table_id = i.from_id
ORDER BY t.table_id, i.target_lag, f.name;

{table_versions}

-- Each stretch in which a table with a target was staler than it: from the issue time of its
-- watermark then plus the target, until the completion that moved it (NULL: still stale).
CREATE VIEW target_misses AS
WITH completions AS (
    SELECT c.table_id, c.barrier, c.completed_at,
           lag(b.issued_at) OVER (PARTITION BY c.table_id ORDER BY c.completed_at, c.barrier) AS before_issued_at
    FROM table_completion c JOIN barrier b USING (barrier)
), stretches AS (
    SELECT table_id, before_issued_at AS watermark_issued_at, completed_at AS until, barrier AS recovered_by
    FROM completions WHERE before_issued_at IS NOT NULL
  UNION ALL
    SELECT t.table_id, b.issued_at, NULL, NULL FROM managed_table t JOIN barrier b ON b.barrier = t.watermark
)
SELECT tt.table_name, tt.effective_target_lag AS target_lag,
       s.watermark_issued_at + tt.effective_target_lag AS missed_from, s.until AS missed_until,
       coalesce(s.until, now()) - (s.watermark_issued_at + tt.effective_target_lag) AS overdue,
       s.recovered_by
FROM stretches s JOIN table_targets tt USING (table_id)
WHERE tt.effective_target_lag IS NOT NULL
  AND coalesce(s.until, now()) > s.watermark_issued_at + tt.effective_target_lag;
"""

DOWNGRADE = """
DROP VIEW schedule_plan;
DROP VIEW target_misses;
DROP VIEW table_versions;
DROP VIEW table_targets;
DROP FUNCTION set_job_runner(text, text, text, jsonb);
DROP FUNCTION set_target_lag(text, interval);
DROP TABLE schedule_state;
DROP TABLE schedule_run;
DROP TABLE job_runner;
ALTER TABLE managed_table DROP COLUMN target_lag;
"""

_VIEW_ROLES = """
SELECT r.rolname FROM pg_roles r
WHERE NOT r.rolsuper AND r.oid <> (SELECT nspowner FROM pg_namespace WHERE nspname = current_schema())
  AND has_table_privilege(r.oid, 'managed_tables', 'SELECT')
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def _view_roles() -> list[str]:
    return [r[0] for r in op.get_bind().exec_driver_sql(_VIEW_ROLES).fetchall()]


def upgrade() -> None:
    roles = _view_roles()
    op.execute(UPGRADE.format(search_path=_search_path(), table_versions=_table_versions()))
    for role in roles:
        op.execute(
            f"GRANT SELECT ON table_targets, target_misses, schedule_plan TO {sql.Identifier(role).as_string(None)}"
        )


def downgrade() -> None:
    roles = _view_roles()
    op.execute(DOWNGRADE)
    op.execute(_table_versions_0010())
    for role in roles:
        op.execute(f"GRANT SELECT ON table_versions TO {sql.Identifier(role).as_string(None)}")


def _table_versions_0010() -> str:
    path = Path(__file__).with_name("0010_cost_follows_change.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    earlier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(earlier)
    return re.search(r"CREATE OR REPLACE VIEW table_versions AS.*?ON true;", earlier.VIEWS, re.S).group(0)


_TARGET_COLUMNS = (  # 0010's table_versions, and each table's target and whether it is met
    (
        "       t.coalesced_into                                        AS coalesced_into\n",
        "       t.coalesced_into                                        AS coalesced_into,\n"
        "       tt.target_lag                                           AS target_lag,\n"
        "       tt.effective_target_lag                                 AS effective_target_lag,\n"
        "       tt.target_from                                          AS target_from,\n"
        "       CASE WHEN tt.effective_target_lag IS NOT NULL\n"
        "            THEN coalesce(now() - b.issued_at <= tt.effective_target_lag, false) END AS target_met\n",
    ),
    (
        "LEFT JOIN barrier b ON b.barrier = t.watermark\n",
        "LEFT JOIN barrier b ON b.barrier = t.watermark\nLEFT JOIN table_targets tt ON tt.table_id = t.table_id\n",
    ),
)


def _table_versions() -> str:
    text = _table_versions_0010()
    for old, new in _TARGET_COLUMNS:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text
