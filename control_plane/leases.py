"""Leases, protected sets and the control-plane half of expiry.

A lease pins the snapshots of a cut for a holder until it is released or its TTL passes
without renewal. Races between lease acquisition and expiry are closed both ways by a
per-table advisory lock: acquisition takes it shared, writes the lease, then re-checks
that no snapshot it pins has been tombstoned; expiry takes it exclusive, reads leases
*after* its candidates were chosen, and tombstones what it will delete before deleting.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

from icebarrier.control_plane import reads
from icebarrier.control_plane.cuts import protected_set, removable
from icebarrier.control_plane.db import advisory_lock, advisory_unlock
from icebarrier.control_plane.errors import (
    InvalidValueError,
    LeaseExpiredError,
    LeaseNotFoundError,
    SnapshotExpiredError,
)
from icebarrier.control_plane.model import Cut, Lease, Level, ProtectedSnapshot, TableName, parse_holder
from icebarrier.control_plane.tables import require

MAX_TTL_S = 7 * 86400
MIN_TTL_S = 1.0  # shorter leases would lapse before a reader's first renewal reached the server


def _check_ttl(ttl_s: float) -> None:
    if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
        raise InvalidValueError(f"lease TTL {ttl_s:g}s is out of range; use at least 1s and at most 7d, e.g. 10m")


def acquire(
    conn: psycopg.Connection,
    tables: list[TableName],
    *,
    ttl_s: float,
    holder: str,
    barrier: int | None = None,
    bootstrap_job: str | None = None,
) -> Cut:
    """Pin a valid cut (the latest, or at ``barrier``) for ``holder`` for ``ttl_s`` seconds.

    With ``bootstrap_job`` the lease also starts that job at the cut's barrier B, in the same
    transaction: it records B as the job's first input range (so B is pinned as the job's
    progress would be, even after the lease ends) and checks that no snapshot the job will
    read after B (its sources' commits in (B, W]) was expired before the pin.
    """
    _check_ttl(ttl_s)
    holder = parse_holder(holder)
    with conn.transaction():
        ids = [require(conn, t) for t in tables]
        advisory_lock(conn, "table", ids, what=f"lease on {', '.join(map(str, tables))}", shared=True)
        cut, table_ids = reads.resolve_with_ids(conn, tables, level=Level.REPEATABLE_READ, barrier=barrier)
        row = conn.execute(
            """
            INSERT INTO lease (holder, barrier, expires_at)
            VALUES (%s, %s, now() + make_interval(secs => %s))
            RETURNING lease_id, expires_at
            """,
            (holder, cut.barrier, ttl_s),
        ).fetchone()
        conn.execute(
            """
            INSERT INTO lease_snapshot (lease_id, table_id, snapshot_id)
            SELECT %s, t, s FROM unnest(%s::bigint[], %s::bigint[]) AS x(t, s)
            """,
            (row["lease_id"], [table_ids[t] for t in cut.snapshots], list(cut.snapshots.values())),
        )
        # Written first, re-checked after: an expiry that tombstoned one of these snapshots
        # before we took the lock wins, and this lease is refused (rolled back).
        gone = conn.execute(
            """
            SELECT t.name, ls.snapshot_id FROM lease_snapshot ls
            JOIN expired_snapshot e USING (table_id, snapshot_id)
            JOIN managed_table t USING (table_id)
            WHERE ls.lease_id = %s ORDER BY t.name LIMIT 1
            """,
            (row["lease_id"],),
        ).fetchone()
        if gone:
            raise SnapshotExpiredError(gone["name"], gone["snapshot_id"], cut.barrier)
        if bootstrap_job is not None:
            later = conn.execute(
                """
                SELECT m.name, c.snapshot_id, c.barrier FROM table_commit c
                JOIN managed_table m USING (table_id)
                JOIN expired_snapshot e ON e.table_id = c.table_id AND e.snapshot_id = c.snapshot_id
                WHERE c.table_id = ANY(%s) AND c.barrier > %s AND c.revoked_by IS NULL
                ORDER BY c.barrier LIMIT 1
                """,
                (ids, cut.barrier),
            ).fetchone()
            if later:
                raise SnapshotExpiredError(later["name"], later["snapshot_id"], later["barrier"])
            conn.execute(
                "INSERT INTO input_range (job_name, barrier, spec) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                (bootstrap_job, cut.barrier, '{"bootstrap": true}'),
            )
    return Cut(
        barrier=cut.barrier, level=Level.REPEATABLE_READ, snapshots=cut.snapshots,
        lease_id=str(row["lease_id"]), expires_at=row["expires_at"],
    )


def renew(conn: psycopg.Connection, lease_id: str, *, ttl_s: float) -> Lease:
    _check_ttl(ttl_s)
    lid = _parse_id(lease_id)
    with conn.transaction():
        row = conn.execute(
            """
            UPDATE lease SET expires_at = now() + make_interval(secs => %s)
            WHERE lease_id = %s AND released_at IS NULL AND expires_at > now()
            RETURNING lease_id
            """,
            (ttl_s, lid),
        ).fetchone()
        if row is None:
            lease = get(conn, lease_id)  # raises if unknown
            raise LeaseExpiredError(lease_id, lease.state)
    return get(conn, lease_id)


def release(conn: psycopg.Connection, lease_id: str) -> Lease:
    """Release a lease (releasing it again changes nothing)."""
    lid = _parse_id(lease_id)
    with conn.transaction():
        conn.execute("UPDATE lease SET released_at = now() WHERE lease_id = %s AND released_at IS NULL", (lid,))
    return get(conn, lease_id)


_LEASES = """
SELECT l.lease_id, l.holder, l.barrier, l.acquired_at, l.expires_at, l.released_at,
       coalesce(json_object_agg(t.name, ls.snapshot_id) FILTER (WHERE t.name IS NOT NULL), '{}') AS snapshots
FROM lease l
LEFT JOIN lease_snapshot ls USING (lease_id)
LEFT JOIN managed_table t USING (table_id)
"""


def get(conn: psycopg.Connection, lease_id: str) -> Lease:
    row = conn.execute(_LEASES + " WHERE l.lease_id = %s GROUP BY l.lease_id", (_parse_id(lease_id),)).fetchone()
    if row is None:
        raise LeaseNotFoundError(lease_id)
    return _lease(row)


def list_leases(conn: psycopg.Connection, *, include_inactive: bool = False) -> list[Lease]:
    where = "" if include_inactive else " WHERE l.released_at IS NULL AND l.expires_at > now()"
    rows = conn.execute(_LEASES + where + " GROUP BY l.lease_id ORDER BY l.acquired_at").fetchall()
    return [_lease(r) for r in rows]


def _lease(r: dict) -> Lease:
    return Lease(
        lease_id=str(r["lease_id"]), holder=r["holder"], barrier=r["barrier"], acquired_at=r["acquired_at"],
        expires_at=r["expires_at"], released_at=r["released_at"],
        snapshots={TableName.parse(t): s for t, s in r["snapshots"].items()},
    )


def _parse_id(lease_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(lease_id))
    except ValueError:
        raise LeaseNotFoundError(lease_id) from None


# -- protected sets and expiry ----------------------------------------------------------------

# For one table: its current snapshot, live lease pins, downstream job progress pins and the
# read-committed window (every snapshot a read-committed reader may resolve now: S(T, lo)
# and all commits in (lo, W(T)], lo being the lowest watermark of any table, or the lowest
# progress of any job: a job that has recorded its first barrier but not completed it yet
# counts as being there, so what it reads next is kept).
_PROTECTION = """
WITH t AS (SELECT table_id, watermark FROM managed_table WHERE table_id = %(table_id)s),
started AS (  -- jobs' progress: their sinks' watermark, else the first barrier they recorded
    SELECT j.job_id, j.name,
           coalesce((SELECT max(m.watermark) FROM job_sink k JOIN managed_table m USING (table_id)
                     WHERE k.job_id = j.job_id),
                    (SELECT min(r.barrier) FROM input_range r WHERE r.job_name = j.name)) AS progress
    FROM job j WHERE j.active),
lo AS (
    SELECT least((SELECT min(m.watermark) FROM managed_table m WHERE m.watermark IS NOT NULL),
                 (SELECT min(progress) FROM started)) AS b)
SELECT
  (SELECT c.snapshot_id FROM table_commit c WHERE c.revoked_by IS NULL AND c.table_id = t.table_id
    ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1) AS current,
  coalesce((SELECT json_agg(json_build_array(l.lease_id, ls.snapshot_id))
            FROM lease_snapshot ls JOIN lease l USING (lease_id)
            WHERE ls.table_id = t.table_id AND l.released_at IS NULL AND l.expires_at > now()), '[]') AS leases,
  coalesce((SELECT json_agg(json_build_array(p.job_name, (
                SELECT c.snapshot_id FROM table_commit c WHERE c.revoked_by IS NULL AND c.table_id = t.table_id AND c.barrier <= p.progress
                ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1)))
            FROM (SELECT st.name AS job_name, st.progress
                  FROM job_source s JOIN started st USING (job_id) WHERE s.table_id = t.table_id) p
            WHERE p.progress IS NOT NULL), '[]') AS job_progress,
  coalesce((SELECT jsonb_agg(c.snapshot_id) FROM table_commit c
            WHERE c.revoked_by IS NULL AND c.table_id = t.table_id AND c.barrier > (SELECT b FROM lo) AND c.barrier <= t.watermark), '[]')
    || jsonb_build_array((SELECT c.snapshot_id FROM table_commit c
                          WHERE c.revoked_by IS NULL AND c.table_id = t.table_id AND c.barrier <= (SELECT b FROM lo)
                          ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1)) AS read_window
FROM t
"""


def protected(
    conn: psycopg.Connection,
    table: TableName,
    *,
    retained: tuple[int, ...] = (),
    tagged: tuple[tuple[str, int], ...] = (),
) -> dict[int, ProtectedSnapshot]:
    """Snapshot ids of ``table`` that must not be expired, each with its reasons."""
    return _protected(conn, require(conn, table), retained=retained, tagged=tagged)


def _protected(conn, table_id: int, *, retained=(), tagged=()) -> dict[int, ProtectedSnapshot]:
    row = conn.execute(_PROTECTION, {"table_id": table_id}).fetchone()
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
def expiry_lock(conn: psycopg.Connection, table: TableName) -> Iterator[None]:
    """Run one expiry of ``table`` at a time, from planning to deleting files (a session-level
    advisory lock on ``conn``; a second expiry of the same table waits here)."""
    table_id = require(conn, table)
    advisory_lock(conn, "expiry", [table_id], what=f"expiry of {table} (another one is running)", session=True)
    try:
        yield
    finally:
        if not conn.closed:
            advisory_unlock(conn, "expiry", [table_id])


def claim_expiry(
    conn: psycopg.Connection,
    table: TableName,
    candidates: list[int],
    *,
    retained: tuple[int, ...] = (),
    tagged: tuple[tuple[str, int], ...] = (),
    dry_run: bool = False,
) -> ExpiryClaim:
    """Decide which of ``candidates`` (chosen by the caller beforehand) may be deleted.

    Under the table's exclusive lock it reads the protected set *now*, and tombstones the
    removable snapshots before returning, so a lease taken afterwards is refused instead of
    pinning a snapshot that is about to disappear. The caller deletes only ``removable``.
    """
    with conn.transaction():
        table_id = require(conn, table)
        advisory_lock(conn, "table", [table_id], what=f"expiry of {table}")
        keep = _protected(conn, table_id, retained=retained, tagged=tagged)
        gone = removable(candidates, keep)
        if not dry_run and gone:
            conn.execute(
                """
                INSERT INTO expired_snapshot (table_id, snapshot_id)
                SELECT %s, unnest(%s::bigint[]) ON CONFLICT DO NOTHING
                """,
                (table_id, gone),
            )
    return ExpiryClaim(table=table, removable=tuple(gone), protected=keep)
