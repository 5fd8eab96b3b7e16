"""A job's session opened in one round trip.

Opening a session (``job_sessions.open_session``: the catalog server, for every ask of `icebarrier
job exec`) was a transaction of 9 statements from Python when the job had nothing to do and 11
when it had: the session's row, the sources' locks, the sinks' locks, the plan, the clock, the
skips on the way, what is due. At 2,000 jobs it was 39 % of the server's CPU, most of it psycopg's
side of the round trips (benchmarks/scale.py, docs/scale.md). ``open_job_session`` is that
transaction as one statement, with the same locks in the same order and the same rules (it calls
``take_lock``, ``plan_barrier``, ``issue_barrier_if_due`` and ``complete_barrier``);
``job_session_row`` is the session's row as every other session request reads it.
``advance_job`` is a job's look (the plan, the skips on the way, the clock), which the runtime's
``jobs.advance`` planned from Python with the same loop: both use it now; ``next_plan`` is its
first step (the plan, the clock asked for a root job), which ``jobs.next_barrier`` calls;
``barrier_due_in_s`` is when the clock's next barrier is due, for it and
``barriers.next_due_in_s``.

``open_job_session`` and ``job_session_row`` are the admin's (the catalog server's role):
revoked from PUBLIC, run as their caller. ``advance_job`` and ``next_plan`` run as their caller
too and read only the views: a job's role may call them, and they do no more than the functions
they call allow that role.

Revision ID: 0031
Revises: 0030
Create Date: 2026-11-28
"""

from psycopg import sql

from alembic import context, op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE FUNCTION job_session_row(p_job text, p_lock boolean DEFAULT false)
RETURNS TABLE (job_name text, barrier bigint, plan text, from_barrier bigint, run_id text,
               opened_at timestamptz, held_until timestamptz, held boolean, succeeded boolean,
               sources text[], sinks text[], progress bigint)
LANGUAGE plpgsql SET search_path = {search_path} AS $$
#variable_conflict use_column
BEGIN
    IF p_lock THEN
        PERFORM 1 FROM job_session s WHERE s.job_name = p_job FOR UPDATE;
    END IF;
    RETURN QUERY
    SELECT s.job_name, s.barrier, s.plan, s.from_barrier, s.run_id, s.opened_at, s.held_until,
           s.held_until > clock_timestamp(), s.succeeded_at IS NOT NULL,
           ARRAY(SELECT m.name FROM job_source x JOIN managed_table m USING (table_id) WHERE x.job_id = j.job_id),
           ARRAY(SELECT m.name FROM job_sink x JOIN managed_table m USING (table_id) WHERE x.job_id = j.job_id),
           (SELECT max(m.watermark) FROM job_sink x JOIN managed_table m USING (table_id) WHERE x.job_id = j.job_id)
    FROM job_session s JOIN job j ON j.name = s.job_name AND j.active
    WHERE s.job_name = p_job;
END $$;

-- A job's next plan (jobs.next_barrier): plan_barrier's row, a root job with nothing to take
-- asking the clock first (unless only an announcement brings it anything); issued: the clock's
-- barrier was issued for it. Runs as its caller, as advance_job.
CREATE FUNCTION next_plan(p_job text, p_skip boolean DEFAULT true, p_coalesce boolean DEFAULT true,
                          p_up_to bigint DEFAULT NULL)
RETURNS TABLE (next_plan jsonb, issued boolean, clock boolean)
LANGUAGE plpgsql SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v_p record;
BEGIN
    SELECT * INTO v_p FROM plan_barrier(p_job, p_skip, p_coalesce, p_up_to);
    clock := v_p.root AND NOT (coalesce(cardinality(v_p.announced), 0) > 0 AND NOT coalesce(v_p.pending, false));
    issued := false;
    IF clock AND (v_p.barrier IS NULL OR v_p.from_barrier IS NULL) THEN
        PERFORM 1 FROM issue_barrier_if_due(p_job);
        IF FOUND THEN
            SELECT * INTO v_p FROM plan_barrier(p_job, p_skip, p_coalesce, p_up_to);
            issued := true;
        END IF;
    END IF;
    next_plan := to_jsonb(v_p);
    RETURN NEXT;
