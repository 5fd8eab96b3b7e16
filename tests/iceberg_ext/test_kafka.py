"""Root jobs from a real Kafka broker (KRaft, tests/conftest.py ``kafka``): each barrier's offset
range recorded with its commit, read ``read_committed`` (aborted transactions never enter),
replayed exactly, an idle topic a skip; and every bad input refused in one line, nothing committed."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from icebarrier.control_plane import barriers, jobs, runs, tokens
from icebarrier.control_plane.errors import JobNotFoundError
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.iceberg_ext.catalog import load_table, summary_properties
from icebarrier.iceberg_ext.faults import AFTER_CONTROL_PLANE, AFTER_ICEBERG_COMMIT, AFTER_INPUT_RANGE, CRASH_EXIT_CODE
from icebarrier.iceberg_ext.job import RootJob
from icebarrier.iceberg_ext.kafka import (
    SUMMARY_OFFSETS,
    KafkaLog,
    KafkaSource,
    KafkaSourceError,
    decode_offsets,
)
from icebarrier.iceberg_ext.runtime import Runtime
from tests.kafka_log import Load, Orders, all_committed, committed_in, new_topic

SCHEMA = "id bigint, user_id int, amount bigint"


def _job(lake, spark, kafka, topic, name="orders", **source):
    sink = f"lake.{lake.namespace}.{name}"
    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {sink} ({SCHEMA}, kafka_partition int, kafka_offset bigint, "
        f"kafka_timestamp timestamp) USING iceberg"
    )
    job = RootJob(
        name=f"{lake.namespace}_{name}",
        sinks=[sink],
        source=KafkaSource(kafka.bootstrap, topic, SCHEMA, **source),
    )
    return job, Runtime(job, settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None)


def _barrier_after_records(lake):
    """A barrier issued once the records produced so far are stamped (the broker's clock moved on)."""
    time.sleep(0.05)
    return barriers.issue(lake.conn).barrier


def _record_when_decided(lake, job, barrier):
    """Record the job's range for ``barrier`` once its records are decided (what a run does before it writes)."""
    while job.source.ready_until() < barrier:
        time.sleep(0.05)
    return runs.record_range(lake.conn, job.name, barrier, job.source.plan(lake.conn, job.name, barrier))


def _until_completed(rt, barrier, timeout_s=20):
    done = []
    deadline = time.monotonic() + timeout_s
    while barrier not in done and time.monotonic() < deadline:
        done += rt.run().completed
        if barrier not in done:
            time.sleep(0.1)
    assert barrier in done, f"barrier {barrier} not completed in {timeout_s} s"
    return done


def _table(rt, sink):
    return load_table(rt.catalog, TableName.parse(sink))


def _ids(spark, sink, barrier_snapshot=None):
    df = (
        spark.table(sink)
        if barrier_snapshot is None
        else spark.read.format("iceberg").option("versionAsOf", barrier_snapshot).load(sink)
    )
    return sorted(r.id for r in df.select("id").collect())


def test_barrier_ranges_exact_aborted_never_enter_idle_is_a_skip(lake, spark, kafka):
    """Barrier B holds exactly the committed records stamped <= B: its offsets are recorded in
    the control plane and in the commit's summary, and a read_committed consumer finds exactly
    the sink's rows in them; aborted transactions never enter; an idle topic is a skip."""
    topic = new_topic(kafka)
    orders = Orders(kafka, topic)
    job, rt = _job(lake, spark, kafka, topic)
    orders.batch(10)
    orders.batch(5, abort=True)
    orders.batch(6)
    b1 = _barrier_after_records(lake)
    orders.batch(4)  # stamped after b1: the next barrier's
    assert _until_completed(rt, b1) == [b1]
    sink = job.sinks[0]
    table = _table(rt, sink)
    snapshot = table.current_snapshot()
    spec = runs.recorded_range(lake.conn, job.name, b1)
    offsets = {int(p): tuple(r) for p, r in spec["offsets"].items()}
    assert decode_offsets(summary_properties(snapshot)[SUMMARY_OFFSETS]) == offsets  # the same range, both places
    assert _ids(spark, sink) == sorted(committed_in(kafka, topic, offsets)) == list(range(10)) + list(range(15, 21))

    b2 = _barrier_after_records(lake)
    assert _until_completed(rt, b2) == [b2]
    assert _ids(spark, sink) == sorted(orders.produced)

    b3 = _barrier_after_records(lake)  # nothing produced since b2
    assert _until_completed(rt, b3) == [b3]
    assert runs.recorded_range(lake.conn, job.name, b3) is None  # a skip: no range, no snapshot
    assert len(_table(rt, sink).snapshots()) == 2
    assert sorted(all_committed(kafka, topic)) == _ids(spark, sink)


def test_open_transaction_holds_the_barrier_until_decided(lake, spark, kafka):
    """A transaction open since before B holds B back (its records may still commit): B closes
    when it commits, and holds them."""
    topic = new_topic(kafka, partitions=1)
    orders = Orders(kafka, topic)
    job, rt = _job(lake, spark, kafka, topic)
    orders.batch(3)
    slow = orders.producer
    slow.begin_transaction()
    for i in (100, 101):
        slow.produce(topic, f'{{"id": {i}, "user_id": 1, "amount": 1}}'.encode(), partition=0)
    slow.flush(30)
    b1 = _barrier_after_records(lake)
    assert rt.run().completed == []  # waiting: the open transaction's records are stamped before b1
    assert "not all decided" in (job.source.waiting_for(b1) or "")
    slow.commit_transaction(30)
    assert _until_completed(rt, b1) == [b1]
    assert _ids(spark, job.sinks[0]) == [0, 1, 2, 100, 101]


def test_replay_of_a_recorded_range_reads_exactly_it(lake, spark, kafka):
    """A range recorded before a crash is read again exactly, whatever was produced since."""
    topic = new_topic(kafka)
    orders = Orders(kafka, topic)
    job, rt = _job(lake, spark, kafka, topic)
    orders.batch(8)
    b1 = _barrier_after_records(lake)
    spec = _record_when_decided(lake, job, b1)  # as a crashed run left it
    orders.batch(8)
    time.sleep(0.05)
    assert _until_completed(rt, b1) == [b1]
    assert runs.recorded_range(lake.conn, job.name, b1) == spec
    assert _ids(spark, job.sinks[0]) == list(range(8))


def test_a_transform_reads_the_range_through_spark(lake, spark, kafka):
    """A root job with a transform reads its range as a Spark DataFrame (not the PyIceberg path)."""
    topic = new_topic(kafka)
    orders = Orders(kafka, topic)
    sink = f"lake.{lake.namespace}.big"
    spark.sql(f"CREATE TABLE {sink} (id bigint, amount bigint, kafka_offset bigint) USING iceberg")
    job = RootJob(
        name=f"{lake.namespace}_big",
        sinks=[sink],
        source=KafkaSource(kafka.bootstrap, topic, SCHEMA),
        transform=lambda df: df.filter("amount > 6").select("id", "amount", "kafka_offset"),
    )
    assert not job.writes_arrow
    rt = Runtime(job, settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None)
    orders.batch(30)
    orders.batch(5, abort=True)
    _until_completed(rt, _barrier_after_records(lake))
    assert _ids(spark, sink) == [i for i in range(30) if i % 13 + 1 > 6]
    assert SUMMARY_OFFSETS in summary_properties(_table(rt, sink).current_snapshot())


def test_partition_added_is_read_from_its_start(lake, spark, kafka):
    topic = new_topic(kafka, partitions=1)
    orders = Orders(kafka, topic)
    job, rt = _job(lake, spark, kafka, topic)
    orders.batch(4)
    _until_completed(rt, _barrier_after_records(lake))
    kafka.add_partitions(topic, 3)
    later = Orders(kafka, topic)  # a producer that knows the new partitions
    later.next_id = 1000
    later.batch(5, partition=2)
    later.batch(5, partition=0)
    b2 = _barrier_after_records(lake)
    _until_completed(rt, b2)
    assert set(runs.recorded_range(lake.conn, job.name, b2)["offsets"]) == {"0", "1", "2"}
    assert _ids(spark, job.sinks[0]) == sorted(orders.produced + later.produced) == sorted(all_committed(kafka, topic))


# -- bad input: one line, nothing committed ---------------------------------------------------------------------


def test_unreachable_broker_missing_topic_and_creation_time_refused(lake, spark, kafka):
    with pytest.raises(
        KafkaSourceError, match=r"Kafka at 127\.0\.0\.1:9 did not answer .* check the source's bootstrap"
    ):
        KafkaLog("127.0.0.1:9", "orders", timeout_s=2).partitions()
    with pytest.raises(KafkaSourceError, match=r"topic no_such_topic does not exist on .*create it"):
        KafkaLog(kafka.bootstrap, "no_such_topic").partitions()
    topic = new_topic(kafka, config={"message.timestamp.type": "CreateTime"})
    with pytest.raises(
        KafkaSourceError, match=r"stamps records with CreateTime; .*message.timestamp.type=LogAppendTime"
    ):
        KafkaLog(kafka.bootstrap, topic).partitions()


def test_bad_record_named_by_partition_and_offset_nothing_committed(lake, spark, kafka):
    topic = new_topic(kafka, partitions=1)
    orders = Orders(kafka, topic)
    job, rt = _job(lake, spark, kafka, topic)
    orders.batch(3)
    orders.raw(b"not json")  # offset 4 (3 is the first transaction's marker)
    b = _barrier_after_records(lake)
    while job.source.ready_until() < b:
        time.sleep(0.05)
    with pytest.raises(KafkaSourceError, match=rf"topic {topic} partition 0 offset 4: the record does not deserialize"):
        rt.run()
    assert _table(rt, job.sinks[0]).current_snapshot() is None


def test_offsets_deleted_by_retention_are_refused_never_skipped(lake, spark, kafka):
    topic = new_topic(kafka, partitions=1)
    orders = Orders(kafka, topic)
    job, rt = _job(lake, spark, kafka, topic)
    orders.batch(5)
    _record_when_decided(lake, job, _barrier_after_records(lake))
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for f in admin.delete_records([TopicPartition(topic, 0, 3)]).values():  # what retention does
        f.result(30)
    with pytest.raises(
        KafkaSourceError, match=rf"topic {topic} partition 0: offsets 0\.\.5 are to be read but the log starts at 3"
    ):
        rt.run()
    assert _table(rt, job.sinks[0]).current_snapshot() is None


# -- faults: real processes killed, the broker restarted, partitions added, under load ---------------------------


class Worker:
    """The job in a process of its own (tests/iceberg_ext/kafka_worker.py), started again after a crash."""

    # Barriers after the load stops that hold every record produced before it. One for a consumer:
    # barrier B holds each record stamped at or before B. Two for Spark: a micro-batch it planned
    # before the last records may take the barrier issued after them (docs/kafka.md).
    settle_barriers = 1

    def __init__(self, lake, kafka, topic, way, tmp_path):
        self.settle_barriers = 2 if way == "stream" else 1
        self.args = [
            sys.executable, "-m", "tests.iceberg_ext.kafka_worker", way, lake.settings.dsn, lake.settings.schema,
            lake.settings.warehouse, lake.namespace, kafka.bootstrap, topic, str(tmp_path / "checkpoint"),
        ]  # fmt: skip
        self.log = tmp_path / f"{way}.log"
        self.proc = None

    def start(self, fault: str | None = None, fault_after: int = 0, trigger_s: float = 1):
        env = {
            **os.environ,
            "ICEBARRIER_FAULT": fault or "",
            "ICEBARRIER_FAULT_AFTER": str(fault_after),
            "KAFKA_WORKER_TRIGGER_S": str(trigger_s),
        }
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.args, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)

    def alive(self):
        return self.proc.poll() is None


