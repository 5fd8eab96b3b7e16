"""The control plane on a primary and a synchronous standby (apps/pg_pair.py): the primary killed
with -9 and the standby promoted, every component follows the promotion without a restart, and
nothing a client saw succeed is lost. Real clusters, real servers, real clients."""

from __future__ import annotations

import collections
import re
import shlex
import subprocess
import threading
import time

import pyarrow as pa
import pytest
import requests

from icebarrier.apps.embedded import CLI
from icebarrier.control_plane import barriers, db, jobs, leases, schema, targets, tokens, upkeep
from icebarrier.control_plane.model import Level
from icebarrier.control_plane.targets import Runner
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.reads import ConsistentRead
from tests.helpers import LoggedProcess
from tests.iceberg_ext.catalog_server import Pipeline, access_token, free_port, rest, start_server, stop_server
from tests.iceberg_ext.conftest import _lake
from tests.iceberg_ext.test_job_exec import PIPELINE_TABLES, SINKS, check_rows, command, setup_pipeline

ROW = pa.schema([("id", pa.int64())])


@pytest.fixture
def pair_lake(pg_pair, warehouse, monkeypatch):
    """A lake whose control plane and SQL catalog live on the pair, every client given its
    multi-host DSN."""
    Settings(dsn=pg_pair.dsn()).ensure_catalog_schema()
    yield from _lake(pg_pair.dsn(), str(warehouse), monkeypatch)


def _snapshots(server: str, path: str, headers: dict) -> int | None:
    """How many snapshots a load through ``server`` shows (None: it failed)."""
    try:
        r = requests.get(f"{server}/v1/{path}", headers=headers, timeout=30)
    except requests.RequestException:
        return None
    return len(r.json()["metadata"]["snapshots"]) if r.status_code == 200 else None


def _until(what, timeout_s: float = 60, *, every_s: float = 0.05):
    """Call ``what`` until it answers something true; that answer."""
    deadline = time.monotonic() + timeout_s
    while not (answer := what()):
        assert time.monotonic() < deadline, f"{what} never succeeded"
        time.sleep(every_s)
    return answer


def _append(table, i: int) -> bool:
    """One row appended (a commit through whatever catalog ``table`` came from); False if refused."""
    try:
        table.refresh().append(pa.table({"id": [i]}, schema=ROW))
        return True
    except Exception:  # noqa: BLE001 - the control plane is away: the commit was not acknowledged
        return False


@pytest.mark.slow
def test_two_servers_follow_a_promotion_and_nothing_acknowledged_is_lost(pair_lake, pg_pair):
    """Two `serve` processes (two hosts) and the SQL catalog written directly, as Spark's JDBC
    catalog does. A commit through either is seen by the next load through the other. The primary
    dies: /readyz says postgres until the standby is promoted; then both servers load and commit
    again without a restart, every acknowledged commit is there, and their memory of loads caught
    up (a load never shows less than the commits acknowledged before it)."""
    lake = pair_lake
    pipeline = Pipeline(lake, {"ingest": ["orders"]})
    pipeline.advance()
    lake.catalog.create_table(f"{lake.namespace}.events", schema=ROW)
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    jid, jsecret = tokens.create(lake.conn, job=f"{lake.namespace}_ingest", whole_lake=True)
    (proc_a, a), (proc_b, b) = start_server(lake), start_server(lake)
    try:
        headers = {"Authorization": f"Bearer {access_token(a, rid, rsecret)}"}
        path = f"latest/namespaces/{lake.namespace}/tables/events"
        through = {s: rest(s, "latest", f"{jid}:{jsecret}").load_table(f"{lake.namespace}.events") for s in (a, b)}
        directly = lake.catalog.load_table(f"{lake.namespace}.events")
        acked = 0
        for i in range(6):  # read your writes across servers
            writer = [through[a], through[b], directly][i % 3]
            assert _append(writer, i)
            acked += 1
            assert _snapshots(b, path, headers) == acked and _snapshots(a, path, headers) == acked

        died = pg_pair.kill_primary()
        assert requests.get(f"{a}/readyz", timeout=30).json() == {"status": "not ready", "failing": ["postgres"]}
        promotion_s = pg_pair.promote()
        loaded_at = _until(lambda: _snapshots(b, path, headers) == acked and time.monotonic())
        committed_at = _until(lambda: _append(through[a], 100) and time.monotonic())
        acked += 1
        lake.conn = db.connect(pg_pair.dsn(), lake.settings.schema)
        barrier = pipeline.advance()  # the barrier, its commit and its completion on the new primary
        completed_at = time.monotonic()
        assert jobs.show(lake.conn, f"{lake.namespace}_ingest").progress == barrier

        for i in range(6):  # both servers' memory follows the new primary's notices
            writer = [through[b], directly, through[a]][i % 3]
            assert _append(writer, 200 + i)
            acked += 1
            assert _snapshots(a, path, headers) == acked and _snapshots(b, path, headers) == acked
        assert requests.get(f"{b}/readyz", timeout=30).json() == {"status": "ready"}
        print(
            f"promotion {promotion_s:.2f} s; from the primary's death: first load {loaded_at - died:.2f} s, "
            f"first commit {committed_at - died:.2f} s, first completed barrier {completed_at - died:.2f} s"
        )
    finally:
        errors = [stop_server(proc_a), stop_server(proc_b)]
    for err in errors:
        assert "Traceback" not in err, err[-3000:]


