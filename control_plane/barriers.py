"""The global barrier sequence, issued from the control plane's database clock, and its anchors.

A barrier is microseconds since the epoch on the database clock. The one-row
``barrier_clock`` is advanced by a single compare-and-set statement (the ``tick_barrier``
function) to ``greatest(last + 1, now)``, so barriers strictly increase even if the clock
steps back, and concurrent issuers are serialised by that row's lock.
"""

from __future__ import annotations

from icebarrier.control_plane import settings
from icebarrier.control_plane.db import Conn, call, one
from icebarrier.control_plane.errors import InvalidValueError
from icebarrier.control_plane.model import Barrier

BARRIER_INTERVAL_KEY = "barrier_interval_ms"
ANCHOR_INTERVAL_KEY = "anchor_interval_ms"


def issue(conn: Conn, *, issued_by: str = "operator") -> Barrier:
    """Issue a barrier now (an operator's request; the admin only)."""
    with conn.transaction():
        row = call(conn, "issue_barrier", issued_by)[0]
    return Barrier(**row)


def issue_when_due(conn: Conn, *, issued_by: str = "schedule") -> Barrier | None:
    """The clock rule, for the admin (``icebarrier schedule``): issue a barrier if the newest is
    older than the barrier interval, else None. Decided under the clock's lock: a job that issued
    the due barrier a moment ago (its transaction still running its skip wave) is not followed by
    a second."""
    with conn.transaction():
        rows = call(conn, "issue_due_barrier", issued_by)
    return Barrier(**rows[0]) if rows else None


def issue_if_due(conn: Conn, *, job: str) -> Barrier | None:
    """The clock rule, asked for by (a role acting for) ``job``: issue a barrier if the newest is
    older than the barrier interval, else None."""
    with conn.transaction():
        rows = call(conn, "issue_barrier_if_due", job)
    return Barrier(**rows[0]) if rows else None


def newest(conn: Conn) -> Barrier | None:
    row = conn.execute(
        "SELECT barrier, issued_at, issued_by, anchor FROM barriers ORDER BY barrier DESC LIMIT 1"
    ).fetchone()
    return Barrier(**row) if row else None


def next_due_in_s(conn: Conn) -> float | None:
    """Seconds until the clock rule issues the next barrier (the newest plus the interval, on the
    database clock; negative: due now), None before the first barrier."""
    due_in_s = one(conn.execute("SELECT barrier_due_in_s() AS due_in_s"))["due_in_s"]
    return None if due_in_s is None else float(due_in_s)


def list_barriers(conn: Conn, *, limit: int = 20) -> list[Barrier]:
    rows = conn.execute(
        "SELECT barrier, issued_at, issued_by, anchor FROM barriers ORDER BY barrier DESC LIMIT %s", (limit,)
    ).fetchall()
    return [Barrier(**r) for r in rows]


def get_interval_s(conn: Conn) -> float:
    return settings.get_s(conn, BARRIER_INTERVAL_KEY)


def set_interval_s(conn: Conn, seconds: float) -> float:
    """Set the barrier interval (the admin only; the setting's CHECK bounds it to 1ms..7d)."""
    return _set_duration(conn, BARRIER_INTERVAL_KEY, "barrier interval", seconds, "10s")


def get_anchor_interval_s(conn: Conn) -> float:
    return settings.get_s(conn, ANCHOR_INTERVAL_KEY)


def set_anchor_interval_s(conn: Conn, seconds: float) -> float:
    """Set the anchor interval: the first barrier issued at or after each multiple of it (on the
    database clock) is an anchor, which no job coalesces (the admin only; 1ms..7d)."""
    return _set_duration(conn, ANCHOR_INTERVAL_KEY, "anchor interval", seconds, "60s")


def _set_duration(conn: Conn, key: str, what: str, seconds: float, example: str) -> float:
    if not 0.001 <= seconds <= 86400 * 7:
        raise InvalidValueError(f"{what} {seconds:g}s is out of range; use at least 1ms and at most 7d, e.g. {example}")
    return settings.set_s(conn, key, seconds)
