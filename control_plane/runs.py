"""What a running job records: input ranges for deterministic replay, and liveness."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

from psycopg.types.json import Jsonb

from icebarrier.control_plane.db import Conn, call


def record_range(conn: Conn, job: str, barrier: int, spec: dict, *, range_key: str | None = None) -> dict:
    """Record the input of ``barrier`` before it is written; returns the recorded range.

    If a range is already recorded for this barrier (a replay after a crash) that one is
    returned, unchanged: the barrier re-reads exactly the same input.
    """
    with conn.transaction():
        return call(conn, "record_input_range", job, barrier, range_key, Jsonb(spec))[0]["record_input_range"]


def recorded_range(conn: Conn, job: str, barrier: int) -> dict | None:
    row = conn.execute("SELECT spec FROM input_ranges WHERE job_name = %s AND barrier = %s", (job, barrier)).fetchone()
    return row["spec"] if row else None


def barrier_for_key(conn: Conn, job: str, range_key: str) -> int | None:
    """The barrier a source position (e.g. ``batch:17``) was assigned, if any."""
    row = conn.execute(
        "SELECT barrier FROM input_ranges WHERE job_name = %s AND range_key = %s", (job, range_key)
    ).fetchone()
    return row["barrier"] if row else None


def last_range(conn: Conn, job: str, *, before_barrier: int) -> dict | None:
    """The job's newest recorded range before ``before_barrier``, or None."""
    return next(recent_ranges(conn, job, before_barrier=before_barrier, page=1), None)


def recent_ranges(conn: Conn, job: str, *, before_barrier: int, page: int = 20) -> Iterator[dict]:
    """The job's recorded ranges before ``before_barrier``, newest first, fetched a page at a time
    (a source's consumed-input watermark is in the newest few: read only as far as needed)."""
    while True:
        rows = conn.execute(
            "SELECT barrier, spec FROM input_ranges WHERE job_name = %s AND barrier < %s "
            "ORDER BY barrier DESC LIMIT %s",
            (job, before_barrier, page),
        ).fetchall()
        yield from ({"barrier": r["barrier"], **r["spec"]} for r in rows)
        if len(rows) < page:
            return
        before_barrier = rows[-1]["barrier"]


def ranges(conn: Conn, job: str, *, up_to_barrier: int | None = None) -> list[dict]:
    """All recorded ranges of a job (oldest first), for sources that track consumption."""
    rows = conn.execute(
        "SELECT barrier, spec FROM input_ranges WHERE job_name = %s AND (%s::bigint IS NULL OR barrier <= %s) "
        "ORDER BY barrier",
        (job, up_to_barrier, up_to_barrier),
    ).fetchall()
    return [{"barrier": r["barrier"], **r["spec"]} for r in rows]


def set_status(conn: Conn, job: str, status: str) -> None:
    with conn.transaction():
        call(conn, "set_job_status", job, status, f"{socket.gethostname()}:{os.getpid()}")


def set_waiting(conn: Conn, job: str, waiting_for: str | None) -> None:
    """Record what the job waits for (None: nothing); writes only when it changes."""
    with conn.transaction():
        call(conn, "set_job_waiting", job, waiting_for)


def heartbeat(conn: Conn, job: str) -> None:
    with conn.transaction():
        call(conn, "job_heartbeat", job)


def record_computation(conn: Conn, job: str, barrier: int, incremental: bool, reason: str | None) -> None:
    """Record how the job computed ``barrier``: from the changes since its previous barrier,
    or in full and why (``job show``, /metrics)."""
    with conn.transaction():
        call(conn, "record_computation", job, barrier, incremental, reason)
