"""History-free planning and push in the runtime: a root job's FileSource plans from its
consumed-input watermark (a few recent ranges, not all), and a `--follow` job wakes on the
control plane's notices, not on its poll."""

from __future__ import annotations

import os
import threading
import time

from icebarrier.control_plane import barriers, jobs, runs
from icebarrier.control_plane.model import JobDefinition
from icebarrier.iceberg_ext.job import TransformJob, overwrite
from icebarrier.iceberg_ext.runtime import Runtime
from icebarrier.iceberg_ext.sources import FileSource
from tests.helpers import WEEK_S


def _arrive(directory, name: str, *, written_s_ago: float = 0.0) -> str:
    """A file renamed into place now (its mtime may be older: written earlier elsewhere)."""
    tmp = directory / f".{name}.tmp"
    tmp.write_text("{}\n")
    if written_s_ago:
        past = time.time() - written_s_ago
        os.utime(tmp, (past, past))
    os.rename(tmp, directory / name)
    return str(directory / name)


def test_a_file_source_plans_from_its_watermark_not_from_every_range(lake, tmp_path):
    """Each plan takes exactly the files that arrived since the previous one — a file renamed
    in after being written long ago included — however many ranges came before, and it still
    does with all but the last few ranges deleted."""
    job = f"{lake.namespace}_files"
    jobs.register(
        lake.conn, JobDefinition(name=job, sinks=frozenset([lake.T("landing")]), external_inputs=frozenset(["files"]))
    )
    source = FileSource(str(tmp_path), "x string", pattern="*.json", margin_s=0.2)
    taken = []
    for step in range(12):
        arrived = {_arrive(tmp_path, f"f{step}.json", written_s_ago=3600 if step == 5 else 0)}
        b = barriers.issue(lake.conn).barrier
        spec = source.plan(lake.conn, job, b)
        assert set(spec["files"]) == arrived, step
        runs.record_range(lake.conn, job, b, spec)
        taken += spec["files"]
        if step == 8:  # the history before the last two ranges is not needed
            lake.conn.execute(
                "DELETE FROM input_range WHERE job_name = %s AND barrier < %s",
                (job, runs.ranges(lake.conn, job)[-2]["barrier"]),
            )
        time.sleep(0.3)  # past the margin: the next plan starts after this one's watermark
    assert sorted(taken) == sorted(str(tmp_path / f"f{i}.json") for i in range(12))
    b = barriers.issue(lake.conn).barrier
    assert source.plan(lake.conn, job, b)["files"] == []


def test_files_arriving_within_the_margin_are_taken_once(lake, tmp_path):
    """Back-to-back plans closer than the margin: no file is taken twice or lost."""
    job = f"{lake.namespace}_fast"
    jobs.register(
        lake.conn, JobDefinition(name=job, sinks=frozenset([lake.T("fast")]), external_inputs=frozenset(["files"]))
    )
    source = FileSource(str(tmp_path), "x string", margin_s=5.0)
    taken = []
    for step in range(20):
        _arrive(tmp_path, f"f{step}")
        b = barriers.issue(lake.conn).barrier
        spec = source.plan(lake.conn, job, b)
        if spec["files"]:
            runs.record_range(lake.conn, job, b, spec)
        taken += spec["files"]
    assert sorted(taken) == sorted(str(tmp_path / f"f{i}") for i in range(20))


def test_a_following_runtime_job_is_skipped_without_waking(lake, spark):
    """An intermediate job under the runtime's --follow with a five-minute poll: each barrier its
    source completes (unchanged) is skipped at once, by the control plane in the source's
    completion: the job's process hears nothing of it (its log has nothing after bootstrapping)."""
    barriers.set_interval_s(lake.conn, WEEK_S)
    src = f"lake.{lake.namespace}.upstream"
    jobs.register(
        lake.conn,
        JobDefinition(
            name=f"{lake.namespace}_up", sinks=frozenset([lake.T("upstream")]), external_inputs=frozenset(["x"])
        ),
    )
    b0 = barriers.issue(lake.conn).barrier
    jobs.complete(lake.conn, f"{lake.namespace}_up", b0)
    spark.sql(f"CREATE TABLE {src} (id bigint) USING iceberg")
    spark.sql(f"CREATE TABLE lake.{lake.namespace}.copy (id bigint) USING iceberg")
    job = TransformJob(
        name=f"{lake.namespace}_copy",
        sources=[src],
        sinks=[f"lake.{lake.namespace}.copy"],
        transform=lambda ctx: overwrite(ctx.table(src)),
    )
    lines = []
    with Runtime(job, settings=lake.settings, spark=spark, log=lines.append) as rt:
        rt.register()
        follower = threading.Thread(target=rt.run, kwargs={"follow": True, "poll_s": 300})
        follower.start()
        try:
            _until(lambda: jobs.show(lake.conn, job.name).progress == b0, lines)  # bootstrapped
            for _ in range(3):
                b = barriers.issue(lake.conn).barrier
                jobs.complete(lake.conn, f"{lake.namespace}_up", b)
                _until(lambda: jobs.show(lake.conn, job.name).progress == b, lines)
        finally:
            rt.stop.set()
            follower.join(30)
    assert not any("skipped" in line for line in lines), lines
    assert [line for line in lines if "waiting" not in line][-1].endswith("1 step(s), 1 computation(s)"), lines


def _until(condition, lines, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s  # the poll alone would take 300 s
    while not condition():
        assert time.monotonic() < deadline, lines[-5:]
        time.sleep(0.05)
