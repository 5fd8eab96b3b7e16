"""A Spark runtime root job appending one row per barrier to the table BENCH_TABLE as job
BENCH_JOB (benchmarks/maintain_beside_jobs.py runs it with `icebarrier run FILE --follow`)."""

import os
from dataclasses import dataclass

from icebarrier.iceberg_ext.job import RootJob
from icebarrier.iceberg_ext.sources import Source


@dataclass
class BarrierClock(Source):
    """One row per barrier: nothing to record but the barrier itself."""

    def plan(self, conn, job: str, barrier: int) -> dict:
        return {"barrier": barrier}

    def read(self, spark, spec: dict):
        b = int(spec["barrier"])
        return spark.range(1).selectExpr(f"CAST({b % 1_000_000} AS BIGINT) AS n", f"CAST({b} AS BIGINT) AS at")

    def describe(self) -> str:
        return "clock"


job = RootJob(name=os.environ["BENCH_JOB"], sinks=[os.environ["BENCH_TABLE"]], source=BarrierClock())
