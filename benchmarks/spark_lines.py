"""Spark 4.1 against Spark 3.5: one barrier of a SQL job that reads a million rows and writes an
aggregate, on each line in the same run.

    python benchmarks/spark_lines.py [--dsn DSN] [--rows 1000000] [--barriers 5] [--runs 3]

Each line runs in a process of its own: the installed PySpark's line with this interpreter, the
other in the virtual environment ``tests/other_line.py`` makes (once, under ~/.cache). A process
opens icebarrier's SparkSession (the line's Iceberg 1.12.0 runtime) on a scratch database, has a
root job append ``--rows`` orders at one barrier, then runs ``user_item_amount`` (the shopping
pipeline's GROUP BY, a full recompute: every barrier reads all the rows and overwrites the sink)
over ``--barriers`` + 1 barriers, each after a small append; the first is a warm-up. Figures per
line: the session's start, and the median wall time of one barrier (``Runtime.run()`` completing
it). A run alternates which line goes first; runs print worst first (by the barrier's ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # tests.other_line: the other line's environment

from incremental import JOBS, ORDERS, _schema  # noqa: E402
from proc import child_run  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, jobs  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402
from icebarrier.iceberg_ext import spark_lines  # noqa: E402

QUERY = JOBS["user_item_amount"]


def one_run(args) -> dict:
    """In this process, on the installed line: the session's start and each barrier's time."""
    from icebarrier.iceberg_ext.catalog import load_catalog
    from icebarrier.iceberg_ext.commits import BarrierCommit
    from icebarrier.iceberg_ext.config import Settings
    from icebarrier.iceberg_ext.job import SqlJob
    from icebarrier.iceberg_ext.runtime import Runtime
    from icebarrier.iceberg_ext.spark import spark_session
    from icebarrier.iceberg_ext.spark_io import append_df

    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory(prefix="icebarrier-lines-") as warehouse:
        settings = Settings(dsn=dsn, warehouse=warehouse).validated()
        started = time.perf_counter()
        spark = spark_session(settings, app_name="icebarrier-bench-lines", extra={"spark.driver.memory": "4g"})
        spark.sql("SELECT 1").collect()
        start_s = time.perf_counter() - started
        spark.sparkContext.setLogLevel("ERROR")
        catalog = load_catalog(settings)
        source, sink = TableName.parse("lake.b.shopping"), "lake.b.user_item_amount"
        spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.b")
        spark.sql(f"CREATE TABLE {source} ({_schema(ORDERS)}) USING iceberg")
        text = QUERY.format(shopping=source)
        spark.sql(f"CREATE TABLE {sink} USING iceberg AS SELECT * FROM ({text}) WHERE false")
        with db.connect(dsn) as conn:
            jobs.register(
                conn, JobDefinition(name="load", sinks=frozenset([source]), external_inputs=frozenset(["gen"]))
            )
            job = SqlJob("user_item_amount", f"INSERT OVERWRITE {sink} {text}", incremental=False)
            runtime = Runtime(job, settings=settings, spark=spark, conn=conn, log=lambda _: None)
            runtime.register()
            next_id, times = 0, []
            for i in range(args.barriers + 1):
                rows = args.rows if i == 0 else 1000
                b = barriers.issue(conn).barrier
                with BarrierCommit(conn, catalog, job="load", barrier=b) as tx:
                    append_df(tx, source, spark.range(next_id, next_id + rows).selectExpr(*ORDERS))
                next_id += rows
                began = time.perf_counter()
                summary = runtime.run()
                assert summary.computations == 1, summary
                times.append(time.perf_counter() - began)
        spark.stop()
    return {"start_s": start_s, "barrier_s": statistics.median(times[1:]), "first_s": times[0]}


def child(python: Path, args) -> dict:
    return child_run(
        [__file__, "--dsn", args.dsn, "--rows", str(args.rows), "--barriers", str(args.barriers), "--one"], python
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows the SQL job reads at each barrier")
    parser.add_argument("--barriers", type=int, default=5, help="barriers measured per line (the median counts)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one line, JSON out
    args = parser.parse_args()
    if args.one:
        print(json.dumps({"line": spark_lines.installed().version, **one_run(args)}))
        return 0
    from tests import other_line

    pythons = {spark_lines.installed().version: Path(sys.executable), other_line.other().version: other_line.python()}
    runs = []
    for i in range(args.runs):
        order = sorted(pythons) if i % 2 else sorted(pythons, reverse=True)
        figures = {line: child(pythons[line], args) for line in order}
        runs.append(figures)
        print(f"run {i + 1} ({' then '.join(order)}): {json.dumps(figures)}", file=sys.stderr, flush=True)

    def ratio(run: dict, key: str) -> float:
        return run["4.1"][key] / run["3.5"][key]

    print(f"one barrier of a SQL job reading {args.rows:,} rows, Spark 4.1 ÷ Spark 3.5, worst first:")
    for run in sorted(runs, key=lambda r: -ratio(r, "barrier_s")):
        print(
            f"  barrier {run['4.1']['barrier_s']:.2f} s ÷ {run['3.5']['barrier_s']:.2f} s = {ratio(run, 'barrier_s'):.2f}"
            f"   (first, a cold JVM: {ratio(run, 'first_s'):.2f}; session start {run['4.1']['start_s']:.1f} s"
            f" ÷ {run['3.5']['start_s']:.1f} s = {ratio(run, 'start_s'):.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
