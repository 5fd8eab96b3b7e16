"""The database enforces who may do what; each rule is defined once, in SQL.

- ``has_completed(start, watermark, B)`` ("T has completed B") and ``snapshot_at(T, B)``
  (``S(T, B)``) are the definitions every cut, protected set, view, revision and completion
  uses. They are SQL-standard function bodies (bound when created, inlined by the planner).
- Every control-plane write is a ``SECURITY DEFINER`` function owned by the schema owner with
  a fixed ``search_path``: it checks the caller's role and its rules once and raises its own
  SQLSTATE (class ``IB``; ``control_plane.errors`` maps them back to error classes).
- Roles: the admin is the schema owner (or a member of it); a job role acts for the jobs in
  ``job_grant``; leases record the role that took them; non-admin lease TTLs are capped by the
  ``lease_max_ttl_ms`` setting. Base tables stay writable by the owner only.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22
"""

import importlib.util
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

NO_BOUND = 2**63 - 1

TABLES = """
-- Which role may act for which job (db grant-job); the job need not be registered yet.
CREATE TABLE job_grant (
    role_name  name        NOT NULL,
    job_name   text        NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT job_grant_pkey PRIMARY KEY (role_name, job_name)
);
CREATE INDEX job_grant_job ON job_grant (job_name);

ALTER TABLE lease ADD COLUMN owner_role name NOT NULL DEFAULT session_user;

ALTER TABLE setting DROP CONSTRAINT setting_known_value_check;
ALTER TABLE setting ADD CONSTRAINT setting_known_value_check CHECK (
    CASE key
        WHEN 'barrier_interval_ms' THEN
            CASE WHEN value ~ '^[0-9]{1,9}$' THEN value::bigint BETWEEN 1 AND 604800000 ELSE false END
        WHEN 'lease_max_ttl_ms' THEN
            CASE WHEN value ~ '^[0-9]{1,9}$' THEN value::bigint BETWEEN 1000 AND 604800000 ELSE false END
        ELSE false
    END);
INSERT INTO setting (key, value) VALUES ('lease_max_ttl_ms', '86400000');
"""

# Definitions used by queries (invoker rights, inlinable; EXECUTE stays with PUBLIC).
DEFINITIONS = """
-- T has completed B: start(T) <= B <= W(T).
CREATE FUNCTION has_completed(p_start bigint, p_watermark bigint, p_barrier bigint) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN coalesce(p_start <= p_barrier AND p_barrier <= p_watermark, false);

-- S(T, B): the newest recorded, unrevoked snapshot of T at or before B (none: empty at B).
CREATE FUNCTION snapshot_at(p_table_id bigint, p_barrier bigint)
RETURNS TABLE (snapshot_id bigint, recorded_at timestamptz)
LANGUAGE sql STABLE PARALLEL SAFE ROWS 1
BEGIN ATOMIC
    SELECT c.snapshot_id, c.recorded_at FROM table_commit c
    WHERE c.table_id = p_table_id AND c.barrier <= p_barrier AND c.revoked_by IS NULL
    ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1;
END;

-- Progress and S(T, b) for the named tables (in the order given; NULLs for unknown names),
-- b being the given barrier, else the tables' lowest watermark (the read-committed
-- candidate). valid: every table has completed b; expired: S(T, b) was expired.
CREATE FUNCTION cut_at(p_names text[], p_barrier bigint)
RETURNS TABLE (ord bigint, table_name text, table_id bigint, start_barrier bigint, watermark bigint,
               snapshot_id bigint, expired boolean, barrier bigint, issued boolean, valid boolean)
LANGUAGE sql STABLE
BEGIN ATOMIC
    WITH t AS (
        SELECT n.ord, n.name, m.table_id, m.start_barrier, m.watermark
        FROM unnest(p_names) WITH ORDINALITY AS n(name, ord)
        LEFT JOIN managed_table m ON m.name = n.name),
    bound AS (SELECT coalesce(p_barrier, min(t.watermark)) AS b FROM t),
    verdict AS MATERIALIZED (
        SELECT bound.b,
               EXISTS (SELECT 1 FROM barrier x WHERE x.barrier = bound.b) AS issued,
               (SELECT bool_and(has_completed(t.start_barrier, t.watermark, bound.b)) FROM t) AS valid
        FROM bound)
    SELECT t.ord, t.name, t.table_id, t.start_barrier, t.watermark, s.snapshot_id,
           EXISTS (SELECT 1 FROM expired_snapshot e
                   WHERE e.table_id = t.table_id AND e.snapshot_id = s.snapshot_id),
           verdict.b, verdict.issued, coalesce(verdict.valid, false)
    FROM t CROSS JOIN verdict
    LEFT JOIN LATERAL snapshot_at(t.table_id, verdict.b) s ON true
    ORDER BY t.ord;
END;

-- What expiry must keep of one table, by reason: its current snapshot, live lease pins,
-- downstream job progress pins, and the read-committed window (every snapshot a
-- read-committed reader may resolve now: S(T, lo) and all commits in (lo, W(T)], lo being the
-- lowest watermark of any table or the lowest progress of any job; a job that recorded its
-- first barrier but has not completed it counts as being there).
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
        SELECT least((SELECT min(m.watermark) FROM managed_table m WHERE m.watermark IS NOT NULL),
                     (SELECT min(progress) FROM started)) AS b)
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

-- A stable advisory-lock class id for a purpose within this schema.
CREATE FUNCTION lock_key(p_purpose text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN ('x' || substr(md5({lock_prefix} || ':' || p_purpose), 1, 8))::bit(32)::integer;

-- Is the caller the admin (the schema owner, a member of it, or a superuser)? These checks run
-- on every write: PL/pgSQL (plans cached for the session) without a SET clause (they run inside
-- the definer functions, whose search_path is fixed).
CREATE FUNCTION caller_is_admin() RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT pg_has_role(session_user, n.nspowner, 'MEMBER') FROM pg_namespace n
            WHERE n.nspname = {schema_literal});
END $$;

-- May the caller act for job p_job (the admin, or a member of a role granted that job)?
CREATE FUNCTION caller_acts_for(p_job text) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN caller_is_admin() OR EXISTS (
        SELECT 1 FROM job_grant g JOIN pg_roles r ON r.rolname = g.role_name
        WHERE g.job_name = p_job AND pg_has_role(session_user, r.oid, 'MEMBER'));
END $$;

-- May the caller write the Iceberg catalog row of catalog.namespace.table? The admin may,
-- a job role only for its jobs' sinks and for tables icebarrier does not manage.
CREATE FUNCTION may_write_catalog_table(p_catalog text, p_namespace text, p_table text) RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    RETURN caller_is_admin() OR NOT EXISTS (
        SELECT 1 FROM managed_table m
        WHERE m.name = lower(p_catalog || '.' || p_namespace || '.' || p_table)
          AND NOT EXISTS (SELECT 1 FROM job_sink k JOIN job j USING (job_id)
                          WHERE k.table_id = m.table_id AND j.active AND caller_acts_for(j.name)));
END $$;
"""

