"""`icebarrier job exec`: plain Spark, DuckDB and PyIceberg scripts (tests/iceberg_ext/engines, no
icebarrier import) as barrier-completing jobs through a real `icebarrier serve`.

The pipeline: ``ingest`` (root: Spark, or PyIceberg where Spark's start-up would only slow a
test down) writes ``orders``; ``count`` (DuckDB) writes ``by_barrier`` from it; ``summarize``
(PyIceberg) writes ``summary`` and ``audit`` from that. At every exact cut: the rows of orders
counted per barrier are by_barrier, and summary = audit = (rows, newest barrier)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from icebarrier.control_plane import barriers, job_sessions, jobs, reads, tokens
from icebarrier.control_plane.errors import BarrierNotValidError
from icebarrier.control_plane.model import JobDefinition
from icebarrier.iceberg_ext.catalog import SUMMARY_RUN, ancestors, barrier_of, summary_properties
from tests.helpers import WEEK_S, anchor
from tests.iceberg_ext.catalog_server import rest

pytestmark = pytest.mark.slow

ENGINES = Path(__file__).parent / "engines"
SINKS = {"ingest": ["orders"], "count": ["by_barrier"], "summarize": ["summary", "audit"]}
SOURCES = {"ingest": [], "count": ["orders"], "summarize": ["by_barrier"]}


def setup_pipeline(lake) -> dict[str, str]:
    """Register the three jobs; a token for each (CLIENT_ID:SECRET by job). Barriers come only
    when a test issues them."""
    barriers.set_interval_s(lake.conn, WEEK_S)
    creds = {}
    for job in SINKS:
        jobs.register(
            lake.conn,
            JobDefinition(
                name=job,
                sources=frozenset(lake.T(t) for t in SOURCES[job]),
                sinks=frozenset(lake.T(t) for t in SINKS[job]),
                external_inputs=frozenset() if SOURCES[job] else frozenset(["ext:orders"]),
            ),
        )
        creds[job] = ":".join(tokens.create(lake.conn, job=job, whole_lake=True))
    return creds


def command(lake, job: str, *, rows: int = 10, spark: bool = False, extra: tuple[str, ...] = ()) -> list[str]:
    if job == "ingest":
        return [
            sys.executable,
            str(ENGINES / ("spark_root.py" if spark else "pyiceberg_root.py")),
            lake.namespace,
            str(rows),
        ]
    script = "duckdb_by_barrier.py" if job == "count" else "pyiceberg_summary.py"
    return [sys.executable, str(ENGINES / script), lake.namespace, *extra]


def exec_args(server: str, cred: str, job: str, cmd: list[str], *options: str) -> list[str]:
    return [
        "icebarrier",
        "--output",
        "json",
        "job",
        "exec",
        job,
        "--catalog-uri",
        server,
        "--credential",
        cred,
        *options,
        "--",
        *cmd,
    ]


def job_exec(
    server: str, cred: str, job: str, cmd: list[str], *options: str, env: dict | None = None, expect: int = 0
) -> dict:
    """Run `icebarrier job exec` to its end; its JSON summary (stderr kept for the assertion)."""
    done = subprocess.run(
        exec_args(server, cred, job, cmd, *options),
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == expect, done.stderr[-3000:]
    summary = json.loads(done.stdout) if done.stdout.strip() else {}
    summary["stderr"] = done.stderr
    return summary


PIPELINE_TABLES = ("orders", "by_barrier", "summary", "audit")


def check_cut(catalog, namespace: str) -> tuple[int, int | None]:
    """The pipeline's invariant over one view of the four tables; (rows, newest barrier)."""
    return check_rows({t: catalog.load_table(f"{namespace}.{t}").scan().to_arrow() for t in PIPELINE_TABLES})


