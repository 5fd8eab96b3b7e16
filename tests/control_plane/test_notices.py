"""Push, not poll: the control plane's notices, a job's wait, and one-transaction looks."""

from __future__ import annotations

import pytest

from icebarrier.control_plane import barriers, db, jobs
from icebarrier.control_plane.jobs import NextBarrier
from icebarrier.control_plane.notices import CLOCK_GRACE_S, RESYNC, SAFETY_POLL_S, Listener, Notice, Wait
from tests.helpers import WEEK_S, T, complete_all, new_barrier, register_chain


def drain(listener: Listener, until: float = 2.0) -> list[Notice]:
    """Every notice that arrives within ``until`` seconds of quiet."""
    found = []
    while batch := listener.wait(until):
        found += batch
        until = 0.2
    return found


def test_notices_announce_barriers_watermarks_and_registrations(conn, dsn):
    """Issuing a barrier, completing it and registering a job each raise their notice, after commit."""
    register_chain(conn)
    with Listener(dsn, None) as listener:
        b = new_barrier(conn)
        jobs.complete(conn, "ingest_orders", b, {T("orders"): 1})
        agg = {"agg": None}  # the reader behind the move, which has completed nothing
        assert drain(listener) == [Notice("barrier", b), Notice("watermark", b, str(T("orders")), agg)]
        with conn.transaction():
            jobs.complete(conn, "ingest_payments", b, {T("payments"): 2})
            assert listener.wait(0.3) == []  # not before the transaction commits
        assert drain(listener) == [Notice("watermark", b, str(T("payments")), agg)]
        jobs.unregister(conn, "report")
        assert Notice("jobs") in drain(listener)


def test_a_listener_whose_connection_died_reconnects_and_says_it_missed_notices(conn, dsn):
    """A terminated listening backend: the next wait reconnects and reports RESYNC, then hears again."""
    with Listener(dsn, None) as listener:
        pid = listener.conn.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert RESYNC in listener.wait(2.0) + listener.wait(2.0)
        b = new_barrier(conn)
        assert Notice("barrier", b) in drain(listener)


def _plan(barrier, waiting, *, progress=10, root=False, announced=(), pending=False, marks=None):
    return NextBarrier(
        job="j",
        barrier=barrier,
        ready=False,
        waiting_for=waiting,
        from_barrier=progress,
        root=root,
        announced=announced,
        pending=pending,
        marks=marks or {},
        sinks=("own",),  # the job's own table
    )


WAITS_FOR_A = _plan(20, {"a": 10}, marks={"a": 10, "b": 20})  # planned at 10 for 20: b is there, a is not


