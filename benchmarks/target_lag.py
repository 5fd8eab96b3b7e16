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

from proc import cpu_s  # noqa: E402
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


def _tree(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_tree(child)]
    return found


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
    alive = 0.0
    for pid in _tree(os.getpid()):
        try:
            alive += cpu_s(pid)
        except OSError:
            continue
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


def prepare(dsn: str, warehouse: str, input_dir: Path, log, jvm_options: str) -> dict[str, str]:
    """The tables, and each job run once (registering it; its first barrier bootstraps)."""
    env = {
        **os.environ,
        "SPARK_SUBMIT_OPTS": jvm_options,
        "ICEBARRIER_DSN": dsn,
        "ICEBARRIER_WAREHOUSE": warehouse,
        "SHOP_NS": NS,
        "SHOP_INPUT": str(input_dir),
    }
    subprocess.run([sys.executable, str(SHOP / "pipeline.py"), "create-tables"], env=env, check=True, cwd=SHOP)
    with db.connect(dsn) as conn:
        barriers.set_interval_s(conn, INTERVAL_S)
    for job in JOBS:
        subprocess.run([*CLI, "run", str(SHOP / f"{job}.py"), "--once"], env=env, check=True, stdout=log, stderr=log)
    return env


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


def scheduled(args, log) -> tuple[dict[str, list[bool]], dict[str, int], tuple[float, int], float]:
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory() as tmp:
        input_dir, warehouse = Path(tmp) / "input", str(Path(tmp) / "wh")
        feed = Feed(input_dir)
        env = prepare(dsn, warehouse, input_dir, log, args.jvm_options)
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
        env = prepare(dsn, warehouse, input_dir, log, args.jvm_options)
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
    args = parser.parse_args()
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    become_subreaper()
    with open(args.log, "w") as log:
        met, runs, (clock, issued), cpu_scheduled = scheduled(args, log)
        cpu_followed = followed(args, log)
    for leaf, seen in met.items():
        share = statistics.fmean(seen)
        print(f"{leaf:18} target {args.target:g} s met {share:7.2%} of {len(seen)} samples (goal >= 99 %)")
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


if __name__ == "__main__":
    sys.exit(main())
