"""Cost follows change: skipped and coalesced barriers, anchors, cuts that read the table rows.

- **Anchors.** The first barrier issued at or after each multiple of ``anchor_interval_ms``
  (default 60 s, on the database clock) is flagged ``barrier.anchor`` when issued. Anchors
  are never coalesced.
- **Skip.** A job whose sources did not change since its progress P completes the barriers
  up to B in one statement: ``complete_barrier`` accepts B > next(P) without coalescing when
  no source changed strictly between P and B (a root job: when it commits nothing).
- **Coalesce.** With ``p_coalesce`` a job completes B once for the barriers strictly between
  P and B (none of them an anchor); each sink records the range in ``coalesced_range`` and,
  for cheap cuts, its newest range on its row. The one definition of "T has completed B"
  becomes ``has_completed(T, B)``: start <= B <= W and B not coalesced in T.
- **Cuts read rows.** ``S(T, W(T))`` and the barrier of its commit are kept on the table's
  row, so a cut at or after it reads the row instead of probing ``table_commit``; the
  read-committed cut over tables whose slowest watermark is coalesced elsewhere falls back
  to the newest valid barrier below it (``latest_valid``).
- ``plan_barrier(job)``: the plan a job follows (exact, skip or coalesce), from the same
  definitions.
- ``input_ranges`` checks the caller's grant once per query instead of once per row.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23
"""

import importlib.util
import re
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

TABLES = """
ALTER TABLE setting DROP CONSTRAINT setting_known_value_check;
ALTER TABLE setting ADD CONSTRAINT setting_known_value_check CHECK (
    CASE key
        WHEN 'barrier_interval_ms' THEN
            CASE WHEN value ~ '^[0-9]{1,9}$' THEN value::bigint BETWEEN 1 AND 604800000 ELSE false END
        WHEN 'anchor_interval_ms' THEN
            CASE WHEN value ~ '^[0-9]{1,9}$' THEN value::bigint BETWEEN 1 AND 604800000 ELSE false END
        WHEN 'lease_max_ttl_ms' THEN
            CASE WHEN value ~ '^[0-9]{1,9}$' THEN value::bigint BETWEEN 1000 AND 604800000 ELSE false END
        ELSE false
    END);
INSERT INTO setting (key, value) VALUES ('anchor_interval_ms', '60000');

-- The first barrier issued at or after each multiple of the anchor interval.
ALTER TABLE barrier ADD COLUMN anchor boolean NOT NULL DEFAULT false;
UPDATE barrier b SET anchor = true
FROM (SELECT barrier, lag(barrier) OVER (ORDER BY barrier) AS previous FROM barrier) x
WHERE x.barrier = b.barrier AND (x.previous IS NULL OR x.barrier / 60000000 > x.previous / 60000000);
CREATE INDEX barrier_anchor ON barrier (barrier) WHERE anchor;

-- Barriers strictly between after_barrier and into_barrier are coalesced in the table: it
-- completed into_barrier once for all of them, and its state at them is undefined.
CREATE TABLE coalesced_range (
    table_id      bigint NOT NULL CONSTRAINT coalesced_range_table_fkey REFERENCES managed_table,
    after_barrier bigint NOT NULL CONSTRAINT coalesced_range_after_fkey REFERENCES barrier,
    into_barrier  bigint NOT NULL CONSTRAINT coalesced_range_into_fkey REFERENCES barrier,
    job_name      text   NOT NULL,
    CONSTRAINT coalesced_range_pkey PRIMARY KEY (table_id, into_barrier),
    CONSTRAINT coalesced_range_order_check CHECK (after_barrier < into_barrier)
);

-- On the table's row: its newest coalesced range, and S(T, W(T)) with its commit's barrier.
ALTER TABLE managed_table
    ADD COLUMN coalesced_after bigint, ADD COLUMN coalesced_into bigint,
    ADD COLUMN current_snapshot_id bigint, ADD COLUMN current_barrier bigint;
UPDATE managed_table m SET current_snapshot_id = c.snapshot_id, current_barrier = c.barrier
FROM (SELECT DISTINCT ON (table_id) table_id, snapshot_id, barrier FROM table_commit WHERE revoked_by IS NULL
      ORDER BY table_id, barrier DESC, commit_id DESC) c
WHERE c.table_id = m.table_id;

-- A completion covers the barriers after from_barrier up to barrier (one, a skipped run, or
-- a coalesced range).
ALTER TABLE table_completion ADD COLUMN from_barrier bigint, ADD COLUMN coalesced boolean NOT NULL DEFAULT false;
"""

DROPPED = """
DROP VIEW consistent_barrier;
DROP FUNCTION cut_at(text[], bigint);
DROP FUNCTION latest_cut(text);
DROP FUNCTION protection(bigint);
DROP FUNCTION has_completed(bigint, bigint, bigint);
DROP FUNCTION complete_barrier(text, bigint, text[], bigint[], text);
"""