def _create_sink(spark, lake, name="orders"):
    sink = f"lake.{lake.namespace}.{name}"
    spark.sql(
        f"CREATE TABLE {sink} ({SCHEMA}, kafka_partition int, kafka_offset bigint, kafka_timestamp timestamp) USING iceberg"
    )
    return sink


def _settle(lake, spark, kafka, topic, sink, job, worker, timeout_s=120):
    """Wait until the job completed the barriers issued after every record was decided."""
    deadline = time.monotonic() + timeout_s
    for _ in range(worker.settle_barriers):
        time.sleep(0.5)
        final = barriers.issue(lake.conn).barrier
        while jobs.show(lake.conn, job).progress is None or jobs.show(lake.conn, job).progress < final:
            assert worker.alive(), worker.log.read_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"job did not reach the final barrier {final}; {_log_state(kafka, topic)}; "
                f"log:\n{worker.log.read_text()[-3000:]}"
            )
            time.sleep(0.3)
    worker.stop()


def _log_state(kafka, topic) -> str:
    """The topic as a source sees it: what is decided, and each partition's stable and high offsets."""
    from confluent_kafka.admin import OffsetSpec

    log = KafkaLog(kafka.bootstrap, topic)
    try:
        partitions = log.partitions()
        stable = log._offsets(partitions, OffsetSpec.latest(), committed=True)
        high = log._offsets(partitions, OffsetSpec.latest(), committed=False)
        return (
            f"decided until {log.stable_until_us()}, stable/high offsets {[(stable[p], high[p]) for p in partitions]}"
        )
    finally:
        log.close()


