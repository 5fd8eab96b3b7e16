"""A pipeline's commit wins a race with maintenance, and every table of the catalog is maintained
(real `icebarrier serve`, PyIceberg clients through it, Spark's compaction, Postgres).

A job session loads its sink, maintenance compacts it, the job appends and publishes: the job's
snapshots are replayed over the compaction (the same data files, its barrier kept), at staging
and at publish. The server started with the ``no-rebase`` mutation refuses, as before: the tests
fail on it."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner
from pyiceberg.serializers import FromInputFile

from icebarrier.apps.maintain import Maintainer
from icebarrier.apps.session_client import CatalogRequestError, SessionClient
from icebarrier.cli.main import cli as command
from icebarrier.control_plane import barriers, jobs, reads, tokens, upkeep
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.iceberg_ext import faults, maintenance, spark_io
from icebarrier.iceberg_ext.catalog import (
    SUMMARY_BARRIER,
    SUMMARY_JOB,
    barrier_of,
    is_compaction,
    load_table,
    summary_properties,
)
from tests.helpers import WEEK_S
from tests.iceberg_ext.catalog_server import rest, start_server, stop_server

pytestmark = pytest.mark.slow

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("barrier", pa.int64(), nullable=False)])


def _job(lake) -> str:
    """Job ``w`` writes ``t`` (a root); its token (CLIENT_ID:SECRET)."""
    barriers.set_interval_s(lake.conn, WEEK_S)
    lake.catalog.create_table(f"{lake.namespace}.t", schema=SCHEMA)
    jobs.register(lake.conn, JobDefinition(name="w", sinks=frozenset([lake.T("t")]), external_inputs=frozenset(["x"])))
    return ":".join(tokens.create(lake.conn, job="w", whole_lake=True))


def _barrier(lake, uri: str, credential: str, *, loaded=None, staged=None) -> dict:
    """One barrier of ``w`` through a job session: load ``t``, ``loaded()``, append a row, ``staged()``,
    publish. Returns the completion."""
    barriers.issue(lake.conn)
    client = SessionClient(uri, credential)
    session = client.open("w", skip=False, coalesce=False, hold_s=60)["session"]
    b = session["barrier"]
    try:
        table = rest(uri, f"job:w@{session['run_id']}", credential).load_table(f"{lake.namespace}.t")
        if loaded:
            loaded()
        tx = table.transaction()  # committed once: PyIceberg's own retry would rebase it at the client
        tx.append(pa.table({"id": [b % 1000], "barrier": [b]}, schema=SCHEMA))
        table._do_commit(updates=tx._updates, requirements=tx._requirements)
        if staged:
            staged()
        return client.publish("w", session["run_id"])
    except Exception:
        client.release("w", session["run_id"])  # what job exec does when its command fails
        raise


def _compact(lake, spark) -> None:
    """The maintenance service's compaction of ``t``, checks and all."""
    report = maintenance.compact(spark, lake.conn, lake.catalog, lake.T("t"), min_input_files=2)
    assert report.snapshot_id is not None, report


def _rewrite(spark, lake) -> None:
    """What :func:`maintenance.compact` does once its checks passed (its Spark run is long: a job
    may stage meanwhile)."""
    spark_io.rewrite_data_files(
        spark,
        lake.T("t"),
        options={"min-input-files": "2"},
        properties={"icebarrier.operation": "compaction", SUMMARY_JOB: maintenance.MAINTENANCE_JOB},
    )


def _rows(lake) -> list[int]:
    return _rows_of(lake, "t")


def _rows_of(lake, table: str) -> list[int]:
    return sorted(load_table(lake.catalog, lake.T(table)).scan().to_arrow()["barrier"].to_pylist())


def _replayed_over_compaction(lake, marks: list[int]) -> None:
    """The table holds each barrier's row once; its current snapshot is the job's, for the last
    barrier, on top of a compaction; cuts at the last barrier read it."""
    assert _rows(lake) == sorted(marks)
    tbl = load_table(lake.catalog, lake.T("t"))
    current = tbl.current_snapshot()
    assert barrier_of(current) == marks[-1] and summary_properties(current)[SUMMARY_JOB] == "w"
    assert is_compaction(tbl.snapshot_by_id(current.parent_snapshot_id))
    cut = reads.resolve(lake.conn, [lake.T("t")])
    assert cut.barrier == marks[-1] and cut.snapshots[lake.T("t")] == current.snapshot_id


def test_a_commit_built_before_a_compaction_is_replayed_over_it(lake, spark, server):
    """The job loads its sink, maintenance compacts it, the job appends: the append is replayed over
    the compaction (no 409), published for its barrier."""
    credential = _job(lake)
    marks = [_barrier(lake, server, credential)["barrier"] for _ in range(3)]
    completion = _barrier(lake, server, credential, loaded=lambda: _compact(lake, spark))
    marks.append(completion["barrier"])
    _replayed_over_compaction(lake, marks)