@pytest.mark.parametrize(
    "plan, notices, wakes",
    [
        # a root job wakes on any barrier, and on nothing else
        (_plan(None, {}, root=True), [Notice("barrier", 30)], True),
        (_plan(None, {}, root=True), [Notice("watermark", 30, "lake.db.x")], False),
        # one whose inputs are announced, none since its progress: on an announcement of one of them only
        (_plan(None, {}, root=True, announced=("in:a", "in:b")), [Notice("barrier", 30)], False),
        (_plan(None, {}, root=True, announced=("in:a", "in:b")), [Notice("input", table="in:c")], False),
        (_plan(None, {}, root=True, announced=("in:a", "in:b")), [Notice("input", table="in:b")], True),
        # ... which says when the clock's next barrier is due (0033): it waits for that barrier
        (_plan(None, {}, root=True, announced=("in:a",)), [Notice("input", table="in:a", due_in_s=0.5)], False),
        (
            _plan(None, {}, root=True, announced=("in:a",)),
            [Notice("input", None, "in:a", None, 0.5), Notice("barrier", 30)],
            True,
        ),
        # one announced since: as any root job
        (_plan(None, {}, root=True, announced=("in:a",), pending=True), [Notice("barrier", 30)], True),
        # an intermediate job does not wake on barriers, only when every source it waits for is there
        (_plan(20, {"a": 10, "b": 10}), [Notice("barrier", 30)], False),
        (_plan(20, {"a": 10, "b": 10}), [Notice("watermark", 20, "a")], False),
        (_plan(20, {"a": 10, "b": 10}), [Notice("watermark", 20, "a"), Notice("watermark", 25, "b")], True),
        (_plan(20, {"a": 10}), [Notice("watermark", 20, "unrelated")], False),
        # no barrier planned yet: every source past the job's progress (10)
        (_plan(None, {"a": 10, "b": 10}), [Notice("watermark", 11, "b")], False),
        (_plan(None, {"a": 10, "b": 10}), [Notice("watermark", 11, "b"), Notice("watermark", 12, "a")], True),
        (_plan(None, {"a": 10, "b": 10}, progress=None), [Notice("watermark", 11, "b")], True),  # bootstrapping
        # a move that names the readers behind it: not this job (the move's wave skipped it), or it
        (_plan(None, {"a": 10}), [Notice("watermark", 11, "a", {"other": 10})], False),
        (_plan(None, {"a": 10}), [Notice("watermark", 11, "a", {"other": 10, "j": 10})], True),
        (_plan(20, {"a": 10}), [Notice("watermark", 20, "a", {"other": 10})], False),
        (_plan(20, {"a": 10}), [Notice("watermark", None, "a", {"other": 10})], True),  # a rewind
        # named with its progress: skipped past its plan (to 25), it needs every source past 25
        (WAITS_FOR_A, [Notice("watermark", 20, "a", {"j": 10})], True),  # its plan stands
        (WAITS_FOR_A, [Notice("watermark", 30, "a", {"j": 25})], False),  # b is at 20 (known)
        (WAITS_FOR_A, [Notice("watermark", 30, "a", {"j": 25}), Notice("watermark", 30, "b", {"j": 25})], True),
        (WAITS_FOR_A, [Notice("watermark", 30, "a", {"j": None})], True),  # its progress not said: the plan's
        # its own sink moved on by a wave: the same, from the sink's mark
        (WAITS_FOR_A, [Notice("watermark", 25, "own"), Notice("watermark", 30, "a", {"j": 10})], False),
        (
            WAITS_FOR_A,
            [Notice("watermark", 25, "own"), Notice("watermark", 26, "b"), Notice("watermark", 26, "a")],
            True,
        ),
        # a rewind (revision) of a source, or of its own sink away from its progress
        (_plan(20, {"a": 10}), [Notice("watermark", None, "a")], True),
        (_plan(20, {"a": 10}), [Notice("watermark", 10, "own")], False),
        (_plan(20, {"a": 10}), [Notice("watermark", 5, "own")], True),
        (_plan(20, {"a": 10}), [Notice("watermark", None, "own")], True),
        # registrations changed, or notices were missed: look again
        (_plan(20, {"a": 10}), [Notice("jobs")], True),
        (_plan(20, {"a": 10}), [RESYNC], True),
    ],
)
def test_a_wait_wakes_only_when_planning_again_can_find_work(plan, notices, wakes):
    """Which notices make planning again worth a transaction."""
    wait = Wait.of(plan, root=plan.root)
    assert any([wait.wakes(n) for n in notices]) is wakes


@pytest.mark.parametrize(
    "payload, notice",
    [
        ("watermark 12 lake.db.x", Notice("watermark", 12, "lake.db.x")),
        ("watermark - lake.db.x", Notice("watermark", None, "lake.db.x")),
        (
            "watermark 12 lake.`my db`.a b/j@11,k.v-1@-",
            Notice("watermark", 12, "lake.`my db`.a b", {"j": 11, "k.v-1": None}),
        ),
        ("watermark 12 lake.db.x/j,k", Notice("watermark", 12, "lake.db.x", {"j": None, "k": None})),  # 0032's
        ("barrier 7", Notice("barrier", 7)),
        ("input in:a/b", Notice("input", table="in:a/b")),
        ("input in:a/b 0.25", Notice("input", table="in:a/b", due_in_s=0.25)),
        ("input in:a/b -", Notice("input", table="in:a/b")),
    ],
)
def test_a_notice_is_read_from_its_payload(payload, notice):
    assert Notice.parse(payload) == notice