def _exactly_once(lake, spark, kafka, topic, sink, job):
    """Each barrier's rows are exactly the records its recorded range names (read back read_committed
    by another consumer); its commit's summary names the same range; nothing is doubled and the
    table holds every committed record."""
    rows = spark.table(sink).select("id", "kafka_partition", "kafka_offset").collect()
    ids = [r.id for r in rows]
    assert len(ids) == len(set(ids)), "a record is in the table twice"
    table = _table_by_name(lake, sink)
    summaries = {}
    for snapshot in table.snapshots():
        props = summary_properties(snapshot)
        if SUMMARY_OFFSETS in props:
            summaries[int(props["icebarrier.barrier"])] = decode_offsets(props[SUMMARY_OFFSETS])
    ranges = [(r["barrier"], r["spec"]) for r in lake.conn.execute(
        "SELECT barrier, spec FROM input_ranges WHERE job_name = %s ORDER BY barrier", (job,)).fetchall()]  # fmt: skip
    checked = 0
    for barrier, spec in ranges:
        offsets = {int(p): tuple(r) for p, r in spec.get("offsets", {}).items()}
        if not offsets:
            continue
        expected = sorted(committed_in(kafka, topic, offsets))
        found = sorted(
            r.id
            for r in rows
            if r.kafka_partition in offsets
            and offsets[r.kafka_partition][0] <= r.kafka_offset < offsets[r.kafka_partition][1]
        )
        assert found == expected, f"barrier {barrier}: rows {found[:10]}… differ from its range {offsets}"
        if expected:
            assert summaries.get(barrier) == offsets, f"barrier {barrier}: the commit's summary names another range"
            checked += 1
    assert checked >= 2
    assert sorted(ids) == sorted(all_committed(kafka, topic))
    return checked