DEFINITIONS = """
-- The coalesced range of T's history that holds B strictly inside, as [after, into]; NULL if
-- none (one index probe: ranges are disjoint, the first ending after B is the only candidate).
CREATE FUNCTION coalesced_range_at(p_table_id bigint, p_barrier bigint) RETURNS bigint[]
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT CASE WHEN r.after_barrier < p_barrier THEN ARRAY[r.after_barrier, r.into_barrier] END
    FROM coalesced_range r WHERE r.table_id = p_table_id AND r.into_barrier > p_barrier
    ORDER BY r.into_barrier LIMIT 1;
END;

-- The same from the table's row, which holds its newest range: the history is probed only for
-- a barrier older than that. Inlined by the planner (no subquery in the body).
CREATE FUNCTION coalesced_at(t managed_table, p_barrier bigint) RETURNS bigint[]
LANGUAGE sql STABLE PARALLEL SAFE
RETURN CASE
    WHEN t.coalesced_after IS NULL OR p_barrier >= t.coalesced_into OR p_barrier = t.coalesced_after THEN NULL
    WHEN p_barrier > t.coalesced_after THEN ARRAY[t.coalesced_after, t.coalesced_into]
    ELSE coalesced_range_at(t.table_id, p_barrier)
END;

-- T has completed B: start(T) <= B <= W(T), and B is not coalesced in T.
CREATE FUNCTION has_completed(t managed_table, p_barrier bigint) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
RETURN coalesce(t.start_barrier <= p_barrier AND p_barrier <= t.watermark, false)
       AND coalesced_at(t, p_barrier) IS NULL;

-- S(T, B)'s snapshot id from snapshot_at (one probe into table_commit).
CREATE FUNCTION snapshot_id_from_history(p_table_id bigint, p_barrier bigint) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT s.snapshot_id FROM snapshot_at(p_table_id, p_barrier) s;
END;

-- S(T, B)'s snapshot id: from the row when B is at or after the current commit's barrier,
-- else from the history. Inlined by the planner.
CREATE FUNCTION snapshot_id_at(t managed_table, p_barrier bigint) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
RETURN CASE WHEN t.current_barrier IS NULL OR t.current_barrier <= p_barrier THEN t.current_snapshot_id
            ELSE snapshot_id_from_history(t.table_id, p_barrier) END;

-- The newest barrier <= p_bound (NULL: the tables' lowest watermark) that every table in
-- p_ids has completed; NULL if there is none. Each step moves below what keeps the
-- candidate from being valid (a watermark, or the start of a coalesced range). p_check_starts
-- false: tables count as started since ever (the floor of every read-committed cut over any
-- of them).
CREATE FUNCTION latest_valid(p_ids bigint[], p_bound bigint, p_check_starts boolean DEFAULT true) RETURNS bigint
LANGUAGE plpgsql STABLE SET search_path = {search_path} AS $$
DECLARE
    v_b bigint := p_bound;
    v record;
BEGIN
    IF v_b IS NULL THEN
        SELECT min(m.watermark) INTO v_b FROM managed_table m WHERE m.table_id = ANY(p_ids);
    END IF;
    LOOP
        SELECT bool_or(m.start_barrier IS NULL OR (p_check_starts AND m.start_barrier > v_b)) AS late,
               min(CASE WHEN v_b > m.watermark THEN m.watermark ELSE (coalesced_at(m, v_b))[1] END) AS lower
          INTO v FROM managed_table m WHERE m.table_id = ANY(p_ids);
        IF v_b IS NULL OR v.late THEN
            RETURN NULL;
        ELSIF v.lower IS NULL THEN
            RETURN v_b;
        END IF;
        v_b := v.lower;
    END LOOP;
END $$;

-- The oldest barrier >= p_bound every table in p_ids has completed; NULL if there is none yet.
CREATE FUNCTION earliest_valid(p_ids bigint[], p_bound bigint) RETURNS bigint
LANGUAGE plpgsql STABLE SET search_path = {search_path} AS $$
DECLARE
    v_b bigint := p_bound;
    v record;
BEGIN
    LOOP
        SELECT bool_or(m.watermark IS NULL OR v_b > m.watermark) AS beyond,
               max(CASE WHEN v_b < m.start_barrier THEN m.start_barrier ELSE (coalesced_at(m, v_b))[2] END) AS higher
          INTO v FROM managed_table m WHERE m.table_id = ANY(p_ids);
        IF v_b IS NULL OR v.beyond THEN
            RETURN NULL;
        ELSIF v.higher IS NULL THEN
            RETURN v_b;
        END IF;
        v_b := v.higher;
    END LOOP;
END $$;

-- Progress and S(T, b) for the named tables (in the order given; NULLs for unknown names),
-- b being the given barrier, else the tables' lowest watermark (the read-committed
-- candidate). valid: every table has completed b; expired: S(T, b) was expired (never the
-- current snapshot, so a cut at or after the current commit reads only the row).
CREATE FUNCTION cut_at(p_names text[], p_barrier bigint)
RETURNS TABLE (ord bigint, table_name text, table_id bigint, start_barrier bigint, watermark bigint,
               snapshot_id bigint, expired boolean, barrier bigint, issued boolean, valid boolean)
LANGUAGE sql STABLE
BEGIN ATOMIC
    WITH t AS (
        SELECT n.ord, n.name, m
        FROM unnest(p_names) WITH ORDINALITY AS n(name, ord)
        LEFT JOIN managed_table m ON m.name = n.name),
    bound AS (SELECT coalesce(p_barrier, min((t.m).watermark)) AS b FROM t),
    verdict AS MATERIALIZED (
        SELECT bound.b,
               EXISTS (SELECT 1 FROM barrier x WHERE x.barrier = bound.b) AS issued,
               (SELECT bool_and(has_completed(t.m, bound.b)) FROM t) AS valid
        FROM bound)
    SELECT t.ord, t.name, (t.m).table_id, (t.m).start_barrier, (t.m).watermark, s.id,
           CASE WHEN (t.m).current_barrier <= verdict.b THEN false
                ELSE EXISTS (SELECT 1 FROM expired_snapshot e
                             WHERE e.table_id = (t.m).table_id AND e.snapshot_id = s.id) END,
           verdict.b, verdict.issued, coalesce(verdict.valid, false)
    FROM t CROSS JOIN verdict
    CROSS JOIN LATERAL (SELECT snapshot_id_at(t.m, verdict.b) AS id) s
    ORDER BY t.ord;
END;

-- The newest barrier every tracked managed table (p_namespace: of catalog.namespace) has
-- completed, NULL if there is none yet. Runs as the owner: readers reach it through views.
CREATE FUNCTION latest_cut(p_namespace text) RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = {search_path}
BEGIN ATOMIC
    SELECT latest_valid(array_agg(t.table_id), NULL) FROM managed_table t
    WHERE (t.watermark IS NOT NULL OR EXISTS (SELECT 1 FROM job_sink k WHERE k.table_id = t.table_id))
      AND (p_namespace IS NULL OR t.name LIKE p_namespace || '.%');
END;

-- What expiry must keep of one table, by reason: its current snapshot, live lease pins,
-- downstream job progress pins, and the read-committed window (every snapshot a
-- read-committed reader may resolve now: S(T, lo) and all commits in (lo, W(T)], lo being
-- the newest barrier up to the lowest watermark that no started table coalesced — a valid
-- cut over any of them is at or after it —, or the lowest progress of any job; a job that
-- recorded its first barrier but has not completed it counts as being there).
CREATE FUNCTION protection(p_table_id bigint)
RETURNS TABLE (current bigint, leases jsonb, job_progress jsonb, read_window jsonb)
LANGUAGE sql STABLE
BEGIN ATOMIC
    WITH t AS (SELECT table_id, watermark FROM managed_table WHERE table_id = p_table_id),
    started AS (
        SELECT j.job_id, j.name,
               coalesce((SELECT max(m.watermark) FROM job_sink k JOIN managed_table m USING (table_id)
                         WHERE k.job_id = j.job_id),
                        (SELECT min(r.barrier) FROM input_range r WHERE r.job_name = j.name)) AS progress
        FROM job j WHERE j.active),
    lo AS (
        SELECT least(latest_valid(array_agg(m.table_id), NULL, false), (SELECT min(progress) FROM started)) AS b
        FROM managed_table m WHERE m.watermark IS NOT NULL)
    SELECT
      (SELECT s.snapshot_id FROM snapshot_at(t.table_id, 9223372036854775807) s),
      coalesce((SELECT jsonb_agg(jsonb_build_array(l.lease_id, ls.snapshot_id))
                FROM lease_snapshot ls JOIN lease l USING (lease_id)
                WHERE ls.table_id = t.table_id AND l.released_at IS NULL AND l.expires_at > now()), '[]'),
      coalesce((SELECT jsonb_agg(jsonb_build_array(st.name, s.snapshot_id))
                FROM job_source src JOIN started st USING (job_id)
                CROSS JOIN LATERAL snapshot_at(t.table_id, st.progress) s
                WHERE src.table_id = t.table_id), '[]'),
      coalesce((SELECT jsonb_agg(c.snapshot_id) FROM table_commit c
                WHERE c.revoked_by IS NULL AND c.table_id = t.table_id
                  AND c.barrier > (SELECT b FROM lo) AND c.barrier <= t.watermark), '[]')
        || coalesce((SELECT jsonb_build_array(s.snapshot_id) FROM snapshot_at(t.table_id, (SELECT b FROM lo)) s),
                    '[]')
    FROM t;
END;

-- The last barrier strictly before p_barrier at which no source of a job changed since
-- p_after (the end of a run the job may skip): before the first data commit, and at the start
-- of the first coalesced range, of any source after p_after; p_limit when none changed.
CREATE FUNCTION unchanged_until(p_sources bigint[], p_after bigint, p_limit bigint) RETURNS bigint
LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT least(p_limit,
                 (SELECT max(x.barrier) FROM barrier x WHERE x.barrier < (
                      SELECT min(c.barrier) FROM table_commit c
                      WHERE c.table_id = ANY(p_sources) AND c.barrier > p_after AND c.barrier <= p_limit
                        AND c.revoked_by IS NULL AND c.operation <> 'compaction')),
                 (SELECT min(greatest(r.after_barrier, p_after)) FROM coalesced_range r
                  WHERE r.table_id = ANY(p_sources) AND r.into_barrier > p_after
                    AND r.after_barrier < p_limit));
END;
"""

