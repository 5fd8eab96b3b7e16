"""Skips without the jobs (DESIGN.md, "Cost per barrier follows the jobs with work"): the control
plane completes every job whose inputs did not change, set-wise, in the statement that issued the
barrier or moved a source; the jobs with work are the only ones that hear of it.

Each rule is shown holding, and broken on purpose where breaking it is possible from outside.
"""

from __future__ import annotations

import threading

import pytest

from icebarrier.control_plane import barriers, db, inputs, job_sessions, jobs, reads
from icebarrier.control_plane.jobs import Plan
from icebarrier.control_plane.notices import Listener, Notice, Wait
from tests.helpers import WEEK_S, T, anchor, job, new_barrier

# r1, r2: roots reading announced inputs in:1, in:2; m1 reads r1, m2 reads r2, j reads m1 and m2.
DAG = [
    job("r1", sinks=["r1"], external=["in:1"]),
    job("r2", sinks=["r2"], external=["in:2"]),
    job("m1", sources=["r1"], sinks=["m1"]),
    job("m2", sources=["r2"], sinks=["m2"]),
    job("j", sources=["m1", "m2"], sinks=["j"]),
]
TABLES = ["r1", "r2", "m1", "m2", "j"]


@pytest.fixture
def lake(conn):
    """The DAG, every job at barrier b0 with one commit per table, its inputs announced before b0."""
    barriers.set_interval_s(conn, WEEK_S)
    for d in DAG:
        jobs.register(conn, d)
    inputs.announce(conn, ["in:1", "in:2"])
    b0 = new_barrier(conn)
    for i, d in enumerate(DAG):
        jobs.complete(conn, d.name, b0, {next(iter(d.sinks)): 100 + i})
    return b0


def progress(conn) -> dict[str, int]:
    return {d.name: jobs.show(conn, d.name).progress for d in DAG}


def commits(conn) -> int:
    conn.execute("SELECT pg_stat_force_next_flush()")
    return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()[
        "xact_commit"
    ]


def drain(listener: Listener) -> list[Notice]:
    found, until = [], 1.0
    while batch := listener.wait(until):
        found += batch
        until = 0.2
    return found


def test_a_barrier_with_no_announcement_completes_every_job_in_its_own_transaction(conn, dsn, lake):
    """Nothing announced since b0: issuing b1 skips all five jobs in that one transaction, one row
    per table from b0; b1 is a valid cut with b0's snapshots; only the barrier is announced."""
    with Listener(dsn, None) as listener:
        before = commits(conn)
        b1 = new_barrier(conn)
        assert commits(conn) - before - 2 == 1  # less the two of measuring
        assert drain(listener) == [Notice("barrier", b1)]  # no job has work: nobody hears more
    assert progress(conn) == dict.fromkeys(progress(conn), b1)
    rows = conn.execute(
        "SELECT job_name, from_barrier, coalesced FROM table_completion WHERE barrier = %s ORDER BY 1", (b1,)
    ).fetchall()
    assert [(r["job_name"], r["from_barrier"], r["coalesced"]) for r in rows] == [
        (name, lake, False) for name in sorted(d.name for d in DAG)
    ]
    cut = reads.resolve(conn, [T(t) for t in TABLES], barrier=b1)
    assert cut.snapshots == {T(t): 100 + i for i, t in enumerate(TABLES)}
    assert jobs.next_barrier(conn, "r1").describe_wait().startswith("an announcement of input in:1")


