"""The error hierarchy of icebarrier.

Every error a user can cause is an :class:`IcebarrierError` whose message says what
happened, the ids involved, expected vs found, and the next step. The CLI prints the
message as one line and exits 1. Errors marked ``retryable`` are conflicts that a bounded
retry may resolve; everything else fails fast.
"""

from __future__ import annotations


class IcebarrierError(Exception):
    """Root of every error icebarrier raises on purpose.

    Errors pickle as their constructor call (they cross process boundaries: the checker's
    processes, multiprocessing in tests), whatever arguments a subclass takes."""

    retryable: bool = False
    _init_args: tuple[tuple, dict]

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls, *args)
        self._init_args = (args, kwargs)
        return self

    def __reduce__(self):
        args, kwargs = self._init_args
        return _rebuild, (type(self), args, kwargs)


def _rebuild(cls: type, args: tuple, kwargs: dict) -> IcebarrierError:
    return cls(*args, **kwargs)


# -- configuration, schema, connection -----------------------------------------------


class ConfigurationError(IcebarrierError):
    """A setting is missing or malformed."""


class ControlPlaneUnavailableError(IcebarrierError):
    """The control-plane database cannot be reached."""


class SchemaOutOfDateError(IcebarrierError):
    def __init__(self, schema: str, current: str | None, head: str) -> None:
        self.schema, self.current, self.head = schema, current, head
        found = f"revision {current}" if current else "no icebarrier schema"
        super().__init__(
            f"control-plane schema {schema!r} is out of date ({found}, expected {head}); "
            f"run `icebarrier db upgrade` first"
        )


class SchemaMigrationError(IcebarrierError):
    def __init__(self, schema: str, reason: str) -> None:
        self.schema, self.reason = schema, reason
        super().__init__(
            f"cannot migrate control-plane schema {schema!r}: {reason}; run `icebarrier db upgrade` as a role that "
            f"may create in this database (its owner or a superuser)"
        )


class LockTimeoutError(IcebarrierError):
    """A control-plane lock was not granted within ``lock_timeout``."""

    def __init__(self, what: str, timeout: str, holders: list[dict]) -> None:
        self.what, self.timeout, self.holders = what, timeout, holders
        held = (
            "; ".join(
                f"backend {h['pid']} (user {h['usename']}, application {h['application_name']!r}, {h['state']}"
                + (f" since {str(h['xact_start'])[:19]}" if h.get("xact_start") else "")
                + ")"
                for h in holders
            )
            or "another backend (it has released it since, or it is a row lock: see pg_locks)"
        )
        super().__init__(
            f"{what}: waited {timeout} for a lock held by {held}; retry when it is done, raise "
            f"ICEBARRIER_LOCK_TIMEOUT, or end that backend with pg_terminate_backend(pid)"
        )


class RoleNotFoundError(IcebarrierError):
    def __init__(self, role: str) -> None:
        self.role = role
        super().__init__(f"Postgres role {role!r} does not exist; create it with CREATE ROLE {role} LOGIN first")


class PermissionDeniedError(IcebarrierError):
    """The calling Postgres role may not do this (see DESIGN.md, "Who may do what")."""

    def __init__(self, role: str, action: str, job: str | None, reason: str, fix: str | None = None) -> None:
        self.role, self.action, self.job, self.reason = role, action, job, reason
        self.fix = fix or (
            f"connect as a role granted job {job} (`icebarrier db grant-job ROLE {job}`, run by the admin)"
            if job
            else "connect as the admin (the schema owner) or ask the admin to do it"
        )
        super().__init__(f"{reason}; {self.fix}")


class GrantNotPerformedError(IcebarrierError):
    def __init__(self, role: str, missing: list[str]) -> None:
        self.role, self.missing = role, missing
        super().__init__(
            f"Postgres did not grant {', '.join(missing)} to {role}; run the grant as the admin "
            f"(the owner of the control-plane and catalog schemas, or a superuser)"
        )


# -- names and definitions ---------------------------------------------------------------


class InvalidValueError(IcebarrierError):
    """A value given by the user (duration, TTL, commit spec…) is malformed or out of range."""


class InvalidNameError(InvalidValueError):
    """A table, job, schema or input name is malformed (and could inject SQL or paths)."""


class JobDefinitionError(IcebarrierError):
    """A job definition is incomplete or mixes root and intermediate inputs."""


class JobNotFoundError(IcebarrierError):
    def __init__(self, job: str) -> None:
        self.job = job
        super().__init__(f"job {job} is not registered; see `icebarrier job list`")


