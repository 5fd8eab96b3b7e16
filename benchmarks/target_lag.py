"""Declared freshness: the shopping pipeline under `icebarrier schedule`, against the same
pipeline under `--follow`, in one run.

    python benchmarks/target_lag.py [--dsn DSN] [--minutes 10] [--target 10] [--jvm-options '…']

The shopping pipeline (examples/shopping: two file-fed roots, two SQL jobs and a delta join,
all PySpark job files), a batch of input files every second, 1-s barriers. Targets of
``--target`` seconds on the three leaves (user_item_amount, user_item_price, shipped_orders).

1. `icebarrier schedule` runs the jobs (registered with ``--file``; it keeps each job file's
   Spark session warm between runs) for ``--minutes``. Sampled every 0.5 s: whether each leaf
   meets its target (goal: >= 99 % of the time, after the first refresh). Counted: each job's
   runs ÷ the barriers the 1-s clock issues over the window (goal <= 1/5 where the target
   allows); the schedule also issues one as each refresh starts, so runs ÷ all barriers issued
   looks better and is printed beside it.
2. The same pipeline (a fresh database and warehouse) with each job under
   `icebarrier run FILE --follow`, as long.

Compute time: CPU seconds (user + system) over the measured minutes of every process each
phase started (the schedule or the five jobs, and their Spark JVMs; from /proc for those alive,
the kernel's accounting for those reaped), once the pipeline runs (the Spark sessions' start
is not counted in either). Ratio schedule ÷ follow (goal <= 0.5).

``--seed-rows N --against full-sql`` measures incremental SQL jobs instead (docs/incremental.md):
``shopping`` starts with N orders (and every other one shipped), and the second phase is the
schedule again with the SQL jobs recomputing in full (``SHOP_INCREMENTAL=0``): targets met in
each, and CPU incremental ÷ full.

Both phases' Spark drivers get ``--jvm-options`` (Spark's own ``SPARK_SUBMIT_OPTS``; default:
the small-job options docs/declared-freshness.md recommends for warm runners, C1 JIT only and
the serial GC; ``--jvm-options ''`` for the JVM's defaults).
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proc import cpu_s, tree_cpu_s  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.apps.embedded import CLI  # noqa: E402
from icebarrier.control_plane import barriers, db, targets  # noqa: E402
from icebarrier.control_plane.model import TableName  # noqa: E402
from icebarrier.control_plane.targets import Runner  # noqa: E402
from icebarrier.iceberg_ext.spark import SMALL_JOBS_JVM_OPTIONS  # noqa: E402

SHOP = Path(__file__).resolve().parent.parent / "examples" / "shopping"
JOBS = ("ingest_shopping", "ingest_shipments", "user_item_amount", "user_item_price", "shipped_orders")
LEAVES = ("user_item_amount", "user_item_price", "shipped_orders")
NS = "shop"
INTERVAL_S = 1  # the barrier clock


def become_subreaper() -> None:
    """Orphaned descendants (a Spark JVM whose Python parent exited) become this process's
    children, so their CPU time is counted when reaped (Linux)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def cpu_now() -> float:
    """CPU seconds (user + system) of every descendant so far: those alive (from /proc) and
    those that exited and were reaped (this process is their subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    alive = tree_cpu_s(os.getpid()) - cpu_s(os.getpid())
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return alive + usage.ru_utime + usage.ru_stime


class Feed:
    """A batch of input files every second (examples/shopping/generate.py)."""

    def __init__(self, input_dir: Path) -> None:
        sys.path.insert(0, str(SHOP))
        from generate import write_batch

        self.write_batch, self.input_dir, self.stop = write_batch, input_dir, threading.Event()
        self.batch = 0
        self.write()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def write(self) -> None:
        self.batch += 1
        self.write_batch(str(self.input_dir), self.batch, orders=50)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.write()


def prepare(dsn: str, warehouse: str, input_dir: Path, log, args, *, incremental: bool = True) -> dict[str, str]:
    """The tables, and each job run once (registering it; its first barrier bootstraps); with
    ``--seed-rows``, the roots' history first holds that many orders."""
    env = {
        **os.environ,
        "SPARK_SUBMIT_OPTS": args.jvm_options,
        "ICEBARRIER_DSN": dsn,
        "ICEBARRIER_WAREHOUSE": warehouse,
        "SHOP_NS": NS,
        "SHOP_INPUT": str(input_dir),
        "SHOP_INCREMENTAL": "1" if incremental else "0",
    }
    subprocess.run([sys.executable, str(SHOP / "pipeline.py"), "create-tables"], env=env, check=True, cwd=SHOP)
    with db.connect(dsn) as conn:
        barriers.set_interval_s(conn, INTERVAL_S)
    for job in JOBS:
        subprocess.run([*CLI, "run", str(SHOP / f"{job}.py"), "--once"], env=env, check=True, stdout=log, stderr=log)
        if job == "ingest_shipments" and args.seed_rows:
            seed = [sys.executable, __file__, "--seed", dsn, warehouse, str(args.seed_rows)]
            subprocess.run(seed, env=env, check=True, stdout=log, stderr=log)
    return env


