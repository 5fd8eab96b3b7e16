"""Job sessions (DESIGN.md, "Jobs in any engine"): a job's next barrier, planned once and held
while any engine computes it through the catalog's warehouse ``job``.

One session a job. It holds the plan (barrier B, exact, skip or coalesce, from progress P) from
its first request until the catalog publishes B (every staged sink commit swaps in and B
completes, one transaction) or the session is discarded (its staged commits dropped: nothing
was visible).

A *run* (``icebarrier job exec``) opens the session and holds it while it lives; the command it
runs names the run in its warehouse (``job:<JOB>@<RUN>``), so a command left behind by a dead
run cannot write into the next run's session. A run whose command fails releases the session: what it
staged is dropped, the plan stays. A run that dies leaves the session held; once its hold lapses
the next run takes it over. Either way the next run adopts the staged commits if the command had
exited 0 (``succeeded``: the publish was cut short), else drops them and computes B again, so
each (table, barrier) is written once.

This module keeps the session's row; the catalog (:mod:`icebarrier.apps.catalog.lake`) stages
and publishes the commits.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import overload

from icebarrier.control_plane import db, jobs
from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import BarrierError
from icebarrier.control_plane.jobs import NextBarrier, Plan
from icebarrier.control_plane.model import TableName

HOLD_S = 30.0  # a run renews its hold every third of this
# one long poll's longest wait for work (``job exec --follow``; the server says what it waits for
# meanwhile): its renewal, a request, is the dearest part of waiting, so it is rare
MAX_WAIT_S = 3600.0
# meanwhile the server sends a line this often (`serve --heartbeat`, at most MAX_HEARTBEAT_S): under
# the idle timeouts of proxies (30 s and up), and under a client's wait for a line
HEARTBEAT_S = 20.0
MAX_HEARTBEAT_S = 60.0


class SessionHeldError(BarrierError):
    """Another run of the job holds its session."""

    def __init__(self, job: str, run_id: str, held_until: datetime) -> None:
        self.job, self.run_id, self.held_until = job, run_id, held_until
        super().__init__(
            f"job {job} is running (run {run_id} holds its session until "
            f"{held_until.isoformat(timespec='seconds')}); one run of a job at a time: wait for it"
        )


class SessionGoneError(BarrierError):
    """A request names a run that no longer holds the job's session."""

    def __init__(self, job: str, run_id: str, current: str | None) -> None:
        self.job, self.run_id, self.current = job, run_id, current
        now = f"run {current} holds it now" if current else "it was published or discarded"
        super().__init__(
            f"run {run_id} of job {job} no longer holds the job's session ({now}); nothing it writes is kept: stop it"
        )


class StaleSessionError(BarrierError):
    """The job's progress moved since its session planned (another writer, or a revision)."""

    def __init__(self, job: str, barrier: int, planned_from: int | None, progress: int | None) -> None:
        self.job, self.barrier, self.planned_from, self.progress = job, barrier, planned_from, progress
        super().__init__(
            f"job {job}'s session for barrier {barrier} was planned from barrier {planned_from}, but the job is now "
            f"at {progress} (barriers were completed outside the session, or a revision rewound it); run the job "
            f"again: its next run plans anew"
        )


class NoBarrierDueError(BarrierError):
    """The job has nothing to complete now (its sources are behind, or no barrier is due)."""

    def __init__(self, plan: NextBarrier) -> None:
        self.plan = plan
        super().__init__(f"job {plan.job} has no barrier to complete now: it waits for {plan.describe_wait()}")


class Opened(str, Enum):
    """How a run came by its session."""

    NEW = "new"  # planned now
    RESUMED = "resumed"  # a dead run's session, its staged commits discarded: B is computed again
    ADOPTED = "adopted"  # a dead run's session whose command had succeeded: publish what it staged


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSession:
    job: str
    barrier: int
    plan: Plan
    from_barrier: int | None
    run_id: str
    opened_at: datetime
    held_until: datetime | None
    succeeded: bool
    sources: frozenset[TableName]
    sinks: frozenset[TableName]

    @property
    def root(self) -> bool:
        return not self.sources

    @property
    def coalesce_after(self) -> int | None:
        """P when the session coalesces the barriers between P and B (stamped on its commits)."""
        return self.from_barrier if self.plan is Plan.COALESCE else None

    def to_json(self) -> dict:
        return {
            "job": self.job,
            "barrier": self.barrier,
            "plan": self.plan.value,
            "from_barrier": self.from_barrier,
            "run_id": self.run_id,
            "opened_at": self.opened_at.isoformat(),
            "held_until": self.held_until.isoformat() if self.held_until else None,
            "succeeded": self.succeeded,
            "sources": sorted(map(str, self.sources)),
            "sinks": sorted(map(str, self.sinks)),
        }


