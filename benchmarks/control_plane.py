"""Control-plane speed: completing barriers, and read-committed cut latency.

    python benchmarks/control_plane.py [--dsn DSN] [--n 2000] [--lake 100000]

Prints, measured in one run on one server:
- complete-barrier ops/s ÷ a plain single-row Postgres transaction's ops/s (goal >= 0.5);
- read-committed cut latency p50/p95 at 10, 100, 1,000 and 10,000 tables, each with a history of
  exact, skipped and coalesced completions (goal p50 <= 1/2/3/5 ms);
- in that lake of 10,000 (and the 1,110 before them) managed tables, or grown to ``--lake``
  tables: the whole-lake cut (the ``read-committed`` warehouse's barrier, view
  ``consistent_barrier``; goal p50 <= 5 ms) and a cut over 20 of the tables (goal p50 <= 0.5 ms);
- how long `icebarrier db upgrade` takes to apply the newest migration to that populated schema.

It creates a scratch database on the server (default: the local one at 127.0.0.1:5432)
and drops it afterwards.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, jobs, reads, schema  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402

GOALS_MS = {10: 1, 100: 2, 1000: 3, 10_000: 5}
WHOLE_LAKE_GOAL_MS, FEW_GOAL_MS, FEW = 5, 0.5, 20


def bench_single_row(conn: psycopg.Connection, n: int) -> float:
    conn.execute("CREATE TABLE bench_counter (id int PRIMARY KEY, n bigint NOT NULL)")
    conn.execute("INSERT INTO bench_counter VALUES (1, 0)")
    start = time.perf_counter()
    for _ in range(n):
        with conn.transaction():
            conn.execute("UPDATE bench_counter SET n = n + 1 WHERE id = 1")
    return n / (time.perf_counter() - start)


def bench_complete(conn: psycopg.Connection, n: int) -> float:
    sink = TableName.parse("lake.bench.events")
    jobs.register(conn, JobDefinition(name="bench_ingest", sinks=frozenset([sink]), external_inputs=frozenset(["x"])))
    marks = [barriers.issue(conn).barrier for _ in range(n)]
    start = time.perf_counter()
    for i, b in enumerate(marks):
        jobs.complete(conn, "bench_ingest", b, {sink: i})
    return n / (time.perf_counter() - start)


def bench_cut(conn: psycopg.Connection, n_tables: int, reps: int) -> tuple[float, float, list[TableName]]:
    names = [TableName.parse(f"lake.cut{n_tables}.t{i}") for i in range(n_tables)]
    job = f"cut_ingest_{n_tables}"
    jobs.register(conn, JobDefinition(name=job, sinks=frozenset(names), external_inputs=frozenset(["x"])))
    barriers.set_anchor_interval_s(conn, 7 * 86400)
    for k in range(5):  # exact, a skipped run, a coalesced range, exact again
        marks = [barriers.issue(conn).barrier for _ in range(1 + k % 3)]
        commits = {t: k * 10_000 + i for i, t in enumerate(names)} if k % 3 != 1 else {}
        jobs.complete(conn, job, marks[-1], commits, coalesce=k % 3 == 2)
    conn.execute("VACUUM ANALYZE managed_table")  # the steady state autovacuum keeps
    conn.execute("VACUUM ANALYZE table_commit")
    conn.execute("VACUUM ANALYZE coalesced_range")
    p50, p95 = timed(lambda: reads.resolve(conn, names), reps)
    assert len(reads.resolve(conn, names).snapshots) == n_tables
    return p50, p95, names


def grow(conn: psycopg.Connection, lake: int) -> None:
    """More managed tables, 10,000 to a root job completed at one barrier, until the lake holds
    ``lake`` (the whole-lake cut's size)."""
    k = 0
    while (have := conn.execute("SELECT count(*) AS n FROM managed_table").fetchone()["n"]) < lake:
        names = [TableName.parse(f"lake.grow{k}.t{i}") for i in range(min(10_000, lake - have))]
        jobs.register(conn, JobDefinition(name=f"grow_{k}", sinks=frozenset(names), external_inputs=frozenset(["x"])))
        jobs.complete(conn, f"grow_{k}", barriers.issue(conn).barrier, {t: i for i, t in enumerate(names)})
        k += 1
    conn.execute("VACUUM ANALYZE managed_table")


def timed(work, reps: int) -> tuple[float, float]:
    """p50 and p95 of ``work()`` in ms, after a warm-up."""
    for _ in range(5):
        work()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.95) - 1]


def report(what: str, p50: float, p95: float, goal: float) -> None:
    print(
        f"{what:<44} p50 {p50:6.2f} ms  p95 {p95:6.2f} ms   (goal p50 <= {goal} ms: {'met' if p50 <= goal else 'MISSED'})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--n", type=int, default=2000, help="operations per throughput measurement")
    parser.add_argument("--reps", type=int, default=200, help="cut resolutions per size")
    parser.add_argument(
        "--lake", type=int, default=0, help="grow the lake to this many managed tables for the whole-lake cut"
    )
    args = parser.parse_args()

    with scratch_database(args.dsn) as dsn:
        with db.connect(dsn) as conn:
            plain = bench_single_row(conn, args.n)
            complete = bench_complete(conn, args.n)
            print(f"plain single-row transaction: {plain:8.0f} ops/s")
            print(f"complete barrier:             {complete:8.0f} ops/s")
            ratio = complete / plain
            print(f"ratio complete/plain:         {ratio:8.2f}   (goal >= 0.5: {'met' if ratio >= 0.5 else 'MISSED'})")
            for n_tables, goal in GOALS_MS.items():
                p50, p95, names = bench_cut(conn, n_tables, args.reps)
                report(f"read-committed cut, {n_tables:6,d} tables:", p50, p95, goal)
            grow(conn, args.lake)
            lake = conn.execute("SELECT count(*) AS n FROM managed_table").fetchone()["n"]
            whole = timed(lambda: conn.execute("SELECT barrier FROM consistent_barrier").fetchone(), args.reps)
            report(f"whole-lake cut ({lake:,d} tables):", *whole, WHOLE_LAKE_GOAL_MS)
            few = timed(lambda: reads.resolve(conn, names[:FEW]), args.reps)
            report(f"cut over {FEW} of {n_tables:,d} tables:", *few, FEW_GOAL_MS)
        upgrade_s = populated_upgrade(dsn)
        print(f"db upgrade, the newest migration on {lake:,d} tables: {upgrade_s:5.2f} s (down one revision, up again)")
    return 0


def populated_upgrade(dsn: str) -> float:
    """Seconds `icebarrier db upgrade` takes to apply the newest migration to this populated
    schema (after a downgrade by one revision, untimed)."""
    schema.downgrade(dsn, revision="-1")
    started = time.perf_counter()
    schema.upgrade(dsn)
    return time.perf_counter() - started


if __name__ == "__main__":
    raise SystemExit(main())