# Raising helpers and the write functions. {search_path} is fixed on each definer function.
FUNCTIONS = """
CREATE FUNCTION fail(p_code text, p_message text, p_detail jsonb DEFAULT '{{}}') RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = p_code, MESSAGE = p_message, DETAIL = p_detail::text;
END $$;

CREATE FUNCTION require_admin(p_action text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT caller_is_admin() THEN
        PERFORM fail('IB030', format('role %s may not %s: that is for the admin (the owner of schema %s)',
                                     session_user, p_action, {schema_literal}),
                     jsonb_build_object('role', session_user, 'action', p_action, 'job', NULL));
    END IF;
END $$;

CREATE FUNCTION require_job(p_job text, p_action text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT caller_acts_for(p_job) THEN
        PERFORM fail('IB030', format('role %s may not %s job %s: it is not granted that job', session_user,
                                     p_action, p_job),
                     jsonb_build_object('role', session_user, 'action', p_action, 'job', p_job));
    END IF;
END $$;

-- Raise from a policy check (row-level security on the Iceberg catalog's pointer table).
CREATE FUNCTION check_catalog_write(p_catalog text, p_namespace text, p_table text) RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = {search_path} AS $$
DECLARE
    v_name text := lower(p_catalog || '.' || p_namespace || '.' || p_table);
    v_writer text;
BEGIN
    IF may_write_catalog_table(p_catalog, p_namespace, p_table) THEN
        RETURN true;
    END IF;
    SELECT j.name INTO v_writer FROM managed_table m JOIN job_sink k USING (table_id) JOIN job j USING (job_id)
    WHERE m.name = v_name AND j.active;
    PERFORM fail('IB030', format('role %s may not commit to %s: it is %s; a job role commits only to its own '
                                 'job''s sinks', session_user, v_name,
                                 coalesce('written by job ' || v_writer, 'managed by icebarrier without a writer')),
                 jsonb_build_object('role', session_user, 'action', 'commit to ' || v_name, 'job', v_writer));
    RETURN false;
END $$;

-- Advisory locks (purpose, id) for ids, in id order; a wait past lock_timeout names the holders.
CREATE FUNCTION take_lock(p_purpose text, p_ids bigint[], p_shared boolean, p_what text,
                          p_session boolean DEFAULT false) RETURNS void
LANGUAGE plpgsql SET search_path = {search_path} AS $$
DECLARE
    v_key integer := lock_key(p_purpose);
    v_sub integer;
BEGIN
    FOREACH v_sub IN ARRAY ARRAY(SELECT DISTINCT (i % 2147483647)::integer FROM unnest(p_ids) i ORDER BY 1) LOOP
        CASE
            WHEN p_session AND p_shared THEN PERFORM pg_advisory_lock_shared(v_key, v_sub);
            WHEN p_session THEN PERFORM pg_advisory_lock(v_key, v_sub);
            WHEN p_shared THEN PERFORM pg_advisory_xact_lock_shared(v_key, v_sub);
            ELSE PERFORM pg_advisory_xact_lock(v_key, v_sub);
        END CASE;
    END LOOP;
EXCEPTION WHEN lock_not_available THEN
    PERFORM fail('IB040', format('%s: waited %s for a lock', p_what, current_setting('lock_timeout')),
                 jsonb_build_object('what', p_what, 'timeout', current_setting('lock_timeout'), 'holders', (
        SELECT coalesce(jsonb_agg(DISTINCT jsonb_build_object(
                   'pid', a.pid, 'usename', a.usename, 'application_name', a.application_name,
                   'state', a.state, 'xact_start', a.xact_start)), '[]')
        FROM pg_locks l JOIN pg_stat_activity a USING (pid)
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND a.pid <> pg_backend_pid()
          AND l.classid = ((v_key::bigint + 4294967296) % 4294967296)::oid
          AND l.objid::bigint IN (SELECT (i % 2147483647) FROM unnest(p_ids) i))));
END $$;

CREATE FUNCTION unlock(p_purpose text, p_ids bigint[]) RETURNS void
LANGUAGE sql SET search_path = {search_path}
BEGIN ATOMIC
    SELECT pg_advisory_unlock(lock_key(p_purpose), (i % 2147483647)::integer) FROM unnest(p_ids) i;
END;

-- Registration -------------------------------------------------------------------------------

-- Register (or, with p_replace, redefine) a job, enforcing the topology rules: a job writes
-- at least one table and reads managed tables or external inputs (not both), never its own
-- sink; a table has one writer; the graph stays acyclic; a job's sinks are at one barrier.
-- Returns created, unchanged, replaced, or changed (a different definition, not replaced).
CREATE FUNCTION register_job(p_job text, p_sources text[], p_sinks text[], p_external text[],
                             p_replace boolean DEFAULT false) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v_sources text[] := ARRAY(SELECT DISTINCT x FROM unnest(p_sources) x ORDER BY 1);
    v_sinks text[] := ARRAY(SELECT DISTINCT x FROM unnest(p_sinks) x ORDER BY 1);
    v_external text[] := ARRAY(SELECT DISTINCT x FROM unnest(p_external) x ORDER BY 1);
    v_current record;
    v_clash record;
    v_cycle text[];
    v_marks jsonb;
    v_job_id bigint;
BEGIN
    PERFORM require_job(p_job, 'register');
    IF cardinality(v_sinks) = 0 THEN
        PERFORM fail('IB015', format('job %s has no sink; pass at least one --sink TABLE', p_job));
    ELSIF cardinality(v_sources) > 0 AND cardinality(v_external) > 0 THEN
        PERFORM fail('IB015', format('job %s reads both managed tables and external inputs; a root job reads only '
                                     'external inputs (--external) and an intermediate job only managed tables '
                                     '(--source). Split it into two jobs', p_job));
    ELSIF cardinality(v_sources) = 0 AND cardinality(v_external) = 0 THEN
        PERFORM fail('IB015', format('job %s reads nothing; pass --source TABLE (intermediate job) or --external '
                                     'NAME (root job)', p_job));
    END IF;
    SELECT min(x) INTO v_clash FROM unnest(v_sources) x WHERE x = ANY(v_sinks);
    IF v_clash.min IS NOT NULL THEN
        PERFORM fail('IB016', format('job %s reads its own sink %s', p_job, v_clash.min),
                     jsonb_build_object('job', p_job, 'table', v_clash.min));
    END IF;

    PERFORM take_lock('topology', ARRAY[0::bigint], false, format('registering job %s', p_job));
    SELECT ARRAY(SELECT t.name FROM job_source s JOIN managed_table t USING (table_id)
                 WHERE s.job_id = j.job_id ORDER BY 1) AS sources,
           ARRAY(SELECT t.name FROM job_sink s JOIN managed_table t USING (table_id)
                 WHERE s.job_id = j.job_id ORDER BY 1) AS sinks,
           ARRAY(SELECT x FROM unnest(j.external_inputs) x ORDER BY 1) AS external
      INTO v_current FROM job j WHERE j.name = p_job AND j.active;
    IF FOUND THEN
        IF v_current.sources = v_sources AND v_current.sinks = v_sinks AND v_current.external = v_external THEN
            RETURN 'unchanged';
        ELSIF NOT p_replace THEN
            RETURN 'changed';
        END IF;
    END IF;

    SELECT t.name, j.name AS owner INTO v_clash
    FROM job_sink k JOIN managed_table t USING (table_id) JOIN job j USING (job_id)
    WHERE t.name = ANY(v_sinks) AND j.active AND j.name <> p_job ORDER BY t.name LIMIT 1;
    IF FOUND THEN
        PERFORM fail('IB017', format('table %s is written by job %s; a table has one writer', v_clash.name,
                                     v_clash.owner),
                     jsonb_build_object('table', v_clash.name, 'owner', v_clash.owner, 'job', p_job));
    END IF;

    -- A cycle: from a new sink, through the other jobs reading it, back to a new source.
    WITH RECURSIVE walk (table_name, path) AS (
        SELECT s, ARRAY[p_job, s] FROM unnest(v_sinks) s
        UNION ALL
        SELECT tk.name, w.path || j.name || tk.name
        FROM walk w
        JOIN managed_table ts ON ts.name = w.table_name
        JOIN job_source src ON src.table_id = ts.table_id
        JOIN job j ON j.job_id = src.job_id AND j.active AND j.name <> p_job
        JOIN job_sink k ON k.job_id = j.job_id
        JOIN managed_table tk ON tk.table_id = k.table_id
        WHERE NOT tk.name = ANY(w.path))
    SELECT w.table_name || w.path INTO v_cycle FROM walk w WHERE w.table_name = ANY(v_sources)
    ORDER BY cardinality(w.path), w.path LIMIT 1;
    IF v_cycle IS NOT NULL THEN
        PERFORM fail('IB018', format('job %s would close a cycle: %s', p_job, array_to_string(v_cycle, ' -> ')),
                     jsonb_build_object('job', p_job, 'path', to_jsonb(v_cycle)));
    END IF;

    SELECT jsonb_object_agg(n.name, m.watermark) INTO v_marks
    FROM unnest(v_sinks) n(name) LEFT JOIN managed_table m USING (name);
    IF (SELECT count(DISTINCT value) FROM jsonb_each(v_marks)) > 1 THEN
        PERFORM fail('IB005', format('job %s would write tables that completed different barriers', p_job),
                     jsonb_build_object('job', p_job, 'watermarks', v_marks));
    END IF;

    INSERT INTO managed_table (name) SELECT unnest(v_sources || v_sinks) ON CONFLICT (name) DO NOTHING;
    INSERT INTO job (name, external_inputs) VALUES (p_job, v_external)
    ON CONFLICT (name) DO UPDATE
      SET external_inputs = excluded.external_inputs, active = true,
          registered_at = CASE WHEN job.active THEN job.registered_at ELSE now() END,
          unregistered_at = NULL
    RETURNING job_id INTO v_job_id;
    DELETE FROM job_source WHERE job_id = v_job_id;
    DELETE FROM job_sink WHERE job_id = v_job_id;
    INSERT INTO job_source (job_id, table_id) SELECT v_job_id, table_id FROM managed_table WHERE name = ANY(v_sources);
    INSERT INTO job_sink (job_id, table_id) SELECT v_job_id, table_id FROM managed_table WHERE name = ANY(v_sinks);
    RETURN CASE WHEN v_current IS NULL THEN 'created' ELSE 'replaced' END;
END $$;

CREATE FUNCTION unregister_job(p_job text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v_job_id bigint;
BEGIN
    PERFORM require_job(p_job, 'unregister');
    PERFORM take_lock('topology', ARRAY[0::bigint], false, format('unregistering job %s', p_job));
    UPDATE job SET active = false, unregistered_at = now() WHERE name = p_job AND active RETURNING job_id INTO v_job_id;
    IF v_job_id IS NULL THEN
        PERFORM fail('IB001', format('job %s is not registered', p_job), jsonb_build_object('job', p_job));
    END IF;
    DELETE FROM job_source WHERE job_id = v_job_id;
    DELETE FROM job_sink WHERE job_id = v_job_id;
END $$;

-- Barriers and settings -------------------------------------------------------------------------

-- Advance the clock to greatest(last + 1, now) and record the barrier, in one statement; with
-- p_min_age_us only if the newest barrier is at least that old (concurrent callers then get
-- one new barrier between them).
CREATE FUNCTION tick_barrier(p_issued_by text, p_min_age_us bigint) RETURNS SETOF barrier
LANGUAGE sql SET search_path = {search_path}
BEGIN ATOMIC
    WITH now_us AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS us),
    tick AS (
        UPDATE barrier_clock c
        SET last_barrier = greatest(c.last_barrier + 1, now_us.us)
        FROM now_us
        WHERE p_min_age_us IS NULL OR c.last_barrier <= now_us.us - p_min_age_us
        RETURNING c.last_barrier)
    INSERT INTO barrier (barrier, issued_at, issued_by)
    SELECT last_barrier, clock_timestamp(), p_issued_by FROM tick
    RETURNING barrier, issued_at, issued_by;
END;

CREATE FUNCTION issue_barrier(p_issued_by text DEFAULT 'operator') RETURNS SETOF barrier
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_admin('issue barriers by hand');
    RETURN QUERY SELECT * FROM tick_barrier(p_issued_by, NULL);
END $$;

-- The clock rule: a new barrier when the newest is older than the barrier interval; any role
-- acting for a job may trigger it when asking for that job's next barrier.
CREATE FUNCTION issue_barrier_if_due(p_job text) RETURNS SETOF barrier
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_job(p_job, 'ask for the next barrier of');
    RETURN QUERY SELECT * FROM tick_barrier(p_job, (SELECT value::bigint * 1000 FROM setting
                                                     WHERE key = 'barrier_interval_ms'));
END $$;

CREATE FUNCTION set_setting(p_key text, p_value text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_admin('change settings');
    UPDATE setting SET value = p_value WHERE key = p_key;
    IF NOT FOUND THEN
        PERFORM fail('IB014', format('there is no setting %s', p_key));
    END IF;
EXCEPTION WHEN check_violation THEN
    PERFORM fail('IB014', format('%s ms for setting %s is out of range; barrier_interval_ms takes 1 ms to 7 days, '
                                 'lease_max_ttl_ms 1 s to 7 days', p_value, p_key));
END $$;

-- Completion ------------------------------------------------------------------------------------

-- Job p_job completes barrier p_barrier for all its sinks, recording the snapshots committed
-- (p_tables[i] -> p_snapshots[i]; sinks without one keep theirs) and when. Completing a
-- completed barrier again with the same commits is a no-op (noop = true); with others,
-- refused. One read decides (and names what is wrong); the sinks then move by compare-and-set
-- from the progress that read saw: if another process moved them first, nothing is written
-- and the conflict is retryable (SQLSTATE 40001). The topology lock, taken shared, keeps the
-- job's sinks what the read saw.
CREATE FUNCTION complete_barrier(p_job text, p_barrier bigint, p_tables text[] DEFAULT '{{}}',
                                 p_snapshots bigint[] DEFAULT '{{}}', p_run_id text DEFAULT NULL)
RETURNS TABLE (sinks text[], noop boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    s record;
    v_given jsonb;
    v_recorded jsonb;
    v_strangers text[];
    v_moved integer;
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
           (SELECT min(b.barrier) FROM barrier b WHERE b.barrier > k.progress) AS expected,
           (SELECT jsonb_object_agg(t.name, t.watermark) FROM job_source src JOIN managed_table t USING (table_id)
            WHERE src.job_id = j.job_id AND NOT has_completed(t.start_barrier, t.watermark, p_barrier)) AS waiting
      INTO s
      FROM job j
      CROSS JOIN LATERAL (
          SELECT array_agg(t.table_id) AS ids, array_agg(t.name) AS names, min(t.start_barrier) AS start,
                 max(t.watermark) AS progress, min(t.watermark) IS DISTINCT FROM max(t.watermark)
                 OR (count(t.watermark) <> count(*) AND count(t.watermark) > 0) AS split, count(*) AS n,
                 min(t.name) FILTER (WHERE t.revision_id IS NOT NULL) AS revising, min(t.revision_id) AS revision_id
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

    IF has_completed(s.start, s.progress, p_barrier) THEN
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
    ELSIF s.progress IS NOT NULL AND p_barrier IS DISTINCT FROM s.expected THEN
        PERFORM fail('IB007', format('job %s must complete barrier %s next, not %s', p_job, s.expected, p_barrier),
                     jsonb_build_object('job', p_job, 'barrier', p_barrier, 'expected', s.expected,
                                        'watermark', s.progress));
    ELSIF s.waiting IS NOT NULL THEN
        PERFORM fail('IB008', format('the sources of job %s have not completed barrier %s', p_job, p_barrier),
                     jsonb_build_object('job', p_job, 'barrier', p_barrier, 'waiting', s.waiting));
    END IF;

    UPDATE managed_table SET watermark = p_barrier, start_barrier = coalesce(start_barrier, p_barrier)
    WHERE table_id = ANY(s.ids) AND watermark IS NOT DISTINCT FROM s.progress AND revision_id IS NULL;
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> s.n THEN
        RAISE EXCEPTION 'another process completed or revised the sinks of job % first', p_job
              USING ERRCODE = 'serialization_failure';
    END IF;
    INSERT INTO table_commit (table_id, barrier, snapshot_id, job_name, run_id)
    SELECT t.table_id, p_barrier, c.snapshot_id, p_job, p_run_id
    FROM unnest(p_tables, p_snapshots) AS c(name, snapshot_id) JOIN managed_table t USING (name);
    INSERT INTO table_completion (table_id, barrier, job_name, completed_at)
    SELECT unnest(s.ids), p_barrier, p_job, clock_timestamp();
    sinks := s.names;
    noop := false;
    RETURN NEXT;
END $$;

-- Record another snapshot a table has completed p_barrier with (compaction, or adoption of a
-- commit found in the table); false if already recorded. The admin, or the table's writer.
CREATE FUNCTION record_commit(p_table text, p_barrier bigint, p_snapshot_id bigint, p_operation text,
                              p_job text, p_run_id text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    t record;
BEGIN
    SELECT m.table_id, m.start_barrier, m.watermark,
           (SELECT j.name FROM job_sink k JOIN job j USING (job_id) WHERE k.table_id = m.table_id AND j.active) AS writer
      INTO t FROM managed_table m WHERE m.name = p_table FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM fail('IB009', format('table %s is not managed by icebarrier', p_table), jsonb_build_object('table', p_table));
    END IF;
    IF NOT (caller_is_admin() OR (t.writer IS NOT NULL AND caller_acts_for(t.writer))) THEN
        PERFORM fail('IB030', format('role %s may not record commits of %s', session_user, p_table),
                     jsonb_build_object('role', session_user, 'action', 'record commits of ' || p_table,
                                        'job', t.writer));
    END IF;
    IF NOT has_completed(t.start_barrier, t.watermark, p_barrier) THEN
        PERFORM fail('IB021', format('table %s has not completed barrier %s (it completed %s..%s); its job records '
                                     'that commit when it completes it', p_table, p_barrier,
                                     t.start_barrier, t.watermark));
    END IF;
    IF EXISTS (SELECT 1 FROM table_commit c WHERE c.table_id = t.table_id AND c.snapshot_id = p_snapshot_id
                                                AND c.revoked_by IS NULL) THEN
        RETURN false;
    END IF;
    INSERT INTO table_commit (table_id, barrier, snapshot_id, operation, job_name, run_id)
    VALUES (t.table_id, p_barrier, p_snapshot_id, p_operation, p_job, p_run_id);
    RETURN true;
END $$;

-- Job runs: input ranges, status, liveness ---------------------------------------------------------

CREATE FUNCTION record_input_range(p_job text, p_barrier bigint, p_range_key text, p_spec jsonb) RETURNS jsonb
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v_spec jsonb;
BEGIN
    PERFORM require_job(p_job, 'record input ranges of');
    INSERT INTO input_range (job_name, barrier, range_key, spec) VALUES (p_job, p_barrier, p_range_key, p_spec)
    ON CONFLICT (job_name, barrier) DO NOTHING RETURNING spec INTO v_spec;
    IF v_spec IS NULL THEN
        SELECT spec INTO v_spec FROM input_range WHERE job_name = p_job AND barrier = p_barrier;
    END IF;
    RETURN v_spec;
END $$;

CREATE FUNCTION set_job_status(p_job text, p_status text, p_runner text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_job(p_job, 'report the status of');
    UPDATE job SET status = p_status, heartbeat_at = now(), runner = p_runner, waiting_for = NULL
    WHERE name = p_job AND active;
    IF NOT FOUND THEN
        PERFORM fail('IB001', format('job %s is not registered', p_job), jsonb_build_object('job', p_job));
    END IF;
END $$;

CREATE FUNCTION set_job_waiting(p_job text, p_waiting_for text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_job(p_job, 'report what waits in');
    UPDATE job SET waiting_for = p_waiting_for
    WHERE name = p_job AND active AND waiting_for IS DISTINCT FROM p_waiting_for;
END $$;

CREATE FUNCTION job_heartbeat(p_job text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_job(p_job, 'send heartbeats of');
    UPDATE job SET heartbeat_at = now() WHERE name = p_job AND active;
END $$;

-- Cuts and leases ----------------------------------------------------------------------------------

-- The cut over p_names at p_barrier (NULL: the latest valid one), checked: unknown tables,
-- a barrier never issued, a cut not valid (the tables' progress in the detail, for the
-- wording), an expired snapshot. p_aligned false: read-uncommitted, no checks. One row: the
-- barrier, and the tables' ids and snapshots in the order given (arrays: 1,000 tables are
-- one row to send, not 1,000).
CREATE FUNCTION resolve_cut(p_names text[], p_barrier bigint, p_aligned boolean DEFAULT true)
RETURNS TABLE (barrier bigint, table_ids bigint[], snapshot_ids bigint[])
LANGUAGE plpgsql STABLE SET search_path = {search_path} SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    v_bound bigint := CASE WHEN p_aligned THEN p_barrier ELSE 9223372036854775807 END;
    c record;
    v_unknown text;
    v_detail jsonb;
BEGIN
    -- The common case in one pass (cut_at returns rows in the order given).
    SELECT array_agg(x.table_id) AS ids, array_agg(x.snapshot_id) AS snaps, bool_and(x.table_id IS NOT NULL) AS known,
           min(x.barrier) AS b, bool_and(x.issued) AS issued, bool_and(x.valid) AS valid, bool_or(x.expired) AS expired
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
        IF NOT c.valid THEN  -- the tables' progress, for the wording (cuts.py)
            SELECT jsonb_agg(jsonb_build_object('name', x.table_name, 'start', x.start_barrier,
                                                'watermark', x.watermark)) INTO v_detail
            FROM cut_at(p_names, v_bound) x;
            PERFORM fail('IB010', format('no consistent cut over %s at %s', array_to_string(p_names, ', '),
                                         coalesce(p_barrier::text, 'the latest barrier')),
                         jsonb_build_object('barrier', p_barrier, 'states', v_detail));
        END IF;
        IF c.expired THEN
            SELECT jsonb_build_object('table', x.table_name, 'snapshot_id', x.snapshot_id, 'barrier', x.barrier)
              INTO v_detail FROM cut_at(p_names, v_bound) x WHERE x.expired ORDER BY x.ord LIMIT 1;
            PERFORM fail('IB011', format('snapshot %s of %s was already expired', v_detail->>'snapshot_id',
                                         v_detail->>'table'), v_detail);
        END IF;
    END IF;
    barrier := CASE WHEN p_aligned THEN c.b END;
    table_ids := c.ids;
    snapshot_ids := c.snaps;
    RETURN NEXT;
END $$;

CREATE FUNCTION lease_ttl_cap_s() RETURNS double precision
LANGUAGE sql STABLE SET search_path = {search_path}
BEGIN ATOMIC
    SELECT CASE WHEN caller_is_admin() THEN 604800
                ELSE (SELECT value::bigint / 1000.0 FROM setting WHERE key = 'lease_max_ttl_ms') END;
END;

CREATE FUNCTION check_lease_ttl(p_ttl_s double precision) RETURNS void
LANGUAGE plpgsql SET search_path = {search_path} AS $$
DECLARE
    v_cap double precision := lease_ttl_cap_s();
BEGIN
    IF p_ttl_s IS NULL OR p_ttl_s < 1 OR p_ttl_s > v_cap THEN
        PERFORM fail('IB014', format('lease TTL %ss is out of range; use at least 1s and at most %ss%s', p_ttl_s,
                                     v_cap, CASE WHEN v_cap < 604800 THEN ' (the lease_max_ttl_ms setting)' ELSE '' END));
    END IF;
END $$;

-- Pin a valid cut (the latest, or at p_barrier) for p_holder, owned by the calling role. With
-- p_bootstrap_job the lease also starts that job at the cut's barrier B: B becomes its first
-- recorded input range, after checking that nothing it will read after B was expired.
-- Per-table shared advisory locks close the race with expiry (which takes them exclusive).
CREATE FUNCTION acquire_lease(p_tables text[], p_ttl_s double precision, p_holder text,
                              p_barrier bigint DEFAULT NULL, p_bootstrap_job text DEFAULT NULL)
RETURNS TABLE (lease_id uuid, barrier bigint, expires_at timestamptz, table_names text[], snapshot_ids bigint[])
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
    c record;
    l record;
    v_later record;
BEGIN
    IF p_bootstrap_job IS NOT NULL THEN
        PERFORM require_job(p_bootstrap_job, 'start');
    END IF;
    PERFORM check_lease_ttl(p_ttl_s);
    v_ids := ARRAY(SELECT m.table_id FROM managed_table m WHERE m.name = ANY(p_tables));
    PERFORM take_lock('table', v_ids, true, format('lease on %s', array_to_string(p_tables, ', ')));
    SELECT p_tables AS names, r.table_ids AS ids, r.snapshot_ids AS snaps, r.barrier AS b
      INTO c FROM resolve_cut(p_tables, p_barrier) r;
    INSERT INTO lease (holder, barrier, expires_at, owner_role)
    VALUES (p_holder, c.b, now() + make_interval(secs => p_ttl_s), session_user)
    RETURNING lease.lease_id, lease.expires_at INTO l;
    INSERT INTO lease_snapshot (lease_id, table_id, snapshot_id)
    SELECT l.lease_id, u.t, u.s FROM unnest(c.ids, c.snaps) AS u(t, s);
    IF p_bootstrap_job IS NOT NULL THEN
        SELECT m.name, x.snapshot_id, x.barrier INTO v_later
        FROM table_commit x JOIN managed_table m USING (table_id)
        JOIN expired_snapshot e ON e.table_id = x.table_id AND e.snapshot_id = x.snapshot_id
        WHERE x.table_id = ANY(c.ids) AND x.barrier > c.b AND x.revoked_by IS NULL
        ORDER BY x.barrier LIMIT 1;
        IF FOUND THEN
            PERFORM fail('IB011', format('snapshot %s of %s was already expired', v_later.snapshot_id, v_later.name),
                         jsonb_build_object('table', v_later.name, 'snapshot_id', v_later.snapshot_id,
                                            'barrier', v_later.barrier));
        END IF;
        INSERT INTO input_range (job_name, barrier, spec) VALUES (p_bootstrap_job, c.b, '{{"bootstrap": true}}')
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN QUERY SELECT l.lease_id, c.b, l.expires_at, c.names, c.snaps;
END $$;

-- The lease, if the caller may manage it (the role that took it, or the admin).
CREATE FUNCTION own_lease(p_lease_id uuid, p_action text) RETURNS lease
LANGUAGE plpgsql SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v lease;
BEGIN
    SELECT * INTO v FROM lease WHERE lease_id = p_lease_id FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM fail('IB012', format('lease %s does not exist', p_lease_id), jsonb_build_object('lease_id', p_lease_id));
    END IF;
    IF NOT (caller_is_admin() OR (v.owner_role IN (SELECT rolname FROM pg_roles)
                                  AND pg_has_role(session_user, v.owner_role, 'MEMBER'))) THEN
        PERFORM fail('IB030', format('role %s may not %s lease %s: it belongs to role %s', session_user, p_action,
                                     p_lease_id, v.owner_role),
                     jsonb_build_object('role', session_user, 'action', p_action || ' lease ' || p_lease_id,
                                        'job', NULL));
    END IF;
    RETURN v;
END $$;

CREATE FUNCTION renew_lease(p_lease_id uuid, p_ttl_s double precision) RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v lease := own_lease(p_lease_id, 'renew');
    v_expires timestamptz;
BEGIN
    PERFORM check_lease_ttl(p_ttl_s);
    UPDATE lease SET expires_at = now() + make_interval(secs => p_ttl_s)
    WHERE lease_id = p_lease_id AND released_at IS NULL AND expires_at > now()
    RETURNING expires_at INTO v_expires;
    IF v_expires IS NULL THEN
        PERFORM fail('IB013', format('lease %s is %s', p_lease_id,
                                     CASE WHEN v.released_at IS NOT NULL THEN 'released' ELSE 'expired' END),
                     jsonb_build_object('lease_id', p_lease_id,
                                        'state', CASE WHEN v.released_at IS NOT NULL THEN 'released' ELSE 'expired' END));
    END IF;
    RETURN v_expires;
END $$;

CREATE FUNCTION release_lease(p_lease_id uuid) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
BEGIN
    PERFORM own_lease(p_lease_id, 'release');
    UPDATE lease SET released_at = now() WHERE lease_id = p_lease_id AND released_at IS NULL;
END $$;

-- Expiry -------------------------------------------------------------------------------------------

-- Of p_candidates (chosen by the caller beforehand), which may be deleted: under the table's
-- exclusive lock, everything outside protection(T) and p_keep (retention, refs), tombstoned
-- here (unless p_dry_run) so that a lease taken afterwards is refused. Returns them and the
-- protection row the decision used.
CREATE FUNCTION claim_expiry(p_table text, p_candidates bigint[], p_keep bigint[], p_dry_run boolean)
RETURNS TABLE (removable bigint[], current bigint, leases jsonb, job_progress jsonb, read_window jsonb)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
#variable_conflict use_column
DECLARE
    v_table_id bigint;
    p record;
    v_gone bigint[];
BEGIN
    PERFORM require_admin('expire snapshots');
    SELECT table_id INTO v_table_id FROM managed_table WHERE name = p_table;
    IF v_table_id IS NULL THEN
        PERFORM fail('IB009', format('table %s is not managed by icebarrier', p_table), jsonb_build_object('table', p_table));
    END IF;
    PERFORM take_lock('table', ARRAY[v_table_id], false, format('expiry of %s', p_table));
    SELECT * INTO p FROM protection(v_table_id);
    v_gone := ARRAY(
        SELECT DISTINCT c FROM unnest(p_candidates) c
        WHERE c IS DISTINCT FROM p.current
          AND NOT c = ANY(coalesce(p_keep, '{{}}'))
          AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p.leases) x WHERE (x->>1)::bigint = c)
          AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p.job_progress) x WHERE (x->>1)::bigint = c)
          AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p.read_window) x WHERE x::text::bigint = c)
        ORDER BY 1);
    IF NOT p_dry_run THEN
        INSERT INTO expired_snapshot (table_id, snapshot_id) SELECT v_table_id, unnest(v_gone) ON CONFLICT DO NOTHING;
    END IF;
    RETURN QUERY SELECT v_gone, p.current, p.leases, p.job_progress, p.read_window;
END $$;

-- Revision -----------------------------------------------------------------------------------------

-- Apply the control-plane half of a revision planned by the caller (p_plan: the tables with
-- their watermarks before and after). Resumes an unfinished revision of the same root to the
-- same barrier (resumed = true) instead.
CREATE FUNCTION begin_revision(p_root text, p_to_barrier bigint, p_plan jsonb)
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
        v_table_id := NULL;
    END LOOP;
    RETURN QUERY SELECT v_rid, p_plan, false;
END $$;

CREATE FUNCTION record_revision_snapshot(p_table text, p_barrier bigint, p_snapshot_id bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_admin('revise tables');
    INSERT INTO table_commit (table_id, barrier, snapshot_id, operation, job_name)
    SELECT table_id, p_barrier, p_snapshot_id, 'revision', 'icebarrier-revise' FROM managed_table WHERE name = p_table;
END $$;

CREATE FUNCTION finish_revision(p_revision_id bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {search_path} AS $$
BEGIN
    PERFORM require_admin('revise tables');
    UPDATE managed_table SET revision_id = NULL WHERE revision_id = p_revision_id;
    UPDATE revision SET state = 'done', finished_at = now() WHERE revision_id = p_revision_id;
END $$;

-- Only roles granted them may call the write functions (db grant-job / grant-reader).
REVOKE EXECUTE ON FUNCTION
    register_job(text, text[], text[], text[], boolean), unregister_job(text), issue_barrier(text),
    issue_barrier_if_due(text), set_setting(text, text),
    complete_barrier(text, bigint, text[], bigint[], text),
    record_commit(text, bigint, bigint, text, text, text), record_input_range(text, bigint, text, jsonb),
    set_job_status(text, text, text), set_job_waiting(text, text), job_heartbeat(text),
    acquire_lease(text[], double precision, text, bigint, text), renew_lease(uuid, double precision),
    release_lease(uuid), claim_expiry(text, bigint[], bigint[], boolean),
    begin_revision(text, bigint, jsonb), record_revision_snapshot(text, bigint, bigint), finish_revision(bigint)
FROM PUBLIC;
"""