FUNCTIONS = """
-- Advance the clock to greatest(last + 1, now) and record the barrier, in one statement,
-- flagged as an anchor if it is the first at or after a multiple of the anchor interval;
-- with p_min_age_us only if the newest barrier is at least that old (concurrent callers then
-- get one new barrier between them).
CREATE OR REPLACE FUNCTION tick_barrier(p_issued_by text, p_min_age_us bigint) RETURNS SETOF barrier
LANGUAGE sql SET search_path = {search_path}
BEGIN ATOMIC
    WITH now_us AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS us),
    tick AS (
        UPDATE barrier_clock c
        SET last_barrier = greatest(c.last_barrier + 1, now_us.us)
        FROM now_us
        WHERE p_min_age_us IS NULL OR c.last_barrier <= now_us.us - p_min_age_us
        RETURNING c.last_barrier),
    anchor AS (SELECT value::bigint * 1000 AS us FROM setting WHERE key = 'anchor_interval_ms')
    INSERT INTO barrier (barrier, issued_at, issued_by, anchor)
    SELECT tick.last_barrier, clock_timestamp(), p_issued_by,
           NOT EXISTS (SELECT 1 FROM barrier x WHERE x.barrier >= tick.last_barrier - tick.last_barrier % anchor.us)
    FROM tick CROSS JOIN anchor
    RETURNING barrier, issued_at, issued_by, anchor;
END;

CREATE OR REPLACE FUNCTION set_setting(p_key text, p_value text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_admin('change settings');
    UPDATE setting SET value = p_value WHERE key = p_key;
    IF NOT FOUND THEN
        PERFORM fail('IB014', format('there is no setting %s', p_key));
    END IF;
EXCEPTION WHEN check_violation THEN
    PERFORM fail('IB014', format('%s ms for setting %s is out of range; barrier_interval_ms and anchor_interval_ms '
                                 'take 1 ms to 7 days, lease_max_ttl_ms 1 s to 7 days', p_value, p_key));
END $$;

-- The plan job p_job follows next (DESIGN.md, "Cost follows change"): the barrier, and how —
-- exact (the next barrier after its progress P), skip (no source changed up to it: no
-- computation), or coalesce (one computation for the barriers after P up to it, never past
-- the first anchor after P). A recorded input range after P is resumed. p_skip false: the
-- job reads the barrier itself and is never skipped; p_coalesce false: every barrier exact;
-- p_up_to: a root job's input is ready up to that barrier only (an event-time watermark).
-- ready: the sources have completed the barrier; waiting: those that have not (watermarks).
CREATE FUNCTION plan_barrier(p_job text, p_skip boolean DEFAULT true, p_coalesce boolean DEFAULT true,
                             p_up_to bigint DEFAULT NULL)
RETURNS TABLE (barrier bigint, plan text, from_barrier bigint, anchors_in_range integer, ready boolean,
               waiting jsonb, root boolean)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    j record;
    v_next bigint;
    v_target bigint;
    v_plan text;
    v_limit bigint;
BEGIN
    PERFORM require_job(p_job, 'plan barriers of');
    SELECT x.job_id, x.sources, x.progress,
           (SELECT min(r.barrier) FROM input_range r
            WHERE r.job_name = p_job AND r.barrier > coalesce(x.progress, -1)) AS resume,
           (SELECT min(m.watermark) FROM managed_table m WHERE m.table_id = ANY(x.sources)) AS sources_at,
           (SELECT bool_and(m.watermark IS NOT NULL) FROM managed_table m WHERE m.table_id = ANY(x.sources)) AS started
      INTO j
      FROM (SELECT jb.job_id,
                   ARRAY(SELECT s.table_id FROM job_source s WHERE s.job_id = jb.job_id) AS sources,
                   (SELECT max(m.watermark) FROM job_sink k JOIN managed_table m USING (table_id)
                    WHERE k.job_id = jb.job_id) AS progress
            FROM job jb WHERE jb.name = p_job AND jb.active) x;
    IF j.job_id IS NULL THEN
        PERFORM fail('IB001', format('job %s is not registered', p_job), jsonb_build_object('job', p_job));
    END IF;
    v_next := (SELECT min(b.barrier) FROM barrier b WHERE b.barrier > j.progress);

    IF j.resume IS NOT NULL THEN  -- input recorded for a barrier: complete exactly that one
        v_target := j.resume;
        v_plan := CASE WHEN j.progress IS NULL OR v_target = v_next THEN 'exact' ELSE 'coalesce' END;
    ELSIF cardinality(j.sources) = 0 THEN  -- a root job: the newest barrier, or the first anchor before it
        v_limit := CASE WHEN p_up_to IS NULL THEN (SELECT max(b.barrier) FROM barrier b)
                        ELSE coalesce(greatest((SELECT max(b.barrier) FROM barrier b WHERE b.barrier <= p_up_to), v_next),
                                      (SELECT max(b.barrier) FROM barrier b)) END;
        IF j.progress IS NULL THEN
            v_target := v_limit;
        ELSIF v_next IS NOT NULL THEN
            v_target := CASE WHEN p_coalesce THEN least(v_limit, (SELECT min(b.barrier) FROM barrier b
                                                                 WHERE b.anchor AND b.barrier > j.progress))
                             ELSE v_next END;
        END IF;
        v_plan := CASE WHEN j.progress IS NULL OR v_target = v_next THEN 'exact' ELSE 'coalesce' END;
    ELSIF j.progress IS NULL THEN  -- bootstrap at the sources' newest common barrier
        v_target := latest_valid(j.sources, NULL);
        v_plan := 'exact';
    ELSIF v_next IS NULL OR NOT j.started OR j.sources_at < v_next THEN
        v_target := v_next;  -- not ready: the sources are behind
        v_plan := 'exact';
    ELSE
        v_limit := CASE WHEN p_skip THEN unchanged_until(j.sources, j.progress, j.sources_at) END;
        IF v_limit > j.progress THEN
            v_target := v_limit;
            v_plan := 'skip';
        ELSIF p_coalesce THEN
            v_target := latest_valid(j.sources, least(j.sources_at, (SELECT min(b.barrier) FROM barrier b
                                                                     WHERE b.anchor AND b.barrier > j.progress)));
            IF v_target IS NULL OR v_target < v_next THEN
                v_target := v_next;  -- a source coalesced v_next: wait for the others to pass its range
            END IF;
            v_plan := CASE WHEN v_target = v_next THEN 'exact' ELSE 'coalesce' END;
        ELSE
            v_target := v_next;
            v_plan := 'exact';
        END IF;
    END IF;

    barrier := v_target;
    plan := v_plan;
    from_barrier := j.progress;
    anchors_in_range := (SELECT count(*) FROM barrier b WHERE b.anchor AND b.barrier > coalesce(j.progress, v_target - 1)
                                                         AND b.barrier <= v_target);
    waiting := (SELECT jsonb_object_agg(m.name, m.watermark) FROM managed_table m
                WHERE m.table_id = ANY(j.sources) AND (v_target IS NULL OR NOT has_completed(m, v_target)));
    ready := v_target IS NOT NULL AND waiting IS NULL AND NOT coalesce(v_target > p_up_to, false);
    root := cardinality(j.sources) = 0;
    RETURN NEXT;
END $$;

-- Job p_job completes barrier p_barrier for all its sinks, recording the snapshots committed
-- (p_tables[i] -> p_snapshots[i]; sinks without one keep theirs) and when. From its progress
-- P, the barriers strictly between P and p_barrier are either skipped (exact: no source changed
-- among them; a root job says so by committing nothing) or, with p_coalesce, coalesced (none
-- of them an anchor). Completing a completed barrier again with the same commits is a no-op
-- (noop = true); with others, refused. One read decides (and names what is wrong); the sinks
-- then move by compare-and-set from the progress that read saw: if another process moved them
-- first, nothing is written and the conflict is retryable (SQLSTATE 40001). The topology
-- lock, taken shared, keeps the job's sinks what the read saw.
CREATE FUNCTION complete_barrier(p_job text, p_barrier bigint, p_tables text[] DEFAULT '{{}}',
                                 p_snapshots bigint[] DEFAULT '{{}}', p_run_id text DEFAULT NULL,
                                 p_coalesce boolean DEFAULT false)
RETURNS TABLE (sinks text[], noop boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    s record;
    v_given jsonb;
    v_recorded jsonb;
    v_strangers text[];
    v_moved integer;
    v_between boolean;
    v_anchor bigint;
    v_exact_until bigint;
BEGIN
    PERFORM require_job(p_job, 'complete barriers of');
    IF cardinality(p_tables) IS DISTINCT FROM cardinality(p_snapshots) OR (cardinality(p_tables) > 1 AND
       (SELECT count(DISTINCT x) FROM unnest(p_tables) x) <> cardinality(p_tables)) THEN
        PERFORM fail('IB014', 'commits must name each table once, each with one snapshot id');
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(lock_key('topology'), 0) THEN
        PERFORM take_lock('topology', ARRAY[0::bigint], true, format('completing barrier %s of job %s', p_barrier,
                                                                      p_job));
    END IF;
    SELECT j.job_id, EXISTS (SELECT 1 FROM barrier b WHERE b.barrier = p_barrier) AS issued, k.*,
           ARRAY(SELECT src.table_id FROM job_source src WHERE src.job_id = j.job_id) AS sources,
           (SELECT min(b.barrier) FROM barrier b WHERE b.barrier > k.progress) AS expected,
           (SELECT jsonb_object_agg(t.name, t.watermark) FROM job_source src JOIN managed_table t USING (table_id)
            WHERE src.job_id = j.job_id AND NOT has_completed(t, p_barrier)) AS waiting,
           (SELECT jsonb_object_agg(t.name, (coalesced_at(t, p_barrier))[2]) FROM job_source src
            JOIN managed_table t USING (table_id)
            WHERE src.job_id = j.job_id AND coalesced_at(t, p_barrier) IS NOT NULL) AS coalesced_in_sources
      INTO s
      FROM job j
      CROSS JOIN LATERAL (
          SELECT array_agg(t.table_id) AS ids, array_agg(t.name) AS names, min(t.start_barrier) AS start,
                 max(t.watermark) AS progress, min(t.watermark) IS DISTINCT FROM max(t.watermark)
                 OR (count(t.watermark) <> count(*) AND count(t.watermark) > 0) AS split, count(*) AS n,
                 min(t.name) FILTER (WHERE t.revision_id IS NOT NULL) AS revising, min(t.revision_id) AS revision_id,
                 (array_agg(t ORDER BY t.table_id))[1] AS first_sink
          FROM job_sink k JOIN managed_table t USING (table_id) WHERE k.job_id = j.job_id) k
     WHERE j.name = p_job AND j.active;
    IF s.job_id IS NULL THEN
        PERFORM fail('IB001', format('job %s is not registered', p_job), jsonb_build_object('job', p_job));
    ELSIF NOT s.issued THEN
        PERFORM fail('IB002', format('barrier %s was never issued', p_barrier), jsonb_build_object('barrier', p_barrier));
    ELSIF s.revising IS NOT NULL THEN
        PERFORM fail('IB003', format('table %s is being revised (revision %s)', s.revising, s.revision_id),
                     jsonb_build_object('table', s.revising, 'revision_id', s.revision_id));
    ELSIF NOT p_tables <@ s.names THEN
        v_strangers := ARRAY(SELECT x FROM unnest(p_tables) x WHERE NOT x = ANY(s.names) ORDER BY 1);
        PERFORM fail('IB004', format('job %s does not write %s', p_job, array_to_string(v_strangers, ', ')),
                     jsonb_build_object('job', p_job, 'tables', to_jsonb(v_strangers)));
    ELSIF s.split THEN
        PERFORM fail('IB005', format('the sinks of job %s are at different barriers', p_job),
                     jsonb_build_object('job', p_job, 'watermarks', (
                         SELECT jsonb_object_agg(t.name, t.watermark) FROM managed_table t
                         WHERE t.table_id = ANY(s.ids))));
    END IF;

    IF has_completed(s.first_sink, p_barrier) THEN
        SELECT coalesce(jsonb_object_agg(c.name, c.snapshot_id), '{{}}') INTO v_given
        FROM unnest(p_tables, p_snapshots) AS c(name, snapshot_id);
        SELECT coalesce(jsonb_object_agg(t.name, c.snapshot_id), '{{}}') INTO v_recorded
        FROM table_commit c JOIN managed_table t USING (table_id)
        WHERE c.table_id = ANY(s.ids) AND c.barrier = p_barrier AND c.operation = 'data' AND c.revoked_by IS NULL;
        IF v_recorded <> v_given THEN
            PERFORM fail('IB006', format('job %s already completed barrier %s with other commits', p_job, p_barrier),
                         jsonb_build_object('job', p_job, 'barrier', p_barrier, 'recorded', v_recorded,
                                            'given', v_given));
        END IF;
        sinks := s.names;
        noop := true;
        RETURN NEXT;
        RETURN;
    ELSIF s.progress IS NOT NULL AND p_barrier <= s.progress THEN
        PERFORM fail('IB007', format('job %s cannot complete barrier %s: its sinks are at %s', p_job, p_barrier,
                                     s.progress),
                     jsonb_build_object('job', p_job, 'barrier', p_barrier, 'expected', s.expected,
                                        'watermark', s.progress,
                                        'coalesced_into', (coalesced_at(s.first_sink, p_barrier))[2]));
    ELSIF s.waiting IS NOT NULL THEN
        PERFORM fail('IB008', format('the sources of job %s have not completed barrier %s', p_job, p_barrier),
                     jsonb_build_object('job', p_job, 'barrier', p_barrier, 'waiting', s.waiting,
                                        'coalesced', s.coalesced_in_sources));
    END IF;

    v_between := s.progress IS NOT NULL AND p_barrier > s.expected;
    IF v_between AND p_coalesce THEN
        v_anchor := (SELECT min(b.barrier) FROM barrier b WHERE b.anchor AND b.barrier > s.progress
                                                             AND b.barrier < p_barrier);
        IF v_anchor IS NOT NULL THEN
            PERFORM fail('IB022', format('job %s cannot coalesce barriers %s..%s: anchor %s lies between', p_job,
                                         s.progress, p_barrier, v_anchor),
                         jsonb_build_object('job', p_job, 'barrier', p_barrier, 'watermark', s.progress,
                                            'anchor', v_anchor));
        END IF;
    ELSIF v_between THEN  -- skipped barriers: exact only if nothing changed among them
        v_exact_until := CASE WHEN cardinality(s.sources) > 0
                              THEN unchanged_until(s.sources, s.progress, p_barrier)
                              WHEN cardinality(p_tables) = 0 THEN p_barrier
                              ELSE s.progress END;
        IF v_exact_until < (SELECT max(b.barrier) FROM barrier b WHERE b.barrier < p_barrier) THEN
            PERFORM fail('IB007', format('job %s must complete barrier %s next, not %s', p_job,
                                         greatest(s.expected, v_exact_until), p_barrier),
                         jsonb_build_object('job', p_job, 'barrier', p_barrier,
                                            'expected', greatest(s.expected, v_exact_until),
                                            'watermark', s.progress, 'changed',
                                            CASE WHEN cardinality(s.sources) > 0 THEN 'sources' ELSE 'input' END));
        END IF;
    END IF;

    UPDATE managed_table t
    SET watermark = p_barrier, start_barrier = coalesce(start_barrier, p_barrier),
        coalesced_after = CASE WHEN v_between AND p_coalesce THEN s.progress ELSE t.coalesced_after END,
        coalesced_into = CASE WHEN v_between AND p_coalesce THEN p_barrier ELSE t.coalesced_into END,
        current_snapshot_id = coalesce(c.snapshot_id, t.current_snapshot_id),
        current_barrier = CASE WHEN c.snapshot_id IS NULL THEN t.current_barrier ELSE p_barrier END
    FROM unnest(s.ids) AS u(table_id)
    LEFT JOIN (SELECT m.table_id, x.snapshot_id FROM unnest(p_tables, p_snapshots) AS x(name, snapshot_id)
               JOIN managed_table m USING (name)) c USING (table_id)
    WHERE t.table_id = u.table_id AND t.watermark IS NOT DISTINCT FROM s.progress AND t.revision_id IS NULL;
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> s.n THEN
        RAISE EXCEPTION 'another process completed or revised the sinks of job % first', p_job
              USING ERRCODE = 'serialization_failure';
    END IF;
    IF v_between AND p_coalesce THEN
        INSERT INTO coalesced_range (table_id, after_barrier, into_barrier, job_name)
        SELECT unnest(s.ids), s.progress, p_barrier, p_job;
    END IF;
    INSERT INTO table_commit (table_id, barrier, snapshot_id, job_name, run_id)
    SELECT t.table_id, p_barrier, c.snapshot_id, p_job, p_run_id
    FROM unnest(p_tables, p_snapshots) AS c(name, snapshot_id) JOIN managed_table t USING (name);
    INSERT INTO table_completion (table_id, barrier, job_name, completed_at, from_barrier, coalesced)
    SELECT unnest(s.ids), p_barrier, p_job, clock_timestamp(), s.progress, v_between AND p_coalesce;
    sinks := s.names;
    noop := false;
    RETURN NEXT;
END $$;

-- Record another snapshot a table has completed p_barrier with (compaction, or adoption of a
-- commit found in the table); false if already recorded. The admin, or the table's writer.
CREATE OR REPLACE FUNCTION record_commit(p_table text, p_barrier bigint, p_snapshot_id bigint, p_operation text,
                                         p_job text, p_run_id text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    t managed_table;
    v_writer text;
BEGIN
    SELECT * INTO t FROM managed_table m WHERE m.name = p_table FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM fail('IB009', format('table %s is not managed by icebarrier', p_table), jsonb_build_object('table', p_table));
    END IF;
    v_writer := (SELECT j.name FROM job_sink k JOIN job j USING (job_id) WHERE k.table_id = t.table_id AND j.active);
    IF NOT (caller_is_admin() OR (v_writer IS NOT NULL AND caller_acts_for(v_writer))) THEN
        PERFORM fail('IB030', format('role %s may not record commits of %s', session_user, p_table),
                     jsonb_build_object('role', session_user, 'action', 'record commits of ' || p_table,
                                        'job', v_writer));
    END IF;
    IF NOT has_completed(t, p_barrier) THEN
        PERFORM fail('IB021', format('table %s has not completed barrier %s (it completed %s..%s%s); its job records '
                                     'that commit when it completes it', p_table, p_barrier,
                                     t.start_barrier, t.watermark,
                                     coalesce(', coalescing it into ' || (coalesced_at(t, p_barrier))[2], '')));
    END IF;
    IF EXISTS (SELECT 1 FROM table_commit c WHERE c.table_id = t.table_id AND c.snapshot_id = p_snapshot_id
                                                AND c.revoked_by IS NULL) THEN
        RETURN false;
    END IF;
    INSERT INTO table_commit (table_id, barrier, snapshot_id, operation, job_name, run_id)
    VALUES (t.table_id, p_barrier, p_snapshot_id, p_operation, p_job, p_run_id);
    IF t.current_barrier IS NULL OR p_barrier >= t.current_barrier THEN
        UPDATE managed_table SET current_snapshot_id = p_snapshot_id, current_barrier = p_barrier
        WHERE table_id = t.table_id;
    END IF;
    RETURN true;
END $$;

-- The row's cache of S(T, W(T)) and of the newest coalesced range, recomputed from history
-- (after a revision rewinds the table).
CREATE FUNCTION refresh_table_row(p_table_id bigint) RETURNS void
LANGUAGE sql SET search_path = {search_path}
BEGIN ATOMIC
    UPDATE managed_table m
    SET current_snapshot_id = (SELECT s.snapshot_id FROM snapshot_at(m.table_id, 9223372036854775807) s),
        current_barrier = (SELECT c.barrier FROM table_commit c WHERE c.table_id = m.table_id AND c.revoked_by IS NULL
                           ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1),
        coalesced_after = (SELECT r.after_barrier FROM coalesced_range r WHERE r.table_id = m.table_id
                           ORDER BY r.into_barrier DESC LIMIT 1),
        coalesced_into = (SELECT r.into_barrier FROM coalesced_range r WHERE r.table_id = m.table_id
                          ORDER BY r.into_barrier DESC LIMIT 1)
    WHERE m.table_id = p_table_id;
END;

-- Apply the control-plane half of a revision planned by the caller (p_plan: the tables with
-- their watermarks before and after). Resumes an unfinished revision of the same root to the
-- same barrier (resumed = true) instead.
CREATE OR REPLACE FUNCTION begin_revision(p_root text, p_to_barrier bigint, p_plan jsonb)
RETURNS TABLE (revision_id bigint, plan jsonb, resumed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v_pending record;
    v_rid bigint;
    t jsonb;
    v_table_id bigint;
    v_bound bigint;
BEGIN
    PERFORM require_admin('revise tables');
    PERFORM take_lock('topology', ARRAY[0::bigint], false, 'a revision');
    SELECT r.revision_id, r.plan, r.root_table, r.to_barrier INTO v_pending
    FROM revision r WHERE r.state = 'applying' ORDER BY r.revision_id LIMIT 1;
    IF FOUND THEN
        IF v_pending.root_table = p_root AND v_pending.to_barrier = p_to_barrier THEN
            RETURN QUERY SELECT v_pending.revision_id, v_pending.plan, true;
            RETURN;
        END IF;
        PERFORM fail('IB020', format('revision %s of %s to barrier %s is unfinished; rerun that revise to finish it '
                                     'first', v_pending.revision_id, v_pending.root_table, v_pending.to_barrier));
    END IF;
    INSERT INTO revision (root_table, to_barrier, plan) VALUES (p_root, p_to_barrier, p_plan)
    RETURNING revision.revision_id INTO v_rid;
    FOR t IN SELECT * FROM jsonb_array_elements(p_plan->'tables') LOOP
        CONTINUE WHEN (t->'from_watermark') = (t->'to_watermark');
        UPDATE managed_table m
        SET watermark = (t->>'to_watermark')::bigint,
            start_barrier = CASE WHEN t->>'to_watermark' IS NULL THEN NULL ELSE m.start_barrier END,
            revision_id = v_rid
        WHERE m.name = t->>'table' AND m.watermark IS NOT DISTINCT FROM (t->>'from_watermark')::bigint
        RETURNING m.table_id INTO v_table_id;
        IF v_table_id IS NULL THEN
            PERFORM fail('IB020', format('table %s moved while planning the revision; run revise again', t->>'table'));
        END IF;
        v_bound := coalesce((t->>'to_watermark')::bigint, -1);
        UPDATE table_commit SET revoked_by = v_rid
        WHERE table_id = v_table_id AND barrier > v_bound AND revoked_by IS NULL;
        DELETE FROM table_completion WHERE table_id = v_table_id AND barrier > v_bound;
        DELETE FROM coalesced_range WHERE table_id = v_table_id AND into_barrier > v_bound;
        -- an intermediate job recomputes from its rewound progress (a root replays its ranges)
        DELETE FROM input_range r WHERE r.barrier > v_bound AND r.job_name IN (
            SELECT j.name FROM job_sink k JOIN job j USING (job_id)
            WHERE k.table_id = v_table_id AND EXISTS (SELECT 1 FROM job_source s WHERE s.job_id = j.job_id));
        PERFORM refresh_table_row(v_table_id);
        v_table_id := NULL;
    END LOOP;
    RETURN QUERY SELECT v_rid, p_plan, false;
END $$;

CREATE OR REPLACE FUNCTION record_revision_snapshot(p_table text, p_barrier bigint, p_snapshot_id bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_admin('revise tables');
    INSERT INTO table_commit (table_id, barrier, snapshot_id, operation, job_name)
    SELECT table_id, p_barrier, p_snapshot_id, 'revision', 'icebarrier-revise' FROM managed_table WHERE name = p_table;
    PERFORM refresh_table_row((SELECT table_id FROM managed_table WHERE name = p_table));
END $$;

-- The cut over p_names at p_barrier (NULL: the latest valid one), checked: unknown tables,
-- a barrier never issued, a cut not valid (the tables' progress, the coalesced ranges that
-- hold the barrier — or, for the latest cut, those after the newest start — and the nearest
-- valid cuts in the detail, for the wording), an expired snapshot.
-- p_aligned false: read-uncommitted, no checks. One row: the barrier, and the tables' ids
-- and snapshots in the order given (arrays: 1,000 tables are one row to send, not 1,000).
CREATE OR REPLACE FUNCTION resolve_cut(p_names text[], p_barrier bigint, p_aligned boolean DEFAULT true)
RETURNS TABLE (barrier bigint, table_ids bigint[], snapshot_ids bigint[])
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = {search_path}
AS $$
#variable_conflict use_column
DECLARE
    v_bound bigint := CASE WHEN p_aligned THEN p_barrier ELSE 9223372036854775807 END;
    c record;
    v_unknown text;
    v_detail jsonb;
    v_ids bigint[];
    v_hi bigint;
BEGIN
    -- The common case in one pass (cut_at returns rows in the order given).
    SELECT array_agg(x.table_id) AS ids, array_agg(x.snapshot_id) AS snaps, bool_and(x.table_id IS NOT NULL) AS known,
           min(x.barrier) AS b, bool_and(x.issued) AS issued, bool_and(x.valid) AS valid, bool_or(x.expired) AS expired,
           max(x.start_barrier) AS newest_start
      INTO c FROM cut_at(p_names, v_bound) x;
    IF NOT c.known THEN
        SELECT min(x.table_name) INTO v_unknown FROM cut_at(p_names, v_bound) x WHERE x.table_id IS NULL;
        PERFORM fail('IB009', format('table %s is not managed by icebarrier', v_unknown),
                     jsonb_build_object('table', v_unknown));
    END IF;
    IF p_aligned THEN
        IF p_barrier IS NOT NULL AND NOT c.issued THEN
            PERFORM fail('IB002', format('barrier %s was never issued', p_barrier),
                         jsonb_build_object('barrier', p_barrier));
        END IF;
        v_ids := c.ids;
        IF NOT c.valid AND p_barrier IS NULL AND c.b IS NOT NULL THEN
            -- the lowest watermark is coalesced in another table: the newest valid cut below it
            v_bound := latest_valid(v_ids, c.b);
            IF v_bound IS NOT NULL THEN
                SELECT array_agg(x.snapshot_id) AS snaps, min(x.barrier) AS b, true AS valid,
                       bool_or(x.expired) AS expired
                  INTO c FROM cut_at(p_names, v_bound) x;
            END IF;
        END IF;
        IF NOT c.valid THEN  -- the tables' progress, for the wording (cuts.py)
            v_hi := coalesce(p_barrier, c.b);
            SELECT jsonb_agg(jsonb_build_object(
                       'name', m.name, 'start', m.start_barrier, 'watermark', m.watermark,
                       'coalesced', coalesce((SELECT jsonb_agg(jsonb_build_array(r.after_barrier, r.into_barrier)
                                                               ORDER BY r.into_barrier)
                                              FROM coalesced_range r
                                              WHERE r.table_id = m.table_id AND r.after_barrier < v_hi
                                                AND r.into_barrier > coalesce(p_barrier, c.newest_start)), '[]'))
                       ORDER BY u.ord) INTO v_detail
            FROM unnest(v_ids) WITH ORDINALITY AS u(id, ord) JOIN managed_table m ON m.table_id = u.id;
            PERFORM fail('IB010', format('no consistent cut over %s at %s', array_to_string(p_names, ', '),
                                         coalesce(p_barrier::text, 'the latest barrier')),
                         jsonb_build_object('barrier', p_barrier, 'states', v_detail,
                                            'nearest', CASE WHEN p_barrier IS NOT NULL THEN jsonb_build_array(
                                                latest_valid(v_ids, p_barrier), earliest_valid(v_ids, p_barrier))
                                            END));
        END IF;
        IF c.expired THEN
            SELECT jsonb_build_object('table', x.table_name, 'snapshot_id', x.snapshot_id, 'barrier', x.barrier)
              INTO v_detail FROM cut_at(p_names, coalesce(v_bound, c.b)) x WHERE x.expired ORDER BY x.ord LIMIT 1;
            PERFORM fail('IB011', format('snapshot %s of %s was already expired', v_detail->>'snapshot_id',
                                         v_detail->>'table'), v_detail);
        END IF;
    END IF;
    barrier := CASE WHEN p_aligned THEN c.b END;
    table_ids := v_ids;
    snapshot_ids := c.snaps;
    RETURN NEXT;
END $$;
REVOKE EXECUTE ON FUNCTION plan_barrier(text, boolean, boolean, bigint),
    complete_barrier(text, bigint, text[], bigint[], text, boolean) FROM PUBLIC;
"""

