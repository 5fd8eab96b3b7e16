"""Declared freshness in the control plane (DESIGN.md, "Declared freshness"): target lags,
their inheritance, target misses, job runners, and the schedule's plan over them."""

import math
import time

import pytest

from icebarrier.apps.schedule import (
    DEFAULT_DURATION_S,
    Due,
    Schedule,
    _Job,
    _Run,
    dry_run,
    due_now,
    measured,
    plan,
    to_run,
)
from icebarrier.control_plane import audit, jobs, targets
from icebarrier.control_plane.errors import InvalidValueError, JobNotFoundError, TableNotFoundError
from icebarrier.control_plane.targets import Runner
from tests.helpers import T, anchor, job, new_barrier


@pytest.fixture
def pipeline(conn):
    """ingest -> a; derive: a -> b; report: b -> c; side: a -> d (c and d read a's data)."""
    jobs.register(conn, job("ingest", sinks=["a"]))
    jobs.register(conn, job("derive", sources=["a"], sinks=["b"]))
    jobs.register(conn, job("report", sources=["b"], sinks=["c"]))
    jobs.register(conn, job("side", sources=["a"], sinks=["d"]))
    return conn


def by_table(conn) -> dict[str, targets.TableTarget]:
    return {t.name.name: t for t in targets.targets(conn)}


def test_a_table_without_a_target_inherits_the_tightest_of_the_tables_that_read_it(pipeline):
    conn = pipeline
    assert all(t.effective_s is None and t.met is None for t in by_table(conn).values())
    targets.set_target_lag(conn, T("c"), 10)
    targets.set_target_lag(conn, T("d"), 30)
    got = by_table(conn)
    assert (got["c"].target_lag_s, got["c"].effective_s, got["c"].target_from) == (10, 10, "lake.db.c")
    assert (got["b"].target_lag_s, got["b"].effective_s, got["b"].target_from) == (None, 10, "lake.db.c")
    assert (got["a"].effective_s, got["a"].target_from) == (10, "lake.db.c")  # the tighter of c and d
    assert got["d"].effective_s == 30
    targets.set_target_lag(conn, T("b"), 60)  # its own target stops what b passes up from c
    got = by_table(conn)
    assert (got["b"].effective_s, got["a"].effective_s, got["a"].target_from) == (60, 30, "lake.db.d")
    targets.set_target_lag(conn, T("d"), None)
    assert by_table(conn)["a"].effective_s == 60 and by_table(conn)["d"].effective_s is None
    events = [e for e in audit.events(conn) if e.action == "table target-lag"]
    assert [(e.table, e.detail["target_lag_s"]) for e in events][-1] == ("lake.db.d", None)
    assert len(events) == 4


def test_a_target_is_met_while_the_watermark_is_younger_than_it_and_each_stale_stretch_is_a_miss(pipeline):
    conn = pipeline
    targets.set_target_lag(conn, T("a"), 0.5)
    assert by_table(conn)["a"].met is False  # nothing completed yet: not fresh
    first = new_barrier(conn)
    jobs.complete(conn, "ingest", first, {T("a"): 1})
    assert by_table(conn)["a"].met is True
    time.sleep(0.8)
    assert by_table(conn)["a"].met is False
    [ongoing] = targets.misses(conn, table=T("a"))
    assert ongoing.until is None and ongoing.overdue_s > 0.2
    second = new_barrier(conn)
    jobs.complete(conn, "ingest", second, {T("a"): 2})
    [recovered] = targets.misses(conn, table=T("a"))
    assert recovered.until is not None and recovered.recovered_by == second and recovered.overdue_s > 0.2
    assert by_table(conn)["a"].met is True
    assert targets.misses(conn, table=T("b")) == []  # no target: none set on it or downstream of it


def test_bad_targets_and_runners_are_refused_writing_nothing(pipeline):
    conn = pipeline
    with pytest.raises(TableNotFoundError):
        targets.set_target_lag(conn, T("nope"), 10)
    with pytest.raises(InvalidValueError):
        targets.set_target_lag(conn, T("a"), 0)
    with pytest.raises(JobNotFoundError):
        targets.set_runner(conn, "nope", Runner(kind="command", spec="true"))
    with pytest.raises(InvalidValueError):
        Runner(kind="cron", spec="true")
    with pytest.raises(InvalidValueError):
        Runner(kind="command", spec="  ")
    assert targets.runners(conn) == {} and all(t.target_lag_s is None for t in targets.targets(conn))


def test_runners_are_kept_per_job_and_their_environment_stays_out_of_the_audit_trail(pipeline):
    conn = pipeline
    targets.set_runner(conn, "ingest", Runner(kind="command", spec="python ingest.py", env={"TOKEN": "s3cr3t"}))
    targets.set_runner(conn, "derive", Runner(kind="file", spec="/jobs/derive.py"))
    assert targets.runners(conn) == {
        "ingest": Runner(kind="command", spec="python ingest.py", env={"TOKEN": "s3cr3t"}),
        "derive": Runner(kind="file", spec="/jobs/derive.py"),
    }
    [event] = [e for e in audit.events(conn) if e.action == "job runner" and e.job == "ingest"]
    assert event.detail["env"] == ["TOKEN"] and "s3cr3t" not in str(event.detail)
    targets.set_runner(conn, "derive", None)
    jobs.unregister(conn, "ingest")
    assert targets.runners(conn) == {}