def _progress(lake, job):
    try:
        return jobs.show(lake.conn, job).progress
    except JobNotFoundError:  # not registered yet: its process is starting
        return None


def _moved(lake, job, worker, timeout_s=120):
    """Wait until the job completes another barrier."""
    before = _progress(lake, job)
    deadline = time.monotonic() + timeout_s
    while _progress(lake, job) == before:
        assert worker.alive(), worker.log.read_text()[-3000:]
        assert time.monotonic() < deadline, (
            f"the job completed nothing in {timeout_s} s:\n{worker.log.read_text()[-3000:]}"
        )
        time.sleep(0.1)


def _table_by_name(lake, sink):
    return load_table(lake.catalog, TableName.parse(sink))


WAYS = ["consumer", "stream"]


@pytest.mark.slow
@pytest.mark.parametrize("way", WAYS)
def test_killed_at_each_point_and_at_random_across_a_broker_restart_and_a_new_partition_exactly_once(
    lake, spark, kafka, tmp_path, way
):
    """Under a transactional load with aborts: the job SIGKILLs itself after recording a range
    (before the Iceberg commit), after the commit, and after the control-plane record, one after
    the other; then it is SIGKILLed at random moments of its work (the stream once, the consumer
    twice), the broker stopped and started again, a partition added. Restarted each time, every
    barrier holds exactly its range, the table every committed record."""
    topic = new_topic(kafka)
    sink = _create_sink(spark, lake)
    barriers.set_interval_s(lake.conn, 1)
    orders = Orders(kafka, topic)
    load = Load(orders, per_s=300)
    load.start()
    job = f"{lake.namespace}_orders"
    worker = Worker(lake, kafka, topic, way, tmp_path)
    for fault in (AFTER_INPUT_RANGE, AFTER_ICEBERG_COMMIT, AFTER_CONTROL_PLANE):
        worker.start(fault, fault_after=1)
        assert worker.proc.wait(180) == CRASH_EXIT_CODE, f"{fault}: {worker.log.read_text()[-3000:]}"
    worker.start()
    rng = random.Random(os.environ.get("PYTEST_XDIST_WORKER", "0"))
    # a random moment of a running job's work (not its JVM's start): twice, once where each restart
    # starts a Spark driver (the stream)
    for _ in range(2 if way == "consumer" else 1):
        _moved(lake, job, worker)
        time.sleep(rng.uniform(0, 1.5))
        worker.kill()
        worker.start()
    _moved(lake, job, worker)
    _moved(lake, job, worker)
    kafka.stop()
    time.sleep(2)
    kafka.start()
    time.sleep(4)
    kafka.add_partitions(topic, 3)
    later = Orders(kafka, topic)
    later.next_id = 1_000_000
    later.batch(30, partition=2)
    time.sleep(3)
    load.stop.set()
    load.join()
    _settle(lake, spark, kafka, topic, sink, job, worker)
    checked = _exactly_once(lake, spark, kafka, topic, sink, job)
    assert checked >= 4
    assert set(orders.produced) | set(later.produced) <= {r.id for r in spark.table(sink).select("id").collect()}


