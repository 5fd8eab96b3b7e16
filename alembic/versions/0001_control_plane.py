"""Control plane: topology, barriers, watermarks, barrier->snapshot map, leases, delays.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TABLES = """
CREATE TABLE setting (
    key   text PRIMARY KEY,
    value text NOT NULL
);
INSERT INTO setting (key, value) VALUES ('barrier_interval_ms', '10000');

-- The barrier sequence: one row, advanced by a single compare-and-set statement so that
-- barriers are strictly increasing even when the database clock is not.
CREATE TABLE barrier_clock (
    singleton    boolean PRIMARY KEY DEFAULT true CONSTRAINT barrier_clock_singleton CHECK (singleton),
    last_barrier bigint  NOT NULL
);
INSERT INTO barrier_clock (last_barrier) VALUES (0);

CREATE TABLE barrier (
    barrier   bigint      PRIMARY KEY,
    issued_at timestamptz NOT NULL,
    issued_by text        NOT NULL
);

CREATE TABLE managed_table (
    table_id      bigint GENERATED ALWAYS AS IDENTITY CONSTRAINT managed_table_pkey PRIMARY KEY,
    name          text        NOT NULL CONSTRAINT managed_table_name_key UNIQUE,
    start_barrier bigint      CONSTRAINT managed_table_start_fkey REFERENCES barrier,
    watermark     bigint      CONSTRAINT managed_table_watermark_fkey REFERENCES barrier,
    created_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT managed_table_progress_check CHECK (
        (start_barrier IS NULL AND watermark IS NULL)
        OR (start_barrier IS NOT NULL AND watermark IS NOT NULL AND start_barrier <= watermark))
);

CREATE TABLE job (
    job_id          bigint GENERATED ALWAYS AS IDENTITY CONSTRAINT job_pkey PRIMARY KEY,
    name            text        NOT NULL CONSTRAINT job_name_key UNIQUE,
    external_inputs text[]      NOT NULL DEFAULT '{}',
    active          boolean     NOT NULL DEFAULT true,
    registered_at   timestamptz NOT NULL DEFAULT now(),
    unregistered_at timestamptz
);

CREATE TABLE job_source (
    job_id   bigint NOT NULL CONSTRAINT job_source_job_fkey REFERENCES job ON DELETE CASCADE,
    table_id bigint NOT NULL CONSTRAINT job_source_table_fkey REFERENCES managed_table,
    CONSTRAINT job_source_pkey PRIMARY KEY (job_id, table_id)
);
CREATE INDEX job_source_table_idx ON job_source (table_id);

CREATE TABLE job_sink (
    job_id   bigint NOT NULL CONSTRAINT job_sink_job_fkey REFERENCES job ON DELETE CASCADE,
    table_id bigint NOT NULL CONSTRAINT job_sink_table_fkey REFERENCES managed_table,
    CONSTRAINT job_sink_pkey PRIMARY KEY (job_id, table_id),
    CONSTRAINT job_sink_one_writer UNIQUE (table_id)
);

