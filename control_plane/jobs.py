"""Jobs: registration (topology rules), the next barrier a job owes, and completing it.

A job's progress is the common watermark of its sinks; it is not stored twice. Registration
and completion are control-plane functions (migration 0007) that check the caller's role and
the rules once; completing barrier B advances every sink's watermark from the job's progress
to B in one transaction with the barrier->snapshot records.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum

from icebarrier.control_plane.db import Conn, call, retrying
from icebarrier.control_plane.errors import JobDefinitionChangedError, JobNotFoundError
from icebarrier.control_plane.model import JobDefinition, TableName, TableState, barrier_label


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
    status: str  # registered, running, stopped, or lost (running without a heartbeat for 90 s)
    heartbeat_at: datetime | None
    progress: int | None
    start_barrier: int | None
    barriers_behind: int
    waiting_for: str | None = None  # what a running job reported it waits for
    sources: tuple[TableState, ...] = ()
    sinks: tuple[TableState, ...] = ()
    # How it computed its last barrier, for a job that says (an SqlJob): barrier, incremental,
    # reason (why in full), at, and how many of each so far (incremental_total, full_total).
    computation: dict | None = None

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
            "computation": self.computation,
            "table_states": {
                str(s.name): {"start_barrier": s.start_barrier, "watermark": s.watermark}
                for s in (*self.sources, *self.sinks)
            },
        }


class Plan(str, Enum):
    """How a job completes its next barrier (DESIGN.md, "Cost follows change")."""

    EXACT = "exact"  # the next barrier after its progress, computed
    SKIP = "skip"  # no source changed up to the barrier: completed with no computation
    COALESCE = "coalesce"  # one computation for every barrier after its progress up to this one


@dataclass(frozen=True, slots=True, kw_only=True)
class NextBarrier:
    """The barrier a job completes next and how; ``ready`` once all its sources have completed it.
    ``from_barrier`` is the job's progress (the barriers after it up to ``barrier`` are covered);
    ``anchors_in_range`` counts the anchors among them."""

    job: str
    barrier: int | None
    ready: bool
    waiting_for: dict[str, int | None] = field(default_factory=dict)
    issued: bool = False  # this call issued the barrier
    plan: Plan = Plan.EXACT
    from_barrier: int | None = None
    anchors_in_range: int = 0
    root: bool = False  # the job has no sources
    announced: tuple[str, ...] = ()  # a root job's external inputs, every one announced (else empty)
    pending: bool = False  # one of them was announced since the job's progress
    # with nothing to do now (advance_job): every source's watermark, and the job's own tables
    marks: dict[str, int | None] = field(default_factory=dict)
    sinks: tuple[str, ...] = ()

    @property
    def waits_for_announcement(self) -> bool:
        """A root job whose announced inputs brought nothing since its progress: nothing to do
        until one is announced (the control plane skips its barriers meanwhile)."""
        return bool(self.announced) and not self.pending

    def describe_wait(self) -> str | None:
        """What the job waits for, in words (None when ready)."""
        if self.ready:
            return None
        if self.waits_for_announcement:
            return f"an announcement of input {', '.join(self.announced)} (`icebarrier input announce`)"
        if self.waiting_for:
            return "sources " + ", ".join(
                f"{t} (at barrier {barrier_label(w)})" if w is not None else f"{t} (no barrier completed yet)"
                for t, w in sorted(self.waiting_for.items())
            )
        return "the next barrier (none due yet; see `icebarrier barrier interval`)"

    def to_json(self) -> dict:
        return {
            "job": self.job,
            "barrier": self.barrier,
            "plan": self.plan.value,
            "from_barrier": self.from_barrier,
            "anchors_in_range": self.anchors_in_range,
            "ready": self.ready,
            "waiting_for": self.waiting_for,
            "issued": self.issued,
            "announced": list(self.announced),
            "pending": self.pending,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    job: str
    barrier: int
    commits: dict[TableName, int]
    sinks: tuple[TableName, ...]
    noop: bool  # the barrier was already completed with these commits
    coalesced: bool = False  # the barriers since the job's progress were coalesced into this one

    def to_json(self) -> dict:
        return {
            "job": self.job,
            "barrier": self.barrier,
            "commits": {str(t): s for t, s in sorted(self.commits.items())},
            "sinks": [str(t) for t in self.sinks],
            "noop": self.noop,
            "coalesced": self.coalesced,
        }


def definition_json(job: JobDefinition) -> dict:
    return {
        "sources": sorted(map(str, job.sources)),
        "sinks": sorted(map(str, job.sinks)),
        "external_inputs": sorted(job.external_inputs),
    }


# -- registration ---------------------------------------------------------------------------


def load_definitions(conn: Conn, *, only: str | None = None) -> dict[str, JobDefinition]:
    """Every active job's definition (``only``: that job's, if it is one)."""
    rows = conn.execute(
        """
        SELECT j.name, j.external_inputs,
               coalesce((SELECT array_agg(t.name) FROM job_source_tables s JOIN managed_tables t USING (table_id)
                          WHERE s.job_id = j.job_id), '{}') AS sources,
               coalesce((SELECT array_agg(t.name) FROM job_sink_tables s JOIN managed_tables t USING (table_id)
                          WHERE s.job_id = j.job_id), '{}') AS sinks
        FROM jobs j WHERE j.active AND (%(only)s::text IS NULL OR j.name = %(only)s)
        """,
        {"only": only},
    ).fetchall()
    return {r["name"]: _definition(r) for r in rows}


def register(conn: Conn, job: JobDefinition, *, replace: bool = False) -> Registration:
    """Register ``job``; the ``register_job`` function enforces the topology rules (one writer
    per table, no cycles, a job never reads its sink, its sinks at one barrier) and writes
    nothing if one is broken. Registrations are serialised by a topology lock."""
    with conn.transaction():
        status = call(
            conn,
            "register_job",
            job.name,
            sorted(map(str, job.sources)),
            sorted(map(str, job.sinks)),
            sorted(job.external_inputs),
            replace,
        )[0]["register_job"]
        if status == "changed":
            current = load_definitions(conn, only=job.name)[job.name]
            raise JobDefinitionChangedError(job.name, current.differences(job))
    return Registration(job=job, status=status)


def unregister(conn: Conn, name: str) -> JobDefinition:
    """Remove a job from the topology; its tables, their history and watermarks stay."""
    with conn.transaction():
        definition = load_definitions(conn, only=name).get(name)
        if definition is None:
            raise JobNotFoundError(name)
        call(conn, "unregister_job", name)
    return definition


# -- listing -----------------------------------------------------------------------------------


_JOB_STATE = """
SELECT j.job_id, j.name, j.external_inputs, j.registered_at, j.heartbeat_at, j.waiting_for,
       CASE WHEN j.status = 'running' AND j.heartbeat_at < now() - interval '90 seconds' THEN 'lost'
            ELSE j.status END AS status,
       coalesce(src.names, '{}') AS sources, coalesce(snk.names, '{}') AS sinks,
       coalesce(src.states, '[]') AS source_states, coalesce(snk.states, '[]') AS sink_states,
       snk.progress, snk.start_barrier,
       to_jsonb(c) - 'job_name' AS computation,
       (SELECT count(*) FROM barriers b WHERE b.barrier > coalesce(snk.progress,
            (extract(epoch FROM j.registered_at) * 1000000)::bigint)) AS barriers_behind
