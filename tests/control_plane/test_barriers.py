"""The barrier sequence: database clock, strictly increasing, one per interval."""

import concurrent.futures
import time

from icebarrier.control_plane import barriers, db
from icebarrier.control_plane.model import barrier_time
from tests.workers import issue_worker, run_all


def test_barriers_come_from_the_database_clock(conn):
    """A barrier is microseconds since the epoch on the server's clock."""
    b = barriers.issue(conn)
    server_now = conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
    assert abs((server_now - barrier_time(b.barrier)).total_seconds()) < 5
    assert b.issued_by == "operator"


def test_barriers_strictly_increase_even_if_the_clock_steps_back(conn):
    """A clock behind the last barrier still yields last + 1."""
    ahead = int((time.time() + 3600) * 1_000_000)
    conn.execute("UPDATE barrier_clock SET last_barrier = %s", (ahead,))
    assert barriers.issue(conn).barrier == ahead + 1
    assert barriers.issue(conn).barrier == ahead + 2


def test_concurrent_issuers_never_collide(dsn):
    """Processes issuing at once get distinct, strictly increasing barriers."""
    results = run_all(issue_worker, [(dsn, 50, False)] * 3)
    issued = [b for r in results for b in r]
    assert len(issued) == 150 == len(set(issued))
    for r in results:
        assert r == sorted(r)


def test_issue_if_due_gives_one_barrier_per_interval(dsn, conn):
    """Many processes asking within one interval produce a single new barrier."""
    barriers.set_interval_s(conn, 3600)
    barriers.issue(conn)
    results = run_all(issue_worker, [(dsn, 10, True)] * 3)
    assert [b for r in results for b in r] == []
    conn.execute("UPDATE barrier_clock SET last_barrier = last_barrier - 3601000000")
    results = run_all(issue_worker, [(dsn, 10, True)] * 3)
    assert len([b for r in results for b in r]) == 1


def test_list_is_newest_first(conn):
    """barrier list shows the newest barriers first, limited."""
    issued = [barriers.issue(conn).barrier for _ in range(5)]
    assert [b.barrier for b in barriers.list_barriers(conn, limit=3)] == issued[::-1][:3]


def test_the_schedule_does_not_issue_a_second_barrier_behind_a_jobs(dsn, conn):
    """A job issues the clock's barrier and has not committed yet (its skip wave runs in that
    transaction); the schedule, which read "due" before, waits for it and then issues nothing.
    An unconditional issue in its place would add a second barrier right behind (the bug)."""
    barriers.set_interval_s(conn, 1)
    barriers.issue(conn)
    time.sleep(1.1)
    assert barriers.next_due_in_s(conn) <= 0
    before = barriers.newest(conn).barrier
    with db.connect(dsn) as job, db.connect(dsn) as schedule:
        with job.transaction():
            assert barriers.issue_if_due(job, job="w") is not None
            answer = concurrent.futures.ThreadPoolExecutor(1).submit(barriers.issue_when_due, schedule)
            time.sleep(0.5)
            assert not answer.done(), "the schedule waits for the clock's lock"
        assert answer.result(timeout=10) is None
    assert len([b for b in barriers.list_barriers(conn) if b.barrier > before]) == 1
