"""A `job exec` command: a plain Python consumer (confluent-kafka through our helper) that appends
barrier B's records to NAMESPACE.orders with PyIceberg (no Spark).

    icebarrier job exec JOB -- python tests/iceberg_ext/kafka_exec.py BOOTSTRAP TOPIC NAMESPACE

``KAFKA_EXEC_FAULT=before-commit|after-commit`` with ``KAFKA_EXEC_FAULT_FILE`` (a file counting
runs): the command SIGKILLs itself on its third run, before or after its commit is staged.
"""

import os
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from pyiceberg.catalog import load_catalog

from icebarrier.iceberg_ext.kafka import KafkaLog, barrier_input


def fault(at: str) -> None:
    if os.environ.get("KAFKA_EXEC_FAULT") != at:
        return
    counter = Path(os.environ["KAFKA_EXEC_FAULT_FILE"])
    runs = int(counter.read_text() or 0) + 1 if counter.exists() else 1
    counter.write_text(str(runs))
    if runs == 3:
        os.kill(os.getpid(), signal.SIGKILL)


def main(bootstrap: str, topic: str, namespace: str) -> None:
    orders = load_catalog(os.environ["ICEBARRIER_CATALOG"]).load_table(f"{namespace}.orders")
    got = barrier_input(KafkaLog(bootstrap, topic), orders)
    if got.empty:
        return  # nothing to commit: the barrier is a skip
    rows = [
        {
            **{k: r.value[k] for k in ("id", "user_id", "amount")},
            "kafka_partition": r.partition,
            "kafka_offset": r.offset,
            "kafka_timestamp": datetime.fromtimestamp(r.timestamp_ms / 1000, UTC),
        }
        for r in got.records
    ]
    fault("before-commit")
    orders.append(pa.Table.from_pylist(rows, schema=orders.schema().as_arrow()), snapshot_properties=got.properties)
    fault("after-commit")


if __name__ == "__main__":
    main(*sys.argv[1:])
