"""Registration, next barrier and completion against a real Postgres."""

import pytest

from icebarrier.control_plane import barriers, jobs, tables
from icebarrier.control_plane.errors import (
    BarrierNotIssuedError,
    BarrierOutOfOrderError,
    CompletionConflictError,
    JobDefinitionChangedError,
    JobNotFoundError,
    NotASinkError,
    SinkAlreadyOwnedError,
    SinkHistoryMismatchError,
    SourcesNotReadyError,
    TopologyCycleError,
)
from tests.helpers import T, complete_all, job, new_barrier, register_chain
from tests.workers import complete_worker, register_worker, run_all


def _counts(conn) -> dict:
    return {
        t: conn.execute(f"SELECT count(*) AS n FROM {t}").fetchone()["n"]
        for t in ("job", "job_source", "job_sink", "managed_table", "table_commit", "table_completion")
    }


def test_refused_registration_writes_nothing(conn):
    """A second writer or a cycle is refused and leaves every table as it was."""
    register_chain(conn)
    before = _counts(conn)
    with pytest.raises(SinkAlreadyOwnedError, match="lake.db.revenue is written by job agg"):
        jobs.register(conn, job("other", sources=["orders"], sinks=["revenue", "brand_new"]))
    with pytest.raises(TopologyCycleError, match="lake.db.report -> agg -> lake.db.revenue -> report"):
        jobs.register(conn, job("agg", sources=["orders", "report"], sinks=["revenue", "extra"]), replace=True)
    assert _counts(conn) == before


def test_cycle_through_registered_jobs_is_refused(conn):
    """Closing a loop through registered jobs is refused with the whole path."""
    register_chain(conn)
    jobs.register(conn, job("back", sources=["report"], sinks=["feedback"]))
    with pytest.raises(TopologyCycleError) as info:
        jobs.register(conn, job("agg", sources=["orders", "feedback"], sinks=["revenue"]), replace=True)
    assert info.value.path == [
        "lake.db.feedback",
        "agg",
        "lake.db.revenue",
        "report",
        "lake.db.report",
        "back",
        "lake.db.feedback",
    ]


def test_reregistering_is_a_noop_and_changes_need_replace(conn):
    """The same definition is unchanged; a different one needs --replace."""
    jobs.register(conn, job("ingest", sinks=["a"]))
    assert jobs.register(conn, job("ingest", sinks=["a"])).status == "unchanged"
    with pytest.raises(JobDefinitionChangedError, match="pass --replace"):
        jobs.register(conn, job("ingest", sinks=["a", "b"]))
    assert jobs.register(conn, job("ingest", sinks=["a", "b"]), replace=True).status == "replaced"
    assert jobs.load_definitions(conn)["ingest"].sinks == {T("a"), T("b")}


def test_unregister_frees_the_sink_and_keeps_history(conn):
    """After unregistering, another job may write the table and continues its watermark."""
    jobs.register(conn, job("ingest", sinks=["a"]))
    b1 = jobs.next_barrier(conn, "ingest").barrier
    jobs.complete(conn, "ingest", b1, {T("a"): 1})
    jobs.unregister(conn, "ingest")
    with pytest.raises(JobNotFoundError):
        jobs.unregister(conn, "ingest")
    jobs.register(conn, job("ingest_v2", sinks=["a"]))
    b2 = new_barrier(conn)
    assert jobs.next_barrier(conn, "ingest_v2").barrier == b2
    jobs.complete(conn, "ingest_v2", b2, {T("a"): 2})
    assert tables.states(conn, [T("a")])[0].watermark == b2


def test_sinks_at_different_barriers_cannot_share_a_job(conn):
    """A job advances its sinks together, so sinks with different history are refused."""
    jobs.register(conn, job("ingest", sinks=["a"]))
    jobs.complete(conn, "ingest", jobs.next_barrier(conn, "ingest").barrier)
    jobs.unregister(conn, "ingest")
    with pytest.raises(SinkHistoryMismatchError, match="lake.db.a at"):
        jobs.register(conn, job("both", sinks=["a", "fresh"]))


