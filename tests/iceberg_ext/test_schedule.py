"""`icebarrier schedule` (DESIGN.md, "Declared freshness") over a pipeline of five jobs that run
themselves: four `job exec` scripts (PyIceberg, DuckDB) and a PySpark runtime job.

    ingest (PyIceberg) -> orders -> count (DuckDB) -> by_barrier -> summarize (PyIceberg) -> summary, audit
                                                                 -> mirror (PyIceberg) -> mirrored
                          orders -> daily (PySpark SqlJob, the runtime) -> daily

Targets: ``mirrored`` 25 s (its upstream inherits it), ``daily`` 30 s (its runs share one
warm Spark session: ``run --on-request``), or three times the refresh the schedule measured
if that is more (the machine is loaded). Barriers come every
second, issued by the schedule. The schedule meets the targets, runs each job far less often
than barriers are issued, retries a run whose command was killed, and a second schedule waits
until the first is killed, then takes over."""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from icebarrier.apps.embedded import CLI
from icebarrier.apps.schedule import dry_run
from icebarrier.control_plane import barriers, jobs, targets, tokens
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.control_plane.targets import Runner
from tests.helpers import LoggedProcess
from tests.iceberg_ext.test_job_exec import ENGINES

pytestmark = pytest.mark.slow

MIRROR = """
import os, sys
from pyiceberg.catalog import load_catalog
ns = sys.argv[1]
catalog = load_catalog(os.environ["ICEBARRIER_CATALOG"])
rows = catalog.load_table(f"{ns}.summary").scan().to_arrow()
catalog.create_table_if_not_exists(f"{ns}.mirrored", schema=rows.schema).overwrite(rows)
"""
DAILY = """
from icebarrier import SqlJob
job = SqlJob("daily", "INSERT OVERWRITE lake.{ns}.daily SELECT count(*) AS n, max(barrier) AS last FROM lake.{ns}.orders")
"""
TARGETS = {"mirrored": 25, "daily": 30}


def register(lake, tmp_path: Path) -> None:
    py, ns = sys.executable, lake.namespace
    (tmp_path / "mirror.py").write_text(MIRROR)
    (tmp_path / "daily.py").write_text(DAILY.format(ns=ns))
    pipeline = {  # job: (sources, sinks, runner)
        "ingest": ([], ["orders"], Runner(kind="command", spec=f"{py} {ENGINES / 'pyiceberg_root.py'} {ns} 5")),
        "count": (
            ["orders"],
            ["by_barrier"],
            Runner(kind="command", spec=f"{py} {ENGINES / 'duckdb_by_barrier.py'} {ns}"),
        ),
        "summarize": (
            ["by_barrier"],
            ["summary", "audit"],
            Runner(kind="command", spec=f"{py} {ENGINES / 'pyiceberg_summary.py'} {ns}"),
        ),
        "mirror": (["summary"], ["mirrored"], Runner(kind="command", spec=f"{py} {tmp_path / 'mirror.py'} {ns}")),
        "daily": (["orders"], ["daily"], Runner(kind="file", spec=str(tmp_path / "daily.py"))),
    }
    for name, (sources, sinks, runner) in pipeline.items():
        jobs.register(
            lake.conn,
            JobDefinition(
                name=name,
                sources=frozenset(lake.T(t) for t in sources),
                sinks=frozenset(lake.T(t) for t in sinks),
                external_inputs=frozenset() if sources else frozenset(["ext:orders"]),
            ),
        )
        targets.set_runner(lake.conn, name, runner)
    for table, seconds in TARGETS.items():
        targets.set_target_lag(lake.conn, lake.T(table), seconds)
    schema = pa.schema([pa.field("n", pa.int64()), pa.field("last", pa.int64())])
    lake.catalog.create_table(f"{ns}.daily", schema=schema)  # a SQL job's sink exists before it runs


def Scheduler(server: str, credential: str, log: Path) -> LoggedProcess:
    """An `icebarrier schedule` process; its log lines, as they come."""
    return LoggedProcess(
        [*CLI, "schedule", "--parallel", "3", "--catalog-uri", server, "--credential", credential], log
    )


