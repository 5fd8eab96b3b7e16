"""Cost follows change (DESIGN.md): skipped runs, coalesced ranges and anchors, against a real Postgres.

Anchors are made by hand: tests run with a week's anchor interval (only a test's first barrier is an
anchor) except where :func:`anchor` issues one with a 1 ms interval.
"""

import pytest

from icebarrier.control_plane import barriers, jobs, reads, revisions, tables
from icebarrier.control_plane.errors import (
    BarrierNotValidError,
    BarrierOutOfOrderError,
    CoalesceAcrossAnchorError,
    SourcesNotReadyError,
)
from icebarrier.control_plane.jobs import Plan
from tests.helpers import WEEK_S, T, anchor, job, new_barrier


@pytest.fixture
def chain(conn):
    """ingest -> a (root); derive reads a -> b; report reads b -> c. Every job completes b0."""
    jobs.register(conn, job("ingest", sinks=["a"]))
    jobs.register(conn, job("derive", sources=["a"], sinks=["b"]))
    jobs.register(conn, job("report", sources=["b"], sinks=["c"]))
    b0 = new_barrier(conn)
    for name, sink, snapshot in (("ingest", "a", 10), ("derive", "b", 20), ("report", "c", 30)):
        jobs.complete(conn, name, b0, {T(sink): snapshot})
    return b0


def test_anchors_are_flagged_when_issued(conn):
    """The first barrier at or after a multiple of the anchor interval is an anchor, the others not."""
    first, second = barriers.issue(conn), barriers.issue(conn)
    assert first.anchor and not second.anchor  # the first barrier ever starts a window
    a = anchor(conn)
    assert [b.anchor for b in barriers.list_barriers(conn, limit=3)] == [True, False, True]
    assert barriers.newest(conn).barrier == a
    assert barriers.get_anchor_interval_s(conn) == WEEK_S


def test_unchanged_sources_skip_in_one_statement(conn, chain):
    """With no source change since its progress, a job skips to its sources' watermark in one
    row, completed by the control plane in the statement that moved its source (down the DAG):
    its plan is then the next barrier. Every skipped barrier is a valid cut with the snapshot of
    before, and the row says where the skip came from."""
    marks = [new_barrier(conn) for _ in range(5)]
    plan = jobs.next_barrier(conn, "ingest")
    assert (plan.plan, plan.barrier) == (Plan.COALESCE, marks[-1])  # a root job: the newest barrier
    jobs.complete(conn, "ingest", marks[-1])  # no input: nothing committed, a skip
    for name in ("derive", "report"):
        plan = jobs.next_barrier(conn, name)
        assert (plan.from_barrier, plan.barrier, plan.ready) == (marks[-1], None, False)
    rows = conn.execute(
        "SELECT m.name, c.barrier, c.from_barrier, c.job_name FROM table_completion c JOIN managed_table m "
        "USING (table_id) WHERE m.name IN ('lake.db.b', 'lake.db.c') ORDER BY 1, 2"
    ).fetchall()
    assert [(r["name"], r["barrier"], r["from_barrier"], r["job_name"]) for r in rows] == [
        ("lake.db.b", chain, None, "derive"),
        ("lake.db.b", marks[-1], chain, "derive"),  # one row for the skipped run
        ("lake.db.c", chain, None, "report"),
        ("lake.db.c", marks[-1], chain, "report"),
    ]
    for b in marks:
        cut = reads.resolve(conn, [T("a"), T("b"), T("c")], barrier=b)
        assert cut.snapshots == {T("a"): 10, T("b"): 20, T("c"): 30}


def test_changes_coalesce_up_to_the_newest_barrier(conn, chain):
    """A job behind with changes computes once at the newest barrier its sources completed; the
    barriers between are coalesced in its sink: a cut there is refused, naming the table, the
    barrier it went into and the nearest valid cuts; downstream must coalesce them too."""
    marks = [new_barrier(conn) for _ in range(4)]
    for i, b in enumerate(marks):
        jobs.complete(conn, "ingest", b, {T("a"): 11 + i})  # a change at every barrier
    plan = jobs.next_barrier(conn, "derive")
    assert (plan.plan, plan.barrier, plan.from_barrier, plan.anchors_in_range) == (Plan.COALESCE, marks[-1], chain, 0)
    result = jobs.complete(conn, "derive", marks[-1], {T("b"): 21}, coalesce=True)
    assert not result.noop
    state = tables.states(conn, [T("b")])[0]
    assert state.coalesced == ((chain, marks[-1]),)
    assert not state.has_completed(marks[1]) and state.has_completed(marks[-1])

    with pytest.raises(BarrierNotValidError) as info:
        reads.resolve(conn, [T("a"), T("b")], barrier=marks[1])
    assert info.value.nearest == (chain, marks[-1])
    assert f"lake.db.b coalesced it into barrier {marks[-1]}" in str(info.value)
    assert f"nearest valid cuts are {chain} (before) and {marks[-1]} (after)" in str(info.value)
    assert reads.resolve(conn, [T("a")], barrier=marks[1]).snapshots == {T("a"): 12}  # a itself is exact

    with pytest.raises(SourcesNotReadyError, match=f"lake.db.b \\(coalesced it into {marks[-1]}\\)"):
        jobs.complete(conn, "report", marks[1], {T("c"): 31})
    plan = jobs.next_barrier(conn, "report")
    assert (plan.plan, plan.barrier) == (Plan.COALESCE, marks[-1])