def test_an_announcement_leaves_its_chain_to_run_and_the_rest_skips(conn, dsn, lake):
    """in:1 announced: at b1 r1 has work (and hears of it), r2 and m2 skip, m1 and j wait for r1.
    r1 then commits: m1 has work; j, which m2's skip already moved a source of, hears of it."""
    with Listener(dsn, None) as listener:
        inputs.announce(conn, ["in:1"])
        [heard] = drain(listener)
        assert (heard.kind, heard.table) == ("input", "in:1") and WEEK_S - 60 < heard.due_in_s <= WEEK_S
        b1 = new_barrier(conn)
        heard = drain(listener)
    assert progress(conn) == {"r1": lake, "r2": b1, "m1": lake, "m2": b1, "j": lake}
    # j reads m2 and waits: the notice names it, the reader behind the move
    assert heard == [Notice("barrier", b1), Notice("watermark", b1, str(T("m2")), {"j": lake})]
    plan = jobs.next_barrier(conn, "r1")
    assert (plan.plan, plan.barrier, plan.ready, plan.pending) == (Plan.EXACT, b1, True, True)
    jobs.complete(conn, "r1", b1, {T("r1"): 201})
    plan = jobs.next_barrier(conn, "m1")
    assert (plan.plan, plan.barrier, plan.ready) == (Plan.EXACT, b1, True)  # r1 changed: m1 computes
    jobs.complete(conn, "m1", b1)  # m1's output did not change: j skips with it, in that statement
    assert progress(conn)["j"] == b1
    # r1 ran b1: in:1 brought nothing since, so b2 skips it again
    b2 = new_barrier(conn)
    assert progress(conn) == dict.fromkeys(progress(conn), b2)


def test_a_move_wakes_the_readers_behind_it_not_those_skipped_with_it(conn, dsn, lake):
    """k reads m2 only, j reads m1 and m2. in:1 announced: at b1 the wave skips r2, m2 and k; m2's
    move is announced for j (behind it, waiting for m1), naming j alone. k's wait, planned before
    b1, does not wake for it (the wake it would have cost before: the same notice without its list
    wakes it); j's does once m1 comes too. The skipped reader's progress is b1 all the same."""
    jobs.register(conn, job("k", sources=["m2"], sinks=["k"]))
    jobs.complete(conn, "k", lake, {T("k"): 300})
    waits = {name: Wait.of(jobs.next_barrier(conn, name), root=False) for name in ("j", "k")}
    assert waits["k"].target is None and waits["k"].job == "k"
    with Listener(dsn, None) as listener:
        inputs.announce(conn, ["in:1"])
        b1 = new_barrier(conn)
        heard = [n for n in drain(listener) if n.kind == "watermark"]
    assert heard == [Notice("watermark", b1, str(T("m2")), {"j": lake})]
    assert jobs.show(conn, "k").progress == b1
    assert not any([waits["k"].wakes(n) for n in heard])
    assert not any([waits["j"].wakes(n) for n in heard])  # named, but m1 is not there yet
    assert Wait.of(jobs.next_barrier(conn, "r1"), root=True).job == "r1"
    stale = Wait(tables={str(T("m2")): lake}, job="k", progress=lake)
    assert stale.wakes(Notice("watermark", b1, str(T("m2"))))  # unnamed: every reader wakes
    with Listener(dsn, None) as listener:
        jobs.complete(conn, "r1", b1, {T("r1"): 201})
        jobs.complete(conn, "m1", b1, {T("m1"): 202})  # m1 changed: j has work
        heard = [n for n in drain(listener) if n.kind == "watermark"]
    assert any([waits["j"].wakes(n) for n in heard]), heard
    assert jobs.next_barrier(conn, "j").ready


def test_a_changed_source_is_never_skipped_past(conn, lake):
    """A data commit at b1 in m2 (its job not announced-only: it computes): j does not skip b1,
    whatever else moved; it skips nothing once the change is behind it either."""
    inputs.announce(conn, ["in:2"])
    b1 = new_barrier(conn)
    jobs.complete(conn, "r2", b1, {T("r2"): 300})
    jobs.complete(conn, "m2", b1, {T("m2"): 301})
    assert progress(conn) == {"r1": b1, "r2": b1, "m1": b1, "m2": b1, "j": lake}
    plan = jobs.next_barrier(conn, "j")
    assert (plan.plan, plan.barrier, plan.ready) == (Plan.EXACT, b1, True)
    jobs.complete(conn, "j", b1, {T("j"): 302})
    b2 = new_barrier(conn)
    assert progress(conn) == dict.fromkeys(progress(conn), b2)
    assert reads.resolve(conn, [T("j"), T("m2")], barrier=b2).snapshots == {T("j"): 302, T("m2"): 301}