# The views, now on the definitions above.
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
               (extract(epoch FROM t.created_at) * 1000000)::bigint)) AS barriers_behind
FROM managed_table t
LEFT JOIN job_sink w ON w.table_id = t.table_id
LEFT JOIN job j ON j.job_id = w.job_id
LEFT JOIN barrier b ON b.barrier = t.watermark
LEFT JOIN LATERAL snapshot_at(t.table_id, 9223372036854775807) c ON true;

-- The latest barrier completed by every managed table that has a writer or has progress.
CREATE OR REPLACE VIEW consistent_barrier AS
WITH tracked AS (
    SELECT t.table_id, t.start_barrier, t.watermark FROM managed_table t
    WHERE t.watermark IS NOT NULL OR EXISTS (SELECT 1 FROM job_sink k WHERE k.table_id = t.table_id)),
candidate AS (SELECT min(watermark) AS b FROM tracked),
bounds AS (
    SELECT CASE WHEN (SELECT bool_and(has_completed(t.start_barrier, t.watermark, candidate.b)) FROM tracked t)
                THEN candidate.b END AS barrier
    FROM candidate)
SELECT bounds.barrier, b.issued_at
FROM bounds LEFT JOIN barrier b ON b.barrier = bounds.barrier;

CREATE OR REPLACE VIEW active_leases AS
SELECT l.lease_id, l.holder, t.name AS table_name, ls.snapshot_id, l.barrier,
       l.acquired_at, l.expires_at, l.owner_role
