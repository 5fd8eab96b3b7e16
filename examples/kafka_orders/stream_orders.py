"""ingest_orders the other way: Spark Structured Streaming (spark-sql-kafka, read_committed), each
micro-batch completing a barrier, its offsets recorded and summarised; barriers pass as skips while
the topic is idle. The same sink and job name as ingest_orders.py: run one or the other.

    python3 stream_orders.py [CHECKPOINT_DIR]       # until SIGINT/SIGTERM
"""

import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pipeline import ORDER, bootstrap, build  # noqa: E402

from icebarrier.iceberg_ext.config import Settings  # noqa: E402
from icebarrier.iceberg_ext.job import RootJob  # noqa: E402
from icebarrier.iceberg_ext.kafka_stream import json_rows, stream  # noqa: E402
from icebarrier.iceberg_ext.spark import spark_session  # noqa: E402


def main() -> None:
    settings = Settings.load()
    batch = build()["ingest_orders"]
    job = RootJob(
        name=batch.name,
        sinks=batch.sinks,
        transform=lambda df: json_rows(df, ORDER),  # Kafka's rows as the orders table's
        external_inputs=batch.external_inputs,
    )
    checkpoint = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parent / "data" / "checkpoint")
    spark = spark_session(settings, app_name=job.name, kafka=True)
    query = stream(
        job, spark, bootstrap=bootstrap(), topic=os.environ.get("KAFKA_TOPIC", "orders"), checkpoint=checkpoint,
        settings=settings,
    )  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if not query.isActive:
            sys.exit(f"error: the streaming query stopped: {query.exception()}")
    query.stop()


if __name__ == "__main__":
    main()