def _row(conn: Conn, job: str, *, lock: bool) -> dict | None:
    """The job's session row (``job_session_row``), if one is open; ``lock``: for update."""
    rows = db.call(conn, "job_session_row", job, lock)
    return rows[0] if rows else None


def _session(row: dict) -> JobSession:
    return JobSession(
        job=row["job_name"],
        barrier=row["barrier"],
        plan=Plan(row["plan"]),
        from_barrier=row["from_barrier"],
        run_id=row["run_id"],
        opened_at=row["opened_at"],
        held_until=row["held_until"],
        succeeded=row["succeeded"],
        sources=frozenset(map(TableName.parse, row["sources"])),
        sinks=frozenset(map(TableName.parse, row["sinks"])),
    )


def _fresh(row: dict) -> JobSession:
    if row["progress"] != row["from_barrier"]:
        raise StaleSessionError(row["job_name"], row["barrier"], row["from_barrier"], row["progress"])
    return _session(row)


def _run_id() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


@overload
def get(conn: Conn, job: str, *, run_id: str, lock: bool = False) -> JobSession: ...
@overload
def get(conn: Conn, job: str, *, run_id: None = None, lock: bool = False) -> JobSession | None: ...
def get(conn: Conn, job: str, *, run_id: str | None = None, lock: bool = False) -> JobSession | None:
    """The job's open session, if any; ``run_id``: it must be that run's (else
    :class:`SessionGoneError`); ``lock``: held for update until the transaction ends. A session
    whose plan no longer starts at the job's progress is :class:`StaleSessionError`."""
    row = _row(conn, job, lock=lock)
    if run_id is not None and (row is None or row["run_id"] != run_id):
        raise SessionGoneError(job, run_id, row["run_id"] if row else None)
    return _fresh(row) if row is not None else None


def current(conn: Conn, job: str, *, run_id: str | None = None) -> JobSession:
    """The session a request through warehouse ``job`` works in: the named run's, else the
    job's open session, else one opened now with the job's plan (its first request)."""
    found = get(conn, job, run_id=run_id)
    if found is not None:
        return found
    opening = open_session(conn, job)
    if opening.session is None:
        assert opening.plan is not None  # an opening without a session says what the job waits for
        raise NoBarrierDueError(opening.plan)
    return opening.session


@dataclass(frozen=True, slots=True, kw_only=True)
class Opening:
    """What opening a run's session came to: the session and how the run came by it (None:
    nothing to complete now; ``plan`` says what the job waits for), after the barriers skipped
    on the way (completed with no computation and no session)."""

    session: JobSession | None
    how: Opened | None
    plan: NextBarrier | None = None
    skipped: tuple[jobs.Completion, ...] = ()
    due_in_s: float | None = None
    newest_barrier: int | None = None  # the newest barrier issued, when a session opened

    @property
    def waits_for(self) -> NextBarrier:
        """What the job waits for, when no session opened."""
        if self.plan is None:
            raise ValueError(f"opening {self} says nothing of what the job waits for")
        return self.plan

    @property
    def opened(self) -> Opened:
        """How the run came by its session, when one opened."""
        if self.how is None:
            raise ValueError(f"opening {self} opened no session")
        return self.how


def open_session(
    conn: Conn, job: str, *, skip: bool = True, coalesce: bool = True, hold_s: float | None = None
) -> Opening:
    """Open the job's session for a run (``hold_s``: held that long; renew with :func:`hold`),
    in one statement (``open_job_session``: one round trip).

    A stale session is discarded. An open one held by a live run is :class:`SessionHeldError`;
    one whose hold lapsed (or that no run holds) is taken over: adopted if its command
    succeeded, else resumed with its staged commits dropped. Otherwise the job's plan is taken
    now: barriers it may skip are completed at once (no session), and a session opened for the
    plan if the job can follow it."""
    row = db.call(conn, "open_job_session", job, skip, coalesce, hold_s, _run_id())[0]
    if row["how"] == "held":
        raise SessionHeldError(job, row["run_id"], row["held_until"])
    if row["next_plan"] is None:  # a dead run's session taken over: no plan taken now
        return Opening(session=_fresh(row), how=Opened(row["how"]), newest_barrier=row["newest_barrier"])
    step = jobs.Advance.of(job, row)
    if row["how"] == "waiting":
        return Opening(session=None, how=None, plan=step.plan, skipped=step.skipped, due_in_s=step.due_in_s)
    return Opening(
        session=_fresh(row),
        how=Opened(row["how"]),
        plan=step.plan,
        skipped=step.skipped,
        newest_barrier=row["newest_barrier"],
    )


