"""Cuts at each level, leases, protected sets and the lease/expiry race."""

import pytest

from icebarrier.control_plane import jobs, leases, reads
from icebarrier.control_plane.errors import (
    BarrierNotIssuedError,
    BarrierNotValidError,
    LeaseExpiredError,
    LeaseNotFoundError,
    NoValidCutError,
    SnapshotExpiredError,
    TableNotFoundError,
)
from icebarrier.control_plane.model import Level
from tests.helpers import T, complete_all, job, new_barrier, register_chain
from tests.workers import expiry_worker, lease_worker

ALL = [T("orders"), T("payments"), T("revenue"), T("report")]


@pytest.fixture
def two_barriers(conn):
    """Barrier b1 complete everywhere; b2 completed by the root tables only."""
    register_chain(conn)
    b1 = new_barrier(conn)
    complete_all(conn, b1, snapshot_base=10)
    b2 = new_barrier(conn)
    jobs.complete(conn, "ingest_orders", b2, {T("orders"): 21})
    jobs.complete(conn, "ingest_payments", b2, {T("payments"): 22})
    return b1, b2


def test_read_committed_is_the_latest_valid_cut(conn, two_barriers):
    """Read-committed over all tables is at b1; over the root tables alone at b2."""
    b1, b2 = two_barriers
    cut = reads.resolve(conn, ALL)
    assert cut.barrier == b1
    assert {str(t): s for t, s in cut.snapshots.items()} == {
        "lake.db.orders": 11,
        "lake.db.payments": 12,
        "lake.db.revenue": 13,
        "lake.db.report": 14,
    }
    assert reads.resolve(conn, ALL[:2]).barrier == b2


def test_read_uncommitted_mixes_moments(conn, two_barriers):
    """Read-uncommitted takes each table's latest snapshot, with no barrier."""
    cut = reads.resolve(conn, ALL, level=Level.READ_UNCOMMITTED)
    assert cut.barrier is None
    assert [cut.snapshots[t] for t in ALL] == [21, 22, 13, 14]


def test_as_of_barrier(conn, two_barriers):
    """A past valid barrier resolves; an invalid or unissued one is a clear error."""
    b1, b2 = two_barriers
    assert reads.resolve(conn, ALL[:2], barrier=b1).snapshots[T("orders")] == 11
    with pytest.raises(BarrierNotValidError, match="lake.db.revenue has only completed up to"):
        reads.resolve(conn, ALL, barrier=b2)
    with pytest.raises(BarrierNotIssuedError):
        reads.resolve(conn, ALL, barrier=b2 + 1)
    with pytest.raises(TableNotFoundError, match="lake.db.nope"):
        reads.resolve(conn, [T("nope")])


def test_no_valid_cut_before_every_table_started(conn):
    """Tables that never completed a barrier have no cut yet, and the error says who to wait for."""
    register_chain(conn)
    with pytest.raises(NoValidCutError, match="completed no barrier yet"):
        reads.resolve(conn, ALL)
    jobs.complete(conn, "ingest_orders", new_barrier(conn), {T("orders"): 1})
    with pytest.raises(NoValidCutError, match="lake.db.payments, lake.db.revenue, lake.db.report completed no"):
        reads.resolve(conn, ALL)
    with pytest.raises(NoValidCutError):
        leases.acquire(conn, ALL, ttl_s=60, holder="x")


def test_lease_pins_a_cut_and_expires(conn, two_barriers):
    """A lease returns the cut, protects its snapshots, and stops protecting when expired."""
    b1, _ = two_barriers
    cut = leases.acquire(conn, ALL, ttl_s=60, holder="dash", barrier=b1)
    assert cut.barrier == b1 and cut.lease_id
    assert f"lease:{cut.lease_id}" in leases.protected(conn, T("orders"))[11].reasons
    conn.execute("UPDATE lease SET expires_at = now() - interval '1 s' WHERE lease_id = %s", (cut.lease_id,))
    assert all(f"lease:{cut.lease_id}" not in p.reasons for p in leases.protected(conn, T("orders")).values())
    with pytest.raises(LeaseExpiredError, match="expired"):
        leases.renew(conn, cut.lease_id, ttl_s=60)