def test_the_plan_starts_a_refresh_its_duration_before_the_target_runs_out(pipeline):
    """Due in = target - freshness - refresh - margin, the refresh being the longest chain of
    job durations ending at the table's writer; its jobs, sources first. Tables with targets of
    their own drive refreshes (those inheriting are refreshed on the way)."""
    conn = pipeline
    targets.set_target_lag(conn, T("c"), 20)
    b = new_barrier(conn)
    for name, sink in (("ingest", "a"), ("derive", "b"), ("report", "c"), ("side", "d")):
        jobs.complete(conn, name, b, {T(sink): 1})
    durations = {"ingest": 1.0, "derive": 2.0, "report": 3.0}
    dues = {d.table: d for d in plan(jobs.load_definitions(conn), targets.targets(conn), durations, {"ingest"})}
    c = dues["lake.db.c"]
    assert c.jobs == ("ingest", "derive", "report") and c.refresh_s == 6.0
    assert c.missing == ("derive", "report")
    assert c.due_in_s == pytest.approx(20 - c.freshness_s - 6.0 - 0.5 - 0.25 * 6.0)
    assert set(dues) == {"lake.db.c"}  # a and b inherit c's target: c's refresh refreshes them; d has none
    assert not due_now(list(dues.values()))  # just refreshed
    # a table that never completed is due at once; a job never measured counts DEFAULT_DURATION_S
    jobs.register(conn, job("late", sources=["c"], sinks=["e"]))
    targets.set_target_lag(conn, T("e"), 20)
    dues = plan(jobs.load_definitions(conn), targets.targets(conn), durations, set())
    e = next(d for d in dues if d.table == "lake.db.e")
    assert math.isinf(e.due_in_s) and e.refresh_s == 6.0 + DEFAULT_DURATION_S
    assert [d.table for d in due_now(dues)] == ["lake.db.e"]  # c is due in 12 s, after e's refresh (8 s)
    # falling due together: with a target of 15 s, c falls due within e's refresh (in 7 s), so
    # both refresh now, for one barrier, instead of c a moment later for another
    targets.set_target_lag(conn, T("c"), 15)
    dues = plan(jobs.load_definitions(conn), targets.targets(conn), durations, set())
    assert [d.table for d in due_now(dues)] == ["lake.db.e", "lake.db.c"]


def test_a_refresh_sharing_a_job_with_one_due_joins_it_within_half_its_cycle():
    """Two leaves read one ingest (targets 20 s, refreshes 5 s: a cycle of 15 s). The one due in
    7 s joins a refresh due now (the ingest runs once, and they stay in step); due in 8 s (over
    half its cycle) it waits. A leaf sharing no job joins only if due within the longest
    refresh due (5 s)."""

    def due(table: str, due_in_s: float, jobs: tuple[str, ...]) -> Due:
        return Due(
            table=table, target_s=20.0, target_from=table, freshness_s=1.0, refresh_s=5.0, due_in_s=due_in_s, jobs=jobs
        )

    now = due("a", 0.0, ("ingest", "left"))
    assert due_now([now, due("b", 7.0, ("ingest", "right"))]) == [now, due("b", 7.0, ("ingest", "right"))]
    assert due_now([now, due("b", 8.0, ("ingest", "right"))]) == [now]
    assert due_now([now, due("c", 7.0, ("other", "far"))]) == [now]
    assert due_now([now, due("c", 4.0, ("other", "far"))]) == [now, due("c", 4.0, ("other", "far"))]
    assert due_now([due("b", 2.0, ("ingest", "right"))]) == []  # nothing due: nothing starts


def test_a_refresh_begun_while_a_job_it_needs_runs_counts_that_run():
    """The ingest runs for one leaf's refresh when the other leaf's refresh begins: that run
    counts for both (the ingest is not run again, and the second refresh ends once its leaf has
    run). A job that was idle when a refresh began must run again."""
    s = Schedule(dsn=None, schema=None, catalog_uri=None, credential=None, log=lambda line: None)
    ingest, leaf = s._jobs.setdefault("ingest", _Job("ingest")), s._jobs.setdefault("leaf", _Job("leaf"))
    ingest.run, ingest.wanted_since = _Run(1, None), time.monotonic()  # wanted by the first leaf's refresh
    due = Due(
        table="t", target_s=10.0, target_from="t", freshness_s=1.0, refresh_s=2.0, due_in_s=0.0, jobs=("ingest", "leaf")
    )
    upstream = {"leaf": ["ingest"]}
    now = time.monotonic() + 0.5
    s._begin(due, upstream, now)
    assert leaf.wanted_since == now
    ingest.last_start, ingest.run, ingest.wanted_since = ingest.run.started, None, None  # its run ended
    leaf.last_start, leaf.wanted_since = now + 0.1, None
    s._end_refreshes()
    assert s._refreshes == {}
    s._begin(due, upstream, now + 5)  # nothing running now: both must run after it began
    assert ingest.wanted_since == now + 5 and leaf.wanted_since == now + 5
    s._end_refreshes()
    assert list(s._refreshes) == ["t"]


