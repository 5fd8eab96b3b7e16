"""Real processes killed at each fault point and restarted: nothing lost, nothing doubled."""

import os
import signal
import subprocess
import sys
import time

import pytest

from icebarrier.control_plane import barriers, jobs, reads, runs, tables
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.faults import AFTER_CONTROL_PLANE, AFTER_ICEBERG_COMMIT, AFTER_INPUT_RANGE, CRASH_EXIT_CODE
from icebarrier.iceberg_ext.job import RootJob
from icebarrier.iceberg_ext.runtime import Runtime, foreach_batch
from icebarrier.iceberg_ext.spark_io import table_at
from tests.iceberg_ext.test_runtime import generate, shop


def _worker(lake, input_dir, job_keys, fault=None, fault_after=0, master=None):
    """Run a job (or several, comma-separated, in order) in a process of its own (``master``: its
    Spark master, e.g. a standalone cluster)."""
    env = {**os.environ, "ICEBARRIER_FAULT": fault or "", "ICEBARRIER_FAULT_AFTER": str(fault_after)}
    if master:
        env["ICEBARRIER_SPARK_MASTER"] = master
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.iceberg_ext.runtime_worker",
            lake.settings.dsn,
            lake.settings.schema,
            lake.settings.warehouse,
            lake.namespace,
            str(input_dir),
            job_keys,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault",
    [AFTER_INPUT_RANGE, pytest.param(AFTER_ICEBERG_COMMIT, marks=pytest.mark.other_line), AFTER_CONTROL_PLANE],
)
def test_root_job_killed_at_each_fault_point_recovers_exactly_once(lake, spark, tmp_path, fault):
    """Kill the ingesting process at the fault point, restart it: every order lands exactly once
    and the watermark ends at the barrier; the recorded input range is the one replayed."""
    shop.create_tables(spark, lake.namespace)
    barriers.set_interval_s(lake.conn, 3600)  # only the barriers this test issues
    input_dir = tmp_path / "input"
    rows = generate.write_batch(str(input_dir), 1, orders=40)
    b = barriers.issue(lake.conn).barrier
    crashed = _worker(lake, input_dir, "ingest_shopping", fault)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-2000:]
    name = shop.build(lake.namespace, str(input_dir))["ingest_shopping"].name
    recorded = runs.recorded_range(lake.conn, name, b)
    assert recorded is not None and len(recorded["files"]) == 1
    generate.write_batch(str(input_dir), 2, orders=40)  # arrives after the range was recorded
    restarted = _worker(lake, input_dir, "ingest_shopping")
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    sink = TableName.parse(shop.tables(lake.namespace)["shopping"])
    assert tables.states(lake.conn, [sink])[0].watermark == b
    cut = reads.resolve(lake.conn, [sink])
    ids = [r.order_id for r in table_at(spark, sink, cut.snapshots[sink]).collect()]
    assert sorted(ids) == sorted(r["order_id"] for r in rows)  # batch 1 exactly: no loss, no duplicate
    assert runs.recorded_range(lake.conn, name, b) == recorded
    b2 = barriers.issue(lake.conn).barrier
    assert _worker(lake, input_dir, "ingest_shopping").returncode == 0
    assert spark.table(str(sink)).count() == 80 and tables.states(lake.conn, [sink])[0].watermark == b2


@pytest.mark.slow
def test_two_sink_job_killed_between_its_commits_is_all_or_nothing_for_readers(lake, spark, tmp_path):
    """Killed after the first of two sinks was committed: readers through cuts see both sinks
    at the previous barrier, never one at B and the other at B-1; the restart completes both."""
    shop.create_tables(spark, lake.namespace)
    barriers.set_interval_s(lake.conn, 3600)
    spark.sql(f"CREATE TABLE lake.{lake.namespace}.by_user (user_id bigint, amount bigint) USING iceberg")
    spark.sql(f"CREATE TABLE lake.{lake.namespace}.by_item (item_id bigint, amount bigint) USING iceberg")
    input_dir = tmp_path / "input"
    built = shop.build(lake.namespace, str(input_dir))
    ingest = Runtime(built["ingest_shopping"], settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None)
    generate.write_batch(str(input_dir), 1, orders=20)
    b1 = barriers.issue(lake.conn).barrier
    ingest.run()
    assert _worker(lake, input_dir, "two_sinks").returncode == 0
    generate.write_batch(str(input_dir), 2, orders=20)
    b2 = barriers.issue(lake.conn).barrier
    ingest.run()
    crashed = _worker(lake, input_dir, "two_sinks", AFTER_ICEBERG_COMMIT, fault_after=0)
    assert crashed.returncode == CRASH_EXIT_CODE
    sinks = [TableName.parse(f"lake.{lake.namespace}.by_user"), TableName.parse(f"lake.{lake.namespace}.by_item")]
    cut = reads.resolve(lake.conn, sinks)
    assert cut.barrier == b1
    totals = [table_at(spark, s, cut.snapshots[s]).groupBy().sum("amount").collect()[0][0] for s in sinks]
    assert totals[0] == totals[1]  # both at b1
    assert _worker(lake, input_dir, "two_sinks").returncode == 0
    cut = reads.resolve(lake.conn, sinks)
    assert cut.barrier == b2
    totals = [table_at(spark, s, cut.snapshots[s]).groupBy().sum("amount").collect()[0][0] for s in sinks]
    assert (
        totals[0]
        == totals[1]
        == spark.table(shop.tables(lake.namespace)["shopping"]).groupBy().sum("amount").collect()[0][0]
    )
    for s in sinks:
        assert (
            len(
                [
                    x
                    for x in spark.sql(f"SELECT summary FROM {s}.snapshots").collect()
                    if x.summary.get("icebarrier.barrier") == str(b2)
                ]
            )
            <= 2
        )  # overwrite: no second commit