def test_renew_release_and_list(conn, two_barriers):
    """Renew extends, release ends protection, list shows live leases only by default."""
    cut = leases.acquire(conn, ALL[:2], ttl_s=10, holder="h")
    renewed = leases.renew(conn, cut.lease_id, ttl_s=3600)
    assert renewed.expires_at > cut.expires_at
    assert [x.lease_id for x in leases.list_leases(conn)] == [cut.lease_id]
    assert leases.release(conn, cut.lease_id).state == "released"
    assert leases.list_leases(conn) == []
    assert leases.list_leases(conn, include_inactive=True)[0].state == "released"
    with pytest.raises(LeaseExpiredError, match="released"):
        leases.renew(conn, cut.lease_id, ttl_s=10)
    with pytest.raises(LeaseNotFoundError):
        leases.release(conn, "not-a-uuid")


def test_protected_set_reasons(conn, two_barriers):
    """Current, downstream job progress and the read-committed window are protected."""
    b1, b2 = two_barriers
    got = {s: p.reasons for s, p in leases.protected(conn, T("orders")).items()}
    # 21 is current; 11 = S(orders, b1) is pinned by agg's progress and is the read-committed floor.
    assert got == {21: ("current", "read-committed"), 11: ("job:agg", "read-committed")}


def test_expired_snapshot_cannot_be_leased(conn, two_barriers):
    """A lease on a snapshot already claimed by expiry is refused with a clear error."""
    b1, b2 = two_barriers
    # Move everything past b1 so 11 is no longer protected, then expire it.
    jobs.complete(conn, "agg", b2, {T("revenue"): 23})
    jobs.complete(conn, "report", b2, {T("report"): 24})
    complete_all(conn, new_barrier(conn), snapshot_base=30)
    claim = leases.claim_expiry(conn, T("orders"), [11, 21, 31])
    assert claim.removable == (11, 21)
    with pytest.raises(SnapshotExpiredError, match="snapshot 11 of lake.db.orders"):
        leases.acquire(conn, ALL, ttl_s=60, holder="late", barrier=b1)
    with pytest.raises(SnapshotExpiredError):
        reads.resolve(conn, ALL, barrier=b1)
    assert leases.list_leases(conn) == []


def test_lease_and_expiry_race_simultaneous(dsn, conn):
    """Lease acquisition racing expiry in separate processes never expires a leased snapshot.

    Leases are kept (not released), so any tombstone on a snapshot some lease pinned is a
    violation; leases that lost the race are refused because their snapshot was gone.
    """
    jobs.register(conn, job("ingest", sinks=["hot"]))
    for i in range(40):
        b = new_barrier(conn)
        jobs.complete(conn, "ingest", b, {T("hot"): 2000 + i})
    from tests.workers import CTX

    queue, start = CTX.Queue(), CTX.Event()
    procs = [
        CTX.Process(target=lease_worker, args=(queue, start, dsn, ["hot"], 80, 1)),
        CTX.Process(target=lease_worker, args=(queue, start, dsn, ["hot"], 80, 2)),
        CTX.Process(target=expiry_worker, args=(queue, start, dsn, ["hot"], 40)),
    ]
    for p in procs:
        p.start()
    start.set()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    granted = [g for kind, g_list, _ in results if kind == "lease" for g in g_list]
    refused = sum(r for kind, _, r in results if kind == "lease")
    tombstoned = {r["snapshot_id"] for r in conn.execute("SELECT snapshot_id FROM expired_snapshot").fetchall()}
    pinned = {s for _, snaps in granted for s in snaps.values()}
    expired_pinned = pinned & tombstoned
    print(
        f"race: {len(granted)} leases granted, {refused} refused (snapshot gone), "
        f"{len(tombstoned)} snapshots expired, {len(expired_pinned)} pinned snapshots expired"
    )
    assert not expired_pinned
    assert len(granted) + refused == 160
    assert conn.execute("SELECT count(*) AS n FROM lease").fetchone()["n"] == len(granted)


def test_a_started_job_holds_the_window_floor_at_its_first_barrier(conn):
    """Found by `icebarrier check`: a job that recorded its first barrier but has not completed
    it yet keeps what it will read next; without that, expiry took the snapshot after B0."""
    from icebarrier.control_plane import runs

    jobs.register(conn, job("ingest", sinks=["src"]))
    jobs.register(conn, job("late", sources=["src"], sinks=["derived"]))
    marks = [new_barrier(conn) for _ in range(3)]
    for i, b in enumerate(marks):
        jobs.complete(conn, "ingest", b, {T("src"): 100 + i})
    assert leases.claim_expiry(conn, T("src"), [100, 101], dry_run=True).removable == (100, 101)
    runs.record_range(conn, "late", marks[0], {"bootstrap": True})
    claim = leases.claim_expiry(conn, T("src"), [100, 101])
    assert claim.removable == () and "job:late" in claim.protected[100].reasons
    assert jobs.next_barrier(conn, "late").barrier == marks[0]


