"""Small builders shared by the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import psycopg.conninfo
from psycopg import sql

from icebarrier.control_plane import barriers, jobs
from icebarrier.control_plane.model import JobDefinition, TableName


def T(name: str) -> TableName:
    return TableName.parse(name if name.count(".") >= 2 else f"lake.db.{name}")


def job(name: str, *, sources=(), sinks=(), external=()) -> JobDefinition:
    if not sources and not external:
        external = (f"ext:{name}",)
    return JobDefinition(
        name=name,
        sources=frozenset(T(s) for s in sources),
        sinks=frozenset(T(s) for s in sinks),
        external_inputs=frozenset(external),
    )


def register_chain(conn) -> None:
    """orders, payments (root) -> revenue (intermediate) -> report (intermediate)."""
    jobs.register(conn, job("ingest_orders", sinks=["orders"]))
    jobs.register(conn, job("ingest_payments", sinks=["payments"]))
    jobs.register(conn, job("agg", sources=["orders", "payments"], sinks=["revenue"]))
    jobs.register(conn, job("report", sources=["revenue"], sinks=["report"]))


def complete_all(conn, barrier: int, snapshot_base: int = 0) -> dict[str, int]:
    """Complete ``barrier`` for every job of :func:`register_chain`, one commit per table."""
    written = {}
    for i, (name, sink) in enumerate(
        [("ingest_orders", "orders"), ("ingest_payments", "payments"), ("agg", "revenue"), ("report", "report")]
    ):
        snapshot = snapshot_base + i + 1
        jobs.complete(conn, name, barrier, {T(sink): snapshot})
        written[sink] = snapshot
    return written


def new_barrier(conn) -> int:
    return barriers.issue(conn).barrier


WEEK_S = 7 * 86400


def calm_anchors(conn) -> None:
    """Anchors come with the database clock (every 60 s by default), so a job behind by several
    barriers would plan differently when a test straddles a minute: tests run with a week's
    anchor interval and make the anchors they need with :func:`anchor`."""
    barriers.set_anchor_interval_s(conn, WEEK_S)


def anchor(conn) -> int:
    """Issue a barrier that is an anchor (the first after a multiple of a 1 ms anchor interval);
    the interval is a week before and after, so no other barrier of a test is one."""
    barriers.set_anchor_interval_s(conn, 0.001)
    time.sleep(0.002)
    b = barriers.issue(conn)
    calm_anchors(conn)
    assert b.anchor
    return b.barrier


@contextmanager
def new_database(server_dsn: str, prefix: str) -> Iterator[str]:
    """A new, empty database on the test server (yields its DSN); dropped, forcibly, afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield psycopg.conninfo.make_conninfo(server_dsn, dbname=name)
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@contextmanager
def login_roles(server_dsn: str, dsn: str, *kinds: str) -> Iterator[dict[str, str]]:
    """New LOGIN roles on the test server, one per kind (yields kind -> role name); afterwards
    what they were granted in ``dsn``'s database is dropped, then the roles."""
    names = {kind: f"ib_{kind}_{uuid.uuid4().hex[:6]}" for kind in kinds}
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        for name in names.values():
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        yield names
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            for name in names.values():
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            for name in names.values():
                admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


class LoggedProcess:
    """A long-running command (a service: `icebarrier schedule`, `maintain`) in a process group
    of its own; its output lines as they come, copied to ``log``."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # what it starts dies with it (the test kills the whole group at the end)
        )
        self.lines: list[str] = []

        def keep() -> None:
            with open(log, "w") as copy:
                for line in self.proc.stdout:
                    self.lines.append(line)
                    copy.write(line)
                    copy.flush()

        threading.Thread(target=keep, daemon=True).start()

    def wait_for(self, text: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            found = [line for line in self.lines if text in line]
            if found:
                return found[0]
            assert self.proc.poll() is None or found, f"{self.proc.args[2:4]} exited: {''.join(self.lines)[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in: {''.join(self.lines)[-3000:]}"
            time.sleep(0.1)

    def log(self) -> str:
        return "".join(self.lines)

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
