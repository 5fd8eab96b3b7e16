"""Control-plane speed: completing barriers, and read-committed cut latency.

    python benchmarks/control_plane.py [--dsn DSN] [--n 2000]

Prints, measured in one run on one server:
- complete-barrier ops/s ÷ a plain single-row Postgres transaction's ops/s (goal >= 0.5);
- read-committed cut latency p50/p95 at 10, 100 and 1,000 tables, each with a history of exact,
  skipped and coalesced completions (goal p50 <= 1/2/3 ms).

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
from icebarrier.control_plane import barriers, db, jobs, reads  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402

GOALS_MS = {10: 1, 100: 2, 1000: 3}


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


def bench_cut(conn: psycopg.Connection, n_tables: int, reps: int) -> tuple[float, float]:
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
    for _ in range(5):
        reads.resolve(conn, names)  # warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        cut = reads.resolve(conn, names)
        times.append((time.perf_counter() - start) * 1000)
    assert len(cut.snapshots) == n_tables
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.95) - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER,
                        help="a server where we may CREATE DATABASE")
    parser.add_argument("--n", type=int, default=2000, help="operations per throughput measurement")
    parser.add_argument("--reps", type=int, default=200, help="cut resolutions per size")
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
                p50, p95 = bench_cut(conn, n_tables, args.reps)
                verdict = "met" if p50 <= goal else "MISSED"
                print(f"read-committed cut, {n_tables:5d} tables: p50 {p50:6.2f} ms  p95 {p95:6.2f} ms"
                      f"   (goal p50 <= {goal} ms: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