def seed(dsn: str, warehouse: str, rows: int) -> None:
    """The roots' next barrier appends ``rows`` orders (ids below the generator's) and ships
    every other one: a history of millions of rows for the SQL jobs to bootstrap from."""
    from icebarrier.control_plane import jobs
    from icebarrier.iceberg_ext.catalog import load_catalog
    from icebarrier.iceberg_ext.commits import BarrierCommit
    from icebarrier.iceberg_ext.config import Settings
    from icebarrier.iceberg_ext.spark import spark_session
    from icebarrier.iceberg_ext.spark_io import append_df

    settings = Settings(dsn=dsn, warehouse=warehouse).validated()
    spark = spark_session(settings, app_name="seed", extra={"spark.driver.memory": "4g"})
    orders = spark.range(-rows, 0).selectExpr(
        "id AS order_id",
        "pmod(id, 20) AS user_id",
        "pmod(hash(id), 10) AS item_id",
        "1 + pmod(hash(id, 1), 4) AS amount",
        "CAST(10 * (1 + pmod(hash(id), 10)) AS DOUBLE) AS price",
    )
    ships = spark.range(-rows, 0, 2).selectExpr("id AS order_id", "IF(pmod(id, 4) = 0, 'ups', 'dhl') AS carrier")
    catalog = load_catalog(settings)
    with db.connect(dsn) as conn:
        b = barriers.issue(conn).barrier
        for name, df in (("shopping", orders), ("shipments", ships)):
            job = f"{NS}_ingest_{name}"
            progress = jobs.show(conn, job).progress
            for r in conn.execute(
                "SELECT barrier FROM barriers WHERE barrier > %s AND barrier < %s ORDER BY barrier", (progress, b)
            ).fetchall():
                jobs.complete(conn, job, r["barrier"])  # issued while the roots ran: nothing new in them
            with BarrierCommit(conn, catalog, job=job, barrier=b) as tx:
                append_df(tx, TableName.parse(f"lake.{NS}.{name}"), df)
    spark.stop()


def sample_targets(dsn: str, seconds: float) -> dict[str, list[bool]]:
    met: dict[str, list[bool]] = {leaf: [] for leaf in LEAVES}
    deadline = time.monotonic() + seconds
    with db.connect(dsn) as conn:
        while time.monotonic() < deadline:
            for t in targets.targets(conn):
                if t.name.name in met:
                    met[t.name.name].append(bool(t.met))
            time.sleep(0.5)
    return met


def scheduled(
    args, log, *, incremental: bool = True
) -> tuple[dict[str, list[bool]], dict[str, int], tuple[float, int], float]:
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory() as tmp:
        input_dir, warehouse = Path(tmp) / "input", str(Path(tmp) / "wh")
        feed = Feed(input_dir)
        env = prepare(dsn, warehouse, input_dir, log, args, incremental=incremental)
        with db.connect(dsn) as conn:
            for job in JOBS:
                targets.set_runner(conn, f"{NS}_{job}", Runner(kind="file", spec=str(SHOP / f"{job}.py")))
            for leaf in LEAVES:
                targets.set_target_lag(conn, TableName.parse(f"lake.{NS}.{leaf}"), args.target)
        feed.thread.start()
        proc = subprocess.Popen([*CLI, "schedule", "--parallel", "5"], env=env, stdout=log, stderr=log)
        # the first refresh: the five Spark sessions start; measured from when every leaf met its target
        deadline = time.monotonic() + 300
        with db.connect(dsn) as conn:
            while not all(t.met for t in targets.targets(conn) if t.name.name in LEAVES):
                if time.monotonic() > deadline:
                    raise SystemExit("the schedule did not refresh the pipeline within 300 s; see the log")
                time.sleep(0.5)
            first = barriers.newest(conn)
        cpu = cpu_now()
        met = sample_targets(dsn, args.minutes * 60)
        cpu = cpu_now() - cpu
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        feed.stop.set()
        with db.connect(dsn) as conn:
            issued = conn.execute(
                "SELECT count(*) AS n, extract(epoch FROM clock_timestamp() - %s) AS elapsed_s FROM barriers "
                "WHERE barrier > %s",
                (first.issued_at, first.barrier),
            ).fetchone()
            runs = {
                r["job_name"].removeprefix(f"{NS}_"): r["n"]
                for r in conn.execute(
                    "SELECT job_name, count(*) AS n FROM schedule_run WHERE started_at >= %s GROUP BY job_name",
                    (first.issued_at,),
                ).fetchall()
            }
    # the clock's barriers (one a second) over the window, and all issued (with those the
    # schedule adds as refreshes start): runs are judged against the fewer
    return met, runs, (float(issued["elapsed_s"]) / INTERVAL_S, issued["n"]), cpu


