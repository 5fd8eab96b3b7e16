"""A waiting job knows every source's mark and its own progress.

A notice that named a waiting reader (0032) still woke it whenever the move reached what its plan
had waited for. But waves of skips had often moved the reader on since its plan, and by then it
waited on another source: most plans a notice caused still found nothing to do (at 200 jobs,
378 of the 442 in a minute; docs/scale.md). Two things change, so that the wait decides from
true marks:

- ``advance_job``: a plan with nothing to do now also carries ``marks`` (every source's
  watermark) and ``sinks`` (the job's own tables: a revision that rewinds one wakes it).
- ``skip_unchanged``: each reader a notice names carries its progress, ``job@P`` (``@-``: it has
  completed nothing). A wait that learns its job moved on plans again only once every source is
  past that progress.

Which readers are named does not change: every reader short of the move, whatever its other
sources (two transactions moving a reader's two sources at once each name it).

- ``notify_input_announced``: an announcement says when the clock's next barrier is due
  (``input NAME SECONDS``; ``-``: no barrier yet). A root job waiting for it then waits for that
  barrier, from its notice or its clock, instead of planning at once to learn the same.

Revision ID: 0033
Revises: 0032
Create Date: 2026-11-29
"""

import importlib.util
import re
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None

NAMES = "(SELECT string_agg(j.name, ',' ORDER BY j.name)"

NAMES_AT = """(SELECT string_agg(j.name || '@' || coalesce((SELECT max(o.watermark) FROM job_sink x
                                                               JOIN managed_table o ON o.table_id = x.table_id
                                                               WHERE x.job_id = j.job_id)::text, '-'),
                                  ',' ORDER BY j.name)"""

WAITING = """    IF v_n.clock AND NOT (v_n.next_plan->>'ready')::boolean THEN"""

MARKS = """    IF NOT (v_n.next_plan->>'ready')::boolean THEN  -- what its wait decides from
        v_n.next_plan := v_n.next_plan || jsonb_build_object(
            'marks', (SELECT coalesce(jsonb_object_agg(t.name, t.watermark), '{{}}')
                      FROM job_sources s JOIN managed_tables t ON t.name = s.table_name WHERE s.job_name = p_job),
            'sinks', (SELECT coalesce(jsonb_agg(s.table_name), '[]') FROM job_sinks s WHERE s.job_name = p_job));
    END IF;
"""


INPUT_NOTICE = """
CREATE OR REPLACE FUNCTION notify_input_announced() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_due double precision;
BEGIN
    EXECUTE format('SELECT %I.barrier_due_in_s()', TG_TABLE_SCHEMA) INTO v_due;
    PERFORM pg_notify('icebarrier.' || TG_TABLE_SCHEMA, 'input ' || NEW.name || ' ' || coalesce(v_due::text, '-'));
    RETURN NULL;
END $$;
"""


def _earlier(stem: str):
    path = Path(__file__).with_name(f"{stem}.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _skip_unchanged(*, at: bool) -> str:
    text = _earlier("0032_a_notice_names_the_readers_behind")._skip_unchanged(naming=True)
    assert text.count(NAMES) == 1
    return text.replace(NAMES, NAMES_AT) if at else text


def _advance_job(*, marks: bool) -> str:
    text = re.search(
        r"CREATE FUNCTION advance_job\(.*?END \$\$;", _earlier("0031_a_session_in_one_round_trip").UPGRADE, re.S
    ).group(0)
    assert text.count(WAITING) == 1
    if marks:
        text = text.replace(WAITING, MARKS + WAITING)
    search_path = f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"
    return text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION").format(search_path=search_path)


def _input_notice(*, due: bool) -> str:
    if due:
        return INPUT_NOTICE
    earlier = _earlier("0027_skips_without_the_jobs").UPGRADE
    text = re.search(r"CREATE FUNCTION notify_input_announced\(.*?END \$\$;", earlier, re.S).group(0)
    return text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")


def upgrade() -> None:
    op.execute(_skip_unchanged(at=True))
    op.execute(_advance_job(marks=True))
    op.execute(_input_notice(due=True))


def downgrade() -> None:
    op.execute(_input_notice(due=False))
    op.execute(_advance_job(marks=False))
    op.execute(_skip_unchanged(at=False))
