"""Cuts that scale: the whole-lake read-committed cut costs one scan of the table rows (no
per-table probes), a namespace's cut costs what its tables cost.

``latest_cut(NULL)`` (the ``read-committed`` warehouse, ``consistent_barrier``) was
``latest_valid`` over an array of every tracked table: each step of its loop probed every
table for a coalesced range. Now: one pass over ``managed_table`` gives the lowest watermark
and the highest start (a cut below a table's start is none), and each step asks the coalesced
ranges that hold the candidate strictly inside (an index on ``into_barrier``; ranges of the
last few barriers) — the same answer. ``latest_cut(namespace)`` finds the namespace's tables
by a range of an index on the name (byte order) instead of a LIKE over every table (in
which a ``_`` of the namespace matched any character).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24
"""

from psycopg import sql

from alembic import context, op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE INDEX coalesced_range_into_idx ON coalesced_range (into_barrier);
CREATE INDEX managed_table_name_prefix_idx ON managed_table (name COLLATE "C");

-- The newest barrier every tracked managed table (p_namespace: of catalog.namespace) has
-- completed, NULL if there is none yet. Runs as the owner: readers reach it through views.
CREATE OR REPLACE FUNCTION latest_cut(p_namespace text) RETURNS bigint
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v record;
    v_lower bigint;
BEGIN
    IF p_namespace IS NOT NULL THEN
        RETURN latest_valid(ARRAY(
            SELECT t.table_id FROM managed_table t
            WHERE t.name COLLATE "C" > p_namespace || '.' AND t.name COLLATE "C" < p_namespace || '/'  -- '/' follows '.'
              AND (t.watermark IS NOT NULL OR EXISTS (SELECT 1 FROM job_sink k WHERE k.table_id = t.table_id))),
            NULL);
    END IF;
    -- a sink that has completed nothing yet is in no cut
    SELECT min(t.watermark) AS lowest, max(t.start_barrier) AS highest_start,
           bool_or(t.watermark IS NULL AND EXISTS (SELECT 1 FROM job_sink k WHERE k.table_id = t.table_id)) AS unstarted
      INTO v FROM managed_table t;
    IF v.lowest IS NULL OR v.unstarted THEN
        RETURN NULL;
    END IF;
    LOOP  -- the candidate only moves down: no watermark is below it, only coalesced ranges can hold it
        IF v.highest_start > v.lowest THEN
            RETURN NULL;
        END IF;
        SELECT min(r.after_barrier) INTO v_lower FROM coalesced_range r
        WHERE r.into_barrier > v.lowest AND r.after_barrier < v.lowest;
        IF v_lower IS NULL THEN
            RETURN v.lowest;
        END IF;
        v.lowest := v_lower;
    END LOOP;
END $$;
"""

DOWNGRADE = """
CREATE OR REPLACE FUNCTION latest_cut(p_namespace text) RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = {search_path}
BEGIN ATOMIC
    SELECT latest_valid(array_agg(t.table_id), NULL) FROM managed_table t
    WHERE (t.watermark IS NOT NULL OR EXISTS (SELECT 1 FROM job_sink k WHERE k.table_id = t.table_id))
      AND (p_namespace IS NULL OR t.name LIKE p_namespace || '.%');
END;
DROP INDEX managed_table_name_prefix_idx;
DROP INDEX coalesced_range_into_idx;
"""


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def upgrade() -> None:
    op.execute(UPGRADE.format(search_path=_search_path()))


def downgrade() -> None:
    op.execute(DOWNGRADE.format(search_path=_search_path()))