END $$;

-- Seconds until the clock rule issues the next barrier (the newest plus the interval, on the
-- database clock; negative: due now), NULL before the first barrier: barriers.next_due_in_s and
-- advance_job. Runs as its caller and reads only the views.
CREATE FUNCTION barrier_due_in_s() RETURNS double precision
LANGUAGE sql SET search_path = {search_path} AS $$
    SELECT ((SELECT max(b.barrier) FROM barriers b)
            + 1000 * (SELECT x.value::bigint FROM settings x WHERE x.key = 'barrier_interval_ms')
            - (extract(epoch FROM clock_timestamp()) * 1000000)::bigint) / 1e6
$$;

-- A job's look (jobs.advance, and open_job_session): its next plan, the barriers it may skip
-- completed at once on the way (at most three, each in a savepoint: a conflict undoes that skip
-- only and leaves it to the next look). due_in_s, for a root job with nothing to take, when the
-- clock's next barrier is due. Runs as its caller: what it does, the functions it calls allow.
CREATE FUNCTION advance_job(p_job text, p_skip boolean DEFAULT true, p_coalesce boolean DEFAULT true,
                            p_up_to bigint DEFAULT NULL)
RETURNS TABLE (next_plan jsonb, issued boolean, skipped jsonb, due_in_s double precision)
LANGUAGE plpgsql SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v_n record;
    v_done record;
    v_skipped jsonb := '[]';
    v_due double precision;
BEGIN
    FOR i IN 0..3 LOOP
        SELECT * INTO v_n FROM next_plan(p_job, p_skip, p_coalesce, p_up_to);
        EXIT WHEN i = 3 OR NOT ((v_n.next_plan->>'ready')::boolean AND v_n.next_plan->>'barrier' IS NOT NULL
                                AND v_n.next_plan->>'plan' = 'skip');
        BEGIN
            SELECT * INTO v_done FROM complete_barrier(p_job, (v_n.next_plan->>'barrier')::bigint, '{{}}', '{{}}',
                                                       NULL, false);
            v_skipped := v_skipped || jsonb_build_object('barrier', (v_n.next_plan->>'barrier')::bigint,
                                                         'sinks', to_jsonb(v_done.sinks), 'noop', v_done.noop,
                                                         'coalesced', v_done.coalesced);
        EXCEPTION WHEN serialization_failure OR deadlock_detected OR SQLSTATE 'IB003' THEN
            EXIT;
        END;
    END LOOP;
    IF v_n.clock AND NOT (v_n.next_plan->>'ready')::boolean THEN
        v_due := barrier_due_in_s();
    END IF;
    RETURN QUERY SELECT v_n.next_plan, v_n.issued, v_skipped, v_due;
END $$;