VIEWS = """
CREATE OR REPLACE VIEW table_versions AS
SELECT t.name AS table_name,
       CASE WHEN w.job_id IS NULL THEN 'unowned'
            WHEN EXISTS (SELECT 1 FROM job_source s WHERE s.job_id = w.job_id) THEN 'intermediate'
            ELSE 'root' END                                    AS table_kind,
       j.name                                                  AS writer_job,
       t.start_barrier                                         AS start_barrier,
       t.watermark                                             AS watermark_barrier,
       b.issued_at                                             AS watermark_issued_at,
       c.snapshot_id                                           AS current_snapshot_id,
       c.recorded_at                                           AS last_commit_at,
       now() - b.issued_at                                     AS freshness,
       (SELECT count(*) FROM barrier x
         WHERE x.barrier > coalesce(t.watermark,
               (extract(epoch FROM t.created_at) * 1000000)::bigint)) AS barriers_behind,
       t.coalesced_after                                       AS coalesced_after,
       t.coalesced_into                                        AS coalesced_into
FROM managed_table t
LEFT JOIN job_sink w ON w.table_id = t.table_id
LEFT JOIN job j ON j.job_id = w.job_id
LEFT JOIN barrier b ON b.barrier = t.watermark
LEFT JOIN LATERAL current_commit(t.table_id) c ON true;

-- The latest barrier completed by every managed table that has a writer or has progress.
CREATE VIEW consistent_barrier AS
SELECT x.barrier, b.issued_at FROM (SELECT latest_cut(NULL) AS barrier) x LEFT JOIN barrier b USING (barrier);

-- A completion covers the barriers after from_barrier up to barrier; coalesced: those
-- strictly between were coalesced into it (their state in the table is undefined).
CREATE OR REPLACE VIEW barrier_delay AS
SELECT c.barrier, t.name AS table_name, b.issued_at, c.completed_at,
       c.completed_at - b.issued_at AS delay, c.job_name, c.from_barrier, c.coalesced
FROM table_completion c
JOIN managed_table t USING (table_id)
JOIN barrier b USING (barrier);

CREATE OR REPLACE VIEW job_delay AS
WITH job_completion AS (
    SELECT j.job_id, j.name AS job_name, c.barrier, min(c.completed_at) AS completed_at
    FROM job j
    JOIN job_sink k ON k.job_id = j.job_id
    JOIN table_completion c ON c.table_id = k.table_id AND c.job_name = j.name
    GROUP BY j.job_id, j.name, c.barrier)
SELECT jc.job_name, jc.barrier, b.issued_at, jc.completed_at,
       coalesce(inputs.ready_at, b.issued_at)                  AS inputs_ready_at,
       jc.completed_at - coalesce(inputs.ready_at, b.issued_at) AS delay
FROM job_completion jc
JOIN barrier b ON b.barrier = jc.barrier
LEFT JOIN LATERAL (
    SELECT max(sc.completed_at) AS ready_at
    FROM job_source s
    CROSS JOIN LATERAL (SELECT c.completed_at FROM table_completion c
                        WHERE c.table_id = s.table_id AND c.barrier >= jc.barrier
                        ORDER BY c.barrier LIMIT 1) sc
    WHERE s.job_id = jc.job_id) inputs ON true;

CREATE OR REPLACE VIEW barriers AS SELECT barrier, issued_at, issued_by, anchor FROM barrier;

-- A job's recorded input ranges are its own (0009), now checked once per query, not per row:
-- a root job reads all its ranges to plan the next one.
CREATE OR REPLACE VIEW input_ranges AS
SELECT r.* FROM input_range r
WHERE (SELECT caller_is_admin()) OR r.job_name IN (
    SELECT g.job_name FROM job_grant g JOIN pg_roles x ON x.rolname = g.role_name
    WHERE pg_has_role(session_user, x.oid, 'MEMBER'));

CREATE VIEW coalesced_ranges AS
SELECT t.name AS table_name, r.table_id, r.after_barrier, r.into_barrier, r.job_name
FROM coalesced_range r JOIN managed_table t USING (table_id);
"""

