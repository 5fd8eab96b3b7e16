"""Resolving cuts: a snapshot per table at one barrier, at a consistency level.

``read-committed`` is the latest valid cut over the tables read, ``--barrier B`` the cut at
B (refused if B is not valid or its snapshots were expired), ``read-uncommitted`` the latest
recorded snapshot of each table with no alignment. ``repeatable-read`` is a cut pinned by a
lease: see :mod:`icebarrier.control_plane.leases`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
from psycopg.rows import tuple_row

from icebarrier.control_plane.cuts import check_valid_at, latest_valid_barrier
from icebarrier.control_plane.errors import (
    BarrierNotIssuedError,
    IcebarrierError,
    NoValidCutError,
    SnapshotExpiredError,
    TableNotFoundError,
)
from icebarrier.control_plane.model import Cut, Level, TableName, TableState

NO_BOUND = 2**63 - 1

# Table progress and S(T, bound) for every table, in one round trip. bound is the given
# barrier, else the tables' lowest watermark (the read-committed candidate); "valid" says
# whether every table completed bound (start <= bound <= watermark). Rows come in the
# order of the names given, with NULLs for unknown tables.
_CUT = """
WITH t AS (
    SELECT n.ord, m.table_id, m.start_barrier, m.watermark
    FROM unnest(%(names)s::text[]) WITH ORDINALITY AS n(name, ord)
    LEFT JOIN managed_table m ON m.name = n.name),
bound AS (SELECT coalesce(%(barrier)s::bigint, min(watermark)) AS b FROM t),
verdict AS MATERIALIZED (
    SELECT bound.b,
           EXISTS (SELECT 1 FROM barrier WHERE barrier = bound.b) AS issued,
           (SELECT bool_and(coalesce(t.start_barrier <= bound.b AND bound.b <= t.watermark, false))
            FROM t) AS valid
    FROM bound)
SELECT t.table_id, t.start_barrier, t.watermark, s.snapshot_id,
       EXISTS (SELECT 1 FROM expired_snapshot e
               WHERE e.table_id = t.table_id AND e.snapshot_id = s.snapshot_id) AS expired,
       verdict.b, verdict.issued, coalesce(verdict.valid, false) AS valid
FROM t CROSS JOIN verdict
LEFT JOIN LATERAL (
    SELECT c.snapshot_id FROM table_commit c
    WHERE c.table_id = t.table_id AND c.barrier <= verdict.b AND c.revoked_by IS NULL
    ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1) s ON true
ORDER BY t.ord
"""


def resolve(
    conn: psycopg.Connection,
    tables: list[TableName],
    *,
    level: Level = Level.READ_COMMITTED,
    barrier: int | None = None,
) -> Cut:
    """Resolve a cut (no lease; for repeatable-read use :func:`icebarrier.control_plane.leases.acquire`)."""
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
    with conn.cursor(row_factory=tuple_row) as cur:
        # Not prepared: a cached generic plan made for 10 tables is slow for 1,000.
        rows = cur.execute(
            _CUT, {"names": [str(t) for t in tables], "barrier": NO_BOUND if uncommitted else barrier}, prepare=False
        ).fetchall()
    for t, (table_id, *_rest) in zip(tables, rows):
        if table_id is None:
            raise TableNotFoundError(str(t))
    ids = {t: r[0] for t, r in zip(tables, rows)}
    snapshots = {t: r[3] for t, r in zip(tables, rows)}
    if uncommitted:
        return Cut(barrier=None, level=level, snapshots=snapshots), ids

    _, _, _, _, _, bound, issued, valid = rows[0]
    if barrier is not None and not issued:
        raise BarrierNotIssuedError(barrier)
    if not valid:
        # The pure functions are the definition; they say which table failed and why.
        states = [TableState(name=t, start_barrier=r[1], watermark=r[2]) for t, r in zip(tables, rows)]
        if barrier is None:
            latest_valid_barrier(states)
        else:
            check_valid_at(states, barrier)
        raise AssertionError(f"cut at {bound} judged invalid by SQL but valid by cuts.py")
    for t, r in zip(tables, rows):
        if r[4]:
            raise SnapshotExpiredError(str(t), r[3], bound)
    return Cut(barrier=bound, level=level, snapshots=snapshots), ids


def wait_for_cut(
    conn: psycopg.Connection,
    tables: list[TableName],
    *,
    timeout_s: float,
    progress: Callable[[str], None] | None = None,
    poll_s: float = 0.2,
    idle: Callable[[], None] | None = None,
) -> int:
    """Wait, at most ``timeout_s``, until ``tables`` have a valid cut; return its barrier.

    While waiting, ``progress`` gets a line naming the jobs that hold the first cut back
    (each time that changes), and ``idle`` runs between polls (default: sleep ``poll_s``;
    a program that drives its own jobs passes one step of them). Past the timeout the
    :class:`NoValidCutError` is raised."""
    deadline = time.monotonic() + timeout_s
    said = None
    while True:
        try:
            return resolve(conn, tables, level=Level.READ_COMMITTED).barrier
        except NoValidCutError as exc:
            if time.monotonic() >= deadline:
                raise
            line = "waiting for a first consistent cut: " + _holding_back(conn, exc.holding)
            if progress is not None and line != said:
                progress(line)
                said = line
            idle() if idle is not None else time.sleep(poll_s)


def _holding_back(conn: psycopg.Connection, holding: dict[str, str]) -> str:
    """The tables keeping a cut from existing (as :func:`latest_valid_barrier` says why), each
    with the job that writes it."""
    writers = {r["table_name"]: r["writer_job"] for r in conn.execute(
        "SELECT table_name, writer_job FROM table_versions WHERE table_name = ANY(%s)", (list(holding),)).fetchall()}
    return "; ".join(f"{'job ' + writers[t] if writers.get(t) else 'no job'} ({t} {why})"
                     for t, why in holding.items()) or "jobs to complete a common barrier"
