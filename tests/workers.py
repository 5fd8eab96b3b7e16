"""Functions run in separate OS processes by the concurrency tests (multiprocessing spawn).

Each worker opens its own connection, waits at a barrier so that all start together, does
one thing and reports the outcome as plain data.
"""

from __future__ import annotations

import multiprocessing as mp

from icebarrier.control_plane import barriers, db, jobs, leases, schema
from icebarrier.control_plane.errors import IcebarrierError
from tests.helpers import T, job

CTX = mp.get_context("spawn")


def run_all(target, args_list, timeout_s: float = 120) -> list:
    """Run ``target(queue, start_event, *args)`` in one process per args; collect results."""
    queue = CTX.Queue()
    start = CTX.Event()
    procs = [CTX.Process(target=target, args=(queue, start, *args)) for args in args_list]
    for p in procs:
        p.start()
    start.set()
    results = [queue.get(timeout=timeout_s) for _ in procs]
    for p in procs:
        p.join(timeout_s)
        assert p.exitcode == 0, f"worker {p.pid} exited with {p.exitcode}"
    return results


def upgrade_worker(queue, start, dsn):
    start.wait()
    queue.put(schema.upgrade(dsn).current)


def register_worker(queue, start, dsn, name, sink):
    with db.connect(dsn) as conn:
        start.wait()
        try:
            queue.put(("ok", jobs.register(conn, job(name, sinks=[sink])).status))
        except IcebarrierError as exc:
            queue.put(("refused", type(exc).__name__))


def complete_worker(queue, start, dsn, name, barrier, sink, snapshot):
    with db.connect(dsn) as conn:
        start.wait()
        try:
            result = jobs.complete(conn, name, barrier, {T(sink): snapshot})
            queue.put(("noop" if result.noop else "completed", snapshot))
        except IcebarrierError as exc:
            queue.put(("refused", type(exc).__name__))


def issue_worker(queue, start, dsn, count, if_due):
    with db.connect(dsn) as conn:
        start.wait()
        issued = []
        for _ in range(count):
            b = barriers.issue_if_due(conn, job="w") if if_due else barriers.issue(conn)
            if b is not None:
                issued.append(b.barrier)
        queue.put(issued)


def lease_worker(queue, start, dsn, tables, rounds, seed=0):
    """Acquire leases at every recorded barrier; report which were granted or refused."""
    import random

    granted, refused = [], 0
    with db.connect(dsn) as conn:
        marks = [r["barrier"] for r in conn.execute("SELECT barrier FROM barrier ORDER BY barrier").fetchall()]
        order = random.Random(seed).choices(marks, k=rounds)
        start.wait()
        for i, barrier in enumerate(order):
            try:
                cut = leases.acquire(conn, [T(t) for t in tables], ttl_s=600, holder=f"w{i}", barrier=barrier)
                granted.append((cut.lease_id, {str(k): v for k, v in cut.snapshots.items()}))
            except IcebarrierError as exc:
                if type(exc).__name__ != "SnapshotExpiredError":
                    raise
                refused += 1
    queue.put(("lease", granted, refused))


def expiry_worker(queue, start, dsn, tables, rounds):
    """Claim every recorded snapshot of each table for expiry, over and over."""
    removed = {t: set() for t in tables}
    with db.connect(dsn) as conn:
        start.wait()
        for _ in range(rounds):
            for t in tables:
                candidates = [
                    r["snapshot_id"]
                    for r in conn.execute(
                        "SELECT c.snapshot_id FROM table_commit c JOIN managed_table m USING (table_id) "
                        "WHERE m.name = %s",
                        (str(T(t)),),
                    ).fetchall()
                ]
                claim = leases.claim_expiry(conn, T(t), candidates)
                removed[t].update(claim.removable)
    queue.put(("expiry", {t: sorted(s) for t, s in removed.items()}, 0))