def test_bootstrap_is_refused_when_a_later_snapshot_is_already_gone(conn):
    """Starting a job at B pins B and checks the snapshots it will read after B still exist."""
    jobs.register(conn, job("ingest", sinks=["src"]))
    jobs.register(conn, job("late", sources=["src"], sinks=["derived"]))
    marks = [new_barrier(conn) for _ in range(3)]
    for i, b in enumerate(marks):
        jobs.complete(conn, "ingest", b, {T("src"): 100 + i})
    leases.claim_expiry(conn, T("src"), [101])
    with pytest.raises(SnapshotExpiredError, match="snapshot 101"):
        leases.acquire(conn, [T("src")], ttl_s=60, holder="b", barrier=marks[0], bootstrap_job="late")
    assert jobs.next_barrier(conn, "late").barrier == marks[2]  # nothing was recorded: start newer
    cut = leases.acquire(conn, [T("src")], ttl_s=60, holder="b", barrier=marks[2], bootstrap_job="late")
    assert cut.barrier == marks[2]


def test_a_first_runs_session_protects_what_it_reads_while_it_lives(conn):
    """Issue 27: a bootstrapping job's session reads its sources at S(T, B); expiry must keep
    those snapshots while the session lives (the pipeline moving on no longer frees them)."""
    from icebarrier.control_plane import job_sessions

    jobs.register(conn, job("ingest", sinks=["src"]))
    jobs.register(conn, job("late", sources=["src"], sinks=["derived"]))
    b0 = new_barrier(conn)
    jobs.complete(conn, "ingest", b0, {T("src"): 100})
    opened = job_sessions.open_session(conn, "late")
    assert opened.session.barrier == b0 and opened.session.from_barrier is None  # a first run
    for i, b in enumerate([new_barrier(conn), new_barrier(conn)], start=1):
        jobs.complete(conn, "ingest", b, {T("src"): 100 + i})
    claim = leases.claim_expiry(conn, T("src"), [100, 101], dry_run=True)
    assert claim.removable == () and "job:late" in claim.protected[100].reasons
    with conn.transaction():
        job_sessions.close(conn, "late")  # the session ends (here: dropped): nothing reads S(src, b0) now
    assert leases.claim_expiry(conn, T("src"), [100, 101], dry_run=True).removable == (100, 101)


def test_expiry_racing_bootstrapping_sessions_never_removes_what_they_read(dsn, conn):
    """A writer moving its table on and an expirer claiming every snapshot it may, in threads of
    their own, while a first run opens its session again and again: no snapshot a session reads
    is ever tombstoned while it lives."""
    import threading

    from icebarrier.control_plane import db, job_sessions

    jobs.register(conn, job("ingest", sinks=["src"]))
    jobs.register(conn, job("late", sources=["src"], sinks=["derived"]))
    jobs.complete(conn, "ingest", new_barrier(conn), {T("src"): 1000})
    stop, failures = threading.Event(), []

    def writing():
        with db.connect(dsn) as c:
            for i in range(1, 10_000):
                if stop.is_set():
                    return
                jobs.complete(c, "ingest", new_barrier(c), {T("src"): 1000 + i})

    def expiring():
        with db.connect(dsn) as c:
            while not stop.is_set():
                candidates = [
                    r["snapshot_id"]
                    for r in c.execute(
                        "SELECT snapshot_id FROM table_commit WHERE snapshot_id NOT IN "
                        "(SELECT snapshot_id FROM expired_snapshot)"
                    ).fetchall()
                ]
                try:
                    leases.claim_expiry(c, T("src"), candidates)
                except Exception as exc:  # noqa: BLE001 - reported below
                    failures.append(exc)
                    return

    threads = [threading.Thread(target=f) for f in (writing, expiring)]
    for t in threads:
        t.start()
    try:
        with db.connect(dsn) as c:
            for _ in range(60):
                session = job_sessions.open_session(c, "late").session
                read = reads.resolve(c, [T("src")], barrier=session.barrier).snapshots[T("src")]
                for _ in range(3):
                    gone = c.execute("SELECT 1 FROM expired_snapshot WHERE snapshot_id = %s", (read,)).fetchone()
                    assert gone is None, f"snapshot {read}, read by late's session at {session.barrier}, was expired"
                with c.transaction():
                    job_sessions.close(c, "late")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures
    assert conn.execute("SELECT count(*) AS n FROM expired_snapshot").fetchone()["n"] > 0  # expiry did run