def test_skip_over_a_change_is_refused(conn, chain):
    """Completing past a source change without coalescing is refused, naming the barrier to do next."""
    b1, b2, b3 = new_barrier(conn), new_barrier(conn), new_barrier(conn)
    jobs.complete(conn, "ingest", b3, {T("a"): 11}, coalesce=True)  # a changed at b3, coalescing b1, b2
    with pytest.raises(SourcesNotReadyError):  # b1 is coalesced in a
        jobs.complete(conn, "derive", b1)
    jobs.register(conn, job("side", sinks=["s"]))
    jobs.complete(conn, "side", b1, {T("s"): 40})
    jobs.register(conn, job("mirror", sources=["s"], sinks=["m"]))
    jobs.complete(conn, "mirror", b1, {T("m"): 50})
    jobs.complete(conn, "side", b2, {T("s"): 41})
    jobs.complete(conn, "side", b3)
    with pytest.raises(BarrierOutOfOrderError, match=f"must complete barrier {b2} next") as info:
        jobs.complete(conn, "mirror", b3)
    assert info.value.changed == "sources"
    assert jobs.next_barrier(conn, "mirror").plan is Plan.COALESCE


def test_anchors_bound_coalescing(conn, chain):
    """A coalesced range stops at the first anchor after the job's progress; coalescing across
    one is refused; every table completes every anchor, so a cut there is valid."""
    before = [new_barrier(conn) for _ in range(3)]
    a = anchor(conn)
    after = [new_barrier(conn) for _ in range(3)]
    with pytest.raises(CoalesceAcrossAnchorError, match=f"anchor {a} lies between"):
        jobs.complete(conn, "ingest", after[-1], {T("a"): 11}, coalesce=True)
    plan = jobs.next_barrier(conn, "ingest")
    assert (plan.plan, plan.barrier, plan.anchors_in_range) == (Plan.COALESCE, a, 1)
    jobs.complete(conn, "ingest", a, {T("a"): 11}, coalesce=True)
    jobs.complete(conn, "ingest", after[-1], {T("a"): 12}, coalesce=True)
    plan = jobs.next_barrier(conn, "derive")
    assert (plan.plan, plan.barrier) == (Plan.COALESCE, a)  # not past the anchor
    jobs.complete(conn, "derive", a, {T("b"): 21}, coalesce=True)
    jobs.complete(conn, "derive", after[-1], {T("b"): 22}, coalesce=True)
    assert reads.resolve(conn, [T("a"), T("b")], barrier=a).snapshots == {T("a"): 11, T("b"): 21}
    for b in (*before, *after[:-1]):
        with pytest.raises(BarrierNotValidError):
            reads.resolve(conn, [T("b")], barrier=b)


def test_read_committed_falls_back_below_a_coalesced_watermark(conn, chain):
    """The read-committed cut is the newest valid barrier: below the lowest watermark when
    another table coalesced it; the catalog's latest_cut and the view agree."""
    b1, b2, b3 = new_barrier(conn), new_barrier(conn), new_barrier(conn)
    jobs.complete(conn, "ingest", b1, {T("a"): 11})
    jobs.complete(conn, "derive", b1, {T("b"): 21})
    jobs.complete(conn, "ingest", b2, {T("a"): 12})
    jobs.complete(conn, "ingest", b3, {T("a"): 13})
    jobs.complete(conn, "derive", b3, {T("b"): 23}, coalesce=True)  # b2 coalesced in b
    jobs.complete(conn, "report", b1, {T("c"): 31})
    jobs.complete(conn, "report", b3, {T("c"): 33}, coalesce=True)
    jobs.register(conn, job("slow", sinks=["d"]))
    jobs.complete(conn, "slow", chain, {T("d"): 40})
    for b in (b1, b2):
        jobs.complete(conn, "slow", b)
    cut = reads.resolve(conn, [T("b"), T("d")])  # lowest watermark b2, coalesced in b
    assert (cut.barrier, cut.snapshots) == (b1, {T("b"): 21, T("d"): 40})
    assert conn.execute("SELECT barrier FROM consistent_barrier").fetchone()["barrier"] == b1
    assert conn.execute("SELECT latest_cut(NULL) AS b").fetchone()["b"] == b1


