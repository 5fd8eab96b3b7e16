"""Run one job of the shopping pipeline (or the two-sink job) in its own process.

    python -m tests.iceberg_ext.runtime_worker DSN SCHEMA WAREHOUSE NAMESPACE INPUT_DIR JOB

Crash points come from ICEBARRIER_FAULT / ICEBARRIER_FAULT_AFTER (iceberg_ext.faults).
"""

from __future__ import annotations

import sys

from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.runtime import Runtime, TransformJob, overwrite
from tests.iceberg_ext.test_runtime import shop


def two_sink_job(namespace: str) -> TransformJob:
    t = shop.tables(namespace)
    return TransformJob(
        name=f"{namespace}_two_sinks", sources=[t["shopping"]],
        sinks=[f"lake.{namespace}.by_user", f"lake.{namespace}.by_item"],
        transform=lambda ctx: {
            f"lake.{namespace}.by_user": overwrite(ctx.table(t["shopping"]).groupBy("user_id").sum("amount")
                                                   .withColumnRenamed("sum(amount)", "amount")),
            f"lake.{namespace}.by_item": overwrite(ctx.table(t["shopping"]).groupBy("item_id").sum("amount")
                                                   .withColumnRenamed("sum(amount)", "amount")),
        })


def main(dsn, cp_schema, warehouse, namespace, input_dir, job_key) -> None:
    settings = Settings(dsn=dsn, schema=cp_schema, warehouse=warehouse).validated()
    job = two_sink_job(namespace) if job_key == "two_sinks" else shop.build(namespace, input_dir)[job_key]
    summary = Runtime(job, settings=settings, log=lambda line: print(line, file=sys.stderr)).run()
    print(len(summary.completed))


if __name__ == "__main__":
    main(*sys.argv[1:])