def test_a_wait_is_due_at_the_clocks_next_barrier_or_the_safety_poll():
    """A root job's wait ends when its next barrier is due; any wait by the safety poll."""
    assert 1.0 < Wait.of(_plan(None, {}, root=True), root=True, due_in_s=1.0).remaining_s() <= 1.0 + CLOCK_GRACE_S
    assert (
        SAFETY_POLL_S - 1 < Wait.of(_plan(None, {}, root=True), root=True, due_in_s=500).remaining_s() <= SAFETY_POLL_S
    )
    # overdue, yet not issued to it: another is issuing it, whose notice wakes it; it looks again soon
    assert 0 < Wait.of(_plan(None, {}, root=True), root=True, due_in_s=-3).remaining_s() <= CLOCK_GRACE_S


def test_an_announcement_makes_a_root_job_due_at_the_clocks_next_barrier():
    """Waiting for an announcement, a root job is due at no clock; one that says the next barrier
    is due in 2 s makes it due then (a little after: the barrier's issuer has the time to tell it)."""
    wait = Wait.of(_plan(None, {}, root=True, announced=("in:a",)), root=True, due_in_s=None)
    assert wait.remaining_s() > SAFETY_POLL_S - 1
    assert not wait.wakes(Notice("input", table="in:a", due_in_s=2.0))
    assert 2.0 < wait.remaining_s() <= 2.0 + CLOCK_GRACE_S


def test_a_job_whose_sources_did_not_change_skips_in_one_transaction(conn, dsn):
    """advance() completes the skip and plans again in one transaction: the job then waits.
    (The control plane skips such a job itself as its sources move; it leaves a job whose sink
    another transaction holds to that transaction, or to the job's own look, as here.)"""
    register_chain(conn)
    barriers.set_interval_s(conn, WEEK_S)
    b1 = new_barrier(conn)
    complete_all(conn, b1)
    b2 = new_barrier(conn)
    with db.connect(dsn) as other, other.transaction():
        other.execute("SELECT 1 FROM managed_table WHERE name = %s FOR UPDATE", (str(T("revenue")),))
        for root in ("ingest_orders", "ingest_payments"):
            jobs.complete(conn, root, b2)  # the roots commit nothing at b2; the skipper does not wait
    assert jobs.show(conn, "agg").progress == b1
    before = _commits(conn)
    step = jobs.advance(conn, "agg", record_wait=True, heartbeat=True)
    assert _commits(conn) - before - 2 == 1  # less the two of measuring
    assert [c.barrier for c in step.skipped] == [b2] and not step.plan.ready and step.plan.barrier is None
    assert jobs.show(conn, "agg").progress == b2 and jobs.show(conn, "agg").waiting_for is None  # not running
    assert step.due_in_s is None  # only a root job waits for the clock


def test_a_root_job_with_nothing_to_take_learns_when_the_next_barrier_is_due(conn):
    """A root job that completed the newest barrier: not ready, due within the interval."""
    register_chain(conn)
    barriers.set_interval_s(conn, 60)
    b = new_barrier(conn)
    jobs.complete(conn, "ingest_orders", b, {T("orders"): 1})
    step = jobs.advance(conn, "ingest_orders")
    assert not step.plan.ready and step.plan.root and 55 < step.due_in_s <= 60


def _commits(conn) -> int:
    """Transactions committed in the test's database (its own: nobody else uses it), counted
    after a flush of this backend's statistics; the count includes this call's first
    transaction, the next call's counts this one's second."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()[
        "xact_commit"
    ]