class TableNotFoundError(IcebarrierError):
    def __init__(self, table: str) -> None:
        self.table = table
        super().__init__(f"table {table} is not managed by icebarrier; register a job that reads or writes it first")


class JobDefinitionChangedError(IcebarrierError):
    def __init__(self, job: str, differences: str) -> None:
        self.job = job
        super().__init__(
            f"job {job} is already registered with a different definition ({differences}); pass --replace to change it"
        )


# -- topology ----------------------------------------------------------------------------


class TopologyError(IcebarrierError):
    """A registration would break a topology rule."""


class SinkAlreadyOwnedError(TopologyError):
    def __init__(self, table: str, owner: str, job: str) -> None:
        self.table, self.owner, self.job = table, owner, job
        super().__init__(
            f"table {table} is written by job {owner}; a table has one writer. "
            f"Unregister {owner} first or let {job} write to another table"
        )


class TopologyCycleError(TopologyError):
    def __init__(self, job: str, path: list[str]) -> None:
        self.job, self.path = job, path
        super().__init__(
            f"job {job} would close a cycle: {' -> '.join(path)}; the topology must be acyclic. "
            f"Read from a table that is not downstream of {job}"
        )


class SelfReadError(TopologyError):
    def __init__(self, job: str, table: str) -> None:
        self.job, self.table = job, table
        super().__init__(
            f"job {job} reads its own sink {table}; a job never reads what it writes. Write to another table"
        )


class SinkHistoryMismatchError(TopologyError):
    def __init__(self, job: str, watermarks: dict[str, int | None]) -> None:
        self.job, self.watermarks = job, watermarks
        listed = ", ".join(f"{t} at {w}" for t, w in sorted(watermarks.items()))
        super().__init__(
            f"job {job} would write tables that completed different barriers ({listed}); "
            f"a job advances all its sinks together. Revise them to one barrier first "
            f"or register separate jobs"
        )


# -- barriers and completion ---------------------------------------------------------------


class BarrierError(IcebarrierError):
    """A barrier cannot be completed or resolved as asked."""


class BarrierNotIssuedError(BarrierError):
    def __init__(self, barrier: int) -> None:
        self.barrier = barrier
        super().__init__(f"barrier {barrier} was never issued; see `icebarrier barrier list`")


class BarrierOutOfOrderError(BarrierError):
    """``changed``: what changed between the job's progress and ``barrier`` so that it may not
    skip there: "sources" (an intermediate job's), "input" (a root job commits); ``coalesced_into``:
    the sinks coalesced ``barrier`` into that one."""

    def __init__(
        self,
        job: str,
        barrier: int,
        expected: int | None,
        watermark: int | None,
        *,
        changed: str | None = None,
        coalesced_into: int | None = None,
    ) -> None:
        self.job, self.barrier, self.expected, self.watermark = job, barrier, expected, watermark
        self.changed, self.coalesced_into = changed, coalesced_into
        nxt = f"barrier {expected}" if expected is not None else "no barrier yet"
        if coalesced_into is not None:
            why = f"its sinks coalesced it into barrier {coalesced_into}; it is not a barrier they completed"
        elif watermark is not None and barrier <= watermark:
            why = f"its sinks are already at {watermark}"
        elif changed:
            what = "its sources changed after" if changed == "sources" else "it commits input that arrived after"
            why = (
                f"its sinks are at {watermark} and {what} {nxt}, so it must complete {nxt} next (or coalesce, up "
                f"to the next anchor)"
            )
        else:
            why = (
                f"its sinks are at {watermark}, so it must complete {nxt} next (barriers are completed in "
                f"order, without gaps)"
            )
        super().__init__(f"job {job} cannot complete barrier {barrier}: {why}; see `icebarrier job next-barrier {job}`")


class CoalesceAcrossAnchorError(BarrierError):
    def __init__(self, job: str, barrier: int, watermark: int, anchor: int) -> None:
        self.job, self.barrier, self.watermark, self.anchor = job, barrier, watermark, anchor
        super().__init__(
            f"job {job} cannot coalesce barriers {watermark}..{barrier}: anchor {anchor} lies between, and anchors "
            f"are never coalesced; complete anchor {anchor} first (see `icebarrier job next-barrier {job}`)"
        )