def test_jobs_the_control_plane_must_leave_alone(conn, lake):
    """Not skipped by the control plane: a job whose last plan asked not to be skipped (it reads
    the barrier), a root job reading an input never announced, and a job with an open session
    (its run computes the barrier)."""
    jobs.next_barrier(conn, "m2", skip=False)  # m2 reads the barrier itself
    jobs.register(conn, job("plain", sinks=["plain"], external=["in:plain"]))  # never announced
    b1 = new_barrier(conn)
    jobs.complete(conn, "plain", b1, {T("plain"): 1})
    b2 = new_barrier(conn)
    assert progress(conn) == {"r1": b2, "r2": b2, "m1": b2, "m2": lake, "j": lake}
    plan = jobs.next_barrier(conn, "m2", skip=False)
    assert (plan.plan, plan.barrier, plan.ready) == (Plan.COALESCE, b2, True)  # computed, not skipped
    assert jobs.next_barrier(conn, "plain").ready  # its input may have anything: it runs every barrier
    step = jobs.advance(conn, "m2")  # asked to skip again: it skips b1..b2 itself, and j with it
    assert [c.barrier for c in step.skipped] == [b2] and progress(conn)["j"] == b2
    # j has work at b3 (r1 and m1 changed); its run's session holds b3 while b4 comes
    inputs.announce(conn, ["in:1"])
    b3 = new_barrier(conn)
    jobs.complete(conn, "r1", b3, {T("r1"): 7})
    jobs.complete(conn, "m1", b3, {T("m1"): 8})
    session = job_sessions.open_session(conn, "j", hold_s=60).session
    assert session is not None and session.barrier == b3
    b4 = new_barrier(conn)
    assert progress(conn) == {"r1": b4, "r2": b4, "m1": b4, "m2": b4, "j": b2}  # j: its session's


def test_a_skip_crosses_anchors_and_every_barrier_on_the_way_is_a_valid_cut(conn, lake):
    """Skips are exact, so they span anchors (only coalescing stops at one)."""
    marks = [new_barrier(conn), anchor(conn), new_barrier(conn)]
    assert progress(conn) == dict.fromkeys(progress(conn), marks[-1])
    for b in (lake, *marks):
        assert reads.resolve(conn, [T(t) for t in TABLES], barrier=b).snapshots == {
            T(t): 100 + i for i, t in enumerate(TABLES)
        }


def test_two_sources_moved_by_concurrent_transactions_wake_their_reader(conn, dsn, lake):
    """m1 and m2 complete b1 in two transactions at once, each not seeing the other's move: j, which
    reads both, still wakes. (Broken on purpose, by naming only the readers whose every source is
    past their progress as each transaction sees it: neither notice names j, and j waits for a
    barrier or its safety poll.)"""
    inputs.announce(conn, ["in:1", "in:2"])
    b1 = new_barrier(conn)
    for i, root in enumerate(("r1", "r2")):
        jobs.complete(conn, root, b1, {T(root): 400 + i})
    wait = Wait.of(jobs.next_barrier(conn, "j"), root=False)
    assert wait.target == b1
    with Listener(dsn, None) as listener, db.connect(dsn) as other:
        with other.transaction():
            jobs.complete(other, "m1", b1, {T("m1"): 500})  # not committed yet
            jobs.complete(conn, "m2", b1, {T("m2"): 501})  # commits, not seeing m1's move
        heard = [n for n in drain(listener) if n.kind == "watermark"]
    assert {n.table for n in heard} == {str(T("m1")), str(T("m2"))}
    assert any([wait.wakes(n) for n in heard]), heard
    assert jobs.next_barrier(conn, "j").ready


