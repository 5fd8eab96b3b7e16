"""Jobs: registration (topology rules), the next barrier a job owes, and completing it.

A job's progress is the common watermark of its sinks; it is not stored twice. Completing
barrier B advances every sink's watermark from the job's progress to B in one
compare-and-set statement, inside one transaction with the barrier->snapshot records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import psycopg

from icebarrier.control_plane import barriers
from icebarrier.control_plane.db import advisory_lock, retrying
from icebarrier.control_plane.errors import (
    BarrierNotIssuedError,
    BarrierOutOfOrderError,
    CompletionConflictError,
    JobDefinitionChangedError,
    JobNotFoundError,
    NotASinkError,
    RevisionInProgressError,
    SinkHistoryMismatchError,
    SourcesNotReadyError,
)
from icebarrier.control_plane.model import JobDefinition, TableName, TableState
from icebarrier.control_plane.topology import check_registration
from icebarrier.control_plane.cuts import latest_valid_barrier
from icebarrier.control_plane.errors import NoValidCutError


@dataclass(frozen=True, slots=True, kw_only=True)
class Registration:
    job: JobDefinition
    status: str  # "created", "unchanged" or "replaced"

    def to_json(self) -> dict:
        return {"job": self.job.name, "status": self.status, **definition_json(self.job)}


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo:
    definition: JobDefinition
    registered_at: datetime
    status: str  # registered, running, stopped, or lost (running without a heartbeat for 30 s)
    heartbeat_at: datetime | None
    progress: int | None
    start_barrier: int | None
    barriers_behind: int
    waiting_for: str | None = None  # what a running job reported it waits for
    sources: tuple[TableState, ...] = ()
    sinks: tuple[TableState, ...] = ()

    @property
    def kind(self) -> str:
        return "root" if self.definition.is_root else "intermediate"

    def to_json(self) -> dict:
        return {
            "job": self.definition.name,
            "kind": self.kind,
            **definition_json(self.definition),
            "registered_at": self.registered_at.isoformat(),
            "status": self.status,
            "heartbeat_at": self.heartbeat_at.isoformat() if self.heartbeat_at else None,
            "start_barrier": self.start_barrier,
            "progress": self.progress,
            "barriers_behind": self.barriers_behind,
            "waiting_for": self.waiting_for,
            "table_states": {
                str(s.name): {"start_barrier": s.start_barrier, "watermark": s.watermark}
                for s in (*self.sources, *self.sinks)
            },
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class NextBarrier:
    """The barrier a job must complete next; ``ready`` once all its sources have completed it."""

    job: str
    barrier: int | None
    ready: bool
    waiting_for: dict[str, int | None] = field(default_factory=dict)
    issued: bool = False  # this call issued the barrier

    def describe_wait(self) -> str | None:
        """What the job waits for, in words (None when ready)."""
        if self.ready:
            return None
        if self.waiting_for:
            return "sources " + ", ".join(
                f"{t} (at barrier {w})" if w is not None else f"{t} (no barrier completed yet)"
                for t, w in sorted(self.waiting_for.items()))
        return "the next barrier (none due yet; see `icebarrier barrier interval`)"

    def to_json(self) -> dict:
        return {
            "job": self.job, "barrier": self.barrier, "ready": self.ready,
            "waiting_for": self.waiting_for, "issued": self.issued,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    job: str
    barrier: int
    commits: dict[TableName, int]
    sinks: tuple[TableName, ...]
    noop: bool  # the barrier was already completed with these commits

    def to_json(self) -> dict:
        return {
            "job": self.job, "barrier": self.barrier,
            "commits": {str(t): s for t, s in sorted(self.commits.items())},
            "sinks": [str(t) for t in self.sinks], "noop": self.noop,
        }


def definition_json(job: JobDefinition) -> dict:
    return {
        "sources": sorted(map(str, job.sources)),
        "sinks": sorted(map(str, job.sinks)),
        "external_inputs": sorted(job.external_inputs),
    }


# -- registration ---------------------------------------------------------------------------


def load_definitions(conn: psycopg.Connection) -> dict[str, JobDefinition]:
    rows = conn.execute(
        """
        SELECT j.name, j.external_inputs,
               coalesce((SELECT array_agg(t.name) FROM job_source s JOIN managed_table t USING (table_id)
                          WHERE s.job_id = j.job_id), '{}') AS sources,
               coalesce((SELECT array_agg(t.name) FROM job_sink s JOIN managed_table t USING (table_id)
                          WHERE s.job_id = j.job_id), '{}') AS sinks
        FROM job j WHERE j.active
        """
    ).fetchall()
    return {r["name"]: _definition(r) for r in rows}


def register(conn: psycopg.Connection, job: JobDefinition, *, replace: bool = False) -> Registration:
    """Register ``job``, checking the topology rules; writes nothing if one is broken.

    Registrations (and revisions) are serialised by a topology lock, so two processes
    registering the same sink at once cannot both win.
    """
    with conn.transaction():
        advisory_lock(conn, "topology", [0], what=f"registering job {job.name}")
        existing = load_definitions(conn)
        current = existing.get(job.name)
        if current == job:
            return Registration(job=job, status="unchanged")
        if current is not None and not replace:
            raise JobDefinitionChangedError(job.name, current.differences(job))
        check_registration(existing, job)
        _check_sink_history(conn, job)

        names = sorted(str(t) for t in job.sources | job.sinks)
        conn.execute(
            "INSERT INTO managed_table (name) SELECT unnest(%s::text[]) ON CONFLICT (name) DO NOTHING", (names,)
        )
        row = conn.execute(
            """
            INSERT INTO job (name, external_inputs) VALUES (%(name)s, %(ext)s)
            ON CONFLICT (name) DO UPDATE
              SET external_inputs = excluded.external_inputs, active = true,
                  registered_at = CASE WHEN job.active THEN job.registered_at ELSE now() END,
                  unregistered_at = NULL
            RETURNING job_id
            """,
            {"name": job.name, "ext": sorted(job.external_inputs)},
        ).fetchone()
        job_id = row["job_id"]
        conn.execute("DELETE FROM job_source WHERE job_id = %s", (job_id,))
        conn.execute("DELETE FROM job_sink WHERE job_id = %s", (job_id,))
        for edge, tables in (("job_source", job.sources), ("job_sink", job.sinks)):
            conn.execute(
                f"INSERT INTO {edge} (job_id, table_id) "  # edge is one of two literals above
                "SELECT %s, table_id FROM managed_table WHERE name = ANY(%s)",
                (job_id, [str(t) for t in tables]),
            )
    return Registration(job=job, status="replaced" if current is not None else "created")


def unregister(conn: psycopg.Connection, name: str) -> JobDefinition:
    """Remove a job from the topology; its tables, their history and watermarks stay."""
    with conn.transaction():
        advisory_lock(conn, "topology", [0], what=f"unregistering job {name}")
        definition = load_definitions(conn).get(name)
        if definition is None:
            raise JobNotFoundError(name)
        row = conn.execute(
            "UPDATE job SET active = false, unregistered_at = now() WHERE name = %s RETURNING job_id", (name,)
        ).fetchone()
        conn.execute("DELETE FROM job_source WHERE job_id = %s", (row["job_id"],))
        conn.execute("DELETE FROM job_sink WHERE job_id = %s", (row["job_id"],))
    return definition


def _check_sink_history(conn: psycopg.Connection, job: JobDefinition) -> None:
    """A job advances its sinks together, so tables with history must be at one barrier."""
    rows = conn.execute(
        "SELECT name, watermark FROM managed_table WHERE name = ANY(%s)", ([str(t) for t in job.sinks],)
    ).fetchall()
    marks = {r["name"]: r["watermark"] for r in rows}
    marks.update({str(t): None for t in job.sinks if str(t) not in marks})
    if len(set(marks.values())) > 1:
        raise SinkHistoryMismatchError(job.name, marks)


# -- listing -----------------------------------------------------------------------------------


_JOB_STATE = """
SELECT j.job_id, j.name, j.external_inputs, j.registered_at, j.heartbeat_at, j.waiting_for,
       CASE WHEN j.status = 'running' AND j.heartbeat_at < now() - interval '30 seconds' THEN 'lost'
            ELSE j.status END AS status,
       coalesce(src.names, '{}') AS sources, coalesce(snk.names, '{}') AS sinks,
       coalesce(src.states, '[]') AS source_states, coalesce(snk.states, '[]') AS sink_states,
       snk.progress, snk.start_barrier,
       (SELECT count(*) FROM barrier b WHERE b.barrier > coalesce(snk.progress,
            (extract(epoch FROM j.registered_at) * 1000000)::bigint)) AS barriers_behind
