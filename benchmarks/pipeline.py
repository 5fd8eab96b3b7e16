"""The job runtime through a three-level chain on local Spark, measured in one run.

    python benchmarks/pipeline.py [--dsn DSN] [--barriers 8] [--rows 100000]

    files --ingest--> events --daily (SQL)--> per_customer --top (SQL)--> top_customers

Prints the end-to-end barrier latency (barrier issued -> completed by the last table, from
the control plane's barrier_delay view), and the runtime's wall time per barrier ÷ the same
transforms run as plain Spark + Iceberg without icebarrier (goal <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402
from icebarrier.control_plane import barriers, db  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402
from icebarrier.iceberg_ext.runtime import RootJob, Runtime, SqlJob  # noqa: E402
from icebarrier.iceberg_ext.sources import FileSource  # noqa: E402
from icebarrier.iceberg_ext.spark import spark_session  # noqa: E402

SCHEMA = "id bigint, customer bigint, amount bigint"
MID = "SELECT customer, sum(amount) AS total, count(*) AS orders FROM {src} GROUP BY customer"
TOP = "SELECT customer, total FROM {src} ORDER BY total DESC LIMIT 100"


def write_batch(folder: Path, k: int, rows: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"batch-{k:05d}.json"
    with open(str(path) + ".tmp", "w") as f:
        for i in range(rows):
            n = k * rows + i
            f.write(json.dumps({"id": n, "customer": n % 5000, "amount": n % 97}) + "\n")
    os.replace(str(path) + ".tmp", path)


def create(spark, ns: str) -> None:
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS lake.{ns}")
    spark.sql(f"CREATE TABLE lake.{ns}.events ({SCHEMA}) USING iceberg")
    spark.sql(f"CREATE TABLE lake.{ns}.per_customer (customer bigint, total bigint, orders bigint) USING iceberg")
    spark.sql(f"CREATE TABLE lake.{ns}.top_customers (customer bigint, total bigint) USING iceberg")


def run_plain(spark, folder: Path, ns: str, k: int) -> None:
    spark.read.schema(SCHEMA).json(str(folder / f"batch-{k:05d}.json")).writeTo(f"lake.{ns}.events").append()
    spark.sql(MID.format(src=f"lake.{ns}.events")).writeTo(f"lake.{ns}.per_customer").overwritePartitions()
    spark.sql(TOP.format(src=f"lake.{ns}.per_customer")).writeTo(f"lake.{ns}.top_customers").overwritePartitions()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER)
    parser.add_argument("--barriers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    with scratch_database(args.dsn) as dsn:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            settings = Settings(dsn=dsn, warehouse=str(tmp / "warehouse")).validated()
            spark = spark_session(settings, app_name="icebarrier-bench-pipeline")
            spark.sparkContext.setLogLevel("ERROR")
            create(spark, "plain")
            create(spark, "managed")
            chain = [
                RootJob(name="ingest", sinks=["lake.managed.events"],
                        source=FileSource(str(tmp / "managed_in"), SCHEMA, pattern="*.json")),
                SqlJob("per_customer", "INSERT INTO lake.managed.per_customer " + MID.format(src="lake.managed.events")),
                SqlJob("top_customers", "INSERT INTO lake.managed.top_customers "
                       + TOP.format(src="lake.managed.per_customer")),
            ]
            with db.connect(dsn) as conn:
                barriers.set_interval_s(conn, 3600)
                runtimes = [Runtime(j, settings=settings, spark=spark, conn=conn, log=lambda _: None) for j in chain]
                plain_s, managed_s = [], []
                for k in range(args.barriers + 1):  # batch 0 warms both paths up
                    write_batch(tmp / "plain_in", k, args.rows)  # one new input file per barrier
                    write_batch(tmp / "managed_in", k, args.rows)
                    start = time.perf_counter()
                    run_plain(spark, tmp / "plain_in", "plain", k)
                    plain_s.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    barriers.issue(conn)
                    for rt in runtimes:
                        assert len(rt.run().completed) == 1
                    managed_s.append(time.perf_counter() - start)
                delays = [r["d"] for r in conn.execute(
                    "SELECT extract(epoch FROM delay) AS d FROM barrier_delay "
                    "WHERE table_name = 'lake.managed.top_customers' ORDER BY barrier").fetchall()][1:]
            assert spark.table("lake.managed.events").count() == spark.table("lake.plain.events").count()
            plain, managed = sum(plain_s[1:]), sum(managed_s[1:])
            print(f"three-level chain, {args.barriers} barriers x {args.rows} rows (after one warm-up barrier):")
            print(f"  end-to-end barrier latency (issue -> top_customers): p50 {statistics.median(delays):.2f} s, "
                  f"max {max(delays):.2f} s")
            print(f"  plain Spark + Iceberg: {plain / args.barriers:6.2f} s per barrier")
            print(f"  icebarrier runtime:    {managed / args.barriers:6.2f} s per barrier")
            ratio = managed / plain
            print(f"  ratio:                 {ratio:6.3f}   (goal <= 1.05: {'met' if ratio <= 1.05 else 'MISSED'})")
            spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
