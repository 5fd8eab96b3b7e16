"""One holder per control plane: the fence of a long-running service (the schedule, the
maintenance service).

A service holds a Postgres advisory lock (session level, keyed by the service and the schema)
on a connection of its own for as long as it runs, and writes who it is into its state table
(a one-row table with ``holder``, ``started_at``, ``seen_at`` and ``plan``). A second instance
waits, naming the holder once, and takes over when the holder's connection ends (its process
died, or the network dropped it): Postgres releases the lock with the session.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable

import psycopg
from psycopg import sql

from icebarrier.control_plane import db
from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import ControlPlaneUnavailableError


class Fence:
    """The lock of service ``name`` (its state in ``state_table``)."""

    def __init__(self, name: str, state_table: str, *, dsn: str | None, schema: str | None, log: Callable[[str], None]):
        self.name, self.dsn, self.schema, self.log = name, dsn, schema, log
        self.state = sql.Identifier(state_table)
        self.holder = f"{socket.gethostname()} pid {os.getpid()}"
        self.conn: Conn | None = None  # the connection holding the lock, while it is held

    def acquire(self, stop: threading.Event, *, poll_s: float = 1.0) -> bool:
        """Hold the lock (on a connection of the fence's own; :meth:`release` lets go), or return
        False once ``stop`` is set. Waits while another instance holds it; retries while Postgres
        is unreachable."""
        waiting = False
        while not stop.is_set():
            try:
                fence = db.connect(self.dsn, self.schema)
                key = f"icebarrier {self.name} {db.schema_of(fence)}"
                if db.one(fence.execute("SELECT pg_try_advisory_lock(hashtext(%s)) AS got", (key,)))["got"]:
                    fence.execute(
                        sql.SQL(
                            "INSERT INTO {} (holder, started_at, seen_at) VALUES (%s, now(), now()) "
                            "ON CONFLICT (singleton) DO UPDATE SET holder = EXCLUDED.holder, started_at = now(), "
                            "seen_at = now(), plan = '[]'"
                        ).format(self.state),
                        (self.holder,),
                    )
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

    def alive(self) -> bool:
        """Whether the lock is still held (its connection answers)."""
        try:
            assert self.conn is not None
            self.conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    def publish(self, plan: object) -> None:
        """Say the holder is alive, and what it plans (JSON), for the status page."""
        assert self.conn is not None
        self.conn.execute(sql.SQL("UPDATE {} SET seen_at = now(), plan = %s").format(self.state), (json.dumps(plan),))

    def release(self) -> None:
        """Let go of the lock (Postgres releases it with the session)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