def test_a_refresh_counts_a_shared_jobs_run_its_table_has_not_consumed_within_its_spare_time():
    """Two leaves read one ingest; leaf b's refresh (target 10 s, refresh 2 s: 7 s to spare)
    falls due 3 s after the ingest ran for leaf a. It counts that run: b has not consumed it
    (b last ran before it) and it is young enough. Older than 7 s, or consumed already,
    the ingest runs again; the writer always runs. Through a chain, a job runs again when any
    job it feeds runs again and its own run cannot count."""
    due = Due(
        table="b", target_s=10.0, target_from="b", freshness_s=6.0, refresh_s=2.0, due_in_s=0.0, jobs=("ingest", "b")
    )
    assert due.spare_s == 7.0
    upstream = {"b": ["ingest"], "a": ["ingest"]}
    assert to_run(due, upstream, {"ingest": 97.0, "b": 90.0}, now=100.0) == ("b",)
    assert to_run(due, upstream, {"ingest": 92.0, "b": 90.0}, now=100.0) == ("ingest", "b")  # 8 s old
    assert to_run(due, upstream, {"ingest": 97.0, "b": 98.0}, now=100.0) == ("ingest", "b")  # b has read it
    assert to_run(due, upstream, {}, now=100.0) == ("ingest", "b")  # never ran (a new schedule)

    chain = Due(
        table="t", target_s=10.0, target_from="t", freshness_s=6.0, refresh_s=2.0, due_in_s=0.0, jobs=("a", "m", "t")
    )
    upstream = {"t": ["m"], "m": ["a"]}
    assert to_run(chain, upstream, {"a": 95.0, "m": 97.0, "t": 90.0}, now=100.0) == ("t",)  # m counts: a too
    assert to_run(chain, upstream, {"a": 95.0, "m": 97.0, "t": 98.0}, now=100.0) == ("a", "m", "t")
    assert to_run(chain, upstream, {"a": 97.0, "m": 92.0, "t": 90.0}, now=100.0) == ("m", "t")  # m too old; a counts


def test_a_jobs_expected_duration_is_the_slowest_of_its_recent_runs():
    """One slow run among the last five moves the job's expected duration (and so its refresh's
    start) to it, until five faster runs have followed: a slowing machine starts refreshes
    early instead of ending them late."""
    s = Schedule(dsn=None, schema=None, catalog_uri=None, credential=None, log=lambda line: None)
    job = s._jobs.setdefault("ingest", _Job("ingest"))
    job.durations.extend([2.0, 2.0, 6.0, 2.0, 2.0])
    assert s._durations() == {"ingest": 6.0}
    job.durations.extend([2.0, 2.0, 2.0])
    assert s._durations() == {"ingest": 2.0}


def test_a_run_is_measured_and_expected_per_computation_one_more_per_anchor_it_passes(pipeline):
    """Coalescing never crosses an anchor, so a run computes once per anchor between its job's
    progress before and after it, and once more. A 6-s run that passed one anchor measures 3 s a
    computation; with two anchors issued since its progress, the job's next run is expected to
    compute three times (9 s), and its table's refresh starts that much earlier."""
    conn = pipeline
    targets.set_target_lag(conn, T("a"), 60)
    b1 = new_barrier(conn)
    jobs.complete(conn, "ingest", b1, {T("a"): 1})
    a2, b3 = anchor(conn), new_barrier(conn)
    conn.execute(
        "INSERT INTO schedule_run (job_name, reason, progress_from, progress_to, seconds) VALUES "
        "('ingest', 'test', %s, %s, 6.0), ('ingest', 'test', NULL, %s, 2.5)",
        (b1, b3, b1),
    )
    assert measured(conn) == {"ingest": [3.0, 2.5]}  # the first run ever: one computation
    assert jobs.anchors_ahead(conn)["ingest"] == 1 and jobs.anchors_ahead(conn)["derive"] == 0
    assert [d.refresh_s for d in dry_run(conn) if d.table == "lake.db.a"] == [6.0]  # 3 s x (1 + a2)
    jobs.complete(conn, "ingest", a2, {T("a"): 2})  # at the anchor: nothing between it and the newest
    assert jobs.anchors_ahead(conn)["ingest"] == 0
    anchor(conn), anchor(conn)
    assert [d.refresh_s for d in dry_run(conn) if d.table == "lake.db.a"] == [9.0]