def check_rows(tables: dict[str, pa.Table]) -> tuple[int, int | None]:
    """The pipeline's invariant over the rows of its four tables at one cut; (rows, newest barrier)."""
    orders, counts = tables["orders"], tables["by_barrier"]
    per_barrier = {
        r["barrier"]: r["count"]
        for r in orders.group_by("barrier")
        .aggregate([("id", "count")])
        .rename_columns(["barrier", "count"])
        .to_pylist()
    }
    assert {r["barrier"]: r["n"] for r in counts.to_pylist()} == per_barrier
    newest = pc.max(orders["barrier"]).as_py()
    for sink in ("summary", "audit"):
        assert tables[sink].to_pylist() == [{"n": orders.num_rows, "last": newest}], sink
    return orders.num_rows, newest


def assert_written_once(lake, table: str, barrier: int, run_id: str) -> None:
    """Every snapshot of ``table``'s history carrying ``barrier`` came from run ``run_id``, and the
    control plane records the newest of them for the barrier."""
    t = lake.catalog.load_table(f"{lake.namespace}.{table}")
    carrying = [s for s in ancestors(t, t.current_snapshot()) if barrier_of(s) == barrier]
    assert carrying and {summary_properties(s)[SUMMARY_RUN] for s in carrying} == {run_id}, table
    assert (
        reads.resolve(lake.conn, [lake.T(table)], barrier=barrier).snapshots[lake.T(table)] == carrying[0].snapshot_id
    )


def pointers(lake) -> dict[str, str | None]:
    """Every catalog pointer of the test's namespace (what readers of latest can see)."""
    rows = lake.conn.execute(
        f'SELECT table_name, metadata_location FROM "{lake.settings.catalog_schema}".iceberg_tables '
        f"WHERE table_namespace = %s",
        (lake.namespace,),
    ).fetchall()
    return {r["table_name"]: r["metadata_location"] for r in rows}