def hold(conn: Conn, job: str, run_id: str, hold_s: float) -> JobSession:
    """Renew the run's hold on the job's session."""
    with conn.transaction():
        get(conn, job, run_id=run_id, lock=True)
        conn.execute(
            "UPDATE job_session SET held_until = clock_timestamp() + make_interval(secs => %s) WHERE job_name = %s",
            (hold_s, job),
        )
    return get(conn, job, run_id=run_id)


def require(conn: Conn, job: str, *, run_id: str | None = None, lock: bool = False) -> JobSession:
    """As :func:`get`, where the request needs the session."""
    session = get(conn, job, run_id=run_id, lock=lock)
    if session is None:
        raise BarrierError(
            f"job {job} has no open session to publish; its first request through warehouse job opens one"
        )
    return session


def mark_succeeded(conn: Conn, job: str, run_id: str | None) -> JobSession:
    """The run's command exited 0: what it staged is whole (a publish cut short is adopted)."""
    with conn.transaction():
        session = require(conn, job, run_id=run_id, lock=True)
        conn.execute("UPDATE job_session SET succeeded_at = now() WHERE job_name = %s", (job,))
    return session


def note_succeeded(conn: Conn, job: str, run_id: str | None) -> None:
    """:func:`mark_succeeded` where the run still holds the session, and nothing otherwise (a
    retried publish whose first attempt published)."""
    conn.execute(
        "UPDATE job_session SET succeeded_at = now() WHERE job_name = %s AND (%s::text IS NULL OR run_id = %s)",
        (job, run_id, run_id),
    )


def compute_again(conn: Conn, job: str, run_id: str | None) -> None:
    """What the run staged cannot be published (its sinks moved under it): drop it; the job's
    next run computes the barrier again instead of adopting it. Nothing if another run holds
    the session now."""
    with conn.transaction():
        row = _row(conn, job, lock=True)
        if row is not None and (run_id is None or row["run_id"] == run_id):
            _drop_staged(conn, job)
            conn.execute("UPDATE job_session SET succeeded_at = NULL WHERE job_name = %s", (job,))


def _drop_staged(conn: Conn, job: str) -> None:
    conn.execute("DELETE FROM catalog_pending WHERE job_name = %s", (job,))


def release(conn: Conn, job: str, run_id: str) -> bool:
    """The run ends without publishing (its command failed): what it staged is dropped (nothing
    of it was visible) and its hold released; the plan stays for the next run, which computes the
    same barrier again. Whether the run still held the session."""
    with conn.transaction():
        row = _row(conn, job, lock=True)
        if row is None or row["run_id"] != run_id:
            return False
        _drop_staged(conn, job)
        # a new run id fences out whatever the run left behind still writing
        conn.execute("UPDATE job_session SET held_until = NULL, run_id = %s WHERE job_name = %s", (_run_id(), job))
        return True


def close(conn: Conn, job: str) -> None:
    """End the session whose barrier was just published (inside the publishing transaction, which
    has swapped in and dropped what it staged)."""
    conn.execute("DELETE FROM job_session WHERE job_name = %s", (job,))


@dataclass(frozen=True, slots=True)
class Staging:
    """What maintenance of one table must leave alone: the commits staged for it (a job session's
    or a multi-sink job's, not yet published: each staged metadata file and the one it was built
    on, None for a table the job created), and since when its writer has had a session or staged
    commits open (files written since may belong to them)."""

    pending: tuple[tuple[str, str | None], ...]
    open_since: datetime | None

    @property
    def metadata_locations(self) -> tuple[str, ...]:
        return tuple(location for location, _ in self.pending)


def staging(conn: Conn, table: TableName) -> Staging:
    """The staging of ``table`` right now (see :class:`Staging`)."""
    row = db.one(
        conn.execute(
            "SELECT coalesce((SELECT jsonb_agg(jsonb_build_array(metadata_location, base_location) "
            "ORDER BY metadata_location) FROM catalog_pending WHERE table_name = %(t)s), '[]') AS pending, "
            "(SELECT min(t) FROM (SELECT staged_at AS t FROM catalog_pending WHERE table_name = %(t)s "
            "UNION ALL SELECT s.opened_at FROM job_session s JOIN job j ON j.name = s.job_name AND j.active "
            "JOIN job_sink k ON k.job_id = j.job_id JOIN managed_table m ON m.table_id = k.table_id "
            "WHERE m.name = %(t)s) o) AS since",
            {"t": str(table)},
        )
    )
    return Staging(tuple((location, base) for location, base in row["pending"]), row["since"])
