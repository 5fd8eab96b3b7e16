"""Iceberg-side overheads, measured in one run on one machine.

    python benchmarks/commit_overhead.py [--dsn DSN] [--barriers 5] [--rows 100000] [--snapshots 10000]

1. Wall time of a Spark job writing N barriers of R rows through icebarrier (barrier-tagged
   commit, exactly-once check, control-plane completion) divided by the same job writing
   Iceberg directly (goal <= 1.05).
2. Expiry planning time (choose candidates, read the protected set) for a table with
   10,000 snapshots (goal <= 1 s).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, jobs  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402
from icebarrier.iceberg_ext.catalog import load_catalog, load_table  # noqa: E402
from icebarrier.iceberg_ext.commits import BarrierCommit  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402
from icebarrier.iceberg_ext.maintenance import expire  # noqa: E402
from icebarrier.iceberg_ext.spark import spark_session  # noqa: E402
from icebarrier.iceberg_ext.spark_io import append_df  # noqa: E402


def batch(spark, barrier_no: int, rows: int):
    return spark.range(barrier_no * rows, (barrier_no + 1) * rows).selectExpr(
        "id", "id % 1000 AS customer", "cast(id % 97 AS bigint) AS amount"
    )


def bench_writes(spark, conn, catalog, n_barriers: int, rows: int, rounds: int = 4) -> tuple[float, float]:
    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.bench")
    spark.sql("CREATE TABLE lake.bench.direct (id bigint, customer bigint, amount bigint) USING iceberg")
    spark.sql("CREATE TABLE lake.bench.managed (id bigint, customer bigint, amount bigint) USING iceberg")
    sink = TableName.parse("lake.bench.managed")
    jobs.register(conn, JobDefinition(name="bench", sinks=frozenset([sink]), external_inputs=frozenset(["gen"])))
    batch(spark, 0, 1000).writeTo("lake.bench.direct").append()  # warm up both paths
    direct_s = managed_s = 0.0
    k = 1
    for r in range(rounds):  # interleave, alternating which goes first, to share the noise fairly

        def direct(k=k):
            for i in range(n_barriers):
                batch(spark, k + i, rows).writeTo("lake.bench.direct").append()

        def managed(k=k):
            for i in range(n_barriers):
                b = barriers.issue(conn).barrier
                with BarrierCommit(conn, catalog, job="bench", barrier=b) as tx:
                    append_df(tx, sink, batch(spark, k + i, rows))

        for which in (direct, managed) if r % 2 == 0 else (managed, direct):
            start = time.perf_counter()
            which()
            elapsed = time.perf_counter() - start
            if which is direct:
                direct_s += elapsed
            else:
                managed_s += elapsed
        k += n_barriers
    assert spark.table("lake.bench.managed").count() == spark.table("lake.bench.direct").count() - 1000
    return direct_s, managed_s


def bench_expiry_planning(conn, catalog, n_snapshots: int) -> float:
    """A table whose metadata lists n snapshots (all sharing one manifest list), with one
    recorded commit per barrier in the control plane, then a dry-run expiry."""
    import pyarrow as pa
    from pyiceberg.table.snapshots import Operation, Snapshot, Summary
    from pyiceberg.table.update import AddSnapshotUpdate, SetSnapshotRefUpdate

    from icebarrier.iceberg_ext.catalog import create_table

    name = TableName.parse("lake.bench.many")
    tbl = create_table(catalog, name, pa.schema([("id", pa.int64())]))
    tbl.append(pa.table({"id": pa.array([1], pa.int64())}))
    tbl = load_table(catalog, name)
    base = tbl.current_snapshot()
    jobs.register(conn, JobDefinition(name="many", sinks=frozenset([name]), external_inputs=frozenset(["gen"])))
    marks = [barriers.issue(conn).barrier for _ in range(n_snapshots)]
    updates, parent = [], base.snapshot_id
    now_ms = int(time.time() * 1000) - n_snapshots
    for i, b in enumerate(marks):
        sid = 10_000_000 + i
        updates.append(
            AddSnapshotUpdate(
                snapshot=Snapshot(
                    snapshot_id=sid,
                    parent_snapshot_id=parent,
                    sequence_number=base.sequence_number + 1 + i,
                    timestamp_ms=now_ms + i,
                    manifest_list=base.manifest_list,
                    schema_id=base.schema_id,
                    summary=Summary(
                        operation=Operation.APPEND, **{"icebarrier.barrier": str(b), "icebarrier.job": "many"}
                    ),
                )
            )
        )
        parent = sid
    updates.append(SetSnapshotRefUpdate(ref_name="main", type="branch", snapshot_id=parent))
    with tbl.transaction() as tx:
        tx._apply(tuple(updates))
    with conn.transaction():
        conn.execute(
            "UPDATE managed_table SET start_barrier = %s, watermark = %s WHERE name = %s",
            (marks[0], marks[-1], str(name)),
        )
        conn.execute(
            """INSERT INTO table_commit (table_id, barrier, snapshot_id, job_name)
               SELECT (SELECT table_id FROM managed_table WHERE name = %s), b, s, 'many'
               FROM unnest(%s::bigint[], %s::bigint[]) AS x(b, s)""",
            (str(name), marks, [10_000_000 + i for i in range(n_snapshots)]),
        )
    assert len(load_table(catalog, name).metadata.snapshots) == n_snapshots + 1
    times = []
    for _ in range(3):
        report = expire(conn, catalog, name, dry_run=True)
        times.append(report.planning_s)
    assert report.candidates == n_snapshots
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER)
    parser.add_argument("--barriers", type=int, default=5)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--snapshots", type=int, default=10_000)
    args = parser.parse_args()

    with scratch_database(args.dsn) as dsn:
        with tempfile.TemporaryDirectory() as warehouse:
            settings = Settings(dsn=dsn, warehouse=warehouse).validated()
            spark = spark_session(settings, app_name="icebarrier-bench")
            spark.sparkContext.setLogLevel("ERROR")
            catalog = load_catalog(settings)
            with db.connect(dsn) as conn:
                direct_s, managed_s = bench_writes(spark, conn, catalog, args.barriers, args.rows)
                ratio = managed_s / direct_s
                print(f"Spark job, 4 x {args.barriers} barriers x {args.rows} rows:")
                print(f"  direct Iceberg writes: {direct_s:7.2f} s")
                print(f"  through icebarrier:    {managed_s:7.2f} s")
                print(f"  ratio:                 {ratio:7.3f}   (goal <= 1.05: {'met' if ratio <= 1.05 else 'MISSED'})")
                planning = bench_expiry_planning(conn, catalog, args.snapshots)
                print(
                    f"expiry planning, {args.snapshots} snapshots: {planning:.3f} s   "
                    f"(goal <= 1 s: {'met' if planning <= 1 else 'MISSED'})"
                )
            spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