def wait_pause(proc: subprocess.Popen, pause: Path) -> int:
    """The pid the engine wrote at its pause point."""
    deadline = time.monotonic() + 300
    while not (pause.exists() and pause.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, f"job exec exited {proc.returncode}"
        time.sleep(0.05)
    return int(pause.read_text())


def wait_progress(lake, job: str, barrier: int, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    """Until ``job`` has completed ``barrier``; ``proc`` (its `job exec --follow`, logging to ``log``)
    must live meanwhile."""
    deadline = time.monotonic() + timeout_s
    while jobs.show(lake.conn, job).progress != barrier:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def paused_run(server: str, credential: str, cmd: list[str], pause: Path, err: Path) -> tuple[subprocess.Popen, int]:
    """`job exec ingest --hold 4s` whose command waits at its pause point ``before``: the process
    and the command's pid."""
    with open(err, "w") as out:  # not a pipe: the command, once orphaned, would hold it open
        proc = subprocess.Popen(
            exec_args(server, credential, "ingest", cmd, "--hold", "4s"),
            env={**os.environ, "ENGINE_PAUSE": "before", "ENGINE_PAUSE_FILE": str(pause)},
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    return proc, wait_pause(proc, pause)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


class TornWatcher:
    """A reader of latest loading A, B, A again, over and over (in a thread): when A did not move
    in between, B must carry A's barrier, else the pair was seen half-published (``torn``)."""

    def __init__(self, catalog, a: str, b: str) -> None:
        self.catalog, self.a, self.b = catalog, a, b
        self.torn, self.looks, self.done = [], 0, threading.Event()
        self.thread = threading.Thread(target=self.watch)
        self.thread.start()

    def watch(self) -> None:
        while not self.done.is_set():
            try:
                first = self.catalog.load_table(self.a).current_snapshot()
                other = self.catalog.load_table(self.b).current_snapshot()
                again = self.catalog.load_table(self.a).current_snapshot()
            except Exception:  # noqa: BLE001 - the tables do not exist before the first publish
                time.sleep(0.05)
                continue
            if first is None or other is None:
                continue
            self.looks += 1
            if first.snapshot_id == again.snapshot_id and barrier_of(first) != barrier_of(other):
                self.torn.append((barrier_of(first), barrier_of(other)))

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def test_the_torn_watcher_sees_two_tables_written_one_after_the_other(lake, server, tmp_path):
    """The check bites: two tables written by plain commits through latest, one after the
    other with a pause between (no session to publish them together), are seen torn."""
    from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER

    writer = rest(server, "latest", ":".join(tokens.create(lake.conn, job="someone", whole_lake=True)))
    schema = pa.schema([pa.field("x", pa.int64())])
    a, b = (writer.create_table(f"{lake.namespace}.{n}", schema=schema) for n in ("plain_a", "plain_b"))
    watcher = TornWatcher(
        rest(server, "latest", ":".join(tokens.create(lake.conn, whole_lake=True))),
        f"{lake.namespace}.plain_a",
        f"{lake.namespace}.plain_b",
    )
    try:
        for barrier in range(1, 6):
            for table in (a, b):
                table.append(
                    pa.table({"x": [barrier]}, schema=schema), snapshot_properties={SUMMARY_BARRIER: str(barrier)}
                )
                time.sleep(0.5)
    finally:
        watcher.stop()
    assert watcher.torn


def test_a_three_engine_pipeline_reads_exact_cuts(lake, server):
    """A root job in Spark and PyIceberg by turns, DuckDB and PyIceberg transforms, run out of
    step: every past barrier they all completed reads as an exact cut (and the read-committed one
    too), and a reader of latest never sees summary and audit from different barriers (published
    together)."""
    creds = setup_pipeline(lake)
    reader = ":".join(tokens.create(lake.conn, whole_lake=True))
    watcher = TornWatcher(rest(server, "latest", reader), f"{lake.namespace}.summary", f"{lake.namespace}.audit")
    rows_at: dict[int, int] = {}
    total = 0
    try:
        for step, jobs_now in enumerate(
            [
                ["ingest", "count", "summarize"],
                ["ingest"],
                ["ingest", "count"],
                ["summarize", "ingest"],
                ["count", "summarize", "count"],
            ]
        ):
            for job in jobs_now:
                if job == "ingest":
                    barriers.issue(lake.conn)
                # the root job in Spark and in PyIceberg by turns: one job, two engines, one barrier line
                out = job_exec(server, creds[job], job, command(lake, job, rows=step + 1, spark=step in (0, 3)))
                if job == "ingest":
                    [done] = out["steps"]
                    total += step + 1
                    rows_at[done["barrier"]] = total
                    assert done["outcome"] == "published" and list(done["commits"]) == [str(lake.T("orders"))]
    finally:
        watcher.stop()
    assert watcher.torn == [] and watcher.looks > 10
    valid = 0
    for b, rows in rows_at.items():
        try:
            reads.resolve(lake.conn, [lake.T(t) for ts in SINKS.values() for t in ts], barrier=b)
        except BarrierNotValidError:
            continue  # coalesced by a transform that was behind
        valid += 1
        assert check_cut(rest(server, f"barrier-{b}", reader), lake.namespace) == (rows, b)
    assert valid >= 3
    assert check_cut(rest(server, f"read-committed:{lake.namespace}", reader), lake.namespace) == (total, max(rows_at))


@pytest.mark.parametrize(
    "engine,point", [(e, p) for e in ("spark", "duckdb", "pyiceberg") for p in ("before", "after")]
)
def test_a_killed_engine_publishes_nothing_and_the_next_run_writes_the_barrier_once(
    lake, server, tmp_path, engine, point
):
    """kill -9 of the engine's process mid-write (before: nothing or part of its commits staged;
    after: all staged, before it exits): job exec exits 137, nothing is visible; the next run
    computes the same barrier and each sink carries it from that run only."""
    creds = setup_pipeline(lake)
    job = {"spark": "ingest", "duckdb": "count", "pyiceberg": "summarize"}[engine]
    barriers.issue(lake.conn)
    for upstream in list(SINKS)[: list(SINKS).index(job)]:
        job_exec(server, creds[upstream], upstream, command(lake, upstream))
    barriers.issue(lake.conn)
    for upstream in list(SINKS)[: list(SINKS).index(job)]:  # a second barrier: the job has one to compute
        job_exec(server, creds[upstream], upstream, command(lake, upstream, rows=5))
    before = pointers(lake)
    pause = tmp_path / "pause"
    proc = subprocess.Popen(
        exec_args(server, creds[job], job, command(lake, job, spark=engine == "spark")),
        env={**os.environ, "ENGINE_PAUSE": point, "ENGINE_PAUSE_FILE": str(pause)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = wait_pause(proc, pause)
    session = job_sessions.get(lake.conn, job)
    staged = lake.conn.execute("SELECT count(*) AS n FROM catalog_pending WHERE job_name = %s", (job,)).fetchone()["n"]
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 137, err[-3000:]
    assert "killed by SIGKILL" in err and "is not published" in err
    assert staged == (len(SINKS[job]) if point == "after" else 1)  # its first run: creating a sink is staged too
    assert pointers(lake) == before  # nothing visible, not even a created table
    assert lake.conn.execute("SELECT count(*) AS n FROM catalog_pending").fetchone()["n"] == 0
    again = job_exec(server, creds[job], job, command(lake, job, spark=engine == "spark"))
    [done] = again["steps"]
    assert done["barrier"] == session.barrier and done["outcome"] == "published"
    assert "computing it again" in again["stderr"]
    for sink in SINKS[job]:
        t = lake.catalog.load_table(f"{lake.namespace}.{sink}")
        run_id = summary_properties(t.current_snapshot())[SUMMARY_RUN]
        assert run_id != session.run_id
        assert_written_once(lake, sink, session.barrier, run_id)
    if job == "summarize":
        check_cut(lake.catalog, lake.namespace)


def test_refusals_name_the_table_and_the_job_and_publish_nothing(lake, server):
    """Writing a table outside the job's sinks (another job's, or an unmanaged one), reading a
    managed table that is not a declared source, running with a reader's or another job's
    token: one line naming the table and the job; nothing published."""
    creds = setup_pipeline(lake)
    barriers.issue(lake.conn)
    for job in ("ingest", "count"):
        job_exec(server, creds[job], job, command(lake, job))
    before, orders = pointers(lake), str(lake.T("orders"))
    ns = lake.namespace
    for extra, fragment in [
        (
            (f"write:{ns}.orders",),
            f"job summarize may not write {orders}: it writes only its sinks "
            f"(lake.{ns}.audit, lake.{ns}.summary) ({orders} is written by "
            f"job ingest)",
        ),
        ((f"write:{ns}.scratch",), f"job summarize may not write lake.{ns}.scratch"),
        ((f"read:{ns}.orders",), f"job summarize may not read {orders}: it is not one of the job's sources"),
    ]:
        out = job_exec(server, creds["summarize"], "summarize", command(lake, "summarize", extra=extra), expect=1)
        assert fragment in out["stderr"] and "is not published" in out["stderr"]
        assert pointers(lake) == before
    assert jobs.show(lake.conn, "summarize").progress is None
    reader = ":".join(tokens.create(lake.conn, whole_lake=True))
    for cred, fragment in [
        (reader, "(reader) may not run job summarize: a reader token writes nothing"),
        (creds["count"], "(job count) may not run job summarize: use a token of job summarize"),
    ]:
        done = subprocess.run(exec_args(server, cred, "summarize", ["true"]), capture_output=True, text=True)
        assert done.returncode == 1 and fragment in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    admin = ":".join(tokens.create(lake.conn, admin=True))
    out = job_exec(server, admin, "summarize", command(lake, "summarize"))
    assert [s["outcome"] for s in out["steps"]] == ["published"]


def test_batch_mode_coalesces_to_the_newest_barrier_and_anchors_stay_valid(lake, server):
    """After the jobs' first barrier, barriers every 200 ms with anchors among them; then one
    `job exec --once` per job: each ends at the newest barrier, computing once per anchor passed
    (coalescing the rest, skipping nothing that changed), and the cut at every anchor reads
    exact."""
    creds = setup_pipeline(lake)
    start = barriers.issue(lake.conn).barrier
    for job in SINKS:
        job_exec(server, creds[job], job, command(lake, job))
    anchors = []
    for i in range(11):
        if i % 4 == 3:
            anchors.append(anchor(lake.conn))
        else:
            barriers.issue(lake.conn)
        time.sleep(0.2)
    newest = barriers.newest(lake.conn).barrier
    steps = {}
    for job in SINKS:
        out = job_exec(server, creds[job], job, command(lake, job, rows=3), "--once")
        steps[job] = out["steps"]
        assert out["steps"][-1]["barrier"] == newest
        assert jobs.show(lake.conn, job).progress == newest
    assert [s["barrier"] for s in steps["ingest"]] == [*anchors, newest]
    assert {s["plan"] for s in steps["ingest"]} == {"coalesce"}
    for job in ("count", "summarize"):
        assert [s["barrier"] for s in steps[job]] == [*anchors, newest]
    reader = ":".join(tokens.create(lake.conn, whole_lake=True))
    for i, a in enumerate(anchors):
        assert check_cut(rest(server, f"barrier-{a}", reader), lake.namespace) == (10 + 3 * (i + 1), a)
    between = sorted(b.barrier for b in barriers.list_barriers(lake.conn, limit=100) if start < b.barrier < anchors[0])
    assert len(between) == 3
    for table in ("orders", "summary"):  # and the barriers between anchors were coalesced, not computed
        with pytest.raises(BarrierNotValidError, match=f"coalesced it into barrier {anchors[0]}"):
            reads.resolve(lake.conn, [lake.T(table)], barrier=between[1])


def test_a_dead_run_is_fenced_out_and_its_session_taken_over(lake, server, tmp_path):
    """kill -9 of `job exec` itself while its command is inside its write: the session stays held
    (another run is refused) until the hold lapses; the next run takes it over and computes the
    same barrier; the orphaned command, let go, is refused when it commits: the barrier is
    written once, by the new run."""
    creds = setup_pipeline(lake)
    b = barriers.issue(lake.conn).barrier
    pause = tmp_path / "pause"
    proc, orphan = paused_run(server, creds["ingest"], command(lake, "ingest", rows=7), pause, tmp_path / "exec.err")
    old = job_sessions.get(lake.conn, "ingest")
    proc.kill()
    proc.wait()
    refused = job_exec(server, creds["ingest"], "ingest", command(lake, "ingest"), expect=1)
    assert f"job ingest is running (run {old.run_id} holds its session until" in refused["stderr"]
    while job_sessions.get(lake.conn, "ingest").held_until > lake.conn.execute("SELECT now() AS t").fetchone()["t"]:
        time.sleep(0.2)
    out = job_exec(server, creds["ingest"], "ingest", command(lake, "ingest", rows=3))
    [done] = out["steps"]
    assert done["barrier"] == b and "computing it again" in out["stderr"]
    pause.unlink()  # the orphan goes on to commit
    deadline = time.monotonic() + 120
    while not gone(orphan):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    orders = lake.catalog.load_table(f"{lake.namespace}.orders")
    assert orders.scan().to_arrow().num_rows == 3
    assert_written_once(lake, "orders", b, summary_properties(orders.current_snapshot())[SUMMARY_RUN])
    assert lake.conn.execute("SELECT count(*) AS n FROM catalog_pending").fetchone()["n"] == 0


def test_a_follow_run_started_while_a_dead_one_holds_the_session_waits_for_it(lake, server, tmp_path):
    """A supervisor restarting `job exec --follow` at once after it was killed meets the dead run's
    hold: the new run says so, waits for the hold to lapse, takes the session over and publishes
    (it does not exit)."""
    creds = setup_pipeline(lake)
    b = barriers.issue(lake.conn).barrier
    pause = tmp_path / "pause"
    first, orphan = paused_run(server, creds["ingest"], command(lake, "ingest", rows=7), pause, tmp_path / "first.err")
    first.kill()
    first.wait()
    os.kill(orphan, signal.SIGKILL)
    log = tmp_path / "second.log"
    with open(log, "w") as out:
        second = subprocess.Popen(
            exec_args(server, creds["ingest"], "ingest", command(lake, "ingest", rows=3), "--follow", "--poll", "1s"),
            stdout=out,
            stderr=out,
        )
    try:
        wait_progress(lake, "ingest", b, second, log)
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, log.read_text()[-3000:]
    assert "asking again until it ends" in log.read_text()


def test_a_publish_cut_short_is_adopted_without_running_the_command_again(lake, server):
    """A run whose command succeeded but whose publish never happened (the session marked
    succeeded, the barrier not published): the next run publishes what it staged, without
    running its command (`false` would fail)."""
    from icebarrier.apps.job_exec import SessionClient

    creds = setup_pipeline(lake)
    b = barriers.issue(lake.conn).barrier
    opened = SessionClient(server, creds["ingest"]).open("ingest", skip=True, coalesce=True, hold_s=0.1)
    run_id = opened["session"]["run_id"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYICEBERG_")}
    env.update(
        {
            "PYICEBERG_CATALOG__LAKE__TYPE": "rest",
            "PYICEBERG_CATALOG__LAKE__URI": server,
            "PYICEBERG_CATALOG__LAKE__WAREHOUSE": f"job:ingest@{run_id}",
            "PYICEBERG_CATALOG__LAKE__CREDENTIAL": creds["ingest"],
            "ICEBARRIER_CATALOG": "lake",
            "ICEBARRIER_BARRIER": str(b),
        }
    )
    subprocess.run(command(lake, "ingest", rows=4), env=env, check=True)
    job_sessions.mark_succeeded(lake.conn, "ingest", run_id)
    assert str(lake.T("orders")) not in {f"lake.{lake.namespace}.{t}" for t in pointers(lake)}
    time.sleep(0.2)  # the hold lapses
    out = job_exec(server, creds["ingest"], "ingest", ["false"])
    assert [(s["barrier"], s["outcome"]) for s in out["steps"]] == [(b, "adopted")]
    assert lake.catalog.load_table(f"{lake.namespace}.orders").scan().to_arrow().num_rows == 4
    assert jobs.show(lake.conn, "ingest").progress == b


def test_a_session_outrun_by_its_job_is_refused_and_planned_anew(lake, server):
    """Barriers completed outside an open session (another writer, a revision) leave it stale:
    its requests and its publish are refused naming the job's new progress, and the next run
    plans anew."""
    from icebarrier.apps.job_exec import CatalogRequestError, SessionClient

    creds = setup_pipeline(lake)
    b1 = barriers.issue(lake.conn).barrier
    job_exec(server, creds["ingest"], "ingest", command(lake, "ingest"))
    client = SessionClient(server, creds["ingest"])
    b2 = barriers.issue(lake.conn).barrier
    run_id = client.open("ingest", skip=True, coalesce=True, hold_s=30)["session"]["run_id"]
    jobs.complete(lake.conn, "ingest", b2)  # outside the session
    with pytest.raises(CatalogRequestError, match=f"planned from barrier {b1}, but the job is now at {b2}"):
        client.publish("ingest", run_id)
    b3 = barriers.issue(lake.conn).barrier
    out = job_exec(server, creds["ingest"], "ingest", command(lake, "ingest"), "--hold", "1s")
    assert [s["barrier"] for s in out["steps"]] == [b3]


def test_follow_runs_the_command_once_per_barrier_and_stops_on_sigterm(lake, server, tmp_path):
    """`job exec --follow` of the DuckDB transform while the root job completes three barriers:
    it completes each (or coalesces those it was behind on), says what it waits for while idle,
    and SIGTERM while idle stops it with exit 0."""
    creds = setup_pipeline(lake)
    with open(tmp_path / "follow.err", "w") as err:
        follow = subprocess.Popen(
            exec_args(server, creds["count"], "count", command(lake, "count"), "--follow", "--poll", "100ms"),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    marks = []
    for rows in (2, 3, 4):
        marks.append(barriers.issue(lake.conn).barrier)
        job_exec(server, creds["ingest"], "ingest", command(lake, "ingest", rows=rows))
        wait_progress(lake, "count", marks[-1], follow, tmp_path / "follow.err")
    while "waiting for" not in (tmp_path / "follow.err").read_text().split("published")[-1]:
        time.sleep(0.1)
    follow.send_signal(signal.SIGTERM)
    out, _ = follow.communicate(timeout=60)
    assert follow.returncode == 0, (tmp_path / "follow.err").read_text()
    summary = json.loads(out)
    assert summary["stopped_by_signal"] and [s["barrier"] for s in summary["steps"]] == marks
    counts = lake.catalog.load_table(f"{lake.namespace}.by_barrier").scan().to_arrow().to_pylist()
    assert sorted((r["barrier"], r["n"]) for r in counts) == list(zip(marks, (2, 3, 4)))


FAILS_FIRST = """
import os, subprocess, sys
tries = sys.argv[1]
n = int(open(tries).read()) if os.path.exists(tries) else 0
open(tries, "w").write(str(n + 1))
sys.exit(3 if n < 2 else subprocess.call(sys.argv[2:]))
"""


def test_follow_runs_a_barrier_whose_command_failed_again(lake, server, tmp_path):
    """`job exec --follow` whose command fails twice (as one does when the catalog fails over
    under it), then succeeds: it stays up, runs the same barrier again, and publishes it once."""
    creds = setup_pipeline(lake)
    mark = barriers.issue(lake.conn).barrier
    job_exec(server, creds["ingest"], "ingest", command(lake, "ingest", rows=4))
    (tmp_path / "fails_first.py").write_text(FAILS_FIRST)
    flaky = [sys.executable, str(tmp_path / "fails_first.py"), str(tmp_path / "tries"), *command(lake, "count")]
    with open(tmp_path / "follow.err", "w") as err:
        follow = subprocess.Popen(
            exec_args(server, creds["count"], "count", flaky, "--follow", "--poll", "100ms"),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    wait_progress(lake, "count", mark, follow, tmp_path / "follow.err")
    follow.send_signal(signal.SIGTERM)
    out, _ = follow.communicate(timeout=60)
    log = (tmp_path / "follow.err").read_text()
    assert follow.returncode == 0, log
    assert "(2 of 5 in a row before job exec gives up)" in log, log
    outcomes = [(s["barrier"], s["outcome"]) for s in json.loads(out)["steps"]]
    assert outcomes == [(mark, "failed"), (mark, "failed"), (mark, "published")], outcomes
    counts = lake.catalog.load_table(f"{lake.namespace}.by_barrier").scan().to_arrow().to_pylist()
    assert [(r["barrier"], r["n"]) for r in counts] == [(mark, 4)]


def test_a_session_lists_the_sinks_it_created_and_only_it_sees_them(lake, server):
    """A first run creates its sink through its session: `list tables` through the session shows
    it before publishing, and a scan of it planned on the server through the session reads what
    the session staged; through latest (and other jobs) it is not there until published."""
    import requests

    from tests.iceberg_ext.catalog_server import access_token

    creds = setup_pipeline(lake)
    mark = barriers.issue(lake.conn).barrier
    client_id, secret = creds["ingest"].split(":")
    auth = {"Authorization": f"Bearer {access_token(server, client_id, secret)}"}
    opened = requests.post(f"{server}/icebarrier/v1/jobs/ingest/session", json={}, headers=auth, timeout=30).json()
    assert opened["ready"], opened
    session = rest(server, "job", creds["ingest"])
    latest = rest(server, "latest", creds["ingest"])
    created = session.create_table(
        f"{lake.namespace}.orders", schema=pa.schema([("id", pa.int64()), ("barrier", pa.int64())])
    )
    assert (lake.namespace, "orders") in session.list_tables(lake.namespace)
    created.append(pa.table({"id": [1, 2], "barrier": [mark, mark]}))  # staged in the session
    on_server = rest(server, "job", creds["ingest"], **{"scan-planning-mode": "server"})
    assert on_server.load_table(f"{lake.namespace}.orders").scan().to_arrow().num_rows == 2  # planned there
    assert (lake.namespace, "orders") not in latest.list_tables(lake.namespace)
    assert (lake.namespace, "orders") not in rest(server, "latest", creds["count"]).list_tables(lake.namespace)
    published = requests.post(
        f"{server}/icebarrier/v1/jobs/ingest/session/publish",
        json={"run_id": opened["session"]["run_id"]},
        headers=auth,
        timeout=30,
    )
    assert published.status_code == 200, published.text
    assert (lake.namespace, "orders") in latest.list_tables(lake.namespace)