def followed(args, log) -> float:
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory() as tmp:
        input_dir, warehouse = Path(tmp) / "input", str(Path(tmp) / "wh")
        feed = Feed(input_dir)
        env = prepare(dsn, warehouse, input_dir, log, args)
        feed.thread.start()
        procs = [
            subprocess.Popen([*CLI, "run", str(SHOP / f"{job}.py"), "--follow"], env=env, stdout=log, stderr=log)
            for job in JOBS
        ]
        # as for the schedule: measured once the pipeline runs (every leaf past a barrier issued since)
        deadline = time.monotonic() + 300
        with db.connect(dsn) as conn:
            started = barriers.issue(conn).barrier
            while not all((t.watermark or 0) >= started for t in targets.targets(conn) if t.name.name in LEAVES):
                if time.monotonic() > deadline:
                    raise SystemExit("the --follow jobs did not catch up within 300 s; see the log")
                time.sleep(0.5)
        cpu = cpu_now()
        time.sleep(args.minutes * 60)
        cpu = cpu_now() - cpu
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(120)
        feed.stop.set()
        return cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--target", type=float, default=10.0, help="target lag of the leaves, seconds")
    parser.add_argument("--log", default="build/target_lag.log", help="where the processes' output goes")
    parser.add_argument(
        "--jvm-options", default=SMALL_JOBS_JVM_OPTIONS, help="the Spark drivers' JVM options, both phases"
    )
    parser.add_argument("--seed-rows", type=int, default=0, help="orders in the history before the run")
    parser.add_argument(
        "--against", choices=("follow", "full-sql"), default="follow", help="the second phase: --follow, or full SQL"
    )
    parser.add_argument("--seed", nargs=3, help=argparse.SUPPRESS)  # a child: DSN WAREHOUSE ROWS
    args = parser.parse_args()
    if args.seed:
        seed(args.seed[0], args.seed[1], int(args.seed[2]))
        return 0
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    become_subreaper()
    if args.against == "full-sql":
        return against_full_sql(args)
    with open(args.log, "w") as log:
        met, runs, (clock, issued), cpu_scheduled = scheduled(args, log)
        cpu_followed = followed(args, log)
    print_targets(met, args.target)
    for job in JOBS:
        n = runs.get(job, 0)
        print(
            f"{job:18} {n:4} runs: 1/{clock / max(n, 1):.1f} of the clock's {clock:.0f} barriers "
            f"(1/{issued / max(n, 1):.1f} of the {issued} issued, with those refreshes began with) (goal <= 1/5)"
        )
    print(
        f"compute: schedule {cpu_scheduled:.0f} CPU s, --follow {cpu_followed:.0f} CPU s over {args.minutes:g} min: "
        f"ratio {cpu_scheduled / cpu_followed:.2f} (goal <= 0.5); JVM options: {args.jvm_options or 'defaults'}"
    )
    return 0


def print_targets(met: dict[str, list[bool]], target: float, label: str = "") -> None:
    for leaf, seen in met.items():
        share = statistics.fmean(seen)
        print(f"{label}{leaf:18} target {target:g} s met {share:7.2%} of {len(seen)} samples (goal >= 99 %)")


def against_full_sql(args) -> int:
    """The schedule with incremental SQL jobs, then with the same jobs recomputing in full."""
    with open(args.log, "w") as log:
        incremental = scheduled(args, log, incremental=True)
        full = scheduled(args, log, incremental=False)
    for label, (met, runs, _, cpu) in (("incremental ", incremental), ("full        ", full)):
        print_targets(met, args.target, label)
        print(f"{label}runs: " + ", ".join(f"{job} {runs.get(job, 0)}" for job in JOBS) + f"; {cpu:.0f} CPU s")
    print(
        f"compute over {args.minutes:g} min with {args.seed_rows:,} orders of history: incremental ÷ full "
        f"{incremental[3] / full[3]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