def test_streaming_micro_batches_complete_one_barrier_each_and_replays_write_nothing(lake, spark, tmp_path):
    """Each micro-batch completes exactly one barrier; replaying a batch id writes nothing twice."""
    shop.create_tables(spark, lake.namespace)
    barriers.set_interval_s(lake.conn, 0.05)
    t = shop.tables(lake.namespace)
    job = RootJob(name=f"{lake.namespace}_stream", sinks=[t["shopping"]], external_inputs=["stream:shopping"])
    run_batch = foreach_batch(job, settings=lake.settings, log=lambda _: None)
    input_dir = tmp_path / "input"
    generate.write_batch(str(input_dir), 1, orders=10)
    generate.write_batch(str(input_dir), 2, orders=10)
    query = (
        spark.readStream.schema(shop.SHOPPING_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(input_dir / "shopping"))
        .writeStream.foreachBatch(run_batch)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert spark.table(t["shopping"]).count() == 20
    completed = [r["barrier"] for r in runs.ranges(lake.conn, job.name)]
    assert len(completed) == 2 == len(set(completed))
    assert tables.states(lake.conn, [TableName.parse(t["shopping"])])[0].watermark == completed[-1]
    replay = spark.read.schema(shop.SHOPPING_SCHEMA).json(str(input_dir / "shopping" / "batch-000002.json"))
    run_batch(replay, 1)  # a restarted query re-delivering batch 1
    assert spark.table(t["shopping"]).count() == 20


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_follow_mode_stops_cleanly_on_a_signal(lake, spark, tmp_path, sig):
    """`icebarrier run FILE --follow` heartbeats while alive; SIGTERM and Ctrl-C (SIGINT, which
    PySpark's own handler would turn into `Aborted!`) both finish the barrier, exit 0 and show stopped."""
    shop.create_tables(spark, lake.namespace)
    job_file = tmp_path / "job.py"
    job_file.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(shop.__file__.rsplit('/', 1)[0])!r})\n"
        "from pipeline import build\n"
        f"job = build({lake.namespace!r}, {str(tmp_path / 'input')!r})['user_item_amount']\n"
    )
    env = {**os.environ}
    proc = subprocess.Popen(
        [sys.executable, "-m", "icebarrier.cli.main", "run", str(job_file), "--follow", "--poll", "200ms"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    name = f"{lake.namespace}_user_item_amount"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if jobs.show(lake.conn, name).status == "running":
                break
        except Exception:
            pass
        time.sleep(0.5)
    assert jobs.show(lake.conn, name).status == "running"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert sig.name in err and "Aborted" not in err and jobs.show(lake.conn, name).status == "stopped"


@pytest.mark.slow
@pytest.mark.cluster
def test_the_pipeline_end_to_end_on_a_standalone_cluster(lake, spark, tmp_path, spark_cluster):
    """The shopping pipeline's jobs in a process of their own (one per round, the jobs in
    order), its Spark on the standalone cluster (executors in their own JVMs), two rounds; the
    first round's process is killed after the root job's Iceberg commit and run again (the next
    batch's files arrived meanwhile): the root writes the range it recorded exactly once, every
    table completes both barriers and the avg-price query reads one consistent cut (amount and
    price sums agree with the input)."""
    shop.create_tables(spark, lake.namespace)
    barriers.set_interval_s(lake.conn, 3600)
    input_dir = tmp_path / "input"
    every = "ingest_shopping,ingest_shipments,user_item_amount,user_item_price,shipped_orders"
    root = shop.build(lake.namespace, str(input_dir))["ingest_shopping"].name
    shopping = TableName.parse(shop.tables(lake.namespace)["shopping"])

    def a_round(rows: list[dict]) -> None:
        done = _worker(lake, input_dir, every, master=spark_cluster)
        assert done.returncode == 0 and done.stdout.split() == ["1"] * 5, done.stderr[-2000:]
        cut = reads.resolve(lake.conn, [shopping])
        ids = [r.order_id for r in table_at(spark, shopping, cut.snapshots[shopping]).collect()]
        assert sorted(ids) == sorted(r["order_id"] for r in rows)  # no loss, no duplicate

    rows = generate.write_batch(str(input_dir), 1, orders=30)
    b1 = barriers.issue(lake.conn).barrier
    crashed = _worker(lake, input_dir, every, AFTER_ICEBERG_COMMIT, master=spark_cluster)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-2000:]
    recorded = runs.recorded_range(lake.conn, root, b1)
    assert recorded is not None and len(recorded["files"]) == 1
    later = generate.write_batch(str(input_dir), 2, orders=30)  # arrives after the range was recorded
    a_round(rows)  # the restart replays the recorded range: batch 1 only
    assert runs.recorded_range(lake.conn, root, b1) == recorded
    rows += later
    b2 = barriers.issue(lake.conn).barrier
    a_round(rows)
    names = [TableName.parse(t) for t in shop.tables(lake.namespace).values()]
    assert {s.watermark for s in tables.states(lake.conn, names)} == {b2}
    cut = reads.resolve(lake.conn, names)
    sink = TableName.parse(shop.tables(lake.namespace)["user_item_amount"])
    amount = table_at(spark, sink, cut.snapshots[sink]).groupBy().sum("amount").collect()[0][0]
    assert amount == sum(r["amount"] for r in rows)
