"""Incremental SQL: a barrier costs what changed, not the size of the table.

    python benchmarks/incremental.py [--dsn DSN] [--sizes 2,8,20] [--barriers 3] [--new-rows 1000] [--runs 3]

Sources of 2, 8 and 20 million orders (``shopping``) and half as many shipments, then
``--new-rows`` new orders (and half as many shipments) per barrier. Three SqlJobs, each twice:
incremental (the default) and ``incremental=False`` (a full recompute and overwrite):

- ``user_item_amount`` and ``user_item_price``: the shopping pipeline's two SQL jobs (GROUP BY
  user and item, 100,000 groups);
- ``shipped_by_user``: a join followed by an aggregate (COUNT, SUM, AVG per user over the orders
  that shipped; 5,000 groups; the AVG keeps a state table).

Per size and job: the median wall time of one barrier (``Runtime.run()`` completing it), for
each variant, and incremental ÷ full (goal <= 0.1 at 8 million rows); then the incremental
time at the largest size ÷ at the smallest (goal <= 1.5) beside the same for full recomputes
(which grows with the rows). At the last barrier the two variants' sinks are compared: equal.
Beside them, the floor any Spark-written barrier pays: the median time of a bare Spark append of
``--new-rows`` rows to an Iceberg table of the same catalog (no query, no control plane), and
that floor ÷ the full recompute at 8 M rows — the least incremental ÷ full a Spark job can reach.
Each ``--runs`` is a process of its own (its own Spark); runs print worst first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proc import child_run  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, jobs  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402
from icebarrier.iceberg_ext.catalog import load_catalog  # noqa: E402
from icebarrier.iceberg_ext.commits import BarrierCommit  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402
from icebarrier.iceberg_ext.job import SqlJob  # noqa: E402
from icebarrier.iceberg_ext.runtime import Runtime  # noqa: E402
from icebarrier.iceberg_ext.spark import spark_session  # noqa: E402
from icebarrier.iceberg_ext.spark_io import append_df  # noqa: E402

USERS, ITEMS = 5000, 20
ORDERS = (
    "id AS order_id",
    f"pmod(hash(id, 1), {USERS}) AS user_id",
    f"pmod(hash(id, 2), {ITEMS}) AS item_id",
    "1 + pmod(hash(id, 3), 4) AS amount",
    f"CAST(10 * (1 + pmod(hash(id, 2), {ITEMS})) AS DOUBLE) AS price",
)
SHIPMENTS = ("id AS order_id", "IF(pmod(id, 4) = 0, 'ups', 'dhl') AS carrier")
JOBS = {
    "user_item_amount": "SELECT user_id, item_id, sum(amount) AS amount FROM {shopping} GROUP BY user_id, item_id",
    "user_item_price": "SELECT user_id, item_id, sum(amount * price) AS price FROM {shopping} GROUP BY user_id, item_id",
    "shipped_by_user": "SELECT s.user_id, count(*) AS orders, sum(s.amount) AS amount, avg(s.price) AS avg_price "
    "FROM {shopping} s JOIN {shipments} p ON s.order_id = p.order_id GROUP BY s.user_id",
}
VARIANTS = ("incremental", "full")


class Lake:
    """One size: the two sources (a root job appends to them) and the six jobs over them."""

    def __init__(self, conn, catalog, spark, settings, rows: int) -> None:
        self.conn, self.catalog, self.spark, self.rows = conn, catalog, spark, rows
        self.ns = f"r{rows}"
        self.tables = {t: TableName.parse(f"lake.{self.ns}.{t}") for t in ("shopping", "shipments")}
        spark.sql(f"CREATE NAMESPACE IF NOT EXISTS lake.{self.ns}")
        spark.sql(f"CREATE TABLE {self.tables['shopping']} ({_schema(ORDERS)}) USING iceberg")
        spark.sql(f"CREATE TABLE {self.tables['shipments']} ({_schema(SHIPMENTS)}) USING iceberg")
        self.root = f"load_{self.ns}"
        jobs.register(
            conn,
            JobDefinition(name=self.root, sinks=frozenset(self.tables.values()), external_inputs=frozenset(["gen"])),
        )
        self.next_id = 0
        self.runtimes = {}
        for name, query in JOBS.items():
            for variant in VARIANTS:
                sink = f"lake.{self.ns}.{name}_{variant}"
                text = query.format(**{k: str(t) for k, t in self.tables.items()})
                spark.sql(f"CREATE TABLE {sink} USING iceberg AS SELECT * FROM ({text}) WHERE false")
                job = SqlJob(
                    f"{self.ns}_{name}_{variant}",
                    f"INSERT OVERWRITE {sink} {text}",
                    incremental=variant == "incremental",
                )
                self.runtimes[(name, variant)] = Runtime(
                    job, settings=settings, spark=spark, conn=conn, log=lambda _: None
                )

    def append(self, n: int) -> int:
        """A barrier at which ``n`` orders arrive (and every other one ships)."""
        b = barriers.issue(self.conn).barrier
        first, self.next_id = self.next_id, self.next_id + n
        with BarrierCommit(self.conn, self.catalog, job=self.root, barrier=b) as tx:
            append_df(tx, self.tables["shopping"], self.spark.range(first, first + n).selectExpr(*ORDERS))
            append_df(tx, self.tables["shipments"], self.spark.range(first, first + n, 2).selectExpr(*SHIPMENTS))
        return b

    def compute(self, name: str, variant: str) -> float:
        started = time.perf_counter()
        summary = self.runtimes[(name, variant)].run()
        assert summary.computations == 1, summary
        return time.perf_counter() - started

    def floor(self, rows: int, times: int = 7) -> float:
        """The median time of a bare Spark append of ``rows`` rows to an Iceberg table."""
        table = f"lake.{self.ns}.floor"
        self.spark.sql(f"CREATE TABLE IF NOT EXISTS {table} ({_schema(ORDERS)}) USING iceberg")
        spent = []
        for _ in range(times):
            started = time.perf_counter()
            self.spark.range(rows).selectExpr(*ORDERS).writeTo(table).append()
            spent.append(time.perf_counter() - started)
        return statistics.median(spent)

    def same_sinks(self, name: str) -> bool:
        inc, full = (self.spark.table(f"lake.{self.ns}.{name}_{v}") for v in VARIANTS)
        return inc.count() == full.count() and inc.exceptAll(full).count() == 0


def _schema(columns: tuple[str, ...]) -> str:
    from pyspark.sql import SparkSession

    df = SparkSession.getActiveSession().range(1).selectExpr(*columns)
    return ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in df.schema.fields)


def one_run(args) -> dict:
    figures: dict = {}
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory(prefix="icebarrier-incr-") as warehouse:
        settings = Settings(dsn=dsn, warehouse=warehouse).validated()
        spark = spark_session(settings, app_name="icebarrier-bench-incremental", extra={"spark.driver.memory": "8g"})
        spark.sparkContext.setLogLevel("ERROR")
        catalog = load_catalog(settings)
        with db.connect(dsn) as conn:
            for millions in args.sizes:
                lake = Lake(conn, catalog, spark, settings, int(millions * 1_000_000))
                lake.append(lake.rows)  # the history: one big barrier
                for runtime in lake.runtimes.values():
                    runtime.run()  # each bootstraps: a full read
                times: dict[tuple[str, str], list[float]] = {k: [] for k in lake.runtimes}
                for _ in range(args.barriers):
                    lake.append(args.new_rows)
                    for name, variant in lake.runtimes:
                        times[(name, variant)].append(lake.compute(name, variant))
                for name in JOBS:
                    if not lake.same_sinks(name):
                        raise SystemExit(f"{name} at {millions} M rows: the incremental sink differs from the full one")
                    figures[f"{name}@{millions:g}"] = {v: statistics.median(times[(name, v)]) for v in VARIANTS}
                figures[f"floor@{millions:g}"] = lake.floor(args.new_rows)
                print(f"  {millions} M rows done", file=sys.stderr, flush=True)
        spark.stop()
    return figures


def report(runs: list[dict], sizes: list[float]) -> None:
    def ratio(fig: dict) -> float:
        return fig["incremental"] / fig["full"]

    key_size = 8 if 8 in sizes else sizes[len(sizes) // 2]
    worst_first = sorted(runs, key=lambda r: -max(ratio(r[f"{j}@{key_size:g}"]) for j in JOBS))
    for i, figures in enumerate(worst_first, 1):
        print(f"run {i}:")
        print(f"  {'job':18} {'rows':>6} {'full s':>8} {'incr s':>8} {'incr/full':>10}")
        for name in JOBS:
            for size in sizes:
                fig = figures[f"{name}@{size:g}"]
                print(f"  {name:18} {size:>5g}M {fig['full']:8.2f} {fig['incremental']:8.2f} {ratio(fig):10.3f}")
        for name in JOBS:
            small, large = figures[f"{name}@{sizes[0]:g}"], figures[f"{name}@{sizes[-1]:g}"]
            grow = {v: large[v] / small[v] for v in VARIANTS}
            print(
                f"  {name}: {sizes[-1]:g}M ÷ {sizes[0]:g}M rows: incremental {grow['incremental']:.2f} "
                f"(goal <= 1.5), full {grow['full']:.2f}"
            )
        worst = max(ratio(figures[f"{j}@{key_size:g}"]) for j in JOBS)
        print(f"  worst incremental ÷ full at {key_size:g}M rows: {worst:.3f} (goal <= 0.1)")
        floor = figures[f"floor@{key_size:g}"]
        least = max(floor / figures[f"{j}@{key_size:g}"]["full"] for j in JOBS)
        print(
            f"  the floor, a bare Spark append of the new rows: {floor:.3f} s; "
            f"÷ the full recompute at {key_size:g}M rows: up to {least:.3f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--sizes", default="2,8,20", help="source sizes, millions of rows")
    parser.add_argument("--barriers", type=int, default=3, help="barriers measured per size (the median counts)")
    parser.add_argument("--new-rows", type=int, default=1000, help="orders arriving per barrier")
    parser.add_argument("--runs", type=int, default=3, help="runs, each in a process of its own")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one run, JSON out
    args = parser.parse_args()
    args.sizes = [float(s) for s in args.sizes.split(",")]
    if args.one:
        print(json.dumps(one_run(args)))
        return 0
    runs = []
    for i in range(args.runs):
        print(f"run {i + 1} of {args.runs} …", file=sys.stderr, flush=True)
        child = ["--dsn", args.dsn, "--sizes", ",".join(f"{s:g}" for s in args.sizes), "--barriers", str(args.barriers)]
        child += ["--new-rows", str(args.new_rows), "--one"]
        runs.append(child_run([__file__, *child]))
        print(f"run {i + 1}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    report(runs, args.sizes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