def test_several_hosts_need_target_session_attrs():
    done = subprocess.run(
        ["icebarrier", "--dsn", "host=db1,db2 port=5432,5433 user=postgres", "barrier", "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "names 2 hosts (db1:5432, db2:5433) without target_session_attrs" in lines[0]
    assert "target_session_attrs=read-write" in lines[0]


@pytest.mark.slow
def test_a_dsn_of_standbys_only_is_refused_in_one_line(pg_pair):
    """The CLI and `serve` given only the standby: one line saying so, a non-zero exit."""
    standby = pg_pair.standby
    dsn = f"host=127.0.0.1 port={standby.port} user=postgres target_session_attrs=read-write"
    for args in (["barrier", "list"], ["serve", "--port", str(free_port())]):
        done = subprocess.run(["icebarrier", "--dsn", dsn, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert "is a standby (read-only)" in lines[0] and "promote" in lines[0], lines[0]


@pytest.mark.slow
def test_job_exec_jobs_resume_on_their_own_after_a_failover(pair_lake, pg_pair, tmp_path):
    """`job exec --follow` of a PyIceberg root and a DuckDB transform through a server, barriers
    every second; the primary killed and the standby promoted mid-run. Neither process exits; both
    go on completing barriers, and every barrier is written once."""
    from tests.iceberg_ext.test_job_exec import exec_args

    lake = pair_lake
    creds = setup_pipeline(lake)
    proc, server = start_server(lake)
    followers: dict[str, subprocess.Popen] = {}
    try:
        for job in ("ingest", "count"):
            with open(tmp_path / f"{job}.err", "w") as err:
                args = exec_args(server, creds[job], job, command(lake, job, rows=3), "--follow", "--poll", "100ms")
                followers[job] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)
        barriers.set_interval_s(lake.conn, 1)

        def progress():
            for job, p in followers.items():
                assert p.poll() is None, f"{job}: {(tmp_path / f'{job}.err').read_text()[-3000:]}"
            return jobs.show(lake.conn, "count").progress

        _until(progress, 120, every_s=0.2)
        pg_pair.fail_over()
        lake.conn = db.connect(pg_pair.dsn(), lake.settings.schema)
        after = [_until(progress, 60, every_s=0.2)]
        for _ in range(3):
            after.append(_until(lambda: (p := progress()) is not None and p > after[-1] and p, 120, every_s=0.2))
    finally:
        for p in followers.values():
            p.terminate()
        for p in followers.values():
            p.wait(60)
        err = stop_server(proc)
    assert "Traceback" not in err, err[-3000:]
    orders = lake.catalog.load_table(f"{lake.namespace}.orders").scan().to_arrow().to_pylist()
    counted = lake.catalog.load_table(f"{lake.namespace}.by_barrier").scan().to_arrow().to_pylist()
    per_barrier: dict[int, int] = {}
    for row in orders:
        per_barrier[row["barrier"]] = per_barrier.get(row["barrier"], 0) + 1
    assert all(n == 3 for n in per_barrier.values()), "a barrier written twice"
    pairs = [(r["barrier"], r["n"]) for r in counted]
    assert len(pairs) == len({b for b, _ in pairs}), "a barrier counted twice"
    assert all(per_barrier.get(b) == n for b, n in pairs)


@pytest.mark.slow
def test_a_standby_lagging_past_the_bound_is_refused_in_one_line(pg_pair):
    """`db status` names each standby and its lag; with the standby's replay paused and a commit
    waiting for it, past ICEBARRIER_STANDBY_MAX_LAG it exits 1 in one line naming the setting."""
    import os

    env = {**os.environ, "ICEBARRIER_DSN": pg_pair.dsn(), "ICEBARRIER_STANDBY_MAX_LAG": "1s"}
    upgrade = subprocess.run(["icebarrier", "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120)
    assert upgrade.returncode == 0, upgrade.stderr
    standby = f"127.0.0.1:{pg_pair.standby.port}"
    ok = subprocess.run(["icebarrier", "db", "status"], env=env, capture_output=True, text=True, timeout=60)
    said = re.search(rf"standby {re.escape(standby)}: replays (\d+\.\d) s behind", ok.stdout)
    assert ok.returncode == 0 and said and float(said[1]) < 1, ok.stdout + ok.stderr  # what it received, replayed
    with db.connect(pg_pair.standby.dsn(), check_schema=False) as conn:
        conn.execute("SELECT pg_wal_replay_pause()")
    with db.connect(pg_pair.dsn()) as conn:  # acknowledged (flushed on the standby), not replayed there
        barriers.issue(conn)
    time.sleep(1.5)
    late = subprocess.run(["icebarrier", "db", "status"], env=env, capture_output=True, text=True, timeout=60)
    assert late.returncode == 1, late.stdout + late.stderr
    lines = late.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in late.stderr, late.stderr
    assert f"the standby at {standby} replays" in lines[0] and "ICEBARRIER_STANDBY_MAX_LAG=1s" in lines[0], lines[0]


class _Reader(threading.Thread):
    """Consistent reads of the pipeline's four tables at ``level``, one after another, each
    checked against the pipeline's invariant, on a connection of its own (reopened when it fails:
    the primary died). ``violations``: reads that broke the invariant; ``ok``: when reads succeeded."""

    def __init__(self, lake, level: Level) -> None:
        super().__init__(daemon=True)
        self.lake, self.level = lake, level
        self.names = [lake.T(t) for t in PIPELINE_TABLES]
        self.ok: list[float] = []
        self.failed: list[str] = []
        self.violations: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                with db.connect(self.lake.settings.dsn, self.lake.settings.schema) as conn:
                    while not self.halt.is_set():
                        with ConsistentRead(
                            conn, self.lake.catalog, self.names, level=self.level, ttl_s=10, holder="reader"
                        ) as r:
                            cut, data = r.read()
                        try:
                            check_rows({t.name: rows for t, rows in data.items()})
                        except AssertionError as exc:
                            self.violations.append(f"barrier {cut.barrier}: {exc}")
                        self.ok.append(time.monotonic())
                        self.halt.wait(0.3)
            except Exception as exc:  # noqa: BLE001 - the control plane is away: read again on a new connection
                self.failed.append(f"{time.monotonic():.1f} {type(exc).__name__}: {str(exc)[:200]}")
                self.halt.wait(0.2)


@pytest.mark.slow
def test_a_scheduled_pipeline_with_readers_and_maintenance_survives_losing_its_primary(pair_lake, pg_pair, tmp_path):
    """The issue's failover test. `icebarrier schedule` runs a three-job `job exec` pipeline
    (PyIceberg, DuckDB, PyIceberg) through `serve` at 1-s barriers; `icebarrier maintain` expires
    snapshots two seconds old; readers read at read-committed and repeatable-read the whole time.
    The primary is killed with -9 and the standby promoted. Then: every barrier completion, token
    and lease a client saw succeed is on the new primary; every read was consistent, and the
    repeatable-read session reads what it read before; the schedule, the maintenance service and
    the jobs go on by themselves; each barrier is written once."""
    lake = pair_lake
    setup_pipeline(lake)  # the jobs registered (their tokens unused: the schedule runs them as the admin)
    for job in SINKS:
        targets.set_runner(lake.conn, job, Runner(kind="command", spec=shlex.join(command(lake, job, rows=3))))
    targets.set_target_lag(lake.conn, lake.T("summary"), 15)
    barriers.set_interval_s(lake.conn, 1)
    admin = ":".join(tokens.create(lake.conn, admin=True))
    proc, server = start_server(lake)
    scheduler = LoggedProcess([*CLI, "schedule", "--catalog-uri", server, "--credential", admin], tmp_path / "s.log")
    maintainer = LoggedProcess([*CLI, "maintain", "--every", "1s"], tmp_path / "maintain.log")
    readers = [_Reader(lake, Level.READ_COMMITTED), _Reader(lake, Level.REPEATABLE_READ)]
    session = None
    try:
        scheduler.wait_for("schedule: running")
        maintainer.wait_for("maintain: running")
        _until(lambda: jobs.show(lake.conn, "summarize").progress, 180, every_s=0.5)  # the first refresh
        for table in PIPELINE_TABLES:  # expiry as eager as it gets: only what is protected stays
            upkeep.set_policy(lake.conn, lake.T(table), {"retain_s": 2, "retain_last": 1})
        for reader in readers:
            reader.start()
        # a lease outlives a failover when its TTL outlasts the promotion, which on a loaded machine
        # takes tens of seconds (CI: a 30-s lease lapsed before the standby took writes)
        session = ConsistentRead(
            lake.conn, lake.catalog, readers[0].names, level=Level.REPEATABLE_READ, ttl_s=120, holder="rr session"
        ).__enter__()
        first_cut, first = session.read()
        check_rows({t.name: rows for t, rows in first.items()})
        token_id, token_secret = tokens.create(lake.conn, name="made just before the failover", whole_lake=True)
        _until(lambda: all(r.ok for r in readers), 60)
        # the primary dies while the schedule's next refresh is under way: a run in flight
        _until(lambda: scheduler.log().count("job count: run started") >= 2, 120, every_s=0.1)
        seen = jobs.show(lake.conn, "summarize").progress  # acknowledged: read on the primary
        newest = barriers.newest(lake.conn).barrier
        maintained = len(maintainer.lines)

        died, promotion_s = pg_pair.fail_over()
        lake.conn = db.connect(pg_pair.dsn(), lake.settings.schema)
        assert jobs.show(lake.conn, "summarize").progress >= seen
        assert barriers.newest(lake.conn).barrier >= newest
        assert leases.get(lake.conn, first_cut.lease_id).state == "active"  # the repeatable-read session's
        access_token(server, token_id, token_secret)  # the token answers through the server
        issued_at = _until(lambda: barriers.newest(lake.conn).barrier > newest and time.monotonic(), 60)
        resumed_at = _until(lambda: jobs.show(lake.conn, "summarize").progress > newest and time.monotonic(), 180)
        again = _until(lambda: all(r.ok and r.ok[-1] > resumed_at for r in readers) and time.monotonic(), 60)
        cut, rows = session.read()  # the same cut, its snapshots kept by its lease through the switch
        assert cut.barrier == first_cut.barrier
        assert {t: d.to_pylist() for t, d in rows.items()} == {t: d.to_pylist() for t, d in first.items()}
        _until(lambda: any("expire done" in line for line in maintainer.lines[maintained:]), 60)
        for service in (scheduler, maintainer, proc):
            assert (service.proc if service is not proc else proc).poll() is None, "a service exited"
        print(
            f"promotion {promotion_s:.2f} s; from the primary's death: a barrier issued {issued_at - died:.2f} s, "
            f"the pipeline's last job past it {resumed_at - died:.2f} s, both readers again {again - died:.2f} s"
        )
    finally:
        for reader in readers:
            reader.halt.set()
        if session is not None:
            session.__exit__(None, None, None)
        scheduler.kill_group()
        maintainer.kill_group()
        err = stop_server(proc)
    for reader in readers:
        reader.join(30)
        assert not reader.violations, reader.violations[:3]
    assert "Traceback" not in err, err[-3000:]
    for service in (scheduler, maintainer):
        assert "Traceback" not in service.log(), service.log()[-3000:]
    assert scheduler.log().count("schedule: running") == 2, scheduler.log()[-3000:]
    assert maintainer.log().count("maintain: running") == 2, maintainer.log()[-3000:]
    orders = lake.catalog.load_table(f"{lake.namespace}.orders").scan().to_arrow()
    per_barrier = collections.Counter(orders["barrier"].to_pylist())
    assert set(per_barrier.values()) == {3}, f"a barrier written twice: {per_barrier}"
    counted = lake.catalog.load_table(f"{lake.namespace}.by_barrier").scan().to_arrow()["barrier"].to_pylist()
    assert len(counted) == len(set(counted)), "a barrier counted twice"


@pytest.mark.slow
def test_what_asynchronous_replication_loses(pg_pair):
    """docs/failover.md, "Asynchronous replication": the standby cut off from the primary. With
    synchronous replication a barrier's commit is not acknowledged (it waits for the standby), so
    losing the primary loses nothing a client saw. Asynchronous (the setting cleared, as Patroni
    does without synchronous_mode_strict), that commit and the next are acknowledged at once; the
    primary dies, the standby is promoted, and both are gone."""
    schema.upgrade(pg_pair.dsn(), "icebarrier")
    with db.connect(pg_pair.dsn()) as conn:
        kept = barriers.issue(conn)
    pg_pair.cut_off_standby()
    acknowledged: list[int] = []

    def issue() -> None:
        with db.connect(pg_pair.dsn()) as conn:
            acknowledged.append(barriers.issue(conn).barrier)

    waiting = threading.Thread(target=issue, daemon=True)
    waiting.start()
    waiting.join(2)
    assert not acknowledged, "a commit the standby lacks was acknowledged under synchronous replication"
    pg_pair.replicate_synchronously(False)
    waiting.join(30)
    issue()
    assert len(acknowledged) == 2, "asynchronous: both acknowledged"
    pg_pair.fail_over()
    with db.connect(pg_pair.dsn()) as conn:
        assert barriers.newest(conn).barrier == kept.barrier  # both acknowledged barriers are lost
        lost = conn.execute("SELECT count(*) AS n FROM barriers WHERE barrier = ANY(%s)", (acknowledged,)).fetchone()
    assert lost["n"] == 0