def test_an_announcement_during_the_issue_of_a_barrier_is_not_missed(conn, dsn, lake):
    """An announcement waits for a barrier being issued, and is dated after it: the barrier's skip
    either sees it or the next barrier runs the job. (Broken on purpose: dated before that barrier,
    the job would be skipped past its data for good.)"""
    with db.connect(dsn) as other:
        with other.transaction():
            issued = barriers.issue(other).barrier  # not committed: the barrier clock's row is held
            done = threading.Event()
            announcer = threading.Thread(target=lambda: (inputs.announce(conn, ["in:1"]), done.set()))
            announcer.start()
            assert not done.wait(0.5)  # waits for the issue
        announcer.join(10)
    assert done.is_set()
    assert progress(conn)["r1"] == issued  # skipped at the barrier issued before the data came
    b2 = new_barrier(conn)
    assert progress(conn)["r1"] == issued and jobs.next_barrier(conn, "r1").barrier == b2  # it runs b2
    announced_us = conn.execute("SELECT announced_us FROM external_input WHERE name = 'in:1'").fetchone()
    assert issued < announced_us["announced_us"] < b2


def test_a_forgotten_input_makes_its_jobs_run_every_barrier(conn, lake):
    """Forgetting an input: the root jobs reading it are planned and run at every barrier again."""
    assert inputs.forget(conn, ["in:2"]) == 1
    b1 = new_barrier(conn)
    assert progress(conn)["r2"] == lake and jobs.next_barrier(conn, "r2").ready
    assert progress(conn)["r1"] == b1
    assert [(i.name, i.jobs) for i in inputs.list_inputs(conn)] == [("in:1", ("r1",))]


def test_a_wait_skipped_past_its_plan_wakes_only_when_every_source_is_past_its_progress(conn, dsn, lake):
    """in:2 announced: at b1 j waits for m2 alone (m1 skipped to b1). r2 then completes b1 with
    nothing new: m2 and j skip with it, quietly. in:1 announced: at b2 m2 skips to b2, naming j,
    which now waits for m1. The notice says j is at b1 and m1 too: no wake (before 0033 it woke,
    its plan met, and planned for nothing; broken on purpose below by forgetting what the notice
    says of j). m1 then completes b2: j wakes, and has work."""
    inputs.announce(conn, ["in:2"])
    b1 = new_barrier(conn)
    step = jobs.advance(conn, "j")
    assert (step.plan.barrier, step.plan.waiting_for) == (b1, {str(T("m2")): lake})
    assert step.plan.marks == {str(T("m1")): b1, str(T("m2")): lake} and step.plan.sinks == (str(T("j")),)
    wait = Wait.of(step.plan, root=False)
    with Listener(dsn, None) as listener:
        jobs.complete(conn, "r2", b1)  # nothing new: m2 and j skip with it
        assert progress(conn)["j"] == b1
        inputs.announce(conn, ["in:1"])
        b2 = new_barrier(conn)
        heard = [n for n in drain(listener) if n.kind == "watermark"]
    assert Notice("watermark", b2, str(T("m2")), {"j": b1}) in heard
    assert not any([wait.wakes(n) for n in heard]), heard
    assert not jobs.advance(conn, "j").plan.ready  # no wake was missed
    forgetful = Wait.of(step.plan, root=False)
    assert any([forgetful.wakes(Notice(n.kind, n.barrier, n.table, None)) for n in heard])  # as before 0033
    with Listener(dsn, None) as listener:
        jobs.complete(conn, "r1", b2, {T("r1"): 210})
        jobs.complete(conn, "m1", b2, {T("m1"): 211})  # m1 changed: j has work
        heard = [n for n in drain(listener) if n.kind == "watermark"]
    assert any([wait.wakes(n) for n in heard]), heard
    assert jobs.advance(conn, "j").plan.ready
