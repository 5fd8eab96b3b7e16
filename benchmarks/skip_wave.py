"""What the control plane's set-wise skips cost Postgres per barrier, against the number of jobs.

    python benchmarks/skip_wave.py [--jobs 200,2000,20000] [--barriers 30] [--active 2]

Per point: the scale benchmark's DAG (five deep, a tenth roots reading announced inputs), every
job completed at a first barrier by the setup; then ``--barriers`` barriers issued one after
another, ``--active`` roots announced before each (their chains are not skipped: they wait for
them; each then completes the barrier with nothing written, as its run would). Printed: the
issuing transaction's time (p50, p95; the wave over every job runs in it), the
jobs each barrier skipped, and the Postgres CPU it took per barrier (the backend's own user+system
time, from /proc). No job process runs: this is the control plane's share alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proc import cpu_s  # noqa: E402
from scale import topology  # noqa: E402 - the same DAG
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, inputs, jobs  # noqa: E402


def run_point(args, n_jobs: int) -> dict:
    definitions = topology(n_jobs, args.seed)
    rng = random.Random(args.seed)
    with scratch_database(args.dsn) as dsn, db.connect(dsn) as conn:
        barriers.set_anchor_interval_s(conn, 3600)
        with conn.transaction():
            for d in definitions:
                jobs.register(conn, d)
        roots = sorted(i for d in definitions for i in d.external_inputs)
        inputs.announce(conn, roots)
        b0 = barriers.issue(conn).barrier
        with conn.transaction():
            for d in definitions:  # in topological order: each job's sources complete b0 first
                jobs.complete(conn, d.name, b0)
        conn.execute("ANALYZE")
        backend = conn.info.backend_pid
        times, skipped, cpu = [], [], []
        root_of = {i: d.name for d in definitions for i in d.external_inputs}
        for _ in range(args.barriers):
            landed = rng.sample(roots, min(len(roots), args.active))
            inputs.announce(conn, landed)
            before_rows = _completions(conn)
            c0, t0 = cpu_s(backend), time.perf_counter()
            b = barriers.issue(conn).barrier
            times.append(time.perf_counter() - t0)
            cpu.append(cpu_s(backend) - c0)
            skipped.append(_completions(conn) - before_rows)
            for i in landed:  # their runs: an empty publish each (its readers skip with it)
                jobs.complete(conn, root_of[i], b)
    ranked = sorted(times)
    return {
        "jobs": n_jobs,
        "p50_ms": 1000 * statistics.median(ranked),
        "p95_ms": 1000 * ranked[min(len(ranked) - 1, int(len(ranked) * 0.95))],
        "skipped": statistics.median(skipped),
        "cpu_ms": 1000 * statistics.median(cpu),
    }


def _completions(conn) -> int:
    return conn.execute("SELECT count(*) AS n FROM table_completion").fetchone()["n"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER)
    parser.add_argument("--jobs", default="200,2000,20000")
    parser.add_argument("--barriers", type=int, default=30)
    parser.add_argument("--active", type=int, default=2, help="roots announced before each barrier")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    for n in (int(x) for x in args.jobs.split(",")):
        r = run_point(args, n)
        print(
            f"{r['jobs']:6d} jobs: issuing a barrier (the wave in it) p50 {r['p50_ms']:7.1f} ms, p95 {r['p95_ms']:7.1f} ms; "
            f"{r['skipped']:.0f} sinks skipped per barrier; Postgres CPU {r['cpu_ms']:6.1f} ms per barrier",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
