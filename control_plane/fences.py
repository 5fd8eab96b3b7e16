"""One holder per control plane: the fence of a long-running service (the schedule, the
maintenance service).

A service holds a Postgres advisory lock (session level, keyed by the service and the schema)
on a connection of its own for as long as it runs, and writes who it is into its state table
(a one-row table with ``holder``, ``started_at``, ``seen_at``, ``lease_until`` and ``plan``). A
second instance waits, naming the holder once, and takes over when the holder's connection ends
(its process died, or the network dropped it): Postgres releases the lock with the session.

The lock alone does not survive a failover: it lives in the primary's memory, so a promoted
standby has none, while the old holder, whose connection died with the primary, may still be
acting (a compaction in Spark commits through connections of its own). The lease does: the
holder renews ``lease_until`` (now + :data:`TTL_ENV`) at each look, replicated like any commit,
and acts only while the lease it last renewed runs, counted from before it sent the renewal
(:meth:`Fence.valid`). A new holder, once it has the lock, waits until the lease it finds has
lapsed. A holder that stops lets its lease go, so the next one starts at once; so does a holder
that lost its connection and takes the lock again (it stopped acting when it lost it).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg import sql

from icebarrier.control_plane import db
from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import ControlPlaneUnavailableError

TTL_ENV, DEFAULT_TTL = "ICEBARRIER_FENCE_TTL", "10s"


class Fence:
    """The lock of service ``name`` (its state in ``state_table``)."""

    def __init__(
        self,
        name: str,
        state_table: str,
        *,
        dsn: str | None,
        schema: str | None,
        log: Callable[[str], None],
        wait_for_lease: bool = True,
    ):
        self.name, self.dsn, self.schema, self.log = name, dsn, schema, log
        self.wait_for_lease = wait_for_lease  # False only to break the fence on purpose (its test)
        self.state = sql.Identifier(state_table)
        self.holder = f"{socket.gethostname()} pid {os.getpid()}"
        self.conn: Conn | None = None  # the connection holding the lock, while it is held
        self.ttl_s = db.duration_env_s(TTL_ENV, DEFAULT_TTL)
        self.valid_until = 0.0  # time.monotonic() until which the lease it last renewed runs
        # it held the lease and stopped acting (released): a lease of its own it finds holds nobody
        self.stopped = False

    def acquire(self, stop: threading.Event, *, poll_s: float = 1.0) -> bool:
        """Hold the lock and the lease (on a connection of the fence's own; :meth:`release` lets
        go), or return False once ``stop`` is set. Waits while another instance holds the lock,
        then until the lease it left has lapsed; retries while Postgres is unreachable."""
        waiting = False
        while not stop.is_set():
            try:
                fence = db.connect(self.dsn, self.schema)
                key = f"icebarrier {self.name} {db.schema_of(fence)}"
                if db.one(fence.execute("SELECT pg_try_advisory_lock(hashtext(%s)) AS got", (key,)))["got"]:
                    if not self._lease_lapsed(fence, stop):
                        fence.close()
                        return False
                    sent = time.monotonic()
                    fence.execute(
                        sql.SQL(
                            "INSERT INTO {} (holder, started_at, seen_at, lease_until) "
                            "VALUES (%s, now(), now(), now() + make_interval(secs => %s)) "
                            "ON CONFLICT (singleton) DO UPDATE SET holder = EXCLUDED.holder, started_at = now(), "
                            "seen_at = now(), lease_until = EXCLUDED.lease_until, plan = '[]'"
                        ).format(self.state),
                        (self.holder, self.ttl_s),
                    )
                    self.valid_until = sent + self.ttl_s
                    self.conn = fence
                    return True
                held = fence.execute(sql.SQL("SELECT holder, started_at FROM {}").format(self.state)).fetchone()
                fence.close()
                if not waiting:
                    self.log(
                        f"another {self.name} runs this control plane"
                        + (f" ({held['holder']}, since {held['started_at']:%H:%M:%S})" if held else "")
                        + "; waiting to take over"
                    )
                    waiting = True
            except (psycopg.OperationalError, ControlPlaneUnavailableError) as exc:
                self.log(f"control plane unreachable ({str(exc).splitlines()[0]}); trying again")
            stop.wait(poll_s)
        return False

    def _lease_lapsed(self, fence: Conn, stop: threading.Event) -> bool:
        """With the lock held: wait until the lease the previous holder left has lapsed (it may
        still act until then: its lock died with a primary, not its process). False if stopped."""
        row = fence.execute(
            sql.SQL(
                "SELECT holder, extract(epoch FROM lease_until - clock_timestamp())::float8 AS left_s FROM {}"
            ).format(self.state)
        ).fetchone()
        if row is None or row["left_s"] is None or row["left_s"] <= 0 or not self.wait_for_lease:
            return True
        if self.stopped and row["holder"] == self.holder:
            return True  # its own, left when it lost its connection (a failover): nobody acts under it
        self.log(
            f"{self.name}: took the lock; {row['holder']} may still act until its lease lapses "
            f"in {row['left_s']:.1f} s (a failover took its lock); waiting"
        )
        return not stop.wait(row["left_s"])

    def alive(self) -> bool:
        """Renew the lease; whether the lock is still held (its connection answers) and the lease runs."""
        try:
            assert self.conn is not None
            sent = time.monotonic()
            self.conn.execute(
                sql.SQL("UPDATE {} SET lease_until = now() + make_interval(secs => %s)").format(self.state),
                (self.ttl_s,),
            )
            self.valid_until = sent + self.ttl_s
        except psycopg.OperationalError:
            return False
        return self.valid()

    def valid(self) -> bool:
        """Whether the lease this holder last renewed still runs: act only then (an action long
        enough to outlive it must look again before it commits)."""
        return time.monotonic() < self.valid_until

    @staticmethod
    def held(conn: Conn, state_table: str) -> bool:
        """Whether some holder of the service whose state is ``state_table`` has a lease that runs
        now (as the database's clock sees it)."""
        return (
            conn.execute(
                sql.SQL("SELECT 1 FROM {} WHERE lease_until > clock_timestamp()").format(sql.Identifier(state_table))
            ).fetchone()
            is not None
        )

    def publish(self, plan: object) -> None:
        """Say the holder is alive, and what it plans (JSON), for the status page."""
        assert self.conn is not None
        self.conn.execute(sql.SQL("UPDATE {} SET seen_at = now(), plan = %s").format(self.state), (json.dumps(plan),))

    def release(self) -> None:
        """Let go of the lease (if the connection still answers) and of the lock (Postgres
        releases it with the session)."""
        if self.conn is not None:
            try:
                self.conn.execute(sql.SQL("UPDATE {} SET lease_until = NULL").format(self.state))
            except psycopg.Error:
                pass  # the connection is gone: the lease lapses on its own
            self.conn.close()
            self.conn = None
            self.stopped = True
        self.valid_until = 0.0
