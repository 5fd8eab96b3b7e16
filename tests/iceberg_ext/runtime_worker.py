"""Run jobs of the shopping pipeline (or the two-sink job) in a process of their own, one after
the other on one Spark session; print how many barriers each completed.

    python -m tests.iceberg_ext.runtime_worker DSN SCHEMA WAREHOUSE NAMESPACE INPUT_DIR JOB[,JOB…]

The key ``tables`` creates the pipeline's tables instead of running a job. Crash points come from
ICEBARRIER_FAULT / ICEBARRIER_FAULT_AFTER (iceberg_ext.faults); the storage settings of a warehouse
on S3 from the icebarrier.toml ICEBARRIER_CONFIG names.
"""

from __future__ import annotations

import os
import sys

from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.job import TransformJob, overwrite
from icebarrier.iceberg_ext.runtime import Runtime
from tests.iceberg_ext.test_runtime import shop


def two_sink_job(namespace: str) -> TransformJob:
    t = shop.tables(namespace)
    return TransformJob(
        name=f"{namespace}_two_sinks",
        sources=[t["shopping"]],
        sinks=[f"lake.{namespace}.by_user", f"lake.{namespace}.by_item"],
        transform=lambda ctx: {
            f"lake.{namespace}.by_user": overwrite(
                ctx.table(t["shopping"]).groupBy("user_id").sum("amount").withColumnRenamed("sum(amount)", "amount")
            ),
            f"lake.{namespace}.by_item": overwrite(
                ctx.table(t["shopping"]).groupBy("item_id").sum("amount").withColumnRenamed("sum(amount)", "amount")
            ),
        },
    )


def main(dsn, cp_schema, warehouse, namespace, input_dir, job_keys) -> None:
    storage = Settings.load_storage(os.environ.get("ICEBARRIER_CONFIG"))
    settings = Settings(dsn=dsn, schema=cp_schema, warehouse=warehouse, storage=storage).validated()
    completed = []
    for key in job_keys.split(","):
        if key == "tables":
            from icebarrier.iceberg_ext.spark import spark_session

            shop.create_tables(spark_session(settings), namespace)
            continue
        job = two_sink_job(namespace) if key == "two_sinks" else shop.build(namespace, input_dir)[key]
        with Runtime(job, settings=settings, log=lambda line: print(line, file=sys.stderr)) as runtime:
            completed.append(len(runtime.run().completed))
    print(*completed)


if __name__ == "__main__":
    main(*sys.argv[1:])