-- The barrier -> snapshot map: the source of truth for S(T, B).
CREATE TABLE table_commit (
    commit_id   bigint GENERATED ALWAYS AS IDENTITY CONSTRAINT table_commit_pkey PRIMARY KEY,
    table_id    bigint      NOT NULL CONSTRAINT table_commit_table_fkey REFERENCES managed_table,
    barrier     bigint      NOT NULL CONSTRAINT table_commit_barrier_fkey REFERENCES barrier,
    snapshot_id bigint      NOT NULL,
    operation   text        NOT NULL DEFAULT 'data'
                CONSTRAINT table_commit_operation_check CHECK (operation IN ('data', 'compaction')),
    job_name    text        NOT NULL,
    run_id      text,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX table_commit_one_data_commit ON table_commit (table_id, barrier) WHERE operation = 'data';
CREATE INDEX table_commit_at_barrier ON table_commit (table_id, barrier DESC, commit_id DESC);
CREATE INDEX table_commit_snapshot ON table_commit (table_id, snapshot_id);

-- When each table completed each barrier (observability; the watermark is the authority).
CREATE TABLE table_completion (
    table_id     bigint      NOT NULL CONSTRAINT table_completion_table_fkey REFERENCES managed_table,
    barrier      bigint      NOT NULL CONSTRAINT table_completion_barrier_fkey REFERENCES barrier,
    job_name     text        NOT NULL,
    completed_at timestamptz NOT NULL,
    CONSTRAINT table_completion_pkey PRIMARY KEY (table_id, barrier)
);
CREATE INDEX table_completion_barrier ON table_completion (barrier);

CREATE TABLE lease (
    lease_id    uuid        CONSTRAINT lease_pkey PRIMARY KEY DEFAULT gen_random_uuid(),
    holder      text        NOT NULL,
    barrier     bigint,
    acquired_at timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    released_at timestamptz
);
CREATE INDEX lease_live ON lease (expires_at) WHERE released_at IS NULL;

CREATE TABLE lease_snapshot (
    lease_id    uuid   NOT NULL CONSTRAINT lease_snapshot_lease_fkey REFERENCES lease ON DELETE CASCADE,
    table_id    bigint NOT NULL CONSTRAINT lease_snapshot_table_fkey REFERENCES managed_table,
    snapshot_id bigint,
    CONSTRAINT lease_snapshot_pkey PRIMARY KEY (lease_id, table_id)
);
CREATE INDEX lease_snapshot_table ON lease_snapshot (table_id, snapshot_id);

-- Raised inside single-statement compare-and-set writes when a precondition no longer
-- holds: SQLSTATE 40001 (serialization_failure) aborts the statement and marks it retryable.
CREATE FUNCTION raise_conflict(message text) RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%', message USING ERRCODE = 'serialization_failure';
END
$$;

-- Tombstones written by expiry, under the per-table lock, before it deletes anything.
CREATE TABLE expired_snapshot (
    table_id    bigint      NOT NULL CONSTRAINT expired_snapshot_table_fkey REFERENCES managed_table,
    snapshot_id bigint      NOT NULL,
    expired_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT expired_snapshot_pkey PRIMARY KEY (table_id, snapshot_id)
);
"""

VIEWS = """
CREATE VIEW job_sources AS
SELECT j.name AS job_name, t.name AS table_name
FROM job_source s JOIN job j USING (job_id) JOIN managed_table t USING (table_id);

CREATE VIEW job_sinks AS
SELECT j.name AS job_name, t.name AS table_name
FROM job_sink s JOIN job j USING (job_id) JOIN managed_table t USING (table_id);

CREATE VIEW table_versions AS
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
LEFT JOIN LATERAL (
    SELECT snapshot_id, recorded_at FROM table_commit c
    WHERE c.table_id = t.table_id
    ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1) c ON true;

CREATE VIEW topology_edges AS
SELECT ext AS from_node, j.name AS to_node, 'reads' AS edge_kind, 'external' AS from_kind, 'job' AS to_kind
FROM job j, unnest(j.external_inputs) AS ext
UNION ALL
SELECT table_name, job_name, 'reads', 'table', 'job' FROM job_sources
UNION ALL
SELECT job_name, table_name, 'writes', 'job', 'table' FROM job_sinks;

-- The latest barrier completed by every managed table that has a writer or has progress.
CREATE VIEW consistent_barrier AS
WITH tracked AS (
    SELECT t.table_id, t.start_barrier, t.watermark FROM managed_table t
    WHERE t.watermark IS NOT NULL OR EXISTS (SELECT 1 FROM job_sink k WHERE k.table_id = t.table_id)),
bounds AS (
    SELECT CASE WHEN bool_and(watermark IS NOT NULL) AND max(start_barrier) <= min(watermark)
                THEN min(watermark) END AS barrier
    FROM tracked)
SELECT bounds.barrier, b.issued_at
FROM bounds LEFT JOIN barrier b ON b.barrier = bounds.barrier;

CREATE VIEW barrier_delay AS
SELECT c.barrier, t.name AS table_name, b.issued_at, c.completed_at,
       c.completed_at - b.issued_at AS delay, c.job_name
FROM table_completion c
JOIN managed_table t USING (table_id)
JOIN barrier b USING (barrier);

CREATE VIEW job_delay AS
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
    JOIN table_completion sc ON sc.table_id = s.table_id AND sc.barrier = jc.barrier
    WHERE s.job_id = jc.job_id) inputs ON true;

CREATE VIEW active_leases AS
SELECT l.lease_id, l.holder, t.name AS table_name, ls.snapshot_id, l.barrier,
       l.acquired_at, l.expires_at
FROM lease l
JOIN lease_snapshot ls USING (lease_id)
JOIN managed_table t USING (table_id)
WHERE l.released_at IS NULL AND l.expires_at > now();
"""

VIEW_NAMES = (
    "active_leases",
    "job_delay",
    "barrier_delay",
    "consistent_barrier",
    "topology_edges",
    "table_versions",
    "job_sinks",
    "job_sources",
)
TABLE_NAMES = (
    "expired_snapshot",
    "lease_snapshot",
    "lease",
    "table_completion",
    "table_commit",
    "job_sink",
    "job_source",
    "job",
    "managed_table",
    "barrier",
    "barrier_clock",
    "setting",
)


def upgrade() -> None:
    op.execute(TABLES)
    op.execute(VIEWS)


def downgrade() -> None:
    for view in VIEW_NAMES:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    for table in TABLE_NAMES:
        op.execute(f"DROP TABLE IF EXISTS {table}")
    op.execute("DROP FUNCTION IF EXISTS raise_conflict(text)")
