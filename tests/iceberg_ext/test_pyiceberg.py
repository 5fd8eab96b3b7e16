"""Barrier-tagged commits, reads, expiry, reconcile and revision through PyIceberg (no JVM)."""

import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from icebarrier.control_plane import barriers, jobs, leases, tables
from icebarrier.control_plane.errors import BarrierNotValidError, SnapshotExpiredError
from icebarrier.control_plane.model import Level
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER, SUMMARY_JOB, barrier_of, load_table, summary_properties
from icebarrier.iceberg_ext.commits import BarrierCommit, DuplicateWriteError
from icebarrier.iceberg_ext.faults import AFTER_ICEBERG_COMMIT, CRASH_EXIT_CODE
from icebarrier.iceberg_ext.maintenance import expire, reconcile, revise
from icebarrier.iceberg_ext.reads import LEASE_TAG_PREFIX, ConsistentRead
from tests.iceberg_ext import pipeline
from tests.iceberg_ext.pipeline import compute_report, compute_totals, ingest, run_barrier


def rows(lake, name, snapshot_id=None):
    tbl = load_table(lake.catalog, lake.T(name))
    return tbl.scan(snapshot_id=snapshot_id).to_arrow() if snapshot_id else tbl.scan().to_arrow()


def test_commits_carry_the_barrier_and_are_recorded(lake):
    """Each write's snapshot summary names barrier, job and run; the map records it."""
    pipeline.setup(lake)
    b = run_barrier(lake, 1)
    tbl = load_table(lake.catalog, lake.T("orders"))
    props = summary_properties(tbl.current_snapshot())
    assert props[SUMMARY_BARRIER] == str(b) and props[SUMMARY_JOB] == "ingest" and props["icebarrier.run"]
    cut = __import__("icebarrier.control_plane.reads", fromlist=["x"]).resolve(
        lake.conn, [lake.T("orders"), lake.T("totals"), lake.T("report")]
    )
    assert cut.barrier == b
    assert cut.snapshots[lake.T("orders")] == tbl.current_snapshot().snapshot_id
    assert rows(lake, "report")["grand_total"].to_pylist() == [50]


def test_a_crash_after_the_iceberg_commit_is_adopted_on_restart(lake):
    """A job killed between the Iceberg commit and the control-plane record (a real process)
    finds its snapshot on restart and adopts it: no duplicate rows, the barrier completes."""
    pipeline.setup(lake)
    b = barriers.issue(lake.conn).barrier
    args = [
        sys.executable,
        "-m",
        "tests.iceberg_ext.worker",
        "ingest",
        lake.settings.dsn,
        lake.settings.schema,
        lake.settings.warehouse,
        lake.namespace,
        str(b),
        "1",
    ]
    crashed = subprocess.run(
        args, env={**os.environ, "ICEBARRIER_FAULT": AFTER_ICEBERG_COMMIT}, capture_output=True, text=True, timeout=120
    )
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr
    assert tables.states(lake.conn, [lake.T("orders")])[0].watermark is None  # not recorded
    assert barrier_of(load_table(lake.catalog, lake.T("orders")).current_snapshot()) == b  # but committed
    restarted = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert restarted.returncode == 0, restarted.stderr
    result = json.loads(restarted.stdout)
    assert result["adopted"] == [str(lake.T("orders"))] and not result["noop"]
    assert rows(lake, "orders").num_rows == 5
    assert len(load_table(lake.catalog, lake.T("orders")).metadata.snapshots) == 1
    assert tables.states(lake.conn, [lake.T("orders")])[0].watermark == b


def test_replaying_a_completed_barrier_writes_nothing(lake):
    """Running a completed barrier again skips every write and is a no-op."""
    pipeline.setup(lake)
    b = run_barrier(lake, 1)
    tx = ingest(lake, b, 1)
    assert tx.completion.noop and rows(lake, "orders").num_rows == 5


def test_one_write_per_table_and_barrier(lake):
    """Writing the same table twice for one barrier is refused."""
    pipeline.setup(lake)
    b = barriers.issue(lake.conn).barrier
    with pytest.raises(DuplicateWriteError, match="one commit"):
        with BarrierCommit(lake.conn, lake.catalog, job="ingest", barrier=b) as tx:
            tx.append_arrow(lake.T("orders"), pipeline.orders_batch(1))
            tx.append_arrow(lake.T("orders"), pipeline.orders_batch(2))
    assert tables.states(lake.conn, [lake.T("orders")])[0].watermark is None


