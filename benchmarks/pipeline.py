"""The job runtime through a three-level chain on local Spark, measured in one run.

    python benchmarks/pipeline.py [--dsn DSN] [--barriers 8] [--rows 100000]
    python benchmarks/pipeline.py --follow-s 300 [--rows 2000]

    files --ingest--> events --daily (SQL)--> per_customer --top (SQL)--> top_customers

Prints the end-to-end barrier latency (barrier issued -> completed by the last table, from
the control plane's barrier_delay view), and the runtime's wall time per barrier ÷ the same
transforms run as plain Spark + Iceberg without icebarrier (goal <= 1.05).

With ``--follow-s``: the three jobs run as ``--follow`` jobs (threads sharing one Spark
session) at a 1 s barrier interval and 60 s anchors while a file of ``--rows`` rows arrives
every second; prints each table's lag (barriers issued after its watermark) over time —
it must not grow —, the read-committed freshness over the three tables (now − issue time of
the cut's barrier, sampled every second; goal p95 <= 5 s), how the jobs completed barriers
(exact / skip / coalesce) and the control-plane function calls and transactions per barrier.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, delays, reads  # noqa: E402
from icebarrier.control_plane.errors import NoValidCutError  # noqa: E402
from icebarrier.control_plane.model import TableName  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402
from icebarrier.iceberg_ext.job import RootJob, SqlJob  # noqa: E402
from icebarrier.iceberg_ext.runtime import Runtime  # noqa: E402
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


def chain(tmp: Path) -> list:
    return [
        RootJob(
            name="ingest",
            sinks=["lake.managed.events"],
            source=FileSource(str(tmp / "managed_in"), SCHEMA, pattern="*.json"),
        ),
        SqlJob("per_customer", "INSERT INTO lake.managed.per_customer " + MID.format(src="lake.managed.events")),
        SqlJob(
            "top_customers", "INSERT INTO lake.managed.top_customers " + TOP.format(src="lake.managed.per_customer")
        ),
    ]


def _counts(conn) -> tuple[int, int]:
    """Barriers issued, and transactions committed in this database."""
    return (
        conn.execute("SELECT count(*) AS n FROM barriers").fetchone()["n"],
        conn.execute("SELECT xact_commit AS x FROM pg_stat_database WHERE datname = current_database()").fetchone()[
            "x"
        ],
    )


def follow(dsn: str, settings: Settings, spark, tmp: Path, seconds: float, rows: int) -> None:
    """The chain as three --follow jobs at 1 s barriers for ``seconds``, sampled every second."""
    names = [TableName.parse(f"lake.managed.{t}") for t in ("events", "per_customer", "top_customers")]
    with db.connect(dsn) as conn:
        barriers.set_interval_s(conn, 1)
        barriers.set_anchor_interval_s(conn, 60)
        conn.execute(sql.SQL("ALTER DATABASE {} SET track_functions = 'pl'").format(sql.Identifier(conn.info.dbname)))
        runtimes = [Runtime(j, settings=settings, spark=spark, log=lambda _: None) for j in chain(tmp)]
        threads = [
            threading.Thread(target=rt.run, kwargs={"follow": True, "poll_s": 0.2}, daemon=True) for rt in runtimes
        ]
        first = _counts(conn)
        for t in threads:
            t.start()
        lag, freshness, started, k, warm_up = [], [], time.monotonic(), 0, 0.0
        while time.monotonic() - started < seconds:
            write_batch(tmp / "managed_in", k, rows)
            k += 1
            time.sleep(max(0.0, k - (time.monotonic() - started)))
            lag.append(
                max(r["barriers_behind"] for r in conn.execute("SELECT barriers_behind FROM table_versions").fetchall())
            )
            try:
                cut = reads.resolve(conn, names)
                freshness.append(
                    conn.execute(
                        "SELECT extract(epoch FROM clock_timestamp()) - %s / 1e6 AS s", (cut.barrier,)
                    ).fetchone()["s"]
                )
            except NoValidCutError:
                if freshness:  # after the chain's first barrier (before it: Spark warming up)
                    freshness.append(None)
                else:
                    warm_up, lag = time.monotonic() - started, []
        for rt in runtimes:
            rt.stop.set()
        for t in threads:
            t.join(timeout=120)
        time.sleep(1)  # the closed sessions' statistics reach the server
        issued, xacts = (now - then for now, then in zip(_counts(conn), first))
        calls = conn.execute("SELECT funcname, calls FROM pg_stat_user_functions ORDER BY calls DESC").fetchall()
        kinds = delays.completion_kinds(conn)
    third = max(1, len(lag) // 3)
    early, late = statistics.mean(lag[:third]), statistics.mean(lag[-third:])
    fresh = sorted(f for f in freshness if f is not None)
    p95 = fresh[int(len(fresh) * 0.95) - 1] if fresh else float("inf")
    print(f"three-level chain as --follow jobs, 1 s barriers, 60 s anchors, {seconds:.0f} s, {rows} rows/s:")
    print(f"  warm-up (until the chain completed its first barrier): {warm_up:.0f} s; then {len(lag)} samples")
    print(
        f"  barriers issued: {issued}; lag (max over tables, barriers): first third {early:.1f}, last third "
        f"{late:.1f}, max {max(lag)}   (goal: does not grow: {'met' if late <= early + 2 else 'MISSED'})"
    )
    print(
        f"  read-committed freshness over the chain: p50 {statistics.median(fresh):.1f} s, p95 {p95:.1f} s, "
        f"max {fresh[-1]:.1f} s, {len(freshness) - len(fresh)} sample(s) without a cut after it   "
        f"(goal p95 <= 5 s: {'met' if p95 <= 5 else 'MISSED'})"
    )
    for name, k in sorted(kinds.items()):
        print(f"  {name}: {k.total()} step(s): {k['skip']} skip, {k['coalesce']} coalesce, {k['exact']} exact")
    print(
        f"  control plane per barrier: {xacts / issued:.1f} transactions; function calls: "
        + ", ".join(f"{r['funcname']} {r['calls'] / issued:.2f}" for r in calls if r["calls"] / issued >= 0.05)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER)
    parser.add_argument("--barriers", type=int, default=8)
    parser.add_argument("--rows", type=int, help="rows per input file (default 100,000; 2,000 with --follow-s)")
    parser.add_argument("--follow-s", type=float, help="run the chain as --follow jobs at 1 s barriers this long")
    args = parser.parse_args()
    with scratch_database(args.dsn) as dsn:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            settings = Settings(dsn=dsn, warehouse=str(tmp / "warehouse")).validated()
            spark = spark_session(settings, app_name="icebarrier-bench-pipeline")
            spark.sparkContext.setLogLevel("ERROR")
            create(spark, "plain")
            create(spark, "managed")
            if args.follow_s:
                follow(dsn, settings, spark, tmp, args.follow_s, args.rows or 2000)
                spark.stop()
                return 0
            rows = args.rows or 100_000
            with db.connect(dsn) as conn:
                barriers.set_interval_s(conn, 3600)
                runtimes = [
                    Runtime(j, settings=settings, spark=spark, conn=conn, log=lambda _: None) for j in chain(tmp)
                ]
                plain_s, managed_s = [], []
                for k in range(args.barriers + 1):  # batch 0 warms both paths up
                    write_batch(tmp / "plain_in", k, rows)  # one new input file per barrier
                    write_batch(tmp / "managed_in", k, rows)
                    start = time.perf_counter()
                    run_plain(spark, tmp / "plain_in", "plain", k)
                    plain_s.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    barriers.issue(conn)
                    for rt in runtimes:
                        assert len(rt.run().completed) == 1
                    managed_s.append(time.perf_counter() - start)
                latencies = [
                    r["d"]
                    for r in conn.execute(
                        "SELECT extract(epoch FROM delay) AS d FROM barrier_delay "
                        "WHERE table_name = 'lake.managed.top_customers' ORDER BY barrier"
                    ).fetchall()
                ][1:]
            assert spark.table("lake.managed.events").count() == spark.table("lake.plain.events").count()
            plain, managed = sum(plain_s[1:]), sum(managed_s[1:])
            print(f"three-level chain, {args.barriers} barriers x {rows} rows (after one warm-up barrier):")
            print(
                f"  end-to-end barrier latency (issue -> top_customers): p50 {statistics.median(latencies):.2f} s, "
                f"max {max(latencies):.2f} s"
            )
            print(f"  plain Spark + Iceberg: {plain / args.barriers:6.2f} s per barrier")
            print(f"  icebarrier runtime:    {managed / args.barriers:6.2f} s per barrier")
            ratio = managed / plain
            print(f"  ratio:                 {ratio:6.3f}   (goal <= 1.05: {'met' if ratio <= 1.05 else 'MISSED'})")
            spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