NEW_FUNCTIONS = (
    "plan_barrier(text, boolean, boolean, bigint)",
    "complete_barrier(text, bigint, text[], bigint[], text, boolean)",
    "refresh_table_row(bigint)",
    "unchanged_until(bigint[], bigint, bigint)",
    "protection(bigint)",
    "latest_cut(text)",
    "cut_at(text[], bigint)",
    "earliest_valid(bigint[], bigint)",
    "latest_valid(bigint[], bigint, boolean)",
    "snapshot_id_at(managed_table, bigint)",
    "snapshot_id_from_history(bigint, bigint)",
    "has_completed(managed_table, bigint)",
    "coalesced_at(managed_table, bigint)",
    "coalesced_range_at(bigint, bigint)",
)


def _search_path() -> str:
    return f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"


def _roles_with(privilege_sql: str) -> list[str]:
    rows = op.get_bind().exec_driver_sql(privilege_sql).fetchall()
    return [r[0] for r in rows]


_JOB_ROLES = """
SELECT r.rolname FROM pg_roles r
WHERE NOT r.rolsuper AND r.oid <> (SELECT nspowner FROM pg_namespace WHERE nspname = current_schema())
  AND has_function_privilege(r.oid, (SELECT p.oid FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace
                                     AND p.proname = 'complete_barrier' LIMIT 1), 'EXECUTE')
"""
_VIEW_ROLES = """
SELECT r.rolname FROM pg_roles r
WHERE NOT r.rolsuper AND r.oid <> (SELECT nspowner FROM pg_namespace WHERE nspname = current_schema())
  AND has_table_privilege(r.oid, 'managed_tables', 'SELECT')
"""