def test_a_staged_commit_is_replayed_over_a_compaction_that_landed_before_the_publish(lake, spark, server):
    """A compaction that checked before the job staged and committed after it (its Spark run is
    long) moves the pointer under the staged commit: the publish replays it."""
    credential = _job(lake)
    marks = [_barrier(lake, server, credential)["barrier"] for _ in range(3)]

    marks.append(_barrier(lake, server, credential, staged=lambda: _rewrite(spark, lake))["barrier"])
    _replayed_over_compaction(lake, marks)


def _stage(lake, table) -> tuple[str, str]:
    """A job's staged commit on ``table`` as the server writes one (an append, its metadata file
    written, the pointer left at its base): (staged metadata, base metadata)."""
    tx = table.transaction()
    tx.append(pa.table({"id": [-1], "barrier": [-1]}, schema=SCHEMA))
    staged = lake.catalog._update_and_stage_table(table, table._identifier, tx._requirements, tx._updates)
    lake.catalog._write_metadata(staged.metadata, staged.io, staged.metadata_location)
    return staged.metadata_location, table.metadata_location


def test_an_expiry_beside_a_staged_commit_leaves_no_data_file_behind(lake, spark):
    """Issue 67: a job's staged commit lists its base's snapshots. Maintenance compacts the table,
    rewrites its manifests and expires everything before: the data files only the expired
    snapshots used (the compaction's inputs) go with the expiry, though the staged commit still
    lists them, and so do the base's manifest lists; the staged commit's own manifest list,
    manifests and data file stay (its publish reads them to replay it). Kept for the staged
    commit, nothing referenced them once it published, and they waited out the data files'
    three days' grace."""
    table = lake.catalog.create_table(f"{lake.namespace}.t", schema=SCHEMA)
    for b in range(3):
        table.append(pa.table({"id": [b], "barrier": [b]}, schema=SCHEMA))
    table = lake.catalog.load_table(f"{lake.namespace}.t")
    pending = _stage(lake, table)
    staged = FromInputFile.table_metadata(table.io.new_input(pending[0])).current_snapshot()
    added = [m for m in staged.manifests(table.io) if m.added_snapshot_id == staged.snapshot_id]
    own = {staged.manifest_list, *pending, *(m.manifest_path for m in added)}
    own |= {e.data_file.file_path for m in added for e in m.fetch_manifest_entry(table.io)}
    small = _data_files(table)
    maintained = {"icebarrier.operation": "compaction", SUMMARY_JOB: maintenance.MAINTENANCE_JOB}
    spark_io.rewrite_data_files(spark, lake.T("t"), options={"min-input-files": "2"}, properties=maintained)
    spark_io.rewrite_manifests(spark, lake.T("t"), properties=maintained)
    tbl = load_table(lake.catalog, lake.T("t"))
    older = [s.snapshot_id for s in tbl.metadata.snapshots if s.snapshot_id != tbl.metadata.current_snapshot_id]
    base_lists = {s.manifest_list for s in tbl.metadata.snapshots if s.snapshot_id in older[:3]}
    deleted = maintenance._expire_and_delete(tbl, older, staged=(pending,))
    on_disk = {maintenance.same_file(str(f)) for f in Path(_root(tbl)).rglob("*") if not f.name.endswith(".crc")}
    assert not {maintenance.same_file(f) for f in small} & on_disk and deleted >= len(small)
    assert not {maintenance.same_file(f) for f in base_lists} & on_disk  # the table's to drop
    assert {maintenance.same_file(f) for f in own} <= on_disk  # the staged commit's own, kept
    assert _rows(lake) == [0, 1, 2]


def test_maintenance_beside_a_commit_staged_on_snapshots_an_expiry_removed(lake, spark, server):
    """Issue 67: an expiry read the staging, a job staged a commit on the table as it was, and the
    expiry then removed snapshots the staged commit's history lists, with their manifest lists.
    The next expiry and orphan pass beside the staged commit read only its own snapshots (before,
    reading a removed manifest list failed them, every pass until it published); the publish
    drops the removed snapshots and lands."""
    from icebarrier.iceberg_ext.orphans import remove_orphans

    credential = _job(lake)
    marks = [_barrier(lake, server, credential)["barrier"] for _ in range(3)]

    def maintain_beside_it() -> None:
        tbl = load_table(lake.catalog, lake.T("t"))
        oldest = tbl.metadata.snapshots[0].snapshot_id
        assert maintenance._expire_and_delete(tbl, [oldest], staged=()) > 0  # as the racing expiry saw it
        report = maintenance.expire(lake.conn, lake.catalog, lake.T("t"), older_than_s=0, retain_last=1)
        assert report.expired and report.files_deleted, report  # the second barrier's snapshot
        remove_orphans(
            lake.conn,
            lake.catalog,
            lake.T("t"),
            older_than_s=0,
            metadata_older_than_s=0,
            catalog_schema=lake.settings.catalog_schema,
        )

    marks.append(_barrier(lake, server, credential, staged=maintain_beside_it)["barrier"])
    assert _rows(lake) == sorted(marks)
    assert reads.resolve(lake.conn, [lake.T("t")]).barrier == marks[-1]