FROM jobs j
LEFT JOIN LATERAL (
    SELECT array_agg(t.name) AS names,
           json_agg(json_build_object('name', t.name, 'start', t.start_barrier, 'watermark', t.watermark)) AS states
    FROM job_source_tables s JOIN managed_tables t USING (table_id) WHERE s.job_id = j.job_id) src ON true
LEFT JOIN LATERAL (
    SELECT array_agg(t.name) AS names, max(t.watermark) AS progress, min(t.start_barrier) AS start_barrier,
           json_agg(json_build_object('name', t.name, 'start', t.start_barrier, 'watermark', t.watermark)) AS states
    FROM job_sink_tables s JOIN managed_tables t USING (table_id) WHERE s.job_id = j.job_id) snk ON true
LEFT JOIN job_computations c ON c.job_name = j.name
WHERE j.active
"""


def list_jobs(conn: Conn, *, after: str | None = None, limit: int | None = None) -> list[JobInfo]:
    """The active jobs by name (``after``, ``limit``: a page of them, the names after that one)."""
    rows = conn.execute(
        _JOB_STATE + " AND (%(after)s::text IS NULL OR j.name > %(after)s) ORDER BY j.name LIMIT %(limit)s",
        {"after": after, "limit": limit},
    ).fetchall()
    return [_job_info(r) for r in rows]


def anchors_ahead(conn: Conn) -> dict[str, int]:
    """Each job's anchors issued after its progress: its next run computes once per anchor
    (coalescing never crosses one) and once more up to the newest barrier."""
    rows = conn.execute(
        """
        SELECT j.name, (SELECT count(*) FROM barriers b WHERE b.anchor AND b.barrier > p.progress) AS anchors
        FROM jobs j, LATERAL (SELECT max(t.watermark) AS progress FROM job_sink_tables s
                              JOIN managed_tables t USING (table_id) WHERE s.job_id = j.job_id) p
        WHERE j.active
        """
    ).fetchall()
    return {r["name"]: r["anchors"] for r in rows}


def show(conn: Conn, name: str) -> JobInfo:
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
        computation=r["computation"],
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
        (
            TableState(name=TableName.parse(i["name"]), start_barrier=i["start"], watermark=i["watermark"])
            for i in items
        ),
        key=lambda s: s.name,
    )


# -- the next barrier ------------------------------------------------------------------------------


def next_barrier(
    conn: Conn, name: str, *, skip: bool = True, coalesce: bool = True, up_to: int | None = None
) -> NextBarrier:
    """The plan ``name`` follows next (the ``plan_barrier`` function decides, on the same
    definitions as completion).

    With progress P: a recorded input range after P is resumed; else an intermediate job
    skips to the last barrier up to which none of its sources changed, or coalesces up to
    the newest barrier its sources completed (never past the first anchor after P), or
    completes the next barrier exactly (``coalesce`` False: always). A root job takes the
    newest barrier, never past the first anchor after P. Without progress, a job resumes the
    first barrier whose input it recorded; otherwise a root job starts at the newest barrier
    and an intermediate job at its sources' latest common completed barrier (bootstrap). A
    root job asking when there is no barrier to take issues one if the newest is older than
    the barrier interval. ``skip`` False: the job reads the barrier itself and is never skipped;
    ``up_to``: a root job's input is ready only up to that barrier (an event-time watermark).
    """
    row = call(conn, "next_plan", name, skip, coalesce, up_to)[0]  # the clock asked in it: one round trip
    return _plan(name, row["next_plan"], issued=row["issued"])


def _plan(name: str, row: dict, *, issued: bool = False) -> NextBarrier:
    """A plan from what ``plan_barrier`` answered."""
    return NextBarrier(
        job=name,
        barrier=row["barrier"],
        ready=row["ready"],
        waiting_for=row["waiting"] or {},
        issued=issued,
        plan=Plan(row["plan"]),
        from_barrier=row["from_barrier"],
        anchors_in_range=row["anchors_in_range"],
        root=row["root"],
        announced=tuple(row["announced"] or ()),
        pending=row["pending"],
        marks=row.get("marks") or {},
        sinks=tuple(row.get("sinks") or ()),
    )


# -- completing a barrier ------------------------------------------------------------------------------


def complete(
    conn: Conn,
    name: str,
    barrier: int,
    commits: dict[TableName, int] | None = None,
    *,
    run_id: str | None = None,
    coalesce: bool = False,
) -> Completion:
    """Record that job ``name`` completed ``barrier`` for all its sinks, in one transaction and
    one round trip (the ``complete_barrier`` function checks the rules and says what is wrong).

    ``commits`` maps sinks to the Iceberg snapshot written for this barrier; sinks without
    one keep their snapshot. The barriers between the job's progress and ``barrier`` are
    skipped (refused if a source changed among them; a root job skips only committing
    nothing) or, with ``coalesce``, coalesced (refused across an anchor). Completing a
    completed barrier again with the same commits is a no-op; with other commits it is refused.
    """
    return retrying(lambda: _complete(conn, name, barrier, dict(commits or {}), run_id, coalesce))


def _complete(
    conn: Conn, name: str, barrier: int, commits: dict[TableName, int], run_id: str | None, coalesce: bool
) -> Completion:
    row = call(
        conn, "complete_barrier", name, barrier, [str(t) for t in commits], list(commits.values()), run_id, coalesce
    )[0]
    return _completion(name, barrier, row, commits)


def _completion(name: str, barrier: int, row: dict, commits: dict[TableName, int] | None = None) -> Completion:
    """A completion from what ``complete_barrier`` answered (``sinks``, ``noop``, ``coalesced``)."""
    return Completion(
        job=name,
        barrier=barrier,
        commits=commits or {},
        sinks=tuple(sorted(TableName.parse(n) for n in row["sinks"])),
        noop=row["noop"],
        coalesced=row["coalesced"],
    )


# -- one look: plan, skip, wait (DESIGN.md, "Cost of waiting") -------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Advance:
    """What one planning transaction came to: the barriers it skipped on the way (completed
    with no computation), then the plan. ``due_in_s``: for a root job with nothing to take,
    when the clock's next barrier is due (it may be negative: due now, for the next look)."""

    plan: NextBarrier
    skipped: tuple[Completion, ...] = ()
    due_in_s: float | None = None

    @classmethod
    def of(cls, name: str, row: dict) -> Advance:
        """What ``advance_job`` answered (``next_plan``, ``issued``, ``skipped``, ``due_in_s``)."""
        return cls(
            plan=_plan(name, row["next_plan"], issued=row["issued"]),
            skipped=tuple(_completion(name, done["barrier"], done) for done in row["skipped"]),
            due_in_s=row["due_in_s"],
        )


def advance(
    conn: Conn,
    name: str,
    *,
    skip: bool = True,
    coalesce: bool = True,
    up_to: int | None = None,
    heartbeat: bool = False,
    record_wait: bool | Callable[[NextBarrier], str | None] = False,
) -> Advance:
    """The job's plan, in one transaction: a skip is completed at once (no computation: its sinks
    keep their snapshots and move to the barrier) and the job planned again, so that a job whose
    sources did not change costs one transaction per look; ``heartbeat``, ``record_wait``: the
    job's heartbeat, and what it waits for (``jobs.waiting_for``; ``record_wait(plan)``, when
    given, may say it better: a root job's source), in the same transaction. A skip that meets a
    concurrent completion is left to the next look."""
    # one statement (advance_job: one round trip); a transaction only with what rides along
    with conn.transaction() if heartbeat or record_wait else nullcontext():
        if heartbeat:
            call(conn, "job_heartbeat", name)
        step = Advance.of(name, call(conn, "advance_job", name, skip, coalesce, up_to)[0])
        if record_wait:
            said = record_wait(step.plan) if callable(record_wait) else None
            call(conn, "set_job_waiting", name, said or step.plan.describe_wait())
    return step