def test_levels_read_uncommitted_mixes_moments_read_committed_does_not(lake):
    """With orders ahead of totals, read-uncommitted sees totals that disagree with orders;
    read-committed sees both at the same barrier; as-of reads a past cut."""
    pipeline.setup(lake)
    b1 = run_barrier(lake, 1)
    b2 = barriers.issue(lake.conn).barrier
    ingest(lake, b2, 2)  # orders at b2, totals/report still at b1
    names = [lake.T("orders"), lake.T("totals")]

    def consistent(data):
        return sum(data[lake.T("orders")]["amount"].to_pylist()) == sum(data[lake.T("totals")]["total"].to_pylist())

    with ConsistentRead(lake.conn, lake.catalog, names, level=Level.READ_UNCOMMITTED) as r:
        assert not consistent(r.read()[1])
    with ConsistentRead(lake.conn, lake.catalog, names, level=Level.READ_COMMITTED) as r:
        cut, data = r.read()
        assert cut.barrier == b1 and consistent(data)
    compute_totals(lake, b2)
    with ConsistentRead(lake.conn, lake.catalog, names, barrier=b1) as r:
        cut, data = r.read()
        assert cut.barrier == b1 and consistent(data) and data[lake.T("orders")].num_rows == 5
    with pytest.raises(BarrierNotValidError):
        ConsistentRead(lake.conn, lake.catalog, [lake.T("report")], barrier=b2).__enter__()


def test_repeatable_read_is_stable_and_leased(lake):
    """Every statement in a repeatable-read block sees the same data while jobs commit; the
    lease (mirrored as a tag) protects the cut and is released at exit."""
    pipeline.setup(lake)
    run_barrier(lake, 1)
    names = [lake.T("orders"), lake.T("totals"), lake.T("report")]
    with ConsistentRead(lake.conn, lake.catalog, names, level=Level.REPEATABLE_READ, mirror_tags=True) as r:
        first = r.read()[1]
        lease_id = r.cut().lease_id
        assert LEASE_TAG_PREFIX + lease_id in load_table(lake.catalog, lake.T("orders")).metadata.refs
        run_barrier(lake, 2)
        run_barrier(lake, 3)
        again = r.read()[1]
        assert {t: d.to_pylist() for t, d in first.items()} == {t: d.to_pylist() for t, d in again.items()}
        assert [x.lease_id for x in leases.list_leases(lake.conn)] == [lease_id]
    assert leases.list_leases(lake.conn) == []
    assert LEASE_TAG_PREFIX + lease_id not in load_table(lake.catalog, lake.T("orders")).metadata.refs
    with ConsistentRead(lake.conn, lake.catalog, names, level=Level.READ_COMMITTED) as r:
        assert r.read()[1][lake.T("report")]["grand_total"].to_pylist() == [150]


def test_expiry_keeps_protected_snapshots_and_deletes_files(lake):
    """Expiry removes unprotected snapshots and their files, keeps leased and current ones,
    and a lease on an expired snapshot is refused."""
    pipeline.setup(lake)
    marks = [run_barrier(lake, i) for i in range(1, 5)]
    pinned = leases.acquire(lake.conn, [lake.T("orders")], ttl_s=600, holder="keep", barrier=marks[1])
    dry = expire(lake.conn, lake.catalog, lake.T("orders"), dry_run=True)
    assert dry.files_deleted == 0 and len(load_table(lake.catalog, lake.T("orders")).metadata.snapshots) == 4
    report = expire(lake.conn, lake.catalog, lake.T("orders"))
    orders_snaps = {m: s for m, s in zip(marks, _recorded(lake, "orders"))}
    assert set(report.expired) == {orders_snaps[marks[0]], orders_snaps[marks[2]]}
    assert report.files_deleted > 0
    assert f"lease:{pinned.lease_id}" in report.protected[orders_snaps[marks[1]]]
    remaining = {s.snapshot_id for s in load_table(lake.catalog, lake.T("orders")).metadata.snapshots}
    assert remaining == {orders_snaps[marks[1]], orders_snaps[marks[3]]}
    assert rows(lake, "orders", orders_snaps[marks[1]]).num_rows == 10  # still readable
    for path in _data_files(lake, "orders"):
        assert os.path.exists(path.removeprefix("file://"))
    with pytest.raises(SnapshotExpiredError):
        ConsistentRead(
            lake.conn, lake.catalog, [lake.T("orders")], level=Level.REPEATABLE_READ, barrier=marks[0]
        ).__enter__()


def _recorded(lake, name):
    return [
        r["snapshot_id"]
        for r in lake.conn.execute(
            "SELECT c.snapshot_id FROM table_commit c JOIN managed_table m USING (table_id) WHERE m.name = %s "
            "ORDER BY c.barrier",
            (str(lake.T(name)),),
        ).fetchall()
    ]


def _data_files(lake, name):
    tbl = load_table(lake.catalog, lake.T(name))
    return [t.file.file_path for t in tbl.scan().plan_files()]


