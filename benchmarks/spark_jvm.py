"""A warm Spark session's cost per small run, with the small-job JVM options against the JVM's
defaults, in one run.

    python benchmarks/spark_jvm.py [--runs 40] [--rounds 3]

A run is what the shopping pipeline's jobs do under ``icebarrier schedule``: append a batch of
50 rows to an Iceberg table, then aggregate the whole table into another (INSERT OVERWRITE).
Each variant gets a JVM of its own (a local[2] session on a file-system catalog in a scratch
directory, options through Spark's ``SPARK_SUBMIT_OPTS``), 20 runs to warm up, then ``--runs``
measured: the driver JVM's CPU seconds (user + system, from /proc) and wall seconds per run.
The variants alternate which goes first, ``--rounds`` times. Printed: each round's ratios
small ÷ defaults, worst first (goal: CPU <= 0.7, wall <= 1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from icebarrier.iceberg_ext.spark import SMALL_JOBS_JVM_OPTIONS


def measure(runs: int) -> dict[str, float]:
    """In this process: a session, warm-up, then ``runs`` measured runs."""
    from proc import cpu_s
    from pyspark.sql import SparkSession

    from icebarrier.iceberg_ext.spark import EXTENSIONS, iceberg_jar

    warehouse = tempfile.mkdtemp()
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.jars", str(iceberg_jar()))
        .config("spark.sql.extensions", EXTENSIONS)
        .config("spark.sql.catalog.b", "org.apache.iceberg.spark.SparkCatalog")
        .config("spark.sql.catalog.b.type", "hadoop")
        .config("spark.sql.catalog.b.warehouse", warehouse)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())

    spark.sql("CREATE TABLE b.db.src (k bigint, v double) USING iceberg")
    spark.sql("CREATE TABLE b.db.agg (k bigint, v double) USING iceberg")

    def run(i: int) -> None:
        batch = spark.range(i * 50, i * 50 + 50).selectExpr("id % 13 AS k", "CAST(id AS double) AS v")
        batch.writeTo("b.db.src").append()
        spark.sql("INSERT OVERWRITE b.db.agg SELECT k, sum(v) FROM b.db.src GROUP BY k")

    for i in range(20):
        run(i)
    cpu, wall = cpu_s(pid), time.perf_counter()
    for i in range(20, 20 + runs):
        run(i)
    return {"cpu_s": (cpu_s(pid) - cpu) / runs, "wall_s": (time.perf_counter() - wall) / runs}


def variant(options: str, runs: int) -> dict[str, float]:
    env = {**os.environ, "SPARK_SUBMIT_OPTS": options}
    out = subprocess.run(
        [sys.executable, __file__, "--measure", "--runs", str(runs)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.runs)))
        return 0
    ratios = []
    for round_ in range(args.rounds):
        order = [("defaults", ""), ("small", SMALL_JOBS_JVM_OPTIONS)]
        got = {name: variant(options, args.runs) for name, options in (order if round_ % 2 == 0 else order[::-1])}
        d, s = got["defaults"], got["small"]
        ratios.append((s["cpu_s"] / d["cpu_s"], s["wall_s"] / d["wall_s"]))
        print(
            f"round {round_ + 1}: defaults {d['cpu_s']:.2f} CPU s, {d['wall_s']:.2f} s; "
            f"small ({SMALL_JOBS_JVM_OPTIONS}) {s['cpu_s']:.2f} CPU s, {s['wall_s']:.2f} s per run",
            flush=True,
        )
    cpu = ", ".join(f"{c:.2f}" for c, _ in sorted(ratios, reverse=True))
    wall = ", ".join(f"{w:.2f}" for _, w in sorted(ratios, key=lambda r: -r[1]))
    print(f"small ÷ defaults, worst first: CPU {cpu} (goal <= 0.7); wall {wall} (goal <= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
