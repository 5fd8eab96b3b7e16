"""Leases, protected sets and the control-plane half of expiry.

A lease pins the snapshots of a cut for a holder until it is released or its TTL passes
without renewal. Races between lease acquisition and expiry are closed both ways by a
per-table advisory lock (inside the ``acquire_lease`` and ``claim_expiry`` functions):
acquisition takes it shared and resolves the cut, refusing tombstoned snapshots; expiry
takes it exclusive, reads leases *after* its candidates were chosen, and tombstones what it
will delete before deleting.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from icebarrier.control_plane import settings
from icebarrier.control_plane.cuts import protected_set
from icebarrier.control_plane.db import Conn, advisory_lock, advisory_unlock, call, one
from icebarrier.control_plane.errors import LeaseNotFoundError
from icebarrier.control_plane.model import Cut, Lease, Level, ProtectedSnapshot, TableName, parse_holder
from icebarrier.control_plane.tables import maintained_id, require


def acquire(
    conn: Conn,
    tables: list[TableName],
    *,
    ttl_s: float,
    holder: str,
    barrier: int | None = None,
    bootstrap_job: str | None = None,
) -> Cut:
    """Pin a valid cut (the latest, or at ``barrier``) for ``holder`` for ``ttl_s`` seconds; the
    lease belongs to the calling role (only it, or the admin, renews or releases it). A TTL is
    at least 1 s and, for roles other than the admin, at most the ``lease_max_ttl_ms`` setting.

    With ``bootstrap_job`` the lease also starts that job at the cut's barrier B, in the same
    transaction: it records B as the job's first input range (so B is pinned as the job's
    progress would be, even after the lease ends) and checks that no snapshot the job will
    read after B (its sources' commits in (B, W]) was expired before the pin.
    """
    holder = parse_holder(holder)
    names = [str(t) for t in dict.fromkeys(tables)]
    with conn.transaction():
        row = call(conn, "acquire_lease", names, float(ttl_s), holder, barrier, bootstrap_job)[0]
    return Cut(
        barrier=row["barrier"],
        level=Level.REPEATABLE_READ,
        snapshots={TableName.parse(t): s for t, s in zip(row["table_names"], row["snapshot_ids"])},
        lease_id=str(row["lease_id"]),
        expires_at=row["expires_at"],
    )


MAX_TTL_KEY = "lease_max_ttl_ms"


def get_max_ttl_s(conn: Conn) -> float:
    """The longest TTL a role other than the admin may give a lease."""
    return settings.get_s(conn, MAX_TTL_KEY)


def set_max_ttl_s(conn: Conn, seconds: float) -> float:
    """Set the cap (the admin only; 1s..7d, checked by the setting's constraint)."""
    return settings.set_s(conn, MAX_TTL_KEY, seconds)


def renew(conn: Conn, lease_id: str, *, ttl_s: float) -> Lease:
    with conn.transaction():
        call(conn, "renew_lease", _parse_id(lease_id), float(ttl_s))
    return get(conn, lease_id)


def release(conn: Conn, lease_id: str) -> Lease:
    """Release a lease (releasing it again changes nothing)."""
    with conn.transaction():
        call(conn, "release_lease", _parse_id(lease_id))
    return get(conn, lease_id)


_LEASES = """
SELECT l.lease_id, l.holder, l.barrier, l.acquired_at, l.expires_at, l.released_at,
       coalesce(json_object_agg(t.name, ls.snapshot_id) FILTER (WHERE t.name IS NOT NULL), '{{}}') AS snapshots
FROM leases l
LEFT JOIN lease_snapshots ls USING (lease_id)
LEFT JOIN managed_tables t USING (table_id)
{where}
GROUP BY l.lease_id, l.holder, l.barrier, l.acquired_at, l.expires_at, l.released_at
ORDER BY l.acquired_at
"""


def get(conn: Conn, lease_id: str) -> Lease:
    row = conn.execute(_LEASES.format(where="WHERE l.lease_id = %s"), (_parse_id(lease_id),)).fetchone()
    if row is None:
        raise LeaseNotFoundError(lease_id)
    return _lease(row)


def list_leases(conn: Conn, *, include_inactive: bool = False) -> list[Lease]:
    where = "" if include_inactive else "WHERE l.released_at IS NULL AND l.expires_at > now()"
    rows = conn.execute(_LEASES.format(where=where)).fetchall()
    return [_lease(r) for r in rows]


def _lease(r: dict) -> Lease:
    return Lease(
        lease_id=str(r["lease_id"]),
        holder=r["holder"],
        barrier=r["barrier"],
        acquired_at=r["acquired_at"],
        expires_at=r["expires_at"],
        released_at=r["released_at"],
        snapshots={TableName.parse(t): s for t, s in r["snapshots"].items()},
    )


def _parse_id(lease_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(lease_id))
    except ValueError:
        raise LeaseNotFoundError(lease_id) from None


# -- protected sets and expiry ----------------------------------------------------------------


def protected(
    conn: Conn,
    table: TableName,
    *,
    retained: tuple[int, ...] = (),
    tagged: tuple[tuple[str, int], ...] = (),
) -> dict[int, ProtectedSnapshot]:
    """Snapshot ids of ``table`` that must not be expired, each with its reasons."""
    row = one(conn.execute("SELECT * FROM protection(%s)", (require(conn, table),)))
    return _protected_from(row, retained=retained, tagged=tagged)


def _protected_from(row: dict, *, retained=(), tagged=()) -> dict[int, ProtectedSnapshot]:
    """The protected set (with reasons, by the pure definition) from a ``protection`` row."""
    return protected_set(
        current=row["current"],
        leases=[(str(lid), sid) for lid, sid in row["leases"]],
        job_progress=[(job, sid) for job, sid in row["job_progress"]],
        read_window=row["read_window"],
        retained=retained,
        tagged=tagged,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpiryClaim:
    """What an expiry may delete (already tombstoned) and what it must keep, and why."""

    table: TableName
    removable: tuple[int, ...]
    protected: dict[int, ProtectedSnapshot]

    def to_json(self) -> dict:
        return {
            "table": str(self.table),
            "removable": list(self.removable),
            "protected": {str(s): list(p.reasons) for s, p in self.protected.items()},
        }


@contextmanager
def expiry_lock(conn: Conn, table: TableName) -> Iterator[None]:
    """Run one expiry of ``table`` at a time, from planning to deleting files (a session-level
    advisory lock on ``conn``; a second expiry of the same table waits here). A table of the
    catalog no job writes is locked by the id maintenance knows it by."""
    table_id = maintained_id(conn, table)
    advisory_lock(conn, "expiry", [table_id], what=f"expiry of {table} (another one is running)", session=True)
    try:
        yield
    finally:
        if not conn.closed:
            advisory_unlock(conn, "expiry", [table_id])


def claim_expiry(
    conn: Conn,
    table: TableName,
    candidates: list[int],
    *,
    retained: tuple[int, ...] = (),
    tagged: tuple[tuple[str, int], ...] = (),
    dry_run: bool = False,
) -> ExpiryClaim:
    """Decide which of ``candidates`` (chosen by the caller beforehand) may be deleted.

    The ``claim_expiry`` function (the admin only) reads the protected set *now*, under the
    table's exclusive lock, and tombstones the removable snapshots before returning, so a lease
    taken afterwards is refused instead of pinning a snapshot that is about to disappear. The
    caller deletes only ``removable``.
    """
    keep = [*retained, *(s for _, s in tagged)]
    with conn.transaction():
        row = call(conn, "claim_expiry", str(table), list(candidates), keep, dry_run)[0]
    protected_ = _protected_from(row, retained=retained, tagged=tagged)
    return ExpiryClaim(table=table, removable=tuple(row["removable"]), protected=protected_)