-- how: held (another live run holds it: nothing changed), adopted or resumed (a dead run's
-- session taken over), new (planned now), waiting (nothing to complete now: next_plan says what
-- the job waits for, due_in_s when the clock's next barrier is due for a root job). skipped: the
-- barriers completed on the way, with no computation. newest_barrier: the newest issued, with a
-- session. Then the session's row, if one is open.
CREATE FUNCTION open_job_session(p_job text, p_skip boolean, p_coalesce boolean, p_hold_s double precision,
                                 p_run_id text)
RETURNS TABLE (how text, next_plan jsonb, issued boolean, skipped jsonb, due_in_s double precision,
               newest_barrier bigint, job_name text, barrier bigint, plan text, from_barrier bigint, run_id text,
               opened_at timestamptz, held_until timestamptz, held boolean, succeeded boolean,
               sources text[], sinks text[], progress bigint)
LANGUAGE plpgsql SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v_s record;
    v_a record;
    v_sources bigint[];
    v_how text;
BEGIN
    SELECT * INTO v_s FROM job_session_row(p_job, true);
    IF FOUND AND v_s.progress IS DISTINCT FROM v_s.from_barrier THEN
        -- stale, held or not: its plan starts where the job no longer is
        DELETE FROM catalog_pending c WHERE c.job_name = p_job;
        DELETE FROM job_session s WHERE s.job_name = p_job;
    ELSIF FOUND THEN
        IF p_hold_s IS NOT NULL AND v_s.held THEN
            RETURN QUERY SELECT 'held', NULL::jsonb, false, '[]'::jsonb, NULL::double precision, NULL::bigint, r.*
                         FROM job_session_row(p_job) r;
            RETURN;
        END IF;
        IF NOT v_s.succeeded THEN  -- resumed: what the dead run staged is dropped, B computed again
            DELETE FROM catalog_pending c WHERE c.job_name = p_job;
        END IF;
        UPDATE job_session s SET run_id = p_run_id, opened_at = now(),
               held_until = clock_timestamp() + make_interval(secs => coalesce(p_hold_s, 0))
        WHERE s.job_name = p_job;
        RETURN QUERY SELECT CASE WHEN v_s.succeeded THEN 'adopted' ELSE 'resumed' END, NULL::jsonb, false,
                            '[]'::jsonb, NULL::double precision, (SELECT max(b.barrier) FROM barrier b), r.*
                     FROM job_session_row(p_job) r;
        RETURN;
    END IF;
    -- Expiry claims a table's snapshots under its lock, exclusive; the session, once its row
    -- commits, protects its sources' S(T, B) (protection(): a first run counts as at B).
    SELECT array_agg(m.table_id ORDER BY m.table_id) INTO v_sources
    FROM job_sources s JOIN managed_tables m ON m.name = s.table_name WHERE s.job_name = p_job;
    IF v_sources IS NOT NULL THEN
        PERFORM take_lock('table', v_sources, true, format('opening job %s''s session', p_job), false);
    END IF;
    -- the sinks, as the control plane's skips lock them: none moves the job while its plan is taken
    PERFORM 1 FROM managed_table t JOIN job_sink k USING (table_id) JOIN job j USING (job_id)
    WHERE j.name = p_job AND j.active ORDER BY t.table_id FOR NO KEY UPDATE OF t;
    SELECT * INTO v_a FROM advance_job(p_job, p_skip, p_coalesce);
    IF NOT (v_a.next_plan->>'ready')::boolean THEN
        RETURN QUERY SELECT 'waiting', v_a.next_plan, v_a.issued, v_a.skipped, v_a.due_in_s, NULL::bigint, r.*
                     FROM (SELECT 1) one LEFT JOIN job_session_row(p_job) r ON false;
        RETURN;
    END IF;
    INSERT INTO job_session AS s (job_name, barrier, plan, from_barrier, run_id, held_until)
    VALUES (p_job, (v_a.next_plan->>'barrier')::bigint, v_a.next_plan->>'plan',
            (v_a.next_plan->>'from_barrier')::bigint, p_run_id,
            clock_timestamp() + make_interval(secs => coalesce(p_hold_s, 0)))
    ON CONFLICT (job_name) DO NOTHING;
    IF FOUND THEN  -- commits staged outside any session (a multi-sink job through latest) are not its
        DELETE FROM catalog_pending c WHERE c.job_name = p_job;
        v_how := 'new';
    ELSE  -- another run opened it meanwhile
        v_how := CASE WHEN p_hold_s IS NULL THEN 'new' ELSE 'held' END;
    END IF;
    RETURN QUERY SELECT v_how, v_a.next_plan, v_a.issued, v_a.skipped, NULL::double precision,
                        (SELECT max(b.barrier) FROM barrier b), r.*
                 FROM job_session_row(p_job) r;
END $$;

REVOKE EXECUTE ON FUNCTION job_session_row(text, boolean) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION open_job_session(text, boolean, boolean, double precision, text) FROM PUBLIC;
"""


def upgrade() -> None:
    search_path = f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"
    op.execute(UPGRADE.format(search_path=search_path))


def downgrade() -> None:
    op.execute("DROP FUNCTION open_job_session(text, boolean, boolean, double precision, text)")
    op.execute("DROP FUNCTION job_session_row(text, boolean)")
    op.execute("DROP FUNCTION advance_job(text, boolean, boolean, bigint)")
    op.execute("DROP FUNCTION next_plan(text, boolean, boolean, bigint)")
    op.execute("DROP FUNCTION barrier_due_in_s()")
