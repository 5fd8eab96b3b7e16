"""The lake maintains itself: policies, the maintenance service's actions, what it keeps, and
who wins a race with it (real Postgres, Iceberg and Spark).

The worker's tests share one Iceberg catalog (see conftest), so a service here is given its
test's table (``only`` / ``--table``): at its default it would maintain every earlier test's
tables too, as it does every table of a user's catalog."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from icebarrier.apps.embedded import CLI, free_port
from icebarrier.apps.maintain import RETRY_S, Maintainer
from icebarrier.cli.main import cli as command
from icebarrier.control_plane import audit, barriers, jobs, leases, reads, tables, tokens, upkeep
from icebarrier.control_plane.model import JobDefinition
from icebarrier.iceberg_ext.catalog import (
    OPERATION_COMPACTION,
    SUMMARY_BARRIER,
    SUMMARY_OPERATION,
    load_table,
    pointers,
    summary_properties,
)
from icebarrier.iceberg_ext.commits import BarrierCommit
from icebarrier.iceberg_ext.spark_io import append_df, table_at
from tests.helpers import LoggedProcess
from tests.iceberg_ext.catalog_server import access_token, scrape


def _events(lake, spark):
    spark.sql(f"CREATE TABLE {lake.T('events')} (id bigint, amount bigint) USING iceberg")
    jobs.register(
        lake.conn, JobDefinition(name="ingest", sinks=frozenset([lake.T("events")]), external_inputs=frozenset(["x"]))
    )


def _ingest(lake, spark, start: int, n: int = 3) -> int:
    """One barrier of ``n`` rows, one small data file."""
    b = barriers.issue(lake.conn).barrier
    df = spark.range(start, start + n, numPartitions=1).selectExpr("id", "id * 10 AS amount")
    with BarrierCommit(lake.conn, lake.catalog, job="ingest", barrier=b) as tx:
        append_df(tx, lake.T("events"), df)
    return b


def _invoke(*args):
    return CliRunner().invoke(command, list(args))


def test_a_policy_is_set_shown_and_returned_to_its_defaults(lake, spark):
    """`table maintenance` sets some settings (the rest stay defaults, marked so), audits the
    change, and `--default` returns a setting; `table show` shows the policy."""
    _events(lake, spark)
    name = str(lake.T("events"))
    shown = _invoke("table", "maintenance", name)
    assert shown.exit_code == 0, shown.output
    assert "retain:                    15.0s (default)" in shown.output, shown.output
    assert "keep the newest:           10 snapshots (default)" in shown.output
    out = _invoke("--output", "json", "table", "maintenance", name, "--retain", "30s", "--target-file-size", "64MB")
    assert out.exit_code == 0, out.output
    policy = json.loads(out.stdout)
    assert policy["retain_s"] == 30 and policy["target_file_size"] == 64 << 20 and policy["retain_last"] == 10
    assert sorted(policy["own"]) == ["retain", "target_file_size"]
    assert "64 MiB" in _invoke("table", "show", name).output
    events = [e for e in audit.events(lake.conn, table=name) if e.action == "table maintenance"]
    assert len(events) == 1 and events[0].detail["policy"]["target_file_size"] == 64 << 20
    back = json.loads(_invoke("--output", "json", "table", "maintenance", name, "--default", "retain").stdout)
    assert back["retain_s"] == 15 and back["own"] == ["target_file_size"]


def test_bad_policy_input_is_one_line_and_writes_nothing(lake, spark):
    """A setting below its least, a bad size or duration, or an unknown table: one line naming
    it, a non-zero exit, nothing written."""
    _events(lake, spark)
    name = str(lake.T("events"))
    for args, says in (
        (["--retain-last", "0"], "retain_last of"),
        (["--compact-min-files", "1"], "compact_min_files"),
        (["--target-file-size", "12PB"], "size '12PB' is invalid"),
        (["--retain", "soon"], "duration 'soon' is invalid"),
        (["--orphan-grace", "0s"], "is invalid"),
        (["--metadata-grace", "10s"], "metadata_grace_s"),
        (["--metadata-grace", "90s"], "must be at least 120"),  # a commit retries for up to 2 minutes
    ):
        out = _invoke("table", "maintenance", name, *args)
        assert out.exit_code != 0 and says in out.output and "Traceback" not in out.output, (args, out.output)
        assert len(out.output.strip().splitlines()) == 1, out.output
    out = _invoke("table", "maintenance", "lake.nowhere.t", "--retain", "1m")
    assert out.exit_code == 1 and "lake.nowhere.t" in out.output
    assert upkeep.statuses(lake.conn, [lake.T("events")])[0].policy.own == ()
    assert not [e for e in audit.events(lake.conn) if e.action == "table maintenance"]


@pytest.mark.other_line  # the maintenance service's Spark work, on both lines
def test_the_service_expires_compacts_and_keeps_what_is_protected(lake, spark):
    """One pass over a table of many small commits: snapshots past the retention expire except
    the leased one; small files are compacted into a snapshot that keeps the last barrier (the
    cut reads it, with the same rows); the manifests it left are within the policy, so they are
    not rewritten after it (counted with the manifests of only deleted entries, which the next
    commit drops, a rewrite followed that a writer's append beside it failed: issue 67); each
    action is recorded and audited; the job commits on top of it all."""
    _events(lake, spark)
    marks = [_ingest(lake, spark, i * 10) for i in range(12)]
    table = lake.T("events")
    upkeep.set_policy(lake.conn, table, {"retain_s": 0, "retain_last": 2, "compact_min_files": 5, "max_manifests": 4})
    lease = leases.acquire(lake.conn, [table], ttl_s=600, holder="long-query", barrier=marks[3])
    pinned = lease.snapshots[table]
    rows = sorted(spark.table(str(table)).collect())
    service = Maintainer(lake.settings, log=lambda _: None, spark_factory=lambda: spark, only=frozenset([table]))
    ran = {(a.action, a.result): a.detail for a in service.maintain(lake.conn, lake.catalog)}
    assert ran[("expire", "done")]["expired"] >= 8, ran
    assert ran[("compact", "done")]["rewritten"] == 12, ran
    assert all(detail["seconds"] > 0 for detail in ran.values()), ran  # what each cost, for the operator
    assert not [a for a, _ in ran if a == "rewrite-manifests"], ran
    tbl = load_table(lake.catalog, table)
    assert tbl.snapshot_by_id(pinned) is not None  # the lease wins
    current = tbl.current_snapshot()
    props = summary_properties(current)
    assert props[SUMMARY_OPERATION] == OPERATION_COMPACTION and props[SUMMARY_BARRIER] == str(marks[-1])
    cut = reads.resolve(lake.conn, [table])
    assert cut.barrier == marks[-1] and cut.snapshots[table] == current.snapshot_id
    assert sorted(spark.table(str(table)).collect()) == rows
    assert table_at(spark, table, pinned).count() == 12
    status = upkeep.statuses(lake.conn, [table])[0]
    assert status.seen["data_files"] == 1 and status.seen["small_files"] == 1 and status.next
    assert status.actions["compact"]["done"] == 1 and status.actions["expire"]["result"] == "done"
    assert {e.action for e in audit.events(lake.conn, table=str(table))} >= {
        "maintenance expire",
        "maintenance compact",
    }
    again = service.maintain(lake.conn, lake.catalog)  # the snapshots the rewrites superseded pass retention
    assert [(a.action, a.result) for a in again] in ([], [("expire", "done")]), again
    assert not service.maintain(lake.conn, lake.catalog)  # nothing new: nothing to do
    b = _ingest(lake, spark, 1000)  # the job continues on top of the compaction
    assert tables.states(lake.conn, [table])[0].watermark == b
    assert spark.table(str(table)).count() == 39


@pytest.mark.other_line  # the maintenance service's Spark work, on both lines
def test_manifests_past_the_policy_are_rewritten_keeping_the_barrier(lake, spark, server):
    """More manifests than the policy allows: one rewrite, a compaction snapshot at the last
    barrier, the same rows; /metrics shows what the service saw and did."""
    _events(lake, spark)
    marks = [_ingest(lake, spark, i * 10) for i in range(6)]
    table = lake.T("events")
    upkeep.set_policy(lake.conn, table, {"max_manifests": 3, "compact_min_files": 100})
    rows = sorted(spark.table(str(table)).collect())
    service = Maintainer(lake.settings, log=lambda _: None, spark_factory=lambda: spark, only=frozenset([table]))
    ran = {(a.action, a.result): a.detail for a in service.maintain(lake.conn, lake.catalog)}
    assert ran[("rewrite-manifests", "done")]["rewritten"] == 6, ran
    tbl = load_table(lake.catalog, table)
    assert len(tbl.current_snapshot().manifests(tbl.io)) == 1
    assert summary_properties(tbl.current_snapshot())[SUMMARY_BARRIER] == str(marks[-1])
    assert reads.resolve(lake.conn, [table]).snapshots[table] == tbl.current_snapshot().snapshot_id
    assert sorted(spark.table(str(table)).collect()) == rows
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    samples = scrape(server, {"Authorization": f"Bearer {access_token(server, cid, secret)}"}, {"tables": "all"})
    labels = (("table", str(table)),)
    assert samples[("icebarrier_table_manifests", labels)] == 1
    assert samples[("icebarrier_maintenance_last_action_seconds", (("action", "rewrite-manifests"), *labels))] > 0
    assert samples[("icebarrier_table_data_files", labels)] == 6
    assert samples[("icebarrier_table_snapshots", labels)] == 7
    done = (("action", "rewrite-manifests"), ("result", "done"), ("table", str(table)))
    assert samples[("icebarrier_maintenance_actions_total", done)] == 1
    assert samples[("icebarrier_maintenance_actions_all_total", done[:2])] == 1  # summed, also by default


def _files(root) -> set:
    return {f for f in root.rglob("*") if f.is_file()}


def test_the_files_under_a_table_go_each_after_its_grace_and_are_counted(lake, spark, server):
    """Issue 67: what a replaced or given-up commit leaves under ``metadata/`` (a manifest list, a
    manifest) goes after the metadata grace, not the data files' three days; a Hadoop checksum
    Spark wrote beside a file goes when maintenance deletes the file (expiry) and stays while the
    file is referenced; an unreferenced data file stays for its own grace. The pass counts the
    files left under the table, in its log line, ``table show`` and ``/metrics``."""
    _events(lake, spark)
    for i in range(4):
        _ingest(lake, spark, i * 10)
    table = lake.T("events")
    root = Path(load_table(lake.catalog, table).metadata.location.removeprefix("file:"))
    upkeep.set_policy(
        lake.conn, table, {"retain_s": 0, "retain_last": 1, "compact_min_files": 100, "max_manifests": 100}
    )
    assert any(f.name.endswith(".crc") for f in (root / "data").iterdir())  # Spark wrote checksums
    old = time.time() - 180  # past the least metadata grace (2 minutes)
    left = {  # as a commit replayed over a maintenance commit, or one that gave up, leaves them
        root / "metadata" / "snap-1-0-left.avro": b"a manifest list",
        root / "metadata" / ".snap-1-0-left.avro.crc": b"its checksum",
        root / "metadata" / "left-m0.avro": b"a manifest",
    }
    stray = root / "data" / "stray.parquet"  # a data file a failed write left: three days' grace
    for f, content in {**left, stray: b"data"}.items():
        f.write_bytes(content)
        os.utime(f, (old, old))
    for f in root.rglob(".*.crc"):  # referenced files' checksums too: old, and kept
        os.utime(f, (old, old))
    upkeep.set_policy(lake.conn, table, {"metadata_grace_s": 120})
    logged: list[str] = []
    service = Maintainer(lake.settings, log=logged.append, spark_factory=lambda: spark, only=frozenset([table]))
    for action in service.maintain(lake.conn, lake.catalog):
        logged.append(action.line())
    assert any("expire done" in ln for ln in logged) and any("remove-orphans done" in ln for ln in logged), logged
    on_disk = _files(root)
    assert not set(left) & on_disk and stray in on_disk
    orphaned_checksums = [f for f in on_disk if f.name.endswith(".crc") and f.with_name(f.name[1:-4]) not in on_disk]
    assert not orphaned_checksums  # expiry took the checksums of the files it deleted
    tbl = load_table(lake.catalog, table)
    for path in [m.manifest_path for m in tbl.current_snapshot().manifests(tbl.io)]:
        local = Path(path.removeprefix("file:").removeprefix("//"))
        assert local.with_name(f".{local.name}.crc") in on_disk  # a referenced file's checksum stays
    metadata = sum(1 for f in on_disk if f.parent == root / "metadata")
    data = len(on_disk) - metadata
    line = next(ln for ln in logged if "remove-orphans done" in ln)
    assert f"metadata_files {metadata}, data_files {data}" in line and "deleted 3" in line, line
    status = upkeep.statuses(lake.conn, [table])[0]
    assert (status.files.metadata, status.files.data) == (metadata, data) and status.files.counted_at
    shown = _invoke("table", "show", str(table))
    assert f"files under it: {metadata + data} ({metadata} metadata, {data} data)" in shown.output, shown.output
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    samples = scrape(server, {"Authorization": f"Bearer {access_token(server, cid, secret)}"}, {"tables": "all"})
    labels = (("folder", "metadata"), ("table", str(table)))
    assert samples[("icebarrier_table_files", labels)] == metadata
    assert samples[("icebarrier_table_files", (("folder", "data"), ("table", str(table))))] == data
    checked = samples[("icebarrier_table_orphans_checked_timestamp_seconds", (("table", str(table)),))]
    assert abs(checked - status.files.counted_at.timestamp()) < 1
    # a pass that removes nothing is counted and logged, not recorded as an action
    recorded = upkeep.statuses(lake.conn, [table])[0].actions["remove-orphans"]["done"]
    later = time.time() + 61  # orphans are due every half the metadata grace (1 minute at least)
    assert not service.maintain(lake.conn, lake.catalog, now=later)
    assert "remove-orphans done (deleted 0" in logged[-1], logged
    again = upkeep.statuses(lake.conn, [table])[0]
    assert again.actions["remove-orphans"]["done"] == recorded and again.files.counted_at > status.files.counted_at


def test_the_metadata_folder_is_listed_every_tenth_of_its_grace(lake, spark):
    """Issue 67: a table committing every second piles up ~100 files a minute under ``metadata/``;
    listed every half grace, the folder held a grace and a half's worth and still climbed. It is
    listed every tenth of the grace (a minute at least), the whole location every half grace: a
    manifest left past the metadata grace goes at the next pass over the metadata folder, a stray
    data file past its own grace waits for the pass over the whole location, and the data count
    shown is that pass's."""
    _events(lake, spark)
    for i in range(2):
        _ingest(lake, spark, i * 10)
    table = lake.T("events")
    root = Path(load_table(lake.catalog, table).metadata.location.removeprefix("file:"))
    upkeep.set_policy(lake.conn, table, {"metadata_grace_s": 1200, "orphan_grace_s": 60, "compact_min_files": 100})
    logged: list[str] = []
    service = Maintainer(lake.settings, log=logged.append, spark_factory=lambda: spark, only=frozenset([table]))
    start = time.time()
    service.maintain(lake.conn, lake.catalog, now=start)  # the first pass lists the whole location
    data = sum(1 for f in _files(root) if f.parent != root / "metadata")
    assert f"data_files {data}," in logged[-1], logged

    left, stray = root / "metadata" / "left-m0.avro", root / "data" / "stray.parquet"
    for f, age in ((left, 1300), (stray, 120)):  # each past its grace
        f.write_bytes(b"left behind")
        os.utime(f, (time.time() - age,) * 2)
    for action in service.maintain(lake.conn, lake.catalog, now=start + 121):  # a tenth of the grace on
        logged.append(action.line())
    line = next(ln for ln in logged if "remove-orphans done (deleted 1" in ln)
    assert "metadata_files" in line and " data_files" not in line, line  # the metadata folder only
    assert not left.exists() and stray.exists()
    assert upkeep.statuses(lake.conn, [table])[0].files.data == data  # the whole pass's count

    for action in service.maintain(lake.conn, lake.catalog, now=start + 601):  # half the grace on
        logged.append(action.line())
    assert not stray.exists()
    assert f"data_files {data}" in logged[-1], logged


def test_compaction_gives_way_to_a_commit_its_job_has_not_completed(lake, spark):
    """While the table holds a commit whose barrier the job has not completed, the compaction
    gives way (recorded once, not at every look); after the job completes, it runs."""
    _events(lake, spark)
    for i in range(4):
        _ingest(lake, spark, i * 10)
    table = lake.T("events")
    upkeep.set_policy(lake.conn, table, {"compact_min_files": 3})
    service = Maintainer(
        lake.settings, tick_s=0, log=lambda _: None, spark_factory=lambda: spark, only=frozenset([table])
    )
    b = barriers.issue(lake.conn).barrier
    with BarrierCommit(lake.conn, lake.catalog, job="ingest", barrier=b) as tx:
        append_df(tx, table, spark.range(100, 103, numPartitions=1).selectExpr("id", "id AS amount"))
        ran = service.maintain(lake.conn, lake.catalog)
        assert [(a.action, a.result) for a in ran] == [("compact", "gave-way")], ran
        assert "has not completed" in ran[0].detail["why"]
        assert not service.maintain(lake.conn, lake.catalog)  # looked again, said once
    ran = service.maintain(lake.conn, lake.catalog)
    assert [(a.action, a.result) for a in ran] == [("compact", "done")], ran
    assert upkeep.statuses(lake.conn, [table])[0].actions["compact"]["gave_way"] == 1


def test_the_pipelines_commits_win_a_race_with_compaction(lake, spark, tmp_path):
    """`icebarrier maintain` compacts at every look (2 small files are enough) while the job
    commits barrier after barrier: every commit of the job succeeds and completes its barrier;
    each compaction lands keeping its barrier, or gives way; no row is lost or doubled."""
    _events(lake, spark)
    table = lake.T("events")
    _ingest(lake, spark, 0)
    upkeep.set_policy(lake.conn, table, {"compact_min_files": 2, "retain_s": 0, "retain_last": 1})
    service = LoggedProcess([*CLI, "maintain", "--every", "0.2s", "--table", str(table)], tmp_path / "maintain.log")
    try:
        _ingest(lake, spark, 10)
        service.wait_for("compact done", timeout_s=120)  # Spark is up in the service
        marks = [_ingest(lake, spark, 10 * i) for i in range(2, 30)]
        ingested = datetime.now(UTC)
        deadline = time.monotonic() + 60
        while datetime.fromisoformat(_compactions(lake, table)["at"]) < ingested:  # one more after the last commit
            assert time.monotonic() < deadline, service.log()[-3000:]
            time.sleep(0.2)
    finally:
        service.kill_group()
    assert tables.states(lake.conn, [table])[0].watermark == marks[-1]
    ids = sorted(r["id"] for r in spark.table(str(table)).collect())
    assert ids == sorted(i for s in range(0, 300, 10) for i in range(s, s + 3))
    counts = _compactions(lake, table)
    assert counts["done"] >= 3 and counts["failed"] == 0, (counts, service.log()[-3000:])
    tbl = load_table(lake.catalog, table)
    for snap in tbl.metadata.snapshots:
        assert SUMMARY_BARRIER in summary_properties(snap)
    assert reads.resolve(lake.conn, [table]).barrier == marks[-1]


def _compactions(lake, table) -> dict:
    return upkeep.statuses(lake.conn, [table])[0].actions["compact"]


def test_one_service_per_control_plane_the_second_takes_over(lake, tmp_path):
    """A second `icebarrier maintain` waits, naming the first; when the first is killed, it
    takes over; SIGTERM stops it cleanly."""
    first = LoggedProcess([*CLI, "maintain", "--every", "1s"], tmp_path / "first.log")
    second = None
    try:
        first.wait_for("maintain: running")
        second = LoggedProcess([*CLI, "maintain", "--every", "1s"], tmp_path / "second.log")
        second.wait_for("waiting to take over")
        assert f"pid {first.proc.pid}" in second.log()
        first.kill_group()
        second.wait_for("maintain: running", timeout_s=30)
        holder = lake.conn.execute("SELECT holder FROM maintenance_state").fetchone()["holder"]
        assert holder.endswith(f"pid {second.proc.pid}")
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(30) == 0, second.log()
    finally:
        first.kill_group()
        if second is not None:
            second.kill_group()


def test_the_service_waits_out_a_catalog_it_cannot_reach(lake, tmp_path):
    """A catalog database that refuses connections (a failover's gap: the primary gone, the
    standby not yet promoted) while the service's lock is had: it says so and tries again, never
    exiting; SIGTERM still stops it cleanly. (It died with SQLAlchemy's traceback before.)"""
    config = tmp_path / "icebarrier.toml"
    config.write_text(
        "[catalog_properties]\n"
        'type = "sql"\n'
        f'uri = "postgresql+psycopg://postgres@127.0.0.1:{free_port()}/icebarrier"\n'
    )
    service = LoggedProcess(
        [*CLI, "maintain", "--every", "1s"],
        tmp_path / "maintain.log",
        env={**os.environ, "ICEBARRIER_CONFIG": str(config)},
    )
    try:
        service.wait_for("maintain: running")
        service.wait_for("control plane unreachable")
        deadline = time.monotonic() + 3 * RETRY_S + 1
        while service.log().count("control plane unreachable") < 3:
            assert service.proc.poll() is None, service.log()[-3000:]
            assert time.monotonic() < deadline, service.log()[-3000:]
            time.sleep(0.1)
        assert "Traceback" not in service.log()
        service.proc.send_signal(signal.SIGTERM)
        assert service.proc.wait(30) == 0, service.log()[-3000:]
    finally:
        service.kill_group()


def _small_files(lake, spark, name: str, n: int) -> None:
    """Table ``name`` written by job ``name`` in ``n`` barriers of one small file each."""
    spark.sql(f"CREATE TABLE {lake.T(name)} (id bigint) USING iceberg")
    jobs.register(
        lake.conn, JobDefinition(name=name, sinks=frozenset([lake.T(name)]), external_inputs=frozenset(["x"]))
    )
    for i in range(n):
        b = barriers.issue(lake.conn).barrier
        with BarrierCommit(lake.conn, lake.catalog, job=name, barrier=b) as tx:
            append_df(tx, lake.T(name), spark.range(i, i + 1, numPartitions=1))


def test_the_service_looks_at_the_longest_due_first_and_reads_what_changed_only(lake, spark):
    """A pass looks at the table whose look has been due longest first (a table long overdue
    before one whose snapshot just moved), and a pass in which nothing moved and no time came
    reads no table's status."""
    names = ["a", "b"]
    for name in names:
        _small_files(lake, spark, name, 2)
    only = frozenset(lake.T(n) for n in names)
    service = Maintainer(lake.settings, log=lambda _: None, spark_factory=lambda: spark, only=only)
    now = time.time()
    service.maintain(lake.conn, lake.catalog, now=now)
    assert service._due(lake.conn, _pointers(lake, only), now) == []  # nothing moved, no time came
    service._tables[lake.T("b")].look_at = now - 100  # b's look came due long ago
    _one_more_file(lake, spark, "a")  # a moves now
    todo = service._due(lake.conn, _pointers(lake, only), now + 1)
    assert [s.policy.table for s in todo] == [lake.T("b"), lake.T("a")]
    service.maintain(lake.conn, lake.catalog, now=now + 1)
    checked = {
        r["table_name"]: r["checked_at"]
        for r in lake.conn.execute(
            "SELECT table_name, checked_at FROM table_maintenance WHERE table_name = ANY(%s)", ([str(t) for t in only],)
        )
    }
    assert checked[str(lake.T("b"))] < checked[str(lake.T("a"))], checked


def _pointers(lake, only):
    return {n: p for n, p in pointers(lake.conn, lake.settings).items() if n in only}


def _one_more_file(lake, spark, name: str) -> None:
    b, progress = barriers.issue(lake.conn).barrier, jobs.show(lake.conn, name).progress
    with BarrierCommit(lake.conn, lake.catalog, job=name, barrier=b, coalesce_after=progress) as tx:
        append_df(tx, lake.T(name), spark.range(100, 101, numPartitions=1))


def test_workers_maintain_several_tables_at_a_time_each_once(lake, spark):
    """`maintain --workers 3 --once` over three tables of small files: each is compacted once,
    through one Spark session, and each action is recorded once."""
    names = ["w1", "w2", "w3"]
    for name in names:
        _small_files(lake, spark, name, 5)
        upkeep.set_policy(lake.conn, lake.T(name), {"compact_min_files": 3, "retain_s": 3600})
    only = frozenset(lake.T(n) for n in names)
    service = Maintainer(lake.settings, log=lambda _: None, spark_factory=lambda: spark, only=only, workers=3)
    ran = service.once(lake.conn, lake.catalog)
    compacted = sorted(str(a.table) for a in ran if a.action == "compact" and a.result == "done")
    assert compacted == sorted(str(lake.T(n)) for n in names), [a.line() for a in ran]
    for name in names:
        assert _compactions(lake, lake.T(name))["done"] == 1, name
        assert len(load_table(lake.catalog, lake.T(name)).scan().to_arrow()) == 5