@pytest.mark.slow
@pytest.mark.other_line
def test_stream_skips_a_barrier_only_when_the_log_holds_nothing_for_it(lake, spark, kafka, tmp_path):
    """Spark's status is as old as its last trigger. With a 15-s trigger, a barrier issued while
    the topic is idle is skipped (Spark runs no micro-batch on an idle topic: only the skipper can
    move the job, and it records no range); one issued after new records is not (the status still
    says "no data"): the next micro-batch completes it, holding them."""
    topic = new_topic(kafka)
    sink = _create_sink(spark, lake)
    job = f"{lake.namespace}_orders"
    barriers.set_interval_s(lake.conn, 3600)  # only the barriers issued here
    orders = Orders(kafka, topic)
    orders.batch(5)
    b0 = _barrier_after_records(lake)
    worker = Worker(lake, kafka, topic, "stream", tmp_path).start(trigger_s=15)
    _moved(lake, job, worker)  # the first micro-batch (its trigger is the query's start)
    assert _progress(lake, job) == b0
    b1 = _barrier_after_records(lake)
    _moved(lake, job, worker)  # the skipper (how soon is a loaded machine's matter: CI once took over 10 s)
    assert _progress(lake, job) == b1 and runs.recorded_range(lake.conn, job, b1) is None
    orders.batch(7)
    b2 = _barrier_after_records(lake)
    _moved(lake, job, worker, timeout_s=60)
    assert _progress(lake, job) == b2
    assert runs.recorded_range(lake.conn, job, b2) is not None, "b2 was skipped with 7 records stamped before it"
    at_b2 = [
        s for s in _table_by_name(lake, sink).snapshots() if summary_properties(s).get("icebarrier.barrier") == str(b2)
    ]
    assert len(at_b2) == 1
    assert _ids(spark, f"{sink}", at_b2[0].snapshot_id) == sorted(orders.produced)
    worker.stop()


class ExecWorker(Worker):
    """`icebarrier job exec JOB --follow -- python kafka_exec.py …` (a catalog client: no database access)."""

    def __init__(self, lake, kafka, topic, server, credential, tmp_path):
        command = [sys.executable, str(Path(__file__).parent / "kafka_exec.py"), kafka.bootstrap, topic, lake.namespace]
        self.args = ["icebarrier", "job", "exec", f"{lake.namespace}_orders", "--catalog-uri", server,
                     "--credential", credential, "--follow", "--", *command]  # fmt: skip
        self.log = tmp_path / "exec.log"
        self.proc = None
        self.fault_file = tmp_path / "fault-count"

    def start(self, fault: str | None = None, fault_after: int = 0):
        env = {**os.environ, "KAFKA_EXEC_FAULT": fault or "", "KAFKA_EXEC_FAULT_FILE": str(self.fault_file)}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                self.args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def kill(self):  # the runner and its command, like a lost machine
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