def test_two_processes_registering_one_sink_exactly_one_wins(dsn):
    """Racing registrations of the same sink from separate processes: one wins, others refused."""
    results = run_all(register_worker, [(dsn, f"racer{i}", "contested") for i in range(4)])
    assert sorted(r[0] for r in results) == ["ok", "refused", "refused", "refused"]
    assert {r[1] for r in results if r[0] == "refused"} == {"SinkAlreadyOwnedError"}


# -- barriers ------------------------------------------------------------------------------


def test_root_job_gets_a_barrier_and_an_intermediate_waits_for_sources(conn):
    """A root job is issued a barrier; an intermediate job is ready only when all sources are."""
    register_chain(conn)
    nb = jobs.next_barrier(conn, "ingest_orders")
    assert nb.ready and nb.issued
    b = nb.barrier
    assert not jobs.next_barrier(conn, "agg").ready
    jobs.complete(conn, "ingest_orders", b, {T("orders"): 1})
    assert jobs.next_barrier(conn, "ingest_payments").barrier == b  # no new one within the interval
    waiting = jobs.next_barrier(conn, "agg")
    assert waiting.barrier is None and waiting.waiting_for == {"lake.db.orders": b, "lake.db.payments": None}
    jobs.complete(conn, "ingest_payments", b, {T("payments"): 2})
    assert jobs.next_barrier(conn, "agg").barrier == b


def test_root_job_issues_only_when_the_newest_barrier_is_older_than_the_interval(conn):
    """Within the interval a root job is told to wait; after it, it gets a new barrier."""
    jobs.register(conn, job("ingest", sinks=["a"]))
    b1 = jobs.next_barrier(conn, "ingest").barrier
    jobs.complete(conn, "ingest", b1)
    barriers.set_interval_s(conn, 3600)
    assert jobs.next_barrier(conn, "ingest").barrier is None
    barriers.set_interval_s(conn, 0.001)
    import time

    time.sleep(0.01)
    nb = jobs.next_barrier(conn, "ingest")
    assert nb.issued and nb.barrier > b1


def test_completion_refuses_out_of_order_skipped_and_unissued(conn):
    """A root job that commits completes the next barrier (or coalesces); only issued ones."""
    jobs.register(conn, job("ingest", sinks=["a"]))
    b1, b2, b3 = new_barrier(conn), new_barrier(conn), new_barrier(conn)
    jobs.complete(conn, "ingest", b1)
    with pytest.raises(BarrierOutOfOrderError, match=f"must complete barrier {b2} next") as info:
        jobs.complete(conn, "ingest", b3, {T("a"): 7})
    assert info.value.expected == b2
    with pytest.raises(BarrierNotIssuedError):
        jobs.complete(conn, "ingest", b2 + 1)
    jobs.complete(conn, "ingest", b2)
    jobs.complete(conn, "ingest", b3)
    assert tables.states(conn, [T("a")])[0].watermark == b3


def test_completion_refuses_commits_to_other_tables(conn):
    """Only the job's sinks can be committed to."""
    register_chain(conn)
    b = new_barrier(conn)
    with pytest.raises(NotASinkError, match="does not write lake.db.revenue"):
        jobs.complete(conn, "ingest_orders", b, {T("revenue"): 1})


def test_intermediate_job_cannot_run_ahead_of_its_sources(conn):
    """Completing B before every source has completed B is refused, naming the lagging source."""
    register_chain(conn)
    b = new_barrier(conn)
    jobs.complete(conn, "ingest_orders", b, {T("orders"): 1})
    with pytest.raises(SourcesNotReadyError, match="lake.db.payments"):
        jobs.complete(conn, "agg", b, {T("revenue"): 3})