def _grant(roles: list[str], what: str) -> None:
    for role in roles:
        op.execute(f"GRANT {what} TO {sql.Identifier(role).as_string(None)}")


def upgrade() -> None:
    job_roles, view_roles = _roles_with(_JOB_ROLES), _roles_with(_VIEW_ROLES)
    op.execute(TABLES)
    op.execute(DROPPED)
    op.execute(DEFINITIONS.format(search_path=_search_path()))
    op.execute(FUNCTIONS.format(search_path=_search_path()))
    op.execute(VIEWS)
    _grant(
        job_roles,
        "EXECUTE ON FUNCTION complete_barrier(text, bigint, text[], bigint[], text, boolean), "
        "plan_barrier(text, boolean, boolean, bigint)",
    )
    _grant(view_roles, "SELECT ON coalesced_ranges, consistent_barrier")


# -- downgrade: the definitions of 0007-0009 again ------------------------------------------------


def _earlier(name: str):
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _statement(text: str, head: str, end: str) -> str:
    """The statement of an earlier revision's text that starts with ``head`` and ends with ``end``."""
    return re.search(re.escape(head) + ".*?" + re.escape(end), text, re.S).group(0)


def downgrade() -> None:
    job_roles, view_roles = _roles_with(_JOB_ROLES), _roles_with(_VIEW_ROLES)
    first, rules = _earlier("0001_control_plane.py"), _earlier("0007_rules_in_the_database.py")
    tokens, views = _earlier("0008_catalog_tokens.py"), _earlier("0009_views_not_tables.py")
    for view in ("coalesced_ranges", "consistent_barrier", "table_versions", "barrier_delay", "job_delay", "barriers"):
        op.execute(f"DROP VIEW {view}")
    for signature in (*NEW_FUNCTIONS, "tick_barrier(text, bigint)"):
        op.execute(f"DROP FUNCTION {signature}")
    op.execute("""
        ALTER TABLE table_completion DROP COLUMN from_barrier, DROP COLUMN coalesced;
        ALTER TABLE managed_table DROP COLUMN coalesced_after, DROP COLUMN coalesced_into,
            DROP COLUMN current_snapshot_id, DROP COLUMN current_barrier;
        DROP TABLE coalesced_range;
        ALTER TABLE barrier DROP COLUMN anchor;
        DELETE FROM setting WHERE key = 'anchor_interval_ms';
        ALTER TABLE setting DROP CONSTRAINT setting_known_value_check;
    """)
    op.execute(_statement(rules.TABLES, "ALTER TABLE setting ADD CONSTRAINT", "END);"))
    with_replace = lambda text: text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")  # noqa: E731
    op.execute(with_replace(rules._formatted(rules.DEFINITIONS)))
    op.execute(with_replace(rules._formatted(rules.FUNCTIONS)))
    op.execute(_statement(tokens.UPGRADE, "CREATE FUNCTION latest_cut", "END;"))
    op.execute(f"ALTER FUNCTION caller_acts_for(text) SECURITY DEFINER SET search_path = {_search_path()}")
    op.execute("ALTER FUNCTION resolve_cut(text[], bigint, boolean) SECURITY DEFINER")
    op.execute("REVOKE EXECUTE ON FUNCTION resolve_cut(text[], bigint, boolean) FROM PUBLIC")
    for name in ("barrier_delay", "job_delay"):
        op.execute(_statement(first.VIEWS, f"CREATE VIEW {name} AS", ";"))
    op.execute(_statement(rules.VIEWS, "CREATE OR REPLACE VIEW consistent_barrier AS", "= bounds.barrier;"))
    op.execute(views.TABLE_VERSIONS.format(current="current_commit(t.table_id)"))
    op.execute(_statement(views.VIEWS, "CREATE VIEW barriers AS", ";"))
    op.execute(
        _statement(views.VIEWS, "CREATE VIEW input_ranges AS", ";").replace("CREATE VIEW", "CREATE OR REPLACE VIEW")
    )
    _grant(job_roles, "EXECUTE ON FUNCTION complete_barrier(text, bigint, text[], bigint[], text)")
    _grant(view_roles, "SELECT ON table_versions, consistent_barrier, barrier_delay, job_delay, barriers")