class SourcesNotReadyError(BarrierError):
    """``coalesced``: sources that coalesced the barrier, with the barrier they coalesced it into."""

    def __init__(
        self, job: str, barrier: int, waiting: dict[str, int | None], coalesced: dict[str, int] | None = None
    ) -> None:
        self.job, self.barrier, self.waiting, self.coalesced = job, barrier, waiting, dict(coalesced or {})
        listed = ", ".join(
            f"{t} (coalesced it into {self.coalesced[t]})" if t in self.coalesced else f"{t} ({_at(w)})"
            for t, w in sorted(waiting.items())
        )
        super().__init__(
            f"job {job} cannot complete barrier {barrier} before its sources have: {listed}; "
            + (
                "coalesce it too, into a barrier they all completed"
                if self.coalesced and set(self.coalesced) == set(waiting)
                else "wait for their jobs to complete it"
            )
        )


class NotASinkError(BarrierError):
    def __init__(self, job: str, tables: list[str]) -> None:
        self.job, self.tables = job, tables
        super().__init__(
            f"job {job} does not write {', '.join(tables)}; commit only to its sinks (see `icebarrier job show {job}`)"
        )


class CompletionConflictError(BarrierError):
    def __init__(self, job: str, barrier: int, recorded: dict[str, int | None], given: dict[str, int | None]) -> None:
        self.job, self.barrier, self.recorded, self.given = job, barrier, recorded, given
        super().__init__(
            f"job {job} already completed barrier {barrier} with commits {_fmt_commits(recorded)}, "
            f"not {_fmt_commits(given)}; a (table, barrier) has one commit. "
            f"Use `icebarrier revise` to redo it"
        )


class NoValidCutError(BarrierError):
    """``holding``: each table that keeps the cut from existing, and why (e.g. "has completed no barrier yet")."""

    def __init__(self, tables: list[str], reason: str, holding: dict[str, str] | None = None) -> None:
        self.tables, self.reason, self.holding = tables, reason, dict(holding or {})
        super().__init__(f"no consistent cut over {', '.join(tables)}: {reason}")


class BarrierNotValidError(BarrierError):
    """``nearest``: the newest valid cut before the barrier and the oldest after it (None: none)."""

    def __init__(
        self, barrier: int, reasons: dict[str, str], nearest: tuple[int | None, int | None] = (None, None)
    ) -> None:
        self.barrier, self.reasons, self.nearest = barrier, reasons, tuple(nearest)
        listed = "; ".join(f"{t} {r}" for t, r in sorted(reasons.items()))
        near = " and ".join(f"{b} ({side})" for b, side in zip(self.nearest, ("before", "after")) if b is not None)
        super().__init__(
            f"barrier {barrier} is not a valid cut: {listed}; "
            + (
                f"the nearest valid cuts are {near}"
                if near
                else "pick a barrier every table has completed (see `icebarrier table list`)"
            )
        )


class RevisionInProgressError(BarrierError):
    retryable = True

    def __init__(self, table: str, revision_id: int) -> None:
        self.table, self.revision_id = table, revision_id
        super().__init__(
            f"table {table} is being revised (revision {revision_id}); its job may complete barriers again "
            f"once `icebarrier revise` finishes (rerun it to resume an interrupted revision)"
        )


class RevisionError(IcebarrierError):
    """A revision cannot be planned or applied as asked."""


# -- leases and snapshots --------------------------------------------------------------------


class LeaseNotFoundError(IcebarrierError):
    def __init__(self, lease_id: str) -> None:
        self.lease_id = lease_id
        super().__init__(f"lease {lease_id} does not exist; see `icebarrier lease list`")


class LeaseExpiredError(IcebarrierError):
    def __init__(self, lease_id: str, state: str) -> None:
        self.lease_id = lease_id
        super().__init__(f"lease {lease_id} is {state} and protects nothing any more; acquire a new lease")


class SnapshotExpiredError(IcebarrierError):
    def __init__(self, table: str, snapshot_id: int, barrier: int | None = None) -> None:
        self.table, self.snapshot_id, self.barrier = table, snapshot_id, barrier
        at = f" (its snapshot at barrier {barrier})" if barrier is not None else ""
        super().__init__(f"snapshot {snapshot_id} of {table}{at} was already expired; read a newer barrier instead")


def _at(watermark: int | None) -> str:
    return "no barrier completed yet" if watermark is None else f"at {watermark}"


def _fmt_commits(commits: dict[str, int | None]) -> str:
    if not commits:
        return "{} (no new snapshots)"
    return "{" + ", ".join(f"{t}={s}" for t, s in sorted(commits.items())) + "}"
