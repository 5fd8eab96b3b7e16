"""The lake maintains itself: a pipeline at 1-s barriers stays as fast as at its first minute.

    python benchmarks/maintenance.py [--dsn DSN] [--minutes 60] [--runs 3] [--plot docs/maintenance.png]

A three-table pipeline (``ingest`` -> ``a``, ``enrich`` a -> ``b``, ``report`` b -> ``c``), each
job appending one row per barrier through PyIceberg (one snapshot, one small data file per
table per barrier), a barrier a second for ``--minutes`` minutes (if the commits take longer than
a second, the barriers come as fast as they can: the marks count barriers, not seconds). Twice:
with ``icebarrier maintain`` running beside it (default policies), and without (then the
barriers come back to back: nothing in the lake depends on the clock without maintenance, so
the same number of commits compressed gives the same curves sooner). Over minute 1 and over
the last minute, per table: the largest metadata file and the most data files in the current
snapshot after any barrier of the minute (compaction makes the file count a sawtooth: one
moment of it says nothing), the commit p50 (one job's append and completion) and the
pinned-load p50 (loads through ``icebarrier serve`` at ``read-committed``, at the minute's
middle and end). Goal: with
maintenance, last minute ÷ minute 1 <= 1.2 for each (the worst table counts). The service's CPU
share: its process tree's CPU seconds ÷ (wall seconds × cores). ``--plot`` draws both curves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalog import session, start  # noqa: E402
from proc import child_run, tree_cpu_s  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.apps.embedded import CLI  # noqa: E402
from icebarrier.control_plane import barriers, db, jobs, tokens  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402
from icebarrier.iceberg_ext.catalog import load_catalog, load_table, upgrade  # noqa: E402
from icebarrier.iceberg_ext.commits import BarrierCommit  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402

TABLES = ("a", "b", "c")
JOBS = {"ingest": (None, "a"), "enrich": ("a", "b"), "report": ("b", "c")}
MEASURES = ("metadata_kib", "data_files", "commit_ms", "load_ms")
SAMPLE_EVERY = 30  # barriers between samples of the curves
LOADS = 15  # pinned loads per table per sample


class Pipeline:
    def __init__(self, conn, settings: Settings) -> None:
        import pyarrow as pa

        self.conn, self.catalog = conn, load_catalog(settings)
        self.catalog.create_namespace("bench")
        self.schema = pa.schema([pa.field("n", pa.int64(), nullable=False), pa.field("at", pa.int64())])
        self.names = {t: TableName.parse(f"lake.bench.{t}") for t in TABLES}
        for t in TABLES:
            self.catalog.create_table(f"bench.{t}", schema=self.schema)
        for job, (source, sink) in JOBS.items():
            jobs.register(
                conn,
                JobDefinition(
                    name=job,
                    sources=frozenset([self.names[source]]) if source else frozenset(),
                    sinks=frozenset([self.names[sink]]),
                    external_inputs=frozenset() if source else frozenset(["clock"]),
                ),
            )
        self.commit_ms: dict[str, list[float]] = {t: [] for t in TABLES}
        self.sizes: dict[str, list[tuple[float, int]]] = {t: [] for t in TABLES}  # after each barrier

    def barrier(self, n: int) -> int:
        """One barrier: each job appends one row to its table and completes it."""
        import pyarrow as pa

        b = barriers.issue(self.conn).barrier
        for job, (_, sink) in JOBS.items():
            started = time.perf_counter()
            with BarrierCommit(self.conn, self.catalog, job=job, barrier=b) as tx:
                tx.append_arrow(self.names[sink], pa.table({"n": [n], "at": [b]}, schema=self.schema))
            self.commit_ms[sink].append((time.perf_counter() - started) * 1000)
            tbl = load_table(self.catalog, self.names[sink])
            snap = tbl.current_snapshot()
            self.sizes[sink].append(
                (
                    len(tbl.io.new_input(tbl.metadata_location)) / 1024,
                    int(snap.summary["total-data-files"]) if snap else 0,
                )
            )
        return b

    def loads(self, http, uri: str) -> dict[str, list[float]]:
        """:data:`LOADS` pinned loads of each table now, in ms."""
        out = {}
        for t in TABLES:
            out[t] = []
            for _ in range(LOADS):
                started = time.perf_counter()
                r = http.get(f"{uri}/v1/read-committed/namespaces/bench/tables/{t}")
                out[t].append((time.perf_counter() - started) * 1000)
                if r.status_code != 200:
                    raise SystemExit(f"load of {t} failed: {r.status_code} {r.text[:300]}")
        return out

    def minute(self, upto: int, loads: list[dict[str, list[float]]]) -> dict[str, dict[str, float]]:
        """Each table's measures over the 60 barriers up to barrier ``upto`` (``loads``: the
        load samples taken in them)."""
        return {
            t: {
                "metadata_kib": max(kib for kib, _ in self.sizes[t][upto - 60 : upto]),
                "data_files": max(files for _, files in self.sizes[t][upto - 60 : upto]),
                "commit_ms": statistics.median(self.commit_ms[t][upto - 60 : upto]),
                "load_ms": statistics.median(x for sample in loads for x in sample[t]),
            }
            for t in TABLES
        }


def one_variant(args, maintained: bool) -> dict:
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory(prefix="icebarrier-maint-") as warehouse:
        settings = Settings(dsn=dsn, warehouse=warehouse).validated()
        upgrade(settings)  # what `icebarrier db upgrade` does before a server starts
        server, uri = start(settings)
        service = None
        try:
            with db.connect(dsn) as conn:
                pipe = Pipeline(conn, settings)
                http = session(uri, *tokens.create(conn, whole_lake=True))
                env = {**os.environ, "ICEBARRIER_DSN": dsn, "ICEBARRIER_WAREHOUSE": warehouse}
                if maintained:
                    service = subprocess.Popen(
                        [*CLI, "maintain", "--every", "1s"],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=open(Path(warehouse) / "maintain.log", "w"),  # noqa: SIM115 - closed with the process
                    )
                total = int(args.minutes * 60)
                curve, samples = [], {}
                started = time.monotonic()
                for n in range(1, total + 1):
                    due = started + n - 1
                    if maintained and (wait := due - time.monotonic()) > 0:
                        time.sleep(wait)
                    pipe.barrier(n)
                    if n % SAMPLE_EVERY == 0 or n in (30, 60, total - 30, total):
                        samples[n] = pipe.loads(http, uri)
                        now = pipe.minute(n, [samples[n]]) if n >= 60 else None
                        if now is not None:
                            curve.append({"barrier": n, **{m: max(s[m] for s in now.values()) for m in MEASURES}})
                marks = {
                    60: pipe.minute(60, [samples[30], samples[60]]),
                    total: pipe.minute(total, [samples[total - 30], samples[total]]),
                }
                wall_s = time.monotonic() - started
                cpu = tree_cpu_s(service.pid) if service else 0.0
        finally:
            if service is not None:
                service.terminate()
                service.wait(60)
            server.terminate()
            server.wait(30)
        return {
            "first": marks[60],
            "last": marks[total],
            "curve": curve,
            "wall_s": wall_s,
            "minutes": args.minutes,
            "cpu_share": cpu / (wall_s * os.cpu_count()),
        }


def ratios(variant: dict) -> dict[str, float]:
    """Last minute ÷ minute 1 per measure, the worst table's."""
    return {m: max(variant["last"][t][m] / max(variant["first"][t][m], 1e-9) for t in TABLES) for m in MEASURES}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--minutes", type=float, default=60, help="how long the pipeline runs (>= 1)")
    parser.add_argument(
        "--without-minutes",
        type=float,
        default=15,
        help="how long the variant without maintenance runs, at most --minutes (its commits grow to seconds: "
        "60 minutes of them take hours; 15 show the slope)",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--plot", help="draw the curves of the first run into this PNG")
    parser.add_argument("--one", choices=("with", "without"), help=argparse.SUPPRESS)  # a child: one variant
    args = parser.parse_args()
    if args.minutes < 1:
        raise SystemExit("--minutes must be at least 1 (the first mark is minute 1)")
    if args.one:
        print(json.dumps(one_variant(args, args.one == "with")))
        return 0
    runs = []
    for i in range(args.runs):
        run = {}
        for variant in ("with", "without"):
            print(
                f"run {i + 1} of {args.runs}: {variant} maintenance, "
                f"{args.minutes if variant == 'with' else min(args.minutes, args.without_minutes):g} min …",
                file=sys.stderr,
                flush=True,
            )
            minutes = args.minutes if variant == "with" else min(args.minutes, args.without_minutes)
            run[variant] = child_run([__file__, "--dsn", args.dsn, "--minutes", str(minutes), "--one", variant])
        runs.append(run)
    report(runs, args.minutes)
    if args.plot:
        plot(runs[0], args.plot)
    return 0


def report(runs: list[dict], minutes: float) -> None:
    worst_first = sorted(runs, key=lambda r: -max(ratios(r["with"]).values()))
    for i, run in enumerate(worst_first, 1):
        last, last_without = (f"min {run[v]['minutes']:g}" for v in ("with", "without"))
        print(f"run {i} (the worst table per measure):")
        print(
            f"  {'measure':14} {'with: min 1':>12} {last:>9} {'ratio':>6}   "
            f"{'without: min 1':>15} {last_without:>9} {'ratio':>6}"
        )
        for m in MEASURES:
            cells = []
            for variant in ("with", "without"):
                v = run[variant]
                first = max(v["first"][t][m] for t in TABLES)
                final = max(v["last"][t][m] for t in TABLES)
                cells.append(f"{first:12.1f} {final:9.1f} {ratios(v)[m]:6.2f}")
            print(f"  {m:14} {cells[0]}   {cells[1]:>32}")
        share = run["with"]["cpu_share"]
        print(
            f"  goal: with maintenance, min {minutes:g} ÷ min 1 <= 1.2 for each: worst {max(ratios(run['with']).values()):.2f}; "
            f"the service's CPU share {share:.1%} of {os.cpu_count()} cores; "
            f"wall {run['with']['wall_s']:.0f} s with, {run['without']['wall_s']:.0f} s without"
        )


def plot(run: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MEASURES), figsize=(16, 3.6))
    titles = {
        "metadata_kib": "metadata file (KiB)",
        "data_files": "data files",
        "commit_ms": "commit p50 (ms)",
        "load_ms": "pinned load p50 (ms)",
    }
    for ax, m in zip(axes, MEASURES, strict=True):
        for variant, style in (("with", "-"), ("without", "--")):
            xs = [p["barrier"] / 60 for p in run[variant]["curve"]]
            ax.plot(xs, [p[m] for p in run[variant]["curve"]], style, label=f"{variant} maintenance")
        ax.set_title(titles[m])
        ax.set_xlabel("minutes at 1-s barriers")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    raise SystemExit(main())