def test_lease_acquisition_racing_expiry_in_processes(lake, capsys):
    """Many rounds of leases racing expiry in separate processes: no leased snapshot is ever
    expired, and leases whose snapshot was already gone are refused."""
    pipeline.setup(lake)
    barriers.set_interval_s(lake.conn, 0.001)
    for i in range(1, 31):
        b = barriers.issue(lake.conn).barrier
        ingest(lake, b, i)
    base = [sys.executable, "-m", "tests.iceberg_ext.worker"]
    common = [lake.settings.dsn, lake.settings.schema, lake.settings.warehouse, lake.namespace]
    env = {**os.environ, "RACE_START_AT": str(time.time() + 8)}
    procs = [
        subprocess.Popen([*base, "leases", *common, "40", str(seed)], stdout=subprocess.PIPE, text=True, env=env)
        for seed in (1, 2)
    ]
    procs.append(subprocess.Popen([*base, "expire", *common, "15"], stdout=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    results = [json.loads(o) for o in outs]
    granted = [g for r in results[:2] for g in r["granted"]]
    refused = sum(r["refused"] for r in results[:2])
    expired = set(results[2]["expired"])
    pinned = {snap for _, snap in granted}
    present = {s.snapshot_id for s in load_table(lake.catalog, lake.T("orders")).metadata.snapshots}
    with capsys.disabled():
        print(
            f"\n[expiry race] {len(granted)} leases granted, {refused} refused (snapshot already expired), "
            f"{len(expired)} snapshots expired, {len(pinned & expired)} pinned snapshots expired"
        )
    assert not pinned & expired
    assert pinned <= present
    assert len(granted) + refused == 80 and expired
    assert granted, "no lease was granted: the workers did not race"


def test_reconcile_adopts_missing_records_and_reports_foreign_writers(lake):
    """Reconcile rebuilds a lost map record from the summary and reports a snapshot written
    outside icebarrier as a single-writer violation."""
    pipeline.setup(lake)
    run_barrier(lake, 1)
    lost = _recorded(lake, "orders")[0]
    lake.conn.execute("DELETE FROM table_commit WHERE snapshot_id = %s", (lost,))
    load_table(lake.catalog, lake.T("orders")).append(pipeline.orders_batch(9))  # no barrier tag
    report = reconcile(lake.conn, lake.catalog, lake.T("orders"))
    assert [s for _, s in report.adopted] == [lost]
    foreign = load_table(lake.catalog, lake.T("orders")).current_snapshot().snapshot_id
    assert [s for s, _ in report.foreign] == [foreign] and not report.ok
    assert _recorded(lake, "orders") == [lost]
    assert reconcile(lake.conn, lake.catalog, lake.T("totals")).ok


def test_revision_of_a_three_level_chain(lake):
    """Revising the root to R rolls it and everything downstream back to their snapshots at
    R, resets watermarks and job progress; recomputation then gives the same totals."""
    pipeline.setup(lake)
    marks = [run_barrier(lake, i) for i in range(1, 4)]
    r = marks[0]
    names = [lake.T("orders"), lake.T("totals"), lake.T("report")]
    at_r = __import__("icebarrier.control_plane.reads", fromlist=["x"]).resolve(lake.conn, names, barrier=r).snapshots
    plan = revise(lake.conn, lake.catalog, lake.T("orders"), r, dry_run=True)
    assert [str(t.table) for t in plan.tables] == [str(n) for n in names]
    assert plan.jobs_reset == ["ingest", "report", "totals"]
    assert tables.states(lake.conn, names)[0].watermark == marks[2]  # dry run changed nothing

    revise(lake.conn, lake.catalog, lake.T("orders"), r)
    for name in names:
        assert tables.states(lake.conn, [name])[0].watermark == r
        assert load_table(lake.catalog, name).metadata.current_snapshot_id == at_r[name]
    assert rows(lake, "report")["grand_total"].to_pylist() == [50]
    assert jobs.next_barrier(lake.conn, "ingest", coalesce=False).barrier == marks[1]
    assert jobs.next_barrier(lake.conn, "ingest").barrier == marks[2]  # or one computation for both
    revoked = lake.conn.execute("SELECT count(*) AS n FROM table_commit WHERE revoked_by IS NOT NULL").fetchone()
    assert revoked["n"] == 6  # two barriers x three tables, kept for audit

    for i, b in enumerate(marks[1:], start=2):  # recompute (root replays the same input)
        tx = ingest(lake, b, i)
        assert not tx.adopted  # the undone snapshots are not in the lineage: written anew
        compute_totals(lake, b)
        compute_report(lake, b)
    assert rows(lake, "report")["grand_total"].to_pylist() == [150]
    assert rows(lake, "orders").num_rows == 15
    assert all(reconcile(lake.conn, lake.catalog, n).ok for n in names)


def test_managed_tables_get_commit_retry_properties(lake):
    """A table written through icebarrier gets bounded commit retries for busy tables."""
    pipeline.setup(lake)
    lake.catalog.create_table(lake.namespace + ".plain", schema=pipeline.ORDERS)  # without our properties
    from icebarrier.control_plane.model import JobDefinition

    jobs.register(
        lake.conn, JobDefinition(name="plain", sinks=frozenset([lake.T("plain")]), external_inputs=frozenset(["x"]))
    )
    b = barriers.issue(lake.conn).barrier
    with BarrierCommit(lake.conn, lake.catalog, job="plain", barrier=b) as tx:
        tx.append_arrow(lake.T("plain"), pipeline.orders_batch(1))
    assert load_table(lake.catalog, lake.T("plain")).properties["commit.retry.num-retries"] == "20"


def test_maintenance_commands(lake):
    """expire, revise, reconcile and tag from the CLI: dry runs change nothing, JSON is stable,
    a single-writer violation exits 1."""
    from click.testing import CliRunner

    from icebarrier.cli.main import cli as command

    pipeline.setup(lake)
    marks = [run_barrier(lake, i) for i in range(1, 4)]
    run = CliRunner().invoke

    dry = run(command, ["-o", "json", "expire", "--table", str(lake.T("orders")), "--dry-run"])
    assert dry.exit_code == 0, dry.stderr
    assert (
        json.loads(dry.stdout)[0]["dry_run"] and len(load_table(lake.catalog, lake.T("orders")).metadata.snapshots) == 3
    )
    plan = run(command, ["-o", "json", "revise", str(lake.T("orders")), "--to-barrier", str(marks[0]), "--dry-run"])
    assert plan.exit_code == 0 and json.loads(plan.stdout)["jobs_reset"] == ["ingest", "report", "totals"]
    assert tables.states(lake.conn, [lake.T("orders")])[0].watermark == marks[-1]
    tagged = run(command, ["tag", "v1", str(lake.T("orders")), str(lake.T("report")), "--barrier", str(marks[1])])
    assert tagged.exit_code == 0 and "v1" in load_table(lake.catalog, lake.T("report")).metadata.refs
    assert run(command, ["reconcile"]).exit_code == 0
    load_table(lake.catalog, lake.T("totals")).append(
        pa.table({"customer": pa.array([9], pa.int64()), "total": pa.array([1], pa.int64())})
    )
    bad = run(command, ["reconcile", str(lake.T("totals"))])
    assert bad.exit_code == 1 and "VIOLATION" in bad.stdout and "single-writer" in bad.stderr
    wrong = run(command, ["revise", str(lake.T("orders")), "--to-barrier", "123"])
    assert wrong.exit_code == 1 and "never issued" in wrong.stderr


def _calls_during(fn, *functions) -> list[int]:
    """How many times each of ``functions`` was entered while ``fn`` ran (a profile hook counts)."""
    codes = {f.__code__: i for i, f in enumerate(functions)}
    counts = [0] * len(functions)

    def hook(frame, event, arg):
        if event == "call" and (i := codes.get(frame.f_code)) is not None:
            counts[i] += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def test_an_append_costs_the_same_whatever_the_history(lake):
    """One barrier's append copies the table's metadata and loads the table as often at 40
    snapshots as at 1, and no more than its own commit needs (three copies, two loads): PyIceberg
    0.12 deep-copied the whole metadata, every snapshot included, some twenty times per append."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.table.update import update_table_metadata

    pipeline.setup(lake)
    counted = []
    for n in range(1, 41):
        b = barriers.issue(lake.conn).barrier
        counts = _calls_during(lambda: ingest(lake, b, n), update_table_metadata, SqlCatalog.load_table)  # noqa: B023
        if n in (1, 40):
            counted.append(counts)
    assert counted[0] == counted[1], counted
    copies, loads = counted[1]
    assert copies <= 3 and loads <= 2, counted


def test_a_transaction_reads_its_metadata_once_per_change(lake):
    """The cache behind that: an unchanged transaction answers with the same metadata; staging
    an update answers with new metadata that has it."""
    pipeline.setup(lake)
    tbl = load_table(lake.catalog, lake.T("orders"))
    tx = tbl.transaction()
    first = tx.table_metadata
    assert tx.table_metadata is first
    tx.set_properties({"icebarrier.test": "1"})
    assert tx.table_metadata is not first and tx.table_metadata.properties["icebarrier.test"] == "1"
    assert "icebarrier.test" not in first.properties
