"""A plan of a table of 1,000,000 data files completes in bounded server memory (issue 69).

    python benchmarks/plan_million_files.py [--files 1000000] [--per-commit 10000] [--runs 3]

One table ``bench.wide`` partitioned by ``part`` (1,000 partitions), whose data files are only
listed: ``--files`` entries committed ``--per-commit`` at a time (one manifest a commit) by
PyIceberg's fast append, each naming a Parquet file that is never written (planning reads
manifests, never data files). Then, through ``icebarrier serve`` (one process), a plan of the
whole table over HTTP, its plan tasks followed one after the other as a client does, while the
server's RSS is sampled every 50 ms; and the same plan again (every manifest in the cache, or as
much as its bound keeps).

Printed per run: the files planned (goal: all of them), the plan tasks, the first and the second
plan's time, and the server's RSS before the plan, its peak during each, and after (goal: the
peak within the manifest cache's bound of what it was before).

Runs worst first (the highest peak). A scratch database and warehouse; removed afterwards.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalog import session, start  # noqa: E402
from proc import tree_rss_mb  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import db, tokens  # noqa: E402
from icebarrier.iceberg_ext.catalog import load_catalog, upgrade  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402

NAME = "bench.wide"
PARTITIONS = 1000


def build(settings: Settings, files: int, per_commit: int) -> None:
    """The table, its ``files`` data files listed ``per_commit`` to a commit."""
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.schema import Schema
    from pyiceberg.transforms import IdentityTransform
    from pyiceberg.typedef import Record
    from pyiceberg.types import IntegerType, LongType, NestedField

    schema = Schema(
        NestedField(1, "id", LongType(), required=False), NestedField(2, "part", IntegerType(), required=False)
    )
    spec = PartitionSpec(PartitionField(source_id=2, field_id=1000, transform=IdentityTransform(), name="part"))
    catalog = load_catalog(settings)
    catalog.create_namespace_if_not_exists("bench")
    table = catalog.create_table(NAME, schema=schema, partition_spec=spec)
    for start_at in range(0, files, per_commit):
        with table.transaction() as tx, tx.update_snapshot().fast_append() as append:
            for i in range(start_at, min(files, start_at + per_commit)):
                part = i % PARTITIONS
                append.append_data_file(
                    DataFile.from_args(
                        content=DataFileContent.DATA,
                        file_path=f"{table.location()}/data/part={part}/{i:07d}.parquet",
                        file_format=FileFormat.PARQUET,
                        partition=Record(part),
                        record_count=1,
                        file_size_in_bytes=500,
                        spec_id=0,
                    )
                )
        table = catalog.load_table(NAME)
        print(f"  {min(files, start_at + per_commit):,} of {files:,} files listed", flush=True)


class Peak:
    """The highest RSS of a process tree while it runs, sampled every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.mb, self._stop = pid, tree_rss_mb(pid), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.mb = max(self.mb, tree_rss_mb(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.mb


def planned(s: requests.Session, uri: str) -> tuple[int, int, float]:
    """A plan of the whole table over HTTP, its tasks followed one by one: (files, tasks, seconds)."""
    base = f"{uri}/v1/latest/namespaces/bench/tables/wide"
    started = time.perf_counter()
    answer = s.post(f"{base}/plan", json={}, timeout=3600).json()
    if answer.get("status") == "submitted":
        while answer.get("status") == "submitted":
            time.sleep(0.2)
            answer = s.get(f"{base}/plan/{answer['plan-id']}", timeout=3600).json()
    files, pending, tasks = len(answer.get("file-scan-tasks", [])), list(answer.get("plan-tasks", [])), 0
    while pending:
        more = s.post(f"{base}/tasks", json={"plan-task": pending.pop()}, timeout=3600).json()
        tasks += 1
        files += len(more.get("file-scan-tasks", []))
        pending += more.get("plan-tasks", [])
    return files, tasks, time.perf_counter() - started


def one_run(args) -> dict:
    warehouse = tempfile.mkdtemp(prefix="icebarrier-million-")
    try:
        with scratch_database(args.dsn) as dsn:
            settings = Settings(dsn=dsn, warehouse=warehouse).validated()
            upgrade(settings)
            started = time.perf_counter()
            build(settings, args.files, args.per_commit)
            built_s = time.perf_counter() - started
            with db.connect(dsn, settings.schema) as conn:
                client_id, secret = tokens.create(conn, whole_lake=True)
            proc, uri = start(settings)
            try:
                s = session(uri, client_id, secret)
                before = tree_rss_mb(proc.pid)
                result = {"built_s": built_s, "before_mb": before}
                for which in ("first", "second"):
                    peak = Peak(proc.pid)
                    files, tasks, seconds = planned(s, uri)
                    result[which] = {"files": files, "tasks": tasks, "s": seconds, "peak_mb": peak.stop()}
                    assert files == args.files, (which, files)
                result["after_mb"] = tree_rss_mb(proc.pid)
            finally:
                proc.terminate()
                proc.wait(30)
        return result
    finally:
        shutil.rmtree(warehouse, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--per-commit", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = []
    for i in range(args.runs):
        print(f"run {i + 1} of {args.runs} …", flush=True)
        results.append(one_run(args))
    print(f"\n{args.files:,} data files, {args.per_commit:,} a commit; one server process; worst first")
    print("run  built  files planned  tasks  first plan  second plan  RSS before  peak (first / second)  after")
    for i, r in enumerate(sorted(results, key=lambda r: -max(r["first"]["peak_mb"], r["second"]["peak_mb"]))):
        first, second = r["first"], r["second"]
        print(
            f"{i + 1:>3}  {r['built_s']:4.0f} s  {first['files']:13,}  {first['tasks']:5}  {first['s']:8.1f} s"
            f"  {second['s']:9.1f} s  {r['before_mb']:7.0f} MB  {first['peak_mb']:.0f} / {second['peak_mb']:.0f} MB"
            f"  {r['after_mb']:.0f} MB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