FROM job j
LEFT JOIN LATERAL (
    SELECT array_agg(t.name) AS names,
           json_agg(json_build_object('name', t.name, 'start', t.start_barrier, 'watermark', t.watermark)) AS states
    FROM job_source s JOIN managed_table t USING (table_id) WHERE s.job_id = j.job_id) src ON true
LEFT JOIN LATERAL (
    SELECT array_agg(t.name) AS names, max(t.watermark) AS progress, min(t.start_barrier) AS start_barrier,
           json_agg(json_build_object('name', t.name, 'start', t.start_barrier, 'watermark', t.watermark)) AS states
    FROM job_sink s JOIN managed_table t USING (table_id) WHERE s.job_id = j.job_id) snk ON true
WHERE j.active
"""


def list_jobs(conn: psycopg.Connection) -> list[JobInfo]:
    return [_job_info(r) for r in conn.execute(_JOB_STATE + " ORDER BY j.name").fetchall()]


def show(conn: psycopg.Connection, name: str) -> JobInfo:
    row = conn.execute(_JOB_STATE + " AND j.name = %s", (name,)).fetchone()
    if row is None:
        raise JobNotFoundError(name)
    return _job_info(row)


def _job_info(r: dict) -> JobInfo:
    return JobInfo(
        definition=_definition(r),
        registered_at=r["registered_at"],
        status=r["status"],
        heartbeat_at=r["heartbeat_at"],
        progress=r["progress"],
        start_barrier=r["start_barrier"],
        barriers_behind=r["barriers_behind"],
        waiting_for=r["waiting_for"] if r["status"] == "running" else None,
        sources=tuple(_states(r["source_states"])),
        sinks=tuple(_states(r["sink_states"])),
    )


def _definition(r: dict) -> JobDefinition:
    return JobDefinition(
        name=r["name"],
        sources=frozenset(TableName.parse(t) for t in r["sources"]),
        sinks=frozenset(TableName.parse(t) for t in r["sinks"]),
        external_inputs=frozenset(r["external_inputs"]),
    )


def _states(items: list[dict]) -> list[TableState]:
    return sorted(
        (TableState(name=TableName.parse(i["name"]), start_barrier=i["start"], watermark=i["watermark"]) for i in items),
        key=lambda s: s.name,
    )


# -- the next barrier ------------------------------------------------------------------------------


def next_barrier(conn: psycopg.Connection, name: str) -> NextBarrier:
    """The barrier ``name`` must complete next.

    With progress P it is the first barrier after P. Without progress, a job resumes the
    first barrier whose input it recorded; otherwise a root job starts at the newest barrier
    and an intermediate job at its sources' latest common completed barrier (bootstrap, no
    need to wait for a new one). A root job asking when there is no
    next barrier issues one if the newest is older than the barrier interval.
    """
    info = show(conn, name)
    issued = False
    if info.progress is None:
        # A job that recorded the input of its first barrier and then crashed must resume that
        # barrier, not start at a newer one (its commit may already be in a table to adopt).
        row = conn.execute("SELECT min(barrier) AS b FROM input_range WHERE job_name = %s", (name,)).fetchone()
        if row["b"] is not None:
            waiting = {str(s.name): s.watermark for s in info.sources if not s.has_completed(row["b"])}
            return NextBarrier(job=name, barrier=row["b"], ready=not waiting, waiting_for=waiting)
    if info.definition.is_root:
        candidate = _first_after(conn, info.progress) if info.progress is not None else _newest_barrier(conn)
        if candidate is None or (info.progress is None and _due(conn)):
            new = barriers.issue_if_due(conn, issued_by=name)
            issued = new is not None
            candidate = _first_after(conn, info.progress) if info.progress is not None else _newest_barrier(conn)
        return NextBarrier(job=name, barrier=candidate, ready=candidate is not None, issued=issued)

    if info.progress is None:
        try:
            candidate = latest_valid_barrier(info.sources)
        except NoValidCutError:
            waiting = {str(s.name): s.watermark for s in info.sources}
            return NextBarrier(job=name, barrier=None, ready=False, waiting_for=waiting)
    else:
        candidate = _first_after(conn, info.progress)
        if candidate is None:
            return NextBarrier(job=name, barrier=None, ready=False)
    waiting = {str(s.name): s.watermark for s in info.sources if not s.has_completed(candidate)}
    return NextBarrier(job=name, barrier=candidate, ready=not waiting, waiting_for=waiting)


def _first_after(conn: psycopg.Connection, barrier: int) -> int | None:
    row = conn.execute("SELECT min(barrier) AS b FROM barrier WHERE barrier > %s", (barrier,)).fetchone()
    return row["b"]


def _newest_barrier(conn: psycopg.Connection) -> int | None:
    newest = barriers.newest(conn)
    return newest.barrier if newest else None


def _due(conn: psycopg.Connection) -> bool:
    """Is the newest barrier older than the barrier interval (or is there none)?"""
    row = conn.execute(
        """
        SELECT coalesce(max(barrier) <= (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
                        - (SELECT value::bigint * 1000 FROM setting WHERE key = 'barrier_interval_ms'), true) AS due
        FROM barrier
        """
    ).fetchone()
    return row["due"]


# -- completing a barrier ------------------------------------------------------------------------------

# Everything completion needs to decide, in one round trip.
_COMPLETION_STATE = """
SELECT j.job_id,
       EXISTS (SELECT 1 FROM barrier WHERE barrier = %(barrier)s) AS barrier_issued,
       coalesce((SELECT json_agg(json_build_object('id', t.table_id, 'name', t.name, 'revision', t.revision_id,
                                                   'start', t.start_barrier, 'watermark', t.watermark))
                 FROM job_sink k JOIN managed_table t USING (table_id) WHERE k.job_id = j.job_id), '[]') AS sinks,
       coalesce((SELECT json_agg(json_build_object('id', t.table_id, 'name', t.name,
                                                   'start', t.start_barrier, 'watermark', t.watermark))
                 FROM job_source k JOIN managed_table t USING (table_id) WHERE k.job_id = j.job_id), '[]') AS sources,
       coalesce((SELECT json_object_agg(t.name, c.snapshot_id)
                 FROM job_sink k JOIN managed_table t USING (table_id)
                 JOIN table_commit c ON c.table_id = k.table_id AND c.barrier = %(barrier)s AND c.operation = 'data'
                                     AND c.revoked_by IS NULL
                 WHERE k.job_id = j.job_id), '{}') AS recorded,
       (SELECT min(b.barrier) FROM barrier b
         WHERE b.barrier > (SELECT max(t.watermark) FROM job_sink k JOIN managed_table t USING (table_id)
                            WHERE k.job_id = j.job_id)) AS expected
FROM job j WHERE j.name = %(job)s AND j.active
"""

# The write, as one atomic statement (its own transaction): advance every sink from the
# job's progress to B (compare-and-set), record the commits and completion times. If a
# sink did not move (another process completed it, or a revision moved it) or the job's
# sinks changed since the state was read, the statement aborts with a retryable
# serialization failure and nothing is written. Sources need no re-check: their
# watermarks only move back through a revision, which also moves these sinks.
_ADVANCE = """
WITH moved AS (
    UPDATE managed_table
    SET watermark = %(barrier)s, start_barrier = coalesce(start_barrier, %(barrier)s)
    WHERE table_id = ANY(%(sink_ids)s) AND watermark IS NOT DISTINCT FROM %(progress)s
      AND revision_id IS NULL
    RETURNING table_id),
commits AS (
    INSERT INTO table_commit (table_id, barrier, snapshot_id, job_name, run_id)
    SELECT c.table_id, %(barrier)s, c.snapshot_id, %(job)s, %(run_id)s
    FROM unnest(%(commit_ids)s::bigint[], %(snapshot_ids)s::bigint[]) AS c(table_id, snapshot_id)
    WHERE (SELECT count(*) FROM moved) = %(n_sinks)s),  -- else no unique violation before the raise
completions AS (
    INSERT INTO table_completion (table_id, barrier, job_name, completed_at)
    SELECT table_id, %(barrier)s, %(job)s, clock_timestamp() FROM moved)
SELECT CASE
    WHEN (SELECT count(*) FROM moved) = %(n_sinks)s
     AND (SELECT array_agg(table_id ORDER BY table_id) FROM job_sink k
          JOIN job j USING (job_id) WHERE j.job_id = %(job_id)s AND j.active) = %(sink_ids)s::bigint[]
    THEN %(n_sinks)s
    ELSE raise_conflict('another process completed or revised these sinks, or the job changed')
END AS moved
"""


# The common case in one round trip: a job with progress P completes the barrier right after
# P, its sources have completed it, and it commits only to its sinks. Every condition is
# checked inside the statement; if one fails nothing moves (moved = 0) and the caller takes
# the two-step path below, which says exactly what is wrong (or sees a no-op). As in
# _ADVANCE, a concurrent completion or revision makes the compare-and-set find nothing, and a
# partial move aborts the statement with a retryable serialization failure.
_FAST_ADVANCE = """
WITH j AS (SELECT job_id FROM job WHERE name = %(job)s AND active),
sinks AS (
    SELECT t.table_id, t.name, t.watermark, t.revision_id
    FROM job_sink k JOIN managed_table t USING (table_id) WHERE k.job_id = (SELECT job_id FROM j)),
state AS (
    SELECT max(watermark) AS progress, count(*) AS n FROM sinks
    HAVING count(*) > 0 AND bool_and(watermark IS NOT NULL) AND count(DISTINCT watermark) = 1
       AND bool_and(revision_id IS NULL)),
ok AS (
    SELECT s.progress, s.n FROM state s
    WHERE %(barrier)s = (SELECT min(b.barrier) FROM barrier b WHERE b.barrier > s.progress)
      AND NOT EXISTS (
          SELECT 1 FROM job_source src JOIN managed_table m USING (table_id)
          WHERE src.job_id = (SELECT job_id FROM j)
            AND NOT coalesce(m.start_barrier <= %(barrier)s AND %(barrier)s <= m.watermark, false))
      AND (SELECT count(*) FROM unnest(%(commit_names)s::text[]) AS c(name) JOIN sinks USING (name))
          = cardinality(%(commit_names)s::text[])),
moved AS (
    UPDATE managed_table m SET watermark = %(barrier)s
    FROM ok
    WHERE m.table_id IN (SELECT table_id FROM sinks) AND m.watermark = ok.progress AND m.revision_id IS NULL
    RETURNING m.table_id),
commits AS (
    INSERT INTO table_commit (table_id, barrier, snapshot_id, job_name, run_id)
    SELECT s.table_id, %(barrier)s, c.snapshot_id, %(job)s, %(run_id)s
    FROM unnest(%(commit_names)s::text[], %(snapshot_ids)s::bigint[]) AS c(name, snapshot_id)
    JOIN sinks s USING (name)
    WHERE (SELECT count(*) FROM moved) = (SELECT n FROM ok)),
completions AS (
    INSERT INTO table_completion (table_id, barrier, job_name, completed_at)
    SELECT table_id, %(barrier)s, %(job)s, clock_timestamp() FROM moved
    WHERE (SELECT count(*) FROM moved) = (SELECT n FROM ok))
SELECT CASE
    WHEN (SELECT count(*) FROM moved) = 0 THEN NULL
    WHEN (SELECT count(*) FROM moved) = (SELECT n FROM ok) THEN (SELECT array_agg(name) FROM sinks)
    ELSE raise_conflict('sinks moved concurrently')::text::text[]
END AS sinks
"""


def complete(
    conn: psycopg.Connection,
    name: str,
    barrier: int,
    commits: dict[TableName, int] | None = None,
    *,
    run_id: str | None = None,
) -> Completion:
    """Record that job ``name`` completed ``barrier`` for all its sinks, in one transaction.

    ``commits`` maps sinks to the Iceberg snapshot written for this barrier; sinks without
    one keep their snapshot. Completing a completed barrier again with the same commits is a
    no-op; with other commits it is refused.
    """
    commits = dict(commits or {})
    return retrying(lambda: _complete_once(conn, name, barrier, commits, run_id))


def _complete_once(
    conn: psycopg.Connection, name: str, barrier: int, commits: dict[TableName, int], run_id: str | None
) -> Completion:
    names = [str(t) for t in commits]
    row = conn.execute(
        _FAST_ADVANCE,
        {"job": name, "barrier": barrier, "run_id": run_id, "commit_names": names,
         "snapshot_ids": list(commits.values())},
    ).fetchone()
    if row["sinks"] is not None:
        return Completion(job=name, barrier=barrier, commits=commits,
                          sinks=tuple(sorted(TableName.parse(n) for n in row["sinks"])), noop=False)
    # Otherwise two round trips and no explicit transaction: a read that decides (and names
    # what is wrong), then one atomic compare-and-set statement that re-validates what the
    # decision relied on (see _ADVANCE).
    state = conn.execute(_COMPLETION_STATE, {"barrier": barrier, "job": name}).fetchone()
    if state is None:
        raise JobNotFoundError(name)
    if not state["barrier_issued"]:
        raise BarrierNotIssuedError(barrier)
    sinks = {s["name"]: s for s in state["sinks"]}
    revising = sorted(n for n, s in sinks.items() if s["revision"] is not None)
    if revising:
        raise RevisionInProgressError(revising[0], sinks[revising[0]]["revision"])
    strangers = sorted(str(t) for t in commits if str(t) not in sinks)
    if strangers:
        raise NotASinkError(name, strangers)
    marks = {s["name"]: s["watermark"] for s in sinks.values()}
    if len(set(marks.values())) > 1:
        raise SinkHistoryMismatchError(name, marks)
    progress = next(iter(marks.values()))
    start = min((s["start"] for s in sinks.values() if s["start"] is not None), default=None)
    given = {str(t): s for t, s in commits.items()}
    sink_names = tuple(sorted(TableName.parse(n) for n in sinks))

    if progress is not None and start <= barrier <= progress:
        if state["recorded"] != given:
            raise CompletionConflictError(name, barrier, state["recorded"], given)
        return Completion(job=name, barrier=barrier, commits=commits, sinks=sink_names, noop=True)
    if progress is not None and barrier != state["expected"]:
        raise BarrierOutOfOrderError(name, barrier, state["expected"], progress)
    waiting = {
        s["name"]: s["watermark"]
        for s in state["sources"]
        if not (s["start"] is not None and s["start"] <= barrier <= s["watermark"])
    }
    if waiting:
        raise SourcesNotReadyError(name, barrier, waiting)

    conn.execute(
        _ADVANCE,
        {
            "barrier": barrier, "progress": progress, "job": name, "job_id": state["job_id"],
            "run_id": run_id, "sink_ids": sorted(s["id"] for s in sinks.values()), "n_sinks": len(sinks),
            "commit_ids": [sinks[str(t)]["id"] for t in commits], "snapshot_ids": list(commits.values()),
        },
    )
    return Completion(job=name, barrier=barrier, commits=commits, sinks=sink_names, noop=False)
