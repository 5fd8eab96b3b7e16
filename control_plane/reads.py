"""Resolving cuts: a snapshot per table at one barrier, at a consistency level.

``read-committed`` is the latest valid cut over the tables read, ``--barrier B`` the cut at
B (refused if B is not valid or its snapshots were expired), ``read-uncommitted`` the latest
recorded snapshot of each table with no alignment. ``repeatable-read`` is a cut pinned by a
lease: see :mod:`control_plane.leases`.
"""

from __future__ import annotations

import psycopg

from control_plane.cuts import check_valid_at, latest_valid_barrier
from control_plane.errors import BarrierNotIssuedError, IcebarrierError, SnapshotExpiredError, TableNotFoundError
from control_plane.model import Cut, Level, TableName, TableState

NO_BOUND = 2**63 - 1

# Table progress and S(T, bound) for every table, in one round trip. bound is the given
# barrier, else the tables' lowest watermark (the read-committed candidate).
_CUT = """
WITH t AS (
    SELECT table_id, name, start_barrier, watermark FROM managed_table WHERE name = ANY(%(names)s)),
bound AS (SELECT coalesce(%(barrier)s::bigint, min(watermark)) AS b FROM t)
SELECT t.table_id, t.name, t.start_barrier, t.watermark, bound.b AS bound, s.snapshot_id,
       EXISTS (SELECT 1 FROM barrier WHERE barrier = bound.b) AS bound_issued,
       EXISTS (SELECT 1 FROM expired_snapshot e
               WHERE e.table_id = t.table_id AND e.snapshot_id = s.snapshot_id) AS expired
FROM t CROSS JOIN bound
LEFT JOIN LATERAL (
    SELECT c.snapshot_id FROM table_commit c
    WHERE c.table_id = t.table_id AND c.barrier <= bound.b
    ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1) s ON true
"""


def resolve(
    conn: psycopg.Connection,
    tables: list[TableName],
    *,
    level: Level = Level.READ_COMMITTED,
    barrier: int | None = None,
) -> Cut:
    """Resolve a cut (no lease; for repeatable-read use :func:`control_plane.leases.acquire`)."""
    cut, _ = resolve_with_ids(conn, tables, level=level, barrier=barrier)
    return cut


def resolve_with_ids(
    conn: psycopg.Connection,
    tables: list[TableName],
    *,
    level: Level = Level.READ_COMMITTED,
    barrier: int | None = None,
) -> tuple[Cut, dict[TableName, int]]:
    """The cut and each table's control-plane id (leases need them)."""
    tables = list(dict.fromkeys(tables))
    if not tables:
        raise IcebarrierError("no tables given; name at least one table to read")
    uncommitted = level is Level.READ_UNCOMMITTED and barrier is None
    rows = conn.execute(
        _CUT, {"names": [str(t) for t in tables], "barrier": NO_BOUND if uncommitted else barrier}
    ).fetchall()
    by_name = {r["name"]: r for r in rows}
    for t in tables:
        if str(t) not in by_name:
            raise TableNotFoundError(str(t))
    ids = {t: by_name[str(t)]["table_id"] for t in tables}
    snapshots = {t: by_name[str(t)]["snapshot_id"] for t in tables}
    if uncommitted:
        return Cut(barrier=None, level=level, snapshots=snapshots), ids

    states = [
        TableState(name=t, start_barrier=by_name[str(t)]["start_barrier"], watermark=by_name[str(t)]["watermark"])
        for t in tables
    ]
    if barrier is None:
        barrier = latest_valid_barrier(states)
    else:
        if not rows[0]["bound_issued"]:
            raise BarrierNotIssuedError(barrier)
        check_valid_at(states, barrier)
    for t in tables:
        if by_name[str(t)]["expired"]:
            raise SnapshotExpiredError(str(t), snapshots[t], barrier)
    return Cut(barrier=barrier, level=level, snapshots=snapshots), ids
