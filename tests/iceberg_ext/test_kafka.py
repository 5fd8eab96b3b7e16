"""Root jobs from a real Kafka broker (KRaft, tests/conftest.py ``kafka``): each barrier's offset
range recorded with its commit, read ``read_committed`` (aborted transactions never enter),
replayed exactly, an idle topic a skip; and every bad input refused in one line, nothing committed."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from icebarrier.control_plane import barriers, runs
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.catalog import load_table, summary_properties
from icebarrier.iceberg_ext.job import RootJob
from icebarrier.iceberg_ext.kafka import (
    SUMMARY_OFFSETS,
    KafkaLog,
    KafkaSource,
    KafkaSourceError,
    decode_offsets,
)
from icebarrier.iceberg_ext.runtime import Runtime
from tests.kafka_log import Orders, all_committed, committed_in, new_topic

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
    df = spark.table(sink) if barrier_snapshot is None else spark.read.option("snapshot-id", barrier_snapshot).table(sink)
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
    while job.source.ready_until() < b1:
        time.sleep(0.05)
    spec = runs.record_range(lake.conn, job.name, b1, job.source.plan(lake.conn, job.name, b1))  # as a crashed run left it
    orders.batch(8)
    time.sleep(0.05)
    assert _until_completed(rt, b1) == [b1]
    assert runs.recorded_range(lake.conn, job.name, b1) == spec
    assert _ids(spark, job.sinks[0]) == list(range(8))


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
    with pytest.raises(KafkaSourceError, match=r"Kafka at 127\.0\.0\.1:9 did not answer .* check the source's bootstrap"):
        KafkaLog("127.0.0.1:9", "orders", timeout_s=2).partitions()
    with pytest.raises(KafkaSourceError, match=r"topic no_such_topic does not exist on .*create it"):
        KafkaLog(kafka.bootstrap, "no_such_topic").partitions()
    topic = new_topic(kafka, config={"message.timestamp.type": "CreateTime"})
    with pytest.raises(KafkaSourceError, match=r"stamps records with CreateTime; .*message.timestamp.type=LogAppendTime"):
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
    b = _barrier_after_records(lake)
    while job.source.ready_until() < b:
        time.sleep(0.05)
    runs.record_range(lake.conn, job.name, b, job.source.plan(lake.conn, job.name, b))
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for f in admin.delete_records([TopicPartition(topic, 0, 3)]).values():  # what retention does
        f.result(30)
    with pytest.raises(KafkaSourceError, match=rf"topic {topic} partition 0: offsets 0\.\.5 are to be read but the log starts at 3"):
        rt.run()
    assert _table(rt, job.sinks[0]).current_snapshot() is None