def test_completing_again_is_idempotent_or_refused(conn):
    """The same commits again are a no-op; different commits are refused; nothing is duplicated."""
    register_chain(conn)
    b = new_barrier(conn)
    jobs.complete(conn, "ingest_orders", b, {T("orders"): 1})
    assert jobs.complete(conn, "ingest_orders", b, {T("orders"): 1}).noop
    with pytest.raises(CompletionConflictError, match="lake.db.orders=1"):
        jobs.complete(conn, "ingest_orders", b, {T("orders"): 2})
    with pytest.raises(CompletionConflictError):
        jobs.complete(conn, "ingest_orders", b, {})
    assert conn.execute("SELECT count(*) AS n FROM table_commit").fetchone()["n"] == 1


def test_barrier_without_changes_only_advances_the_watermark(conn):
    """A sink without a commit keeps its snapshot; its watermark still moves."""
    register_chain(conn)
    b1 = new_barrier(conn)
    complete_all(conn, b1)
    b2 = new_barrier(conn)
    jobs.complete(conn, "ingest_orders", b2)
    v = {str(x.name): x for x in tables.list_versions(conn)}
    assert v["lake.db.orders"].watermark == b2 and v["lake.db.orders"].current_snapshot_id == 1


def test_a_job_added_to_history_bootstraps_from_the_latest_common_barrier(conn):
    """A new intermediate job starts at its sources' latest common completed barrier."""
    register_chain(conn)
    b1, b2 = new_barrier(conn), new_barrier(conn)
    complete_all(conn, b1)
    jobs.complete(conn, "ingest_orders", b2, {T("orders"): 11})
    jobs.register(conn, job("late", sources=["orders", "payments"], sinks=["late_view"]))
    nb = jobs.next_barrier(conn, "late")
    assert nb.barrier == b1 and nb.ready
    jobs.complete(conn, "late", b1, {T("late_view"): 99})
    assert tables.states(conn, [T("late_view")])[0].start_barrier == b1
    assert jobs.next_barrier(conn, "late").waiting_for == {"lake.db.payments": b1}


def test_concurrent_completions_of_one_barrier(dsn, conn):
    """Processes racing to complete the same barrier: exactly one records it."""
    jobs.register(conn, job("ingest", sinks=["a"]))
    b = new_barrier(conn)
    results = run_all(complete_worker, [(dsn, "ingest", b, "a", 7)] * 3 + [(dsn, "ingest", b, "a", 8)])
    outcomes = sorted(r[0] for r in results)
    assert outcomes.count("completed") == 1
    winner = next(r[1] for r in results if r[0] == "completed")
    for outcome, snapshot in results:
        if outcome == "noop":
            assert snapshot == winner
        if outcome == "refused":
            assert snapshot != winner
    rows = conn.execute("SELECT snapshot_id FROM table_commit").fetchall()
    assert [r["snapshot_id"] for r in rows] == [winner]


def test_concurrent_completions_of_consecutive_barriers_stay_gap_free(dsn, conn):
    """Processes completing different barriers of one job never leave a gap or go backwards."""
    jobs.register(conn, job("ingest", sinks=["a"]))
    marks = [new_barrier(conn) for _ in range(6)]
    jobs.complete(conn, "ingest", marks[0], {T("a"): 0})
    args = [(dsn, "ingest", b, "a", i) for i, b in enumerate(marks) if i]
    for _ in range(6):  # repeat: each round completes at least the next one
        run_all(complete_worker, args)
        if tables.states(conn, [T("a")])[0].watermark == marks[-1]:
            break
    recorded = [r["barrier"] for r in conn.execute("SELECT barrier FROM table_completion ORDER BY barrier").fetchall()]
    assert recorded == sorted(set(recorded))
    assert recorded == marks


def test_a_root_job_resumes_the_first_barrier_it_recorded(conn):
    """Found by `icebarrier check`: a root job that crashed after recording (and maybe
    committing) its first barrier resumes it instead of starting at a newer one."""
    from icebarrier.control_plane import runs

    jobs.register(conn, job("ingest", sinks=["a"]))
    b1 = new_barrier(conn)
    runs.record_range(conn, "ingest", b1, {"files": ["x"]})
    new_barrier(conn)
    assert jobs.next_barrier(conn, "ingest").barrier == b1
