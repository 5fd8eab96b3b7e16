"""The global barrier sequence, issued from the control plane's database clock.

A barrier is microseconds since the epoch on the database clock. The one-row
``barrier_clock`` is advanced by a single compare-and-set statement to
``greatest(last + 1, now)``, so barriers strictly increase even if the clock steps back,
and concurrent issuers are serialised by that row's lock.
"""

from __future__ import annotations

import psycopg

from icebarrier.control_plane.errors import InvalidValueError
from icebarrier.control_plane.model import Barrier

BARRIER_INTERVAL_KEY = "barrier_interval_ms"

# Advance the clock and record the barrier in one statement. With %(min_age_us)s set, only
# when the newest barrier is at least that old ("issue when the newest is older than the
# barrier interval"); concurrent callers then get one new barrier between them.
_ISSUE = """
WITH now_us AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS us),
tick AS (
    UPDATE barrier_clock c
    SET last_barrier = greatest(c.last_barrier + 1, now_us.us)
    FROM now_us
    WHERE %(min_age_us)s::bigint IS NULL OR c.last_barrier <= now_us.us - %(min_age_us)s::bigint
    RETURNING c.last_barrier)
INSERT INTO barrier (barrier, issued_at, issued_by)
SELECT last_barrier, clock_timestamp(), %(issued_by)s FROM tick
RETURNING barrier, issued_at, issued_by
"""


def issue(conn: psycopg.Connection, *, issued_by: str = "operator") -> Barrier:
    """Issue a barrier now (an operator's request)."""
    with conn.transaction():
        row = conn.execute(_ISSUE, {"min_age_us": None, "issued_by": issued_by}).fetchone()
    return Barrier(**row)


def issue_if_due(conn: psycopg.Connection, *, issued_by: str) -> Barrier | None:
    """Issue a barrier if the newest is older than the barrier interval, else None."""
    with conn.transaction():
        row = conn.execute(
            _ISSUE,
            {"min_age_us": _interval_us(conn), "issued_by": issued_by},
        ).fetchone()
    return Barrier(**row) if row else None


def newest(conn: psycopg.Connection) -> Barrier | None:
    row = conn.execute("SELECT barrier, issued_at, issued_by FROM barrier ORDER BY barrier DESC LIMIT 1").fetchone()
    return Barrier(**row) if row else None


def list_barriers(conn: psycopg.Connection, *, limit: int = 20) -> list[Barrier]:
    rows = conn.execute(
        "SELECT barrier, issued_at, issued_by FROM barrier ORDER BY barrier DESC LIMIT %s", (limit,)
    ).fetchall()
    return [Barrier(**r) for r in rows]


def get_interval_s(conn: psycopg.Connection) -> float:
    return _interval_us(conn) / 1_000_000


def set_interval_s(conn: psycopg.Connection, seconds: float) -> float:
    if not 0.001 <= seconds <= 86400 * 7:
        raise InvalidValueError(f"barrier interval {seconds:g}s is out of range; use at least 1ms and at most 7d, "
                                f"e.g. 10s")
    with conn.transaction():
        conn.execute(
            "UPDATE setting SET value = %s WHERE key = %s", (str(round(seconds * 1000)), BARRIER_INTERVAL_KEY)
        )
    return get_interval_s(conn)


def _interval_us(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT value FROM setting WHERE key = %s", (BARRIER_INTERVAL_KEY,)).fetchone()
    return int(row["value"]) * 1000