def _data_files(table) -> set[str]:
    return {
        e.data_file.file_path
        for s in table.metadata.snapshots
        for m in s.manifests(table.io)
        for e in m.fetch_manifest_entry(table.io)
    }


def _root(tbl) -> str:
    return tbl.metadata.location.removeprefix("file://").removeprefix("file:")


def test_the_no_rebase_mutation_loses_the_race(lake, spark, server):
    """The server started with the no-rebase mutation refuses the commit maintenance moved the table
    under (what the job saw before this release): the tests above fail on it. (No maintenance
    service runs here: the mutated server holds no publish for a rival; the rewrites are the test's.)"""
    proc, uri = start_server(lake, "--session-quiet", "1s", env_extra={faults.MUTATION_ENV: faults.NO_REBASE})
    try:
        credential = _job(lake)
        for _ in range(3):
            _barrier(lake, server, credential)
        with pytest.raises(Exception, match="CommitFailed|changed"):
            _barrier(lake, uri, credential, loaded=lambda: _compact(lake, spark))
        b = _barrier(lake, uri, credential)["barrier"]  # PyIceberg's retry loads again: staged, then
        with pytest.raises(CatalogRequestError, match="not by maintenance alone"):  # compacted under
            _barrier(lake, uri, credential, staged=lambda: _rewrite(spark, lake))
        assert _rows(lake)[-1] == b
    finally:
        stop_server(proc)


def test_a_whole_table_overwrite_is_replayed_over_a_compaction(lake, spark, server):
    """A job that replaces the whole table (a full recompute) while a compaction lands under its
    staged commit: replayed, it replaces the compacted files (the same rows), so the table holds
    the job's rows alone."""
    credential = _job(lake)
    for _ in range(3):
        _barrier(lake, server, credential)
    barriers.issue(lake.conn)
    client = SessionClient(server, credential)
    session = client.open("w", skip=False, coalesce=False, hold_s=60)["session"]
    table = rest(server, f"job:w@{session['run_id']}", credential).load_table(f"{lake.namespace}.t")
    table.overwrite(pa.table({"id": [1], "barrier": [session["barrier"]]}, schema=SCHEMA))  # staged
    _rewrite(spark, lake)
    client.publish("w", session["run_id"])
    assert _rows(lake) == [session["barrier"]]
    assert reads.resolve(lake.conn, [lake.T("t")]).barrier == session["barrier"]


def test_a_real_conflict_is_still_refused(lake, spark, server):
    """A job that deletes a file maintenance rewrote (its rows now share a file with others) is not
    replayed (its rows would be wrong): its publish is refused, naming why, and nothing of it is
    visible."""
    credential = _job(lake)
    marks = [_barrier(lake, server, credential)["barrier"] for _ in range(3)]
    barriers.issue(lake.conn)
    client = SessionClient(server, credential)
    session = client.open("w", skip=False, coalesce=False, hold_s=60)["session"]
    table = rest(server, f"job:w@{session['run_id']}", credential).load_table(f"{lake.namespace}.t")
    table.delete(f"barrier = {marks[0]}")  # staged: removes the first barrier's file
    _rewrite(spark, lake)
    with pytest.raises(CatalogRequestError, match="not by maintenance alone.*rewrote"):
        client.publish("w", session["run_id"])
    assert _rows(lake) == sorted(marks)


