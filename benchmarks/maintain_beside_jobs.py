"""Maintenance beside a pipeline never breaks it, and keeps every table flat (issue 48).

    python benchmarks/maintain_beside_jobs.py --mode exec|spark|schedule|unmanaged [--minutes 30] [--runs 3]

One managed table ``lake.d.t``, a barrier every second from this driver, ``icebarrier serve`` and
``icebarrier maintain`` at its defaults, and the table's writer:

- ``exec``: a plain PyIceberg script (benchmarks/engines/append_one.py: load the table, append one
  row) under ``icebarrier job exec w --follow``;
- ``spark``: a Spark runtime root job (benchmarks/engines/spark_append_job.py) under
  ``icebarrier run FILE --follow``;
- ``schedule``: the script of ``exec`` registered as the job's command, run ``--once`` by
  ``icebarrier schedule`` for a target lag of 5 s.

The writer runs under a supervisor that restarts it when it exits and counts each exit (goal 0).
Printed per run: barriers issued; computations (runs that published) and barriers completed
(coalesced ones included) ÷ issued; compactions and manifest rewrites done, and given way;
last minute ÷ minute 2 of the metadata file's size (its largest), the load p50 (loads of
``latest`` through the server, five a second) and the append p50 (the writer's own: the script's
append; Spark's commit time from the job's log) — goal <= 1.2 each. And the files under the table
(issue 67): the files under ``metadata/`` and ``data/``, counted every 5 s (compaction's cycle
is ~40 s, so a count at each minute's end alone samples a sawtooth at random), each minute's mean
and peak, and the snapshots the table keeps (also every 5 s) beside the writer's commits of each
minute; the mean count over the last 10 minutes ÷ the mean over the 10 before, for each folder
(goal <= 1.1; runs shorter than 20 minutes compare their two last halves). ``--verbose`` prints each minute as it ends.

``unmanaged``: a table no job writes, created through ``serve`` and appended 1,000 times by a
PyIceberg client through ``latest`` with the service running: appends 951–1,000 ÷ 51–100 for
the append p50 and the load p50, and the metadata file at 1,000 ÷ at 100 (goal <= 1.2 each).

Runs worst first. A scratch database and warehouse; removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalog import session, start  # noqa: E402
from proc import child_run  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.apps.embedded import CLI  # noqa: E402
from icebarrier.control_plane import barriers, db, jobs, targets, tokens, upkeep  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName, parse_duration_s  # noqa: E402
from icebarrier.iceberg_ext.catalog import load_catalog, upgrade  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402

ENGINES = Path(__file__).resolve().parent / "engines"
TABLE = TableName.parse("lake.d.t")
LOADS_PER_S = 5
FILES_EVERY_S = 5  # how often the files under the table are counted (compaction's cycle is ~40 s)


def _schema():
    import pyarrow as pa

    return pa.schema([pa.field("n", pa.int64(), nullable=False), pa.field("at", pa.int64())])


class Supervisor:
    """Runs ``command`` until stopped, restarting it when it exits; counts the exits."""

    def __init__(self, command: list[str], env: dict, log: Path) -> None:
        self.command, self.env, self.log = command, env, log
        self.exits: list[tuple[int, str]] = []
        self.stopping = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            with open(self.log, "a") as out:
                self.proc = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=out, start_new_session=True)
            code = self.proc.wait()
            if self.stopping.is_set():
                return
            lines = self.log.read_text().splitlines()
            self.exits.append((code, next((ln for ln in reversed(lines) if ln.startswith("error")), "")))
            time.sleep(1)

    def stop(self) -> None:
        import signal

        self.stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.thread.join(60)


def metadata_kib(conn, settings: Settings, table: TableName) -> float:
    location = conn.execute(
        f'SELECT metadata_location FROM "{settings.catalog_schema}".iceberg_tables '
        "WHERE table_namespace = %s AND table_name = %s",
        (".".join(table.namespace), table.name),
    ).fetchone()["metadata_location"]
    return (
        os.path.getsize(urlparse(location).path if "://" in location or location.startswith("file:") else location)
        / 1024
    )


def _files_under(table_dir: Path) -> dict[str, int]:
    """How many files the table holds under ``metadata/`` and ``data/`` (Hadoop's checksum files
    beside Spark's files included: they are files an operator pays for too)."""
    return {part: sum(len(names) for _, _, names in os.walk(table_dir / part)) for part in ("metadata", "data")}


def _minute_of(samples: list[dict[str, int]]) -> dict[str, float]:
    """A minute's files under the table from its samples: each folder's mean (what the minute held,
    the figure compared) and its peak (``<folder>_max``)."""
    out: dict[str, float] = {}
    for part in ("metadata", "data", "snapshots"):
        out[part] = statistics.mean(s[part] for s in samples)
        out[f"{part}_max"] = max(s[part] for s in samples)
    return out


def _files_ratios(files: list[dict[str, float]]) -> dict[str, float]:
    """For each folder, the mean count over the last 10 minutes ÷ the mean over the 10 before
    (halves of the last 2w minutes, w = min(10, minutes // 2))."""
    w = min(10, len(files) // 2)
    last, before = files[-w:], files[-2 * w : -w]
    return {
        part: statistics.mean(m[part] for m in last) / max(statistics.mean(m[part] for m in before), 1)
        for part in ("metadata", "data")
    }


def managed(args) -> dict:
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory(prefix="icebarrier-beside-") as warehouse:
        settings = Settings(dsn=dsn, warehouse=warehouse).validated()
        upgrade(settings)  # what `icebarrier db upgrade` does: the catalog announces its pointers too
        logs = Path(warehouse) / "logs"
        logs.mkdir()
        env = {**os.environ, "ICEBARRIER_DSN": dsn, "ICEBARRIER_WAREHOUSE": warehouse}
        catalog = load_catalog(settings)
        catalog.create_namespace("d")
        table_dir = Path(urlparse(catalog.create_table("d.t", schema=_schema()).metadata.location).path)
        files: list[dict[str, int]] = []
        server, uri = start(settings)
        writer = service = None
        times = Path(warehouse) / "times.jsonl"
        try:
            with db.connect(dsn) as conn:
                barriers.set_interval_s(conn, 3600)  # this driver issues them, one a second
                jobs.register(conn, JobDefinition(name="w", sinks=frozenset([TABLE]), external_inputs=frozenset(["x"])))
                credential = ":".join(tokens.create(conn, job="w", whole_lake=True))
                script = [sys.executable, str(ENGINES / "append_one.py"), "d.t", str(times)]
                if args.mode == "exec":
                    command = [*CLI, "job", "exec", "w", "--follow", "--no-skip", "--catalog-uri", uri]
                    command += ["--credential", credential, "--", *script]
                elif args.mode == "spark":
                    env.update(BENCH_JOB="w", BENCH_TABLE=str(TABLE))
                    command = [*CLI, "run", str(ENGINES / "spark_append_job.py"), "--follow"]
                else:
                    targets.set_runner(conn, "w", targets.Runner(kind="command", spec=" ".join(script)))
                    targets.set_target_lag(conn, TABLE, 5.0)
                    admin = ":".join(tokens.create(conn, admin=True, name="schedule"))
                    command = [*CLI, "schedule", "--no-barriers", "--catalog-uri", uri, "--credential", admin]
                service = subprocess.Popen(
                    [*CLI, "maintain"], env=env, stdout=open(logs / "maintain.log", "w"), stderr=subprocess.STDOUT
                )
                barriers.issue(conn)
                writer = Supervisor(command, env, logs / "writer.log")
                http = session(uri, *tokens.create(conn, whole_lake=True))
                total = int(args.minutes * 60)
                per_s: list[dict] = []
                samples: list[dict[str, int]] = []  # this minute's counts of the files under the table
                started = time.monotonic()
                issued = 1
                for second in range(total):
                    barriers.issue(conn)
                    issued += 1
                    loads = []
                    for _ in range(LOADS_PER_S):
                        t0 = time.perf_counter()
                        r = http.get(f"{uri}/v1/latest/namespaces/d/tables/t")
                        loads.append((time.perf_counter() - t0) * 1000)
                        if r.status_code != 200:
                            raise SystemExit(f"load failed: {r.status_code} {r.text[:300]}")
                    per_s.append({"loads": loads, "kib": metadata_kib(conn, settings, TABLE)})
                    if second % FILES_EVERY_S == FILES_EVERY_S - 1:
                        snapshots = len(catalog.load_table("d.t").metadata.snapshots)
                        samples.append({**_files_under(table_dir), "snapshots": snapshots})
                    if second % 60 == 59:  # the minute's files under the table: their mean and peak
                        files.append(_minute_of(samples))
                        samples = []
                        if args.verbose:
                            print(f"minute {len(files)}: {files[-1]}", file=sys.stderr, flush=True)
                    if (wait := started + second + 1 - time.monotonic()) > 0:
                        time.sleep(wait)
                newest = barriers.newest(conn).barrier
                deadline = time.monotonic() + 120  # the writer catches up with the last barrier
                while jobs.show(conn, "w").progress != newest and time.monotonic() < deadline:
                    time.sleep(0.5)
                progress = jobs.show(conn, "w").progress
                completed = conn.execute(
                    "SELECT count(*) AS n FROM barrier WHERE barrier <= %s", (progress or 0,)
                ).fetchone()["n"]
                commits = [
                    r["at"]
                    for r in conn.execute(
                        "SELECT extract(epoch FROM recorded_at)::float8 AS at FROM table_commits "
                        "WHERE operation = 'data' ORDER BY commit_id"
                    )
                ]
                computations = len(commits)
                wall_start = time.time() - (time.monotonic() - started)  # the epoch time of second 0
                for m, f in enumerate(files):  # the writer's commits in each minute: what the snapshots follow
                    f["commits"] = sum(1 for at in commits if m * 60 <= at - wall_start < (m + 1) * 60)
                actions = upkeep.statuses(conn, [TABLE])[0].actions
                failed_runs = (
                    conn.execute("SELECT count(*) AS n FROM schedule_run WHERE exit_code <> 0").fetchone()["n"]
                    if args.mode == "schedule"
                    else 0
                )
        finally:
            if writer is not None:
                writer.stop()
            if service is not None:
                service.terminate()
                service.wait(60)
            server.terminate()
            server.wait(30)
            log_tail = (logs / "writer.log").read_text()[-2000:] if (logs / "writer.log").exists() else ""
            if args.logs:
                kept = Path(args.logs) / f"run-{os.getpid()}"
                shutil.copytree(logs, kept)
                if times.exists():  # the writer's own times, to look at a run again
                    shutil.copy(times, kept)
        appends = _appends(args.mode, times, logs / "writer.log", wall_start, commits)

        def minute(m: int) -> dict:
            window = per_s[(m - 1) * 60 : m * 60]
            in_window = [ms for at, ms in appends if (m - 1) * 60 <= at < m * 60]
            return {
                "metadata_kib": max(s["kib"] for s in window),
                "load_ms": statistics.median(x for s in window for x in s["loads"]),
                "append_ms": statistics.median(in_window) if in_window else float("nan"),
            }

        last = total // 60
        return {
            "issued": issued,
            "completed": completed,
            "computations": computations,
            "exits": writer.exits + [(1, "a scheduled run failed")] * failed_runs,
            "compact": {k: actions.get("compact", {}).get(k, 0) for k in ("done", "gave_way", "failed")},
            "rewrite_manifests": {
                k: actions.get("rewrite-manifests", {}).get(k, 0) for k in ("done", "gave_way", "failed")
            },
            "minute_2": minute(2),
            "last": minute(last),
            "last_minute": last,
            "files": files,
            "log_tail": log_tail,
        }


def _appends(mode: str, times: Path, log: Path, wall_start: float, commits: list[float]) -> list[tuple[float, float]]:
    """(seconds since the start, the writer's append ms) of each of its commits: the script's own
    timing, or for Spark the runtime's line per computed barrier (its read, write and record), in
    the order of the commits the control plane recorded (``commits``: their epoch times)."""
    if mode != "spark":
        rows = [json.loads(line) for line in times.read_text().splitlines()] if times.exists() else []
        return [(r["at"] - wall_start, r["append_ms"]) for r in rows]
    took = [
        parse_duration_s(line.rsplit(" in ", 1)[1].split(" ", 1)[0]) * 1000
        for line in log.read_text().splitlines()
        if line.startswith("job w: barrier") and (" completed in " in line or " coalesced from " in line)
    ]
    return [(at - wall_start, ms) for at, ms in zip(commits, took, strict=False)]


def unmanaged(args) -> dict:
    import pyarrow as pa

    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory(prefix="icebarrier-free-") as warehouse:
        settings = Settings(dsn=dsn, warehouse=warehouse).validated()
        upgrade(settings)
        env = {**os.environ, "ICEBARRIER_DSN": dsn, "ICEBARRIER_WAREHOUSE": warehouse}
        server, uri = start(settings)
        service = None
        try:
            with db.connect(dsn) as conn:
                jobs.register(
                    conn, JobDefinition(name="other", sinks=frozenset([TABLE]), external_inputs=frozenset(["x"]))
                )
                client_id, secret = tokens.create(conn, job="other", whole_lake=True)
                service = subprocess.Popen(
                    [*CLI, "maintain"],
                    env=env,
                    stdout=open(Path(warehouse) / "maintain.log", "w"),
                    stderr=subprocess.STDOUT,
                )
                from pyiceberg.catalog.rest import RestCatalog

                rest = RestCatalog(
                    "bench",
                    uri=uri,
                    warehouse="latest",
                    credential=f"{client_id}:{secret}",
                    **{"oauth2-server-uri": f"{uri}/v1/oauth/tokens"},
                )
                rest.create_namespace("free")
                table = rest.create_table("free.t", schema=_schema())
                free = TableName.parse("lake.free.t")
                append_ms, load_ms, kib = [], [], {}
                for n in range(1, args.appends + 1):
                    t0 = time.perf_counter()
                    table = rest.load_table("free.t")
                    t1 = time.perf_counter()
                    table.append(pa.table({"n": [n], "at": [n]}, schema=_schema()))
                    append_ms.append((time.perf_counter() - t1) * 1000)
                    load_ms.append((t1 - t0) * 1000)
                    if n in (100, args.appends):
                        kib[n] = metadata_kib(conn, settings, free)
                    time.sleep(args.pause)
                rows = table.scan().to_arrow().num_rows
                actions = upkeep.statuses(conn, [free])[0].actions
        finally:
            if service is not None:
                service.terminate()
                service.wait(60)
            server.terminate()
            server.wait(30)
        last = args.appends
        return {
            "rows": rows,
            "appends": last,
            "append_ms": (statistics.median(append_ms[50:100]), statistics.median(append_ms[last - 50 : last])),
            "load_ms": (statistics.median(load_ms[50:100]), statistics.median(load_ms[last - 50 : last])),
            "metadata_kib": (kib[100], kib[last]),
            "actions": {a: {k: v.get(k, 0) for k in ("done", "gave_way", "failed")} for a, v in actions.items()},
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("exec", "spark", "schedule", "unmanaged"), required=True)
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--minutes", type=float, default=30, help="how long the pipeline runs (>= 3)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--appends", type=int, default=1000, help="unmanaged: appends (>= 200)")
    parser.add_argument("--pause", type=float, default=0.2, help="unmanaged: seconds between appends")
    parser.add_argument("--verbose", action="store_true", help="the files under the table at each minute, as it goes")
    parser.add_argument("--logs", help="keep each run's service and writer logs and the writer's times in this folder")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(unmanaged(args) if args.mode == "unmanaged" else managed(args)))
        return 0
    if args.mode != "unmanaged" and args.minutes < 3:
        raise SystemExit("--minutes must be at least 3 (minute 2 is the baseline)")
    results = []
    for i in range(args.runs):
        print(f"run {i + 1} of {args.runs}: {args.mode} …", file=sys.stderr, flush=True)
        results.append(child_run([__file__, *sys.argv[1:], "--one"]))
    (report_unmanaged if args.mode == "unmanaged" else report_managed)(results, args)
    return 0


def _ratios(r: dict) -> dict[str, float]:
    return {m: r["last"][m] / r["minute_2"][m] for m in ("metadata_kib", "load_ms", "append_ms")}


def report_managed(results: list[dict], args) -> None:
    def worst(r: dict) -> tuple:
        return (-len(r["exits"]), -max(*_ratios(r).values(), *_files_ratios(r["files"]).values()))

    for i, r in enumerate(sorted(results, key=worst), 1):
        ratios = _ratios(r)
        print(
            f"run {i}: {args.mode}, {args.minutes:g} min: {r['issued']} barriers issued; completed "
            f"{r['completed'] / r['issued']:.3f}, computations {r['computations'] / r['issued']:.3f} of them; "
            f"writer exits {len(r['exits'])}{': ' + r['exits'][0][1] if r['exits'] else ''}; "
            f"compactions {r['compact']['done']} done, {r['compact']['gave_way']} gave way, {r['compact']['failed']} "
            f"failed; manifest rewrites {r['rewrite_manifests']['done']} done"
        )
        for m, ratio in ratios.items():
            print(
                f"  {m:13} min 2 {r['minute_2'][m]:8.2f}  min {r['last_minute']} {r['last'][m]:8.2f}  ratio {ratio:.2f}"
            )
        print(
            f"  goal: exits 0, each ratio <= 1.2: {'met' if not r['exits'] and max(ratios.values()) <= 1.2 else 'MISSED'}"
        )
        files = r["files"]
        for m in range(0, len(files), 5):
            print(
                "  "
                + "  ".join(
                    f"min {i + 1}: {f['metadata']:.0f}/{f['data']:.0f}/{f['snapshots']:.0f}/{f['commits']}"
                    for i, f in enumerate(files[m : m + 5], m)
                )
            )
        growth = _files_ratios(files)
        w = min(10, len(files) // 2)
        print(
            f"  files (metadata/data/snapshots kept: each minute's mean; /the minute's commits): last {w} min ÷ the {w} before: "
            f"metadata {growth['metadata']:.2f}, data {growth['data']:.2f}; goal <= 1.1: "
            f"{'met' if max(growth.values()) <= 1.1 else 'MISSED'}"
        )


def report_unmanaged(results: list[dict], args) -> None:
    def worst(r):
        return max(r[m][1] / r[m][0] for m in ("append_ms", "load_ms", "metadata_kib"))

    for i, r in enumerate(sorted(results, key=lambda r: -worst(r)), 1):
        print(f"run {i}: unmanaged table, {r['appends']} appends ({r['rows']} rows); the service: {r['actions']}")
        for m in ("append_ms", "load_ms", "metadata_kib"):
            first, last = r[m]
            print(f"  {m:13} at 100 {first:8.2f}  at {r['appends']} {last:8.2f}  ratio {last / first:.2f}")
        print(f"  goal: each ratio <= 1.2: {'met' if worst(r) <= 1.2 else 'MISSED'}")


if __name__ == "__main__":
    raise SystemExit(main())