@pytest.mark.slow
def test_job_exec_python_consumer_killed_everywhere_exactly_once(lake, spark, kafka, server, tmp_path):
    """The plain-consumer way under `job exec`: its command SIGKILLed before its commit and after
    it (staged), the runner and command killed at random moments (after publishes too), the broker
    restarted; the catalog records each range in the control plane as it publishes the barrier."""
    topic = new_topic(kafka)
    sink = _create_sink(spark, lake)
    job = f"{lake.namespace}_orders"
    jobs.register(
        lake.conn, JobDefinition(name=job, sinks=frozenset([TableName.parse(sink)]), external_inputs=frozenset([topic]))
    )
    credential = ":".join(tokens.create(lake.conn, job=job))  # least privilege: its sink only
    barriers.set_interval_s(lake.conn, 1)
    load = Load(Orders(kafka, topic), per_s=300)
    load.start()
    worker = ExecWorker(lake, kafka, topic, server, credential, tmp_path)
    for fault in ("before-commit", "after-commit"):
        worker.fault_file.unlink(missing_ok=True)
        worker.start(fault)
        deadline = time.monotonic() + 60
        while not worker.fault_file.exists() or worker.fault_file.read_text() != "3":
            assert time.monotonic() < deadline, worker.log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1)
        worker.kill()
    worker.start()
    rng = random.Random(7)
    for _ in range(2):
        time.sleep(rng.uniform(2, 6))
        worker.kill()
        worker.start()
    kafka.stop()
    time.sleep(2)
    kafka.start()
    time.sleep(4)
    load.stop.set()
    load.join()
    _settle(lake, spark, kafka, topic, sink, job, worker)
    assert _exactly_once(lake, spark, kafka, topic, sink, job) >= 3


# -- bad input through the command line: one line, a non-zero exit, nothing committed ------------------------

JOB_FILE = """
import os
from icebarrier import KafkaSource, RootJob, main
job = RootJob(
    name=os.environ["JOB"],
    sinks=[os.environ["SINK"]],
    source=KafkaSource(os.environ["BOOTSTRAP"], os.environ["TOPIC"], "id bigint, user_id int, amount bigint", timeout_s=3),
)
if __name__ == "__main__":
    main(job)
"""


@pytest.mark.slow
def test_bad_inputs_are_one_line_a_failure_and_nothing_committed(lake, spark, kafka, tmp_path):
    """`icebarrier run job.py --once` (a real process) on each bad input: exit 1, one line naming
    the setting and the fix, no traceback; no snapshot, and a refused source registers nothing."""
    sink = _create_sink(spark, lake)
    (tmp_path / "job.py").write_text(JOB_FILE)
    good = new_topic(kafka, partitions=1)
    orders = Orders(kafka, good)
    orders.batch(2)
    orders.raw(b"{broken")
    cases = [
        ("127.0.0.1:9", good, r"Kafka at 127\.0\.0\.1:9 did not answer .*check the source's bootstrap servers"),
        (kafka.bootstrap, "no_such_topic", r"Kafka topic no_such_topic does not exist on .*create it"),
        (kafka.bootstrap, new_topic(kafka, config={"message.timestamp.type": "CreateTime"}), r"stamps records with CreateTime"),
        (kafka.bootstrap, good, rf"topic {good} partition 0 offset 3: the record does not deserialize"),
    ]  # fmt: skip
    env = {
        **os.environ,
        "ICEBARRIER_DSN": lake.settings.dsn,
        "ICEBARRIER_SCHEMA": lake.settings.schema,
        "ICEBARRIER_WAREHOUSE": lake.settings.warehouse,
        "SINK": sink,
    }
    for i, (bootstrap, topic, needle) in enumerate(cases):
        job = f"{lake.namespace}_bad{i}"
        time.sleep(0.3)
        barriers.issue(lake.conn)
        done = subprocess.run(
            ["icebarrier", "run", str(tmp_path / "job.py"), "--once"],
            env={**env, "JOB": job, "BOOTSTRAP": bootstrap, "TOPIC": topic},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr  # beside the job's progress lines
        assert re.search(needle, errors[0]), errors[0]
        if i < 3:  # refused before registering: nothing written at all
            with pytest.raises(JobNotFoundError):
                jobs.show(lake.conn, job)
    assert _table_by_name(lake, sink).current_snapshot() is None

    # offsets retention deleted while the job was down: refused by name, never skipped
    sink = _create_sink(spark, lake, "retained")
    env["SINK"] = sink
    retained = new_topic(kafka, partitions=1)
    later = Orders(kafka, retained)
    later.batch(4)  # offsets 0-3, the marker at 4

    def run_once():
        time.sleep(0.3)
        barriers.issue(lake.conn)
        return subprocess.run(
            ["icebarrier", "run", str(tmp_path / "job.py"), "--once"],
            env={**env, "JOB": f"{lake.namespace}_retained", "BOOTSTRAP": kafka.bootstrap, "TOPIC": retained},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    assert run_once().returncode == 0
    first = _table_by_name(lake, sink).current_snapshot().snapshot_id
    later.batch(4)  # offsets 5-8
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})  # kept until its futures resolve
    for f in admin.delete_records([TopicPartition(retained, 0, 7)]).values():  # what retention does
        f.result(30)
    done = run_once()
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert re.search(rf"topic {retained} partition 0: offsets 5\.\.9 are to be read but the log starts at 7", errors[0])
    assert _table_by_name(lake, sink).current_snapshot().snapshot_id == first