FROM lease l
JOIN lease_snapshot ls USING (lease_id)
JOIN managed_table t USING (table_id)
WHERE l.released_at IS NULL AND l.expires_at > now();
"""

FUNCTION_SIGNATURES = (
    "finish_revision(bigint)",
    "record_revision_snapshot(text, bigint, bigint)",
    "begin_revision(text, bigint, jsonb)",
    "claim_expiry(text, bigint[], bigint[], boolean)",
    "release_lease(uuid)",
    "renew_lease(uuid, double precision)",
    "own_lease(uuid, text)",
    "acquire_lease(text[], double precision, text, bigint, text)",
    "check_lease_ttl(double precision)",
    "lease_ttl_cap_s()",
    "resolve_cut(text[], bigint, boolean)",
    "job_heartbeat(text)",
    "set_job_waiting(text, text)",
    "set_job_status(text, text, text)",
    "record_input_range(text, bigint, text, jsonb)",
    "record_commit(text, bigint, bigint, text, text, text)",
    "complete_barrier(text, bigint, text[], bigint[], text)",
    "set_setting(text, text)",
    "issue_barrier_if_due(text)",
    "issue_barrier(text)",
    "tick_barrier(text, bigint)",
    "unregister_job(text)",
    "register_job(text, text[], text[], text[], boolean)",
    "unlock(text, bigint[])",
    "take_lock(text, bigint[], boolean, text, boolean)",
    "check_catalog_write(text, text, text)",
    "require_job(text, text)",
    "require_admin(text)",
    "fail(text, text, jsonb)",
    "may_write_catalog_table(text, text, text)",
    "caller_acts_for(text)",
    "caller_is_admin()",
    "lock_key(text)",
    "protection(bigint)",
    "cut_at(text[], bigint)",
    "snapshot_at(bigint, bigint)",
    "has_completed(bigint, bigint, bigint)",
)


def _formatted(text: str) -> str:
    schema = context.config.attributes["schema"]
    return text.format(
        schema_literal=sql.Literal(schema).as_string(None),
        lock_prefix=sql.Literal(f"icebarrier:{schema}").as_string(None),
        search_path=f"{sql.Identifier(schema).as_string(None)}, pg_temp",
    )


def upgrade() -> None:
    op.execute(TABLES)
    op.execute(_formatted(DEFINITIONS))
    op.execute(_formatted(FUNCTIONS))
    op.execute(VIEWS)


def _earlier(name: str):
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def downgrade() -> None:
    first, second = _earlier("0001_control_plane.py"), _earlier("0002_revisions.py")
    for view in first.VIEW_NAMES:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    op.execute(first.VIEWS)
    op.execute(second.TABLE_VERSIONS.format(commit_filter=" AND c.revoked_by IS NULL"))
    for signature in FUNCTION_SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.execute("DELETE FROM setting WHERE key = 'lease_max_ttl_ms'")
    op.execute("ALTER TABLE setting DROP CONSTRAINT setting_known_value_check")
    op.execute(_earlier("0006_setting_checks.py").CHECK)
    op.execute("ALTER TABLE lease DROP COLUMN owner_role")
    op.execute("DROP TABLE job_grant")
