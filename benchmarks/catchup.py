"""Cost follows change: a SQL job catching up, against one up-to-date barrier in the same run.

    python benchmarks/catchup.py [--dsn DSN] [--behind 300] [--barrier-ms 10] [--anchor-ms 600]
                                 [--warehouse s3://bucket/prefix | --s3]

The SQL job is ``user_item_amount`` of ``examples/shopping`` (incremental: each computation
reads what arrived since the previous one; ``SHOP_INCREMENTAL=0``: a full recompute and
overwrite per computation). Barriers and anchors are issued on the database clock at
``--barrier-ms`` / ``--anchor-ms``: the defaults are 1 s barriers with 60 s anchors run 100x
faster (the same 60 barriers per anchor); pass 1000 / 60000 to run in real time. Prints:

- baseline: the job completing one barrier when up to date (a change, one computation);
- unchanged: the job ``--behind`` barriers behind, its sources unchanged (goal <= 1.5x baseline);
- changes: the same while the root jobs run alongside (``--follow``, in threads) and a batch
  of input arrives every 10 barriers: computations (goal <= anchors in range + 1) and time
  (goal <= that many x baseline x 1.2);
- hourly batch: 1 s barriers for 10 minutes (600 barriers, compressed alike), then one
  ``--once`` run: at most one computation per anchor passed (+1 past the last), and its
  output equals a full recompute at the barrier it completed.

It creates a scratch database and warehouse and removes both. ``--warehouse s3://…`` runs it on
object storage (the ``[storage]`` settings of icebarrier.toml or the AWS variables). ``--s3`` runs it
twice, on a local warehouse and on moto's S3 server on 127.0.0.1 (each in a process of its own,
its own Spark), and prints S3 ÷ local for the wall time of one barrier and for the hourly batch's
computations and time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "shopping"))

import generate  # noqa: E402
import pipeline as shop  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, reads  # noqa: E402
from icebarrier.control_plane.model import TableName  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402
from icebarrier.iceberg_ext.runtime import Runtime  # noqa: E402
from icebarrier.iceberg_ext.spark import spark_session  # noqa: E402

ROOTS = ("ingest_shopping", "ingest_shipments")
JOB = "user_item_amount"


class Bench:
    def __init__(self, conn, spark, settings, ns: str, input_dir: Path, barrier_s: float) -> None:
        self.conn, self.spark, self.ns, self.input_dir, self.barrier_s = conn, spark, ns, input_dir, barrier_s
        shop.create_tables(spark, ns)
        built = shop.build(ns, str(input_dir))
        self.runtimes = {
            k: Runtime(built[k], settings=settings, spark=spark, conn=None if k in ROOTS else conn, log=lambda _: None)
            for k in (*ROOTS, JOB)
        }  # roots: own connections
        self.batch = 0

    def ingest(self, *, run: bool = True) -> None:
        self.batch += 1
        generate.write_batch(str(self.input_dir), self.batch, orders=200)
        for name in ROOTS if run else ():
            self.runtimes[name].run()

    def tick(self, n: int, *, ingest_every: int | None = None) -> list[int]:
        """Issue n barriers at the barrier interval; with ``ingest_every``, a batch of input
        arrives that often and the root jobs follow along in threads."""
        roots = [
            threading.Thread(target=self.runtimes[name].run, kwargs={"follow": True, "poll_s": 0.05})
            for name in (ROOTS if ingest_every else ())
        ]
        for t in roots:
            t.start()
        marks, started = [], time.monotonic()
        for i in range(n):
            marks.append(barriers.issue(self.conn).barrier)
            if ingest_every and (i + 1) % ingest_every == 0:
                self.ingest(run=False)
            time.sleep(max(0.0, (i + 1) * self.barrier_s - (time.monotonic() - started)))
        for name in ROOTS:
            self.runtimes[name].stop.set()
        for t in roots:
            t.join()
        for name in ROOTS:
            self.runtimes[name].run()  # the last barriers
        return marks

    def run_job(self):
        started = time.perf_counter()
        summary = self.runtimes[JOB].run()
        return time.perf_counter() - started, summary

    def anchors_in(self, after: int, upto: int) -> int:
        return self.conn.execute(
            "SELECT count(*) AS n FROM barriers WHERE anchor AND barrier > %s AND barrier <= %s", (after, upto)
        ).fetchone()["n"]

    def equals_recompute(self) -> bool:
        t = shop.tables(self.ns)
        source, sink = TableName.parse(t["shopping"]), TableName.parse(t[JOB])
        cut = reads.resolve(self.conn, [source, sink])
        got = self.spark.sql(f"SELECT * FROM {sink} VERSION AS OF {cut.snapshots[sink]}").collect()
        want = self.spark.sql(
            f"SELECT user_id, item_id, sum(amount) AS amount FROM {source} "
            f"VERSION AS OF {cut.snapshots[source]} GROUP BY user_id, item_id"
        ).collect()
        return sorted(map(tuple, got)) == sorted(map(tuple, want))


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--behind", type=int, default=300, help="barriers the job falls behind")
    parser.add_argument("--barrier-ms", type=float, default=10, help="barrier interval (1 s / 100 by default)")
    parser.add_argument("--anchor-ms", type=float, default=600, help="anchor interval (60 s / 100 by default)")
    parser.add_argument("--batch-barriers", type=int, default=600, help="barriers before the hourly batch run")
    parser.add_argument("--warehouse", help="s3://bucket/prefix: run on object storage ([storage] settings)")
    parser.add_argument("--s3", action="store_true", help="run locally and on moto's S3 server; print S3 / local")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a child of --s3: the figures
    args = parser.parse_args()
    if args.s3:
        return compare_s3(args)
    figures = run(args)
    if args.json:
        print(json.dumps(figures))
    return 0


def compare_s3(args) -> int:
    """The benchmark on a local warehouse and on S3 (moto's server), each in a process of its own."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.s3 import moto_server

    def child(warehouse: str | None, env: dict) -> dict:
        argv = [sys.executable, __file__, "--json", "--dsn", args.dsn, "--behind", str(args.behind)]
        argv += ["--barrier-ms", str(args.barrier_ms), "--anchor-ms", str(args.anchor_ms)]
        argv += ["--batch-barriers", str(args.batch_barriers)] + (["--warehouse", warehouse] if warehouse else [])
        done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True)
        print(done.stdout.rsplit("\n", 2)[0], file=sys.stderr)
        if done.returncode:
            raise SystemExit(f"the run on {warehouse or 'a local warehouse'} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as tmp, moto_server(Path(tmp) / "moto.log") as s3:
        config = Path(tmp) / "icebarrier.toml"
        config.write_text(s3.storage_toml())
        print("local warehouse:", file=sys.stderr)
        local = child(None, {})
        print(f"S3 (moto's server on 127.0.0.1, bucket {s3.bucket}):", file=sys.stderr)
        remote = child(f"s3://{s3.bucket}/catchup", {"ICEBARRIER_CONFIG": str(config)})
    print(
        f"one barrier (one computation): local {local['baseline_s'] * 1000:.0f} ms, S3 {remote['baseline_s'] * 1000:.0f} ms, "
        f"S3 / local {remote['baseline_s'] / local['baseline_s']:.2f}"
    )
    print(
        f"hourly batch: computations local {local['batch_computations']}, S3 {remote['batch_computations']}; "
        f"time local {local['batch_s']:.1f} s, S3 {remote['batch_s']:.1f} s, S3 / local "
        f"{remote['batch_s'] / local['batch_s']:.2f}; output = full recompute: local {local['batch_exact']}, "
        f"S3 {remote['batch_exact']}"
    )
    return 0


def run(args) -> dict:
    """Every phase on one warehouse; prints each line and returns the figures compare_s3 needs."""
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory() as tmp:
        warehouse = args.warehouse or str(Path(tmp) / "warehouse")
        storage = Settings.load_storage(os.environ.get("ICEBARRIER_CONFIG"))
        settings = Settings(dsn=dsn, warehouse=warehouse, storage=storage).validated()
        spark = spark_session(settings, app_name="icebarrier-bench-catchup")
        spark.sparkContext.setLogLevel("ERROR")
        with db.connect(dsn) as conn:
            barriers.set_interval_s(conn, 3600)  # only the benchmark issues barriers
            barriers.set_anchor_interval_s(conn, args.anchor_ms / 1000)
            bench = Bench(conn, spark, settings, "catchup", Path(tmp) / "input", args.barrier_ms / 1000)

            one = []
            for _ in range(4):  # the first warms Spark up
                barriers.issue(conn)
                bench.ingest()
                seconds, summary = bench.run_job()
                assert summary.computations == 1, summary
                one.append(seconds)
            baseline = statistics.median(one[1:])
            print(f"baseline: one up-to-date barrier (one computation): {baseline * 1000:7.0f} ms")

            bench.tick(args.behind)
            seconds, summary = bench.run_job()
            ratio = seconds / baseline
            print(
                f"unchanged: {args.behind} barriers behind, sources unchanged: {seconds * 1000:7.0f} ms, "
                f"{summary.computations} computation(s), {len(summary.completed)} step(s); "
                f"ratio {ratio:.2f}   (goal <= 1.5: {verdict(ratio <= 1.5)})"
            )

            start = conn.execute("SELECT max(barrier) AS b FROM barriers").fetchone()["b"]
            marks = bench.tick(args.behind, ingest_every=10)
            seconds, summary = bench.run_job()
            anchors = bench.anchors_in(start, marks[-1])
            budget = (anchors + 1) * baseline * 1.2
            print(
                f"changes: {args.behind} barriers behind, a batch every 10, {anchors} anchor(s) in range: "
                f"{summary.computations} computation(s) (goal <= {anchors + 1}: "
                f"{verdict(summary.computations <= anchors + 1)}), {seconds * 1000:.0f} ms "
                f"(goal <= {budget * 1000:.0f} ms: {verdict(seconds <= budget)}); ratio to (anchors+1) x baseline "
                f"{seconds / ((anchors + 1) * baseline):.2f}; output = full recompute: {bench.equals_recompute()}"
            )

            start = marks[-1]
            marks = bench.tick(args.batch_barriers, ingest_every=10)
            seconds, summary = bench.run_job()
            anchors = bench.anchors_in(start, marks[-1])
            exact = bench.equals_recompute()
            print(
                f"hourly batch (--once after {args.batch_barriers} barriers, {anchors} anchor(s) passed): "
                f"{summary.computations} computation(s) (goal <= {anchors + 1}: "
                f"{verdict(summary.computations <= anchors + 1)}), "
                f"{seconds:.1f} s, {seconds / baseline:.1f}x one barrier; "
                f"output = full recompute at barrier {summary.completed[-1]}: {exact}",
                flush=True,
            )
        spark.stop()
    return {
        "baseline_s": baseline,
        "batch_computations": summary.computations,
        "batch_s": seconds,
        "batch_exact": exact,
    }


if __name__ == "__main__":
    raise SystemExit(main())