HOSTILE = """
import os, sys
import pyarrow as pa
from pyiceberg.catalog import load_catalog
table = load_catalog(os.environ["ICEBARRIER_CATALOG"]).load_table(sys.argv[1])
schema = table.schema().as_arrow()
row = pa.Table.from_pylist([{"id": 1, "user_id": 1, "amount": 1}], schema=schema)
table.append(row, snapshot_properties={"icebarrier.input-range": sys.argv[2]})
"""


@pytest.mark.slow
def test_a_commit_cannot_record_a_bad_input_range(lake, spark, server, tmp_path):
    """Through the catalog a commit records its input range at publish only from a root job, as a
    JSON object of bounded size: a string that is not JSON, one too large, or a range from a job
    that reads tables is refused by name, and nothing is published or recorded."""
    sink = f"lake.{lake.namespace}.raw"
    derived = f"lake.{lake.namespace}.derived"
    spark.sql(f"CREATE TABLE {sink} (id bigint, user_id int, amount bigint) USING iceberg")
    spark.sql(f"CREATE TABLE {derived} (id bigint, user_id int, amount bigint) USING iceberg")
    root, mid = f"{lake.namespace}_raw", f"{lake.namespace}_derived"
    raw, der = TableName.parse(sink), TableName.parse(derived)
    jobs.register(lake.conn, JobDefinition(name=root, sinks=frozenset([raw]), external_inputs=frozenset(["x"])))
    jobs.register(lake.conn, JobDefinition(name=mid, sources=frozenset([raw]), sinks=frozenset([der])))
    (tmp_path / "commit.py").write_text(HOSTILE)
    barriers.set_interval_s(lake.conn, 3600)
    barriers.issue(lake.conn)

    def exec_(job, table, value):
        credential = ":".join(tokens.create(lake.conn, job=job))
        return subprocess.run(
            ["icebarrier", "job", "exec", job, "--catalog-uri", server, "--credential", credential, "--",
             sys.executable, str(tmp_path / "commit.py"), f"{lake.namespace}.{table}", value],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    bad = [
        ("not json", "it is not JSON"),
        ('"a string"', "not a JSON object"),
        ("[" + "1," * 40000 + "1]", "over 65536"),
    ]
    for value, why in bad:
        done = exec_(root, "raw", value)
        assert done.returncode != 0 and "icebarrier.input-range" in done.stderr and why in done.stderr, done.stderr[
            -2000:
        ]
        assert _table_by_name(lake, sink).current_snapshot() is None
    good = '{"topic": "t", "offsets": {"0": [0, 1]}}'
    assert exec_(root, "raw", good).returncode == 0
    assert runs.recorded_range(lake.conn, root, jobs.show(lake.conn, root).progress) == json.loads(good)
    done = exec_(mid, "derived", good)
    assert done.returncode != 0 and "only a root job records an input range" in done.stderr, done.stderr[-2000:]
    assert _table_by_name(lake, derived).current_snapshot() is None
    assert lake.conn.execute("SELECT count(*) AS n FROM input_ranges WHERE job_name = %s", (mid,)).fetchone()["n"] == 0
