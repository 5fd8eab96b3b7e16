"""A whole-lake cut below a table's start is none, wherever the candidate moved.

0028 answered ``latest_cut(NULL)`` by index probes and compared the highest start with the lowest
watermark once, before the loop that moves the candidate down past coalesced ranges. A range can
move it below a start: a table started at barrier 2 (watermark 2) beside one that coalesced 1..3
gave barrier 1, which the first table never completed (0013 compared at every step; Hypothesis
found the case in ``test_cut_agreement``). The comparison is made at every step again.

Revision ID: 0034
Revises: 0033
Create Date: 2026-11-29
"""

import importlib.util
import re
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE OR REPLACE FUNCTION latest_cut(p_namespace text) RETURNS bigint
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_lowest bigint;
    v_highest_start bigint;
    v_lower bigint;
BEGIN
    IF p_namespace IS NOT NULL THEN
        RETURN latest_valid(ARRAY(
            SELECT t.table_id FROM managed_table t
            WHERE t.name COLLATE "C" > p_namespace || '.' AND t.name COLLATE "C" < p_namespace || '/'  -- '/' follows '.'
              AND (t.watermark IS NOT NULL OR EXISTS (SELECT 1 FROM job_sink k WHERE k.table_id = t.table_id))),
            NULL);
    END IF;
    v_lowest := (SELECT min(t.watermark) FROM managed_table t);
    -- a sink that has completed nothing yet is in no cut
    IF v_lowest IS NULL OR EXISTS (
        SELECT 1 FROM managed_table t
        WHERE t.watermark IS NULL AND EXISTS (SELECT 1 FROM job_sink k WHERE k.table_id = t.table_id)
    ) THEN
        RETURN NULL;
    END IF;
    v_highest_start := (SELECT max(t.start_barrier) FROM managed_table t);
    LOOP  -- no watermark is below the candidate, only coalesced ranges can hold it
        IF v_highest_start > v_lowest THEN
            RETURN NULL;  -- a cut below a table's start is none (and the candidate only moves down)
        END IF;
        SELECT min(r.after_barrier) INTO v_lower FROM coalesced_range r
        WHERE r.into_barrier > v_lowest AND r.after_barrier < v_lowest;
        IF v_lower IS NULL THEN
            RETURN v_lowest;
        END IF;
        v_lowest := v_lower;
    END LOOP;
END $$;
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def _previous() -> str:
    """0028's latest_cut, verbatim."""
    path = Path(__file__).with_name("0028_whole_lake_cut_by_index.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return re.search(r"CREATE OR REPLACE FUNCTION latest_cut\(.*?END \$\$;", module.UPGRADE, re.S).group(0)


def upgrade() -> None:
    op.execute(UPGRADE.format(search_path=_search_path()))


def downgrade() -> None:
    op.execute(_previous().format(search_path=_search_path()))