def test_an_unmanaged_table_is_maintained_and_its_writers_win(lake, spark, server, tmp_path):
    """A table created through `serve` that no job writes: `table maintenance` sets its policy, the
    service expires and compacts it, and a PyIceberg client that loaded it before the compaction
    appends through `latest` all the same."""
    catalog = rest(server, "latest", _job(lake))  # any engine with a job's token: `free` is no job's sink
    free = catalog.create_table(f"{lake.namespace}.free", schema=SCHEMA)
    for i in range(6):
        free.append(pa.table({"id": [i], "barrier": [0]}, schema=SCHEMA))
    name = f"lake.{lake.namespace}.free"
    result = CliRunner().invoke(
        command,
        [
            "--dsn",
            lake.settings.dsn,
            "--output",
            "json",
            "table",
            "maintenance",
            name,
            "--retain",
            "0s",
            "--retain-last",
            "1",
            "--compact-min-files",
            "2",
        ],
        env={"ICEBARRIER_SCHEMA": lake.settings.schema, "ICEBARRIER_WAREHOUSE": lake.settings.warehouse},
    )
    assert result.exit_code == 0, result.output
    stale = catalog.load_table(f"{lake.namespace}.free")  # loaded before the service compacts it
    service = Maintainer(
        settings=lake.settings,
        spark_factory=lambda: spark,
        log=lambda line: None,
        only=frozenset([TableName.parse(name)]),
    )
    ran = {(a.action, a.result) for a in service.maintain(lake.conn, lake.catalog)}
    assert {("expire", "done"), ("compact", "done")} <= ran, ran
    stale.append(pa.table({"id": [99], "barrier": [0]}, schema=SCHEMA))
    tbl = catalog.load_table(f"{lake.namespace}.free")
    assert sorted(tbl.scan().to_arrow()["id"].to_pylist()) == [0, 1, 2, 3, 4, 5, 99]
    assert is_compaction(tbl.snapshot_by_id(tbl.current_snapshot().parent_snapshot_id))
    assert SUMMARY_BARRIER not in summary_properties(tbl.current_snapshot())
    status = next(s for s in upkeep.statuses(lake.conn) if str(s.policy.table) == name)
    assert not status.managed and status.actions["compact"]["done"] == 1


def test_a_follow_job_runs_a_refused_barrier_again(lake, server, tmp_path):
    """`job exec --follow` whose publish is refused because its sink moved under the run (a commit
    from outside, not maintenance) runs the barrier again, says so, and goes on: the barrier is
    published once, by the second run."""
    import os
    import signal
    import subprocess
    import sys

    from tests.iceberg_ext.test_job_exec import ENGINES, exec_args, wait_pause, wait_progress

    barriers.set_interval_s(lake.conn, WEEK_S)
    orders = lake.T("orders")
    jobs.register(lake.conn, JobDefinition(name="ingest", sinks=frozenset([orders]), external_inputs=frozenset(["x"])))
    credential = ":".join(tokens.create(lake.conn, job="ingest", whole_lake=True))
    lake.catalog.create_table(f"{lake.namespace}.orders", schema=SCHEMA)
    pause, log = tmp_path / "pause", tmp_path / "exec.log"
    first = barriers.issue(lake.conn).barrier
    script = [sys.executable, str(ENGINES / "pyiceberg_root.py"), lake.namespace, "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            exec_args(server, credential, "ingest", script, "--follow", "--poll", "1s", "--no-skip"),
            env={**os.environ, "ENGINE_PAUSE": "after", "ENGINE_PAUSE_FILE": str(pause)},
            stdout=out,
            stderr=out,
        )
    try:
        wait_pause(proc, pause)  # the run's commit is staged: a commit from outside moves the table
        lake.catalog.load_table(f"{lake.namespace}.orders").append(
            pa.table({"id": [-1], "barrier": [0]}, schema=SCHEMA)
        )
        pause.unlink()
        wait_pause(proc, pause)  # the barrier runs again
        assert "was refused at publish" in log.read_text() and "running it again" in log.read_text()
        pause.unlink()
        wait_progress(lake, "ingest", first, proc, log, timeout_s=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]
    assert _rows_of(lake, "orders") == [0, first]  # the foreign row, and the barrier's once


def test_orphan_removal_keeps_the_files_spark_wrote_for_a_pyiceberg_table(lake, spark):
    """Spark spells a local file ``file:/…`` where PyIceberg spells it ``file:///…``: a compaction's
    files (written by Spark) of a table PyIceberg created are referenced all the same, and orphan
    removal with no grace at all deletes only what nothing references."""
    from icebarrier.iceberg_ext.orphans import remove_orphans

    table = lake.catalog.create_table(f"{lake.namespace}.t", schema=SCHEMA)
    for i in range(3):
        table.append(pa.table({"id": [i], "barrier": [i]}, schema=SCHEMA))
    upkeep.enroll(lake.conn, lake.T("t"))
    _compact(lake, spark)
    tbl = load_table(lake.catalog, lake.T("t"))
    assert tbl.current_snapshot().manifest_list.startswith("file:/") and tbl.metadata.location.startswith("file:///")
    stray = f"{tbl.metadata.location}/data/stray.parquet".removeprefix("file://")
    with open(stray, "wb") as f:
        f.write(b"nothing references me")
    report = remove_orphans(
        lake.conn,
        lake.catalog,
        lake.T("t"),
        older_than_s=0,
        metadata_older_than_s=0,
        catalog_schema=lake.settings.catalog_schema,
    )
    data = [o.rsplit("/", 1)[1] for o in report.orphans if "/data/" in o and not o.endswith(".crc")]
    assert data == ["stray.parquet"]  # (Hadoop's .crc files beside Spark's are referenced by nothing)
    assert _rows(lake) == [0, 1, 2]  # every file of the current snapshot is there
