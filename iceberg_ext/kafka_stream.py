"""Root jobs from a Kafka log through Spark Structured Streaming (``spark-sql-kafka``; docs/kafka.md):
:func:`stream` runs a query whose micro-batches complete the job's barriers
(:func:`~icebarrier.iceberg_ext.runtime.foreach_batch`), each batch's offsets recorded and
summarised as the other ways record them (:mod:`.kafka`), and barriers skipped while the topic is
idle (:class:`IdleSkipper`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from icebarrier.control_plane import runs
from icebarrier.control_plane.model import barrier_label
from icebarrier.iceberg_ext.kafka import KafkaLog, ddl_columns, ends_of, offsets_of
from icebarrier.iceberg_ext.runtime import foreach_batch


def json_rows(df, schema: str):
    """Spark's Kafka rows (key, value, partition, offset, timestamp…) as a KafkaSource's: the JSON
    value's fields of ``schema`` (Spark DDL), then ``kafka_partition``, ``kafka_offset`` and
    ``kafka_timestamp``. The ``transform`` of a job :func:`stream` runs, for the same sink."""
    from pyspark.sql import functions as F

    value = F.from_json(F.col("value").cast("string"), schema)
    return df.select(
        *(value[c].alias(c) for c in ddl_columns(schema)),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("timestamp").alias("kafka_timestamp"),
    )


class IdleSkipper(threading.Thread):
    """Completes a streaming Kafka job's barriers as skips while the topic is idle (Spark runs no
    micro-batch then, so the pipeline downstream would wait). Barrier B is skipped only when the
    log itself says so: every record stamped at or before B is decided, and none of them is a
    committed record after the last recorded batch (Spark's ``query.status`` is as old as its last
    trigger, so it is only a cheap first look). Shares ``lock`` with the micro-batches: a batch
    never plans while a skip is being decided, and one that starts after a skip takes the next
    barrier. Its own control-plane connection and Kafka clients (the batches' are theirs)."""

    def __init__(
        self, runtime_of: Callable, query, lock: threading.Lock, kafka: KafkaLog, every_s: float = 0.5
    ) -> None:
        super().__init__(daemon=True, name="icebarrier-kafka-idle")
        self.runtime_of, self.query, self.lock, self.every_s = runtime_of, query, lock, every_s
        self.kafka = kafka
        self.stop = threading.Event()
        self._conn: Any = None
        self._read_empty: dict[int, int] = {}  # per partition: offsets read and found holding no committed record

    def run(self) -> None:
        from icebarrier.control_plane import db

        while not self.stop.wait(self.every_s) and self.query.isActive:
            rt = self.runtime_of()
            if rt is None:  # no micro-batch ran yet: the job is not registered
                continue
            try:
                with self.lock:
                    status = self.query.status
                    if status["isDataAvailable"] or status["isTriggerActive"]:
                        continue  # records wait for (or are in) a micro-batch
                    if self._conn is None or self._conn.closed:
                        self._conn = db.connect(rt.settings.dsn, rt.settings.schema)
                    barrier = self._idle_barrier(rt.job.name)
                    if barrier is None:
                        continue
                rt.log(f"job {rt.job.name}: barrier {barrier_label(barrier)} skipped (topic idle)")
            except Exception as exc:  # noqa: BLE001 - a lost connection or broker, a refused skip: look again
                rt.log(f"job {rt.job.name}: idle check failed: {type(exc).__name__}: {exc}")
                if self._conn is not None:
                    self._conn.close()
                self._conn = None

    def _idle_barrier(self, job: str) -> int | None:
        """Complete the job's next barrier as a skip if the log holds nothing for it; returns it."""
        from icebarrier.control_plane import jobs

        plan = jobs.next_barrier(self._conn, job)
        if not plan.ready or self.kafka.stable_until_us() < plan.barrier:
            return None
        last = runs.last_range(self._conn, job, before_barrier=plan.barrier + 1)
        if last is not None and (plan.from_barrier is None or last["barrier"] > plan.from_barrier):
            return None  # a batch recorded its range and has not committed it: it (or its replay) will
        starts = ends_of(offsets_of(last or {}))
        starts.update({p: e for p, e in self._read_empty.items() if e > starts.get(p, -1)})
        pending = {p: r for p, r in self.kafka.plan(starts, plan.barrier).items() if r[1] > r[0]}
        if pending:
            if self.kafka.holds_records(pending):
                return None  # committed records for this barrier: Spark's next micro-batch takes them
            self._read_empty.update(ends_of(pending))  # aborted records, markers
        jobs.complete(self._conn, job, plan.barrier)
        return plan.barrier


def stream(
    job,
    spark,
    *,
    bootstrap: str,
    topic: str,
    checkpoint: str,
    trigger_s: float = 1.0,
    settings=None,
    options: dict[str, str] | None = None,
    log_: Callable[[str], None] | None = None,
):
    """Start a Structured Streaming query from ``topic`` (``spark-sql-kafka``, ``read_committed``,
    failing on lost data) whose micro-batches complete ``job``'s barriers; returns the query.
    ``job.transform(df)`` turns Kafka's rows (key, value, partition, offset, timestamp…) into the
    sink's. Barriers pass as skips while the topic is idle."""
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("failOnDataLoss", "true")
        .option("kafka.isolation.level", "read_committed")
    )
    for key, value in (options or {}).items():
        reader = reader.option(key, value)
    kafka = KafkaLog(bootstrap, topic)
    kafka.partitions()  # the topic exists, with broker timestamps (refused in one line otherwise)
    if not job.external_inputs:
        job.external_inputs = [kafka.describe()]
    lock = threading.Lock()
    batches = foreach_batch(job, settings=settings, log=log_, kafka=kafka, lock=lock)
    query = (
        reader.load()
        .writeStream.foreachBatch(batches)
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime=f"{int(trigger_s * 1000)} milliseconds")
        .start()
    )
    IdleSkipper(batches.runtime, query, lock, KafkaLog(bootstrap, topic)).start()
    return query