def test_views_show_coalesced_ranges(conn, chain):
    """table_versions shows a table's newest coalesced range; barrier_delay each completion's range."""
    new_barrier(conn)
    b2 = new_barrier(conn)
    jobs.complete(conn, "ingest", b2, {T("a"): 11}, coalesce=True)
    row = conn.execute(
        "SELECT coalesced_after, coalesced_into, current_snapshot_id FROM table_versions WHERE table_name = 'lake.db.a'"
    ).fetchone()
    assert (row["coalesced_after"], row["coalesced_into"], row["current_snapshot_id"]) == (chain, b2, 11)
    rows = conn.execute(
        "SELECT barrier, from_barrier, coalesced FROM barrier_delay WHERE table_name = 'lake.db.a' ORDER BY barrier"
    ).fetchall()
    assert [(r["barrier"], r["from_barrier"], r["coalesced"]) for r in rows] == [
        (chain, None, False),
        (b2, chain, True),
    ]
    assert conn.execute("SELECT after_barrier, into_barrier FROM coalesced_ranges").fetchall() == [
        {"after_barrier": chain, "into_barrier": b2}
    ]


def test_revision_rewinds_coalesced_history(conn, chain):
    """Revising a root to a barrier drops the coalesced ranges after it downstream, which rewind
    to the last barrier they completed at or before it."""
    b1, b2, b3 = new_barrier(conn), new_barrier(conn), new_barrier(conn)
    jobs.complete(conn, "ingest", b1, {T("a"): 11})
    jobs.complete(conn, "ingest", b2, {T("a"): 12})
    jobs.complete(conn, "ingest", b3, {T("a"): 13})
    jobs.complete(conn, "derive", b3, {T("b"): 23}, coalesce=True)
    plan = revisions.begin(conn, T("a"), b2)
    by_table = {t.table: t for t in plan.tables}
    assert by_table[T("b")].to_watermark == chain  # b2 is coalesced in b: back to b0
    revisions.finish(conn, plan.revision_id)
    state = tables.states(conn, [T("b")])[0]
    assert (state.watermark, state.coalesced) == (chain, ())
    assert reads.resolve(conn, [T("b")]).snapshots == {T("b"): 20}
    assert jobs.next_barrier(conn, "derive").barrier is not None


def test_a_root_plans_only_up_to_its_input_watermark(conn, chain):
    """An event-time root's input is ready up to its watermark: the plan stops there, and is not
    ready while the watermark has not passed the next barrier."""
    b1, b2, b3 = new_barrier(conn), new_barrier(conn), new_barrier(conn)
    plan = jobs.next_barrier(conn, "ingest", up_to=b2 + 1)
    assert (plan.plan, plan.barrier, plan.ready) == (Plan.COALESCE, b2, True)
    plan = jobs.next_barrier(conn, "ingest", up_to=b1 - 1)
    assert (plan.barrier, plan.ready) == (b1, False)
    assert jobs.next_barrier(conn, "ingest").barrier == b3


def test_completion_says_whether_the_database_recorded_a_coalesced_completion(conn):
    """`--coalesce` over an empty range records an exact completion and says so; over skipped
    barriers it coalesces and says so; a repeat reports what was recorded the first time."""
    from icebarrier.control_plane import barriers, jobs
    from tests.helpers import T, job

    jobs.register(conn, job("src", sinks=["src_out"], external=["ext:src"]))
    b1 = barriers.issue(conn).barrier
    assert not jobs.complete(conn, "src", b1, {T("src_out"): 1}, coalesce=True).coalesced  # first: nothing to fold
    b2 = barriers.issue(conn).barrier
    exact = jobs.complete(conn, "src", b2, {T("src_out"): 2}, coalesce=True)
    assert not exact.coalesced and not exact.noop  # the next barrier: an empty range, recorded exact
    barriers.issue(conn)
    b4 = barriers.issue(conn).barrier
    folded = jobs.complete(conn, "src", b4, {T("src_out"): 4}, coalesce=True)
    assert folded.coalesced and folded.to_json()["coalesced"] is True
    again = jobs.complete(conn, "src", b4, {T("src_out"): 4})
    assert again.noop and again.coalesced
    assert not jobs.complete(conn, "src", b2, {T("src_out"): 2}, coalesce=True).coalesced
    recorded = conn.execute("SELECT barrier, coalesced FROM table_completion ORDER BY barrier").fetchall()
    assert [(r["barrier"], r["coalesced"]) for r in recorded] == [(b1, False), (b2, False), (b4, True)]
