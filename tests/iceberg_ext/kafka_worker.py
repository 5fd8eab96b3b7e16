"""A Kafka root job in a process of its own, following barriers until SIGTERM (or a crash point):

    python -m tests.iceberg_ext.kafka_worker WAY DSN SCHEMA WAREHOUSE NAMESPACE BOOTSTRAP TOPIC [CHECKPOINT]

WAY ``consumer``: the runtime with a KafkaSource (a plain consumer reads each barrier's range);
``stream``: Spark Structured Streaming (spark-sql-kafka) whose micro-batches complete barriers,
triggered every ``KAFKA_WORKER_TRIGGER_S`` seconds (1 unless set).
The sink is ``lake.<NAMESPACE>.orders`` (tests/iceberg_ext/test_kafka.py creates it).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.job import RootJob
from icebarrier.iceberg_ext.kafka import KafkaSource
from icebarrier.iceberg_ext.kafka_stream import json_rows, stream
from icebarrier.iceberg_ext.runtime import Runtime

SCHEMA = "id bigint, user_id int, amount bigint"


def main(way, dsn, cp_schema, warehouse, namespace, bootstrap, topic, checkpoint=None) -> None:
    settings = Settings(dsn=dsn, schema=cp_schema, warehouse=warehouse).validated()
    sink = f"lake.{namespace}.orders"
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if way == "consumer":
        job = RootJob(name=f"{namespace}_orders", sinks=[sink], source=KafkaSource(bootstrap, topic, SCHEMA))
        with Runtime(job, settings=settings, log=log) as runtime:
            runtime.run(follow=True, poll_s=1.0)
        return
    from icebarrier.iceberg_ext.spark import spark_session

    spark = spark_session(settings, app_name="kafka-stream", kafka=True)
    job = RootJob(name=f"{namespace}_orders", sinks=[sink], transform=lambda df: json_rows(df, SCHEMA))
    trigger_s = float(os.environ.get("KAFKA_WORKER_TRIGGER_S", "1"))
    query = stream(
        job,
        spark,
        bootstrap=bootstrap,
        topic=topic,
        checkpoint=checkpoint,
        trigger_s=trigger_s,
        settings=settings,
        log_=log,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.5):
        if not query.isActive:
            raise SystemExit(f"query stopped: {query.exception()}")
    query.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