def script_pids(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and "job exec" not in cmdline and "sh -c" not in cmdline:
                pids.append(int(entry.name))
    return pids


def sample(lake, seconds: float, met: dict[str, list[bool]]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for t in targets.targets(lake.conn):
            if t.name.name in TARGETS:
                met.setdefault(t.name.name, []).append(bool(t.met))
        time.sleep(0.5)


def wait_until_met(lake, deadline: float, failure: Callable[[], str]) -> None:
    """Until every target is met at once, each by a refresh that started from now on: one planned
    before (for another target, or before a fault) may meet it for a moment, then miss it
    (``failure()``: the message if ``deadline`` passes)."""
    after = barriers.newest(lake.conn).barrier
    while not all(t.met and t.watermark > after for t in targets.targets(lake.conn) if t.name.name in TARGETS):
        assert time.monotonic() < deadline, failure()
        time.sleep(0.5)


def wait_until_each_ran(lake, schedule: LoggedProcess) -> None:
    """Until every job's run has succeeded once (or the schedule's log stops growing for 2 minutes)."""
    names = set(jobs.load_definitions(lake.conn))
    size, moved = 0, time.monotonic()
    while True:
        done = lake.conn.execute("SELECT DISTINCT job_name FROM schedule_run WHERE exit_code = 0").fetchall()
        if {r["job_name"] for r in done} >= names:
            return
        if len(schedule.log()) != size:
            size, moved = len(schedule.log()), time.monotonic()
        assert time.monotonic() - moved < 120, f"no progress in 2 minutes\n{schedule.log()[-4000:]}"
        time.sleep(0.5)


def test_the_schedule_meets_targets_coalescing_retrying_and_handing_over(lake, server, tmp_path):
    barriers.set_interval_s(lake.conn, 1)
    register(lake, tmp_path)
    admin = ":".join(tokens.create(lake.conn, admin=True))
    first = Scheduler(server, admin, tmp_path / "first.log")
    second = None
    try:
        first.wait_for("schedule: running")
        second = Scheduler(server, admin, tmp_path / "second.log")
        second.wait_for("waiting to take over")
        holder = lake.conn.execute("SELECT holder FROM schedule_state").fetchone()["holder"]
        assert holder.endswith(f"pid {first.proc.pid}")
        # warm-up: every job ran once (the PySpark job's first run starts a JVM); then targets a
        # few times the refreshes this machine measured (a loaded machine runs the chain slower
        # than the target of a quiet one allows): reachable, and then always met
        wait_until_each_ran(lake, first)
        longest = 0
        for due in dry_run(lake.conn):
            table = TableName.parse(due.table)
            target = max(TARGETS[table.name], math.ceil(3 * due.refresh_s))
            targets.set_target_lag(lake.conn, table, target)
            longest = max(longest, target)
        wait_until_met(lake, time.monotonic() + 3 * longest, lambda: first.log()[-4000:])
        started = barriers.newest(lake.conn)
        met: dict[str, list[bool]] = {}
        sample(lake, 15, met)  # undisturbed, the schedule meets the targets (30 samples)
        for table, seen in met.items():
            share = sum(seen) / len(seen)
            assert share >= 0.9, f"{table}: target met {share:.0%} of {len(seen)} samples\n{first.log()[-3000:]}"
        deadline = time.monotonic() + 3 * longest  # ingest runs at least once a target
        while not (killed := script_pids(f"pyiceberg_root.py {lake.namespace}")):
            assert time.monotonic() < deadline, f"ingest never ran in {3 * longest} s\n{first.log()[-3000:]}"
            time.sleep(0.2)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        first.wait_for("job ingest: run failed")
        retried = first.wait_for("retry 1 in")
        # the killed run costs the targets what it took plus its retry; then they recover
        wait_until_met(
            lake, time.monotonic() + 3 * longest, lambda: f"no recovery after {retried}\n{first.log()[-3000:]}"
        )
        # the first schedule dies with its runs: the second takes over, and the targets recover
        # (a Spark session starts again first: a miss is allowed meanwhile)
        first.kill_group()
        second.wait_for("schedule: running", timeout_s=30)
        wait_until_met(lake, time.monotonic() + 180 + 3 * longest, lambda: second.log()[-4000:])
        holder = lake.conn.execute("SELECT holder FROM schedule_state").fetchone()["holder"]
        assert holder.endswith(f"pid {second.proc.pid}")
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(60) == 0, second.log()[-3000:]
    finally:
        first.kill_group()
        if second is not None:
            second.kill_group()
    # coalescing: runs far fewer than barriers; no job ran twice at once; the killed run failed
    issued = lake.conn.execute("SELECT count(*) AS n FROM barriers WHERE barrier > %s", (started.barrier,)).fetchone()[
        "n"
    ]
    runs = lake.conn.execute(
        "SELECT job_name, started_at, finished_at, exit_code FROM schedule_run ORDER BY job_name, started_at"
    ).fetchall()
    window = [r for r in runs if r["started_at"] >= started.issued_at]
    for name in ("ingest", "count", "summarize", "mirror", "daily"):
        mine = [r for r in window if r["job_name"] == name]
        assert 1 <= len(mine) <= issued / 5, f"{name}: {len(mine)} runs for {issued} barriers"
        done = [r for r in runs if r["job_name"] == name and r["finished_at"] is not None]
        for before, after in zip(done, done[1:]):
            assert before["finished_at"] <= after["started_at"], f"two runs of {name} at once: {before} {after}"
    assert any(r["job_name"] == "ingest" and r["exit_code"] not in (0, None) for r in runs)
    log = first.log()
    assert "published nothing" in log
    # the PySpark job file ran more than once in one process, started with the schedule
    assert log.count("job daily: runner started") == 1 and log.count("job daily: run done") >= 2, log[-3000:]
    assert log.index("job daily: runner started") < log.index("job daily: run started")


def test_a_refresh_starts_with_a_barrier_of_its_own(lake, server, tmp_path):
    """Barriers an hour apart on the clock, one root job with a target of seconds: the schedule
    issues a barrier as each refresh starts, so the job's run computes the lake as of then and
    its table meets the target; between refreshes it issues none."""
    barriers.set_interval_s(lake.conn, 3600)
    py, ns = sys.executable, lake.namespace
    jobs.register(
        lake.conn,
        JobDefinition(
            name="ingest",
            sources=frozenset(),
            sinks=frozenset([lake.T("orders")]),
            external_inputs=frozenset(["ext:orders"]),
        ),
    )
    targets.set_runner(lake.conn, "ingest", Runner(kind="command", spec=f"{py} {ENGINES / 'pyiceberg_root.py'} {ns} 5"))
    targets.set_target_lag(lake.conn, lake.T("orders"), 12)
    admin = ":".join(tokens.create(lake.conn, admin=True))
    schedule = Scheduler(server, admin, tmp_path / "schedule.log")
    try:
        schedule.wait_for("job ingest: run done")
        (due,) = dry_run(lake.conn)  # a loaded machine's refresh: a target it can meet
        target = max(12, math.ceil(3 * due.refresh_s))
        targets.set_target_lag(lake.conn, lake.T("orders"), target)
        started = barriers.newest(lake.conn)

        def count(query: str) -> int:
            return lake.conn.execute(query, {"barrier": started.barrier, "at": started.issued_at}).fetchone()["n"]

        issued = "SELECT count(*) AS n FROM barriers WHERE barrier > %(barrier)s AND issued_by = 'schedule'"
        runs = "SELECT count(*) AS n FROM schedule_run WHERE started_at > %(at)s"
        # sampled over two more refreshes (the gaps between them are where no barrier is due)
        met: list[bool] = []
        deadline = time.monotonic() + 5 * target
        while count(runs) < 3:
            assert time.monotonic() < deadline, f"{count(runs)} refreshes in {5 * target} s\n{schedule.log()[-3000:]}"
            met += [bool(t.met) for t in targets.targets(lake.conn) if t.name == lake.T("orders")]
            time.sleep(0.5)
        barriers_issued, refreshes = count(issued), count(runs)
    finally:
        schedule.kill_group()
    assert sum(met) / len(met) >= 0.8, f"target met in {sum(met)} of {len(met)} samples\n{schedule.log()[-3000:]}"
    # each refresh began with a barrier of its own (the first counted began with ``started``),
    # and none were issued between refreshes (+ 1: the newest one's barrier may precede its run)
    assert refreshes - 1 <= barriers_issued <= refreshes, (
        f"{barriers_issued} barriers for {refreshes} refreshes\n{schedule.log()[-3000:]}"
    )
