"""Scan planning on the server against a client's own, in the same run (issue 69).

    python benchmarks/scan_planning.py [--partitions 200] [--commits 101] [--clients 16] [--runs 3]

One managed table ``bench.events`` partitioned by ``part`` (identity), written by one job:
``--commits`` barriers, each an append of one row to each of ``--partitions`` partitions (so
``partitions × commits`` data files, one manifest a commit), through ``icebarrier serve``.
Printed per run, as PyIceberg's caller sees it (``scan().plan_files()`` through ``latest``, a
filter selecting one partition):

- **own**: PyIceberg 0.12 planning itself (it reads the manifest list and every manifest);
- **server cold**: the first plan after the server started (no manifest kept), and **server
  warm**: the same plan again, each ÷ own (goal: warm <= 0.1);
- **incremental**: a plan between the cuts of the first and the last barrier ÷ a plan of the last
  one (both without a filter, over HTTP, their plan tasks followed);
- **plans/s** from ``--clients`` client processes on a warm cache, each plan a partition of its
  own, and the server's RSS after 1,000 distinct plans;
- **Spark**: a Spark session (Iceberg 1.12's REST client) planning the same filtered query with
  ``scan-planning-mode`` client and server, each its median of 5 (after one to warm both):
  the time to Spark's executed plan (which is when Iceberg plans the scan; the server's count
  of plans proves it did there), client ÷ server.

Runs worst first (the highest warm ratio). A scratch database and warehouse; removed afterwards.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow as pa
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalog import session, start  # noqa: E402
from proc import tree_rss_mb  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, jobs, tokens  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER, load_catalog, upgrade  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402

NAME = "bench.events"
TABLE = TableName.parse(f"lake.{NAME}")


def build(settings: Settings, partitions: int, commits: int) -> list[int]:
    """The table, ``commits`` barriers of one append each; the cut's snapshot of each barrier."""
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.schema import Schema
    from pyiceberg.transforms import IdentityTransform
    from pyiceberg.types import DoubleType, IntegerType, LongType, NestedField

    schema = Schema(
        NestedField(1, "id", LongType(), required=False),
        NestedField(2, "part", IntegerType(), required=False),
        NestedField(3, "v", DoubleType(), required=False),
    )
    spec = PartitionSpec(PartitionField(source_id=2, field_id=1000, transform=IdentityTransform(), name="part"))
    catalog = load_catalog(settings)
    catalog.create_namespace_if_not_exists("bench")
    table = catalog.create_table(NAME, schema=schema, partition_spec=spec)
    arrow = schema.as_arrow()
    cuts = []
    with db.connect(settings.dsn, settings.schema) as conn:
        jobs.register(conn, JobDefinition(name="writer", sinks=frozenset([TABLE]), external_inputs=frozenset(["x"])))
        for i in range(commits):
            b = barriers.issue(conn).barrier
            rows = pa.table(
                {
                    "id": [i * partitions + p for p in range(partitions)],
                    "part": list(range(partitions)),
                    "v": [1.0] * partitions,
                },
                schema=arrow,
            )
            table.append(rows, snapshot_properties={SUMMARY_BARRIER: str(b)})
            jobs.complete(conn, "writer", b, {TABLE: table.current_snapshot().snapshot_id})
            cuts.append(table.current_snapshot().snapshot_id)
            if (i + 1) % 20 == 0:
                print(f"  {i + 1} of {commits} commits", flush=True)
    return cuts


def rest(uri: str, credential: str, mode: str):
    from pyiceberg.catalog.rest import RestCatalog

    return RestCatalog(
        f"bench_{uuid.uuid4().hex[:6]}",
        uri=uri,
        warehouse="latest",
        credential=credential,
        **{"oauth2-server-uri": f"{uri}/v1/oauth/tokens", "scan-planning-mode": mode},
    )


def timed_plan(table, part: int) -> tuple[float, int]:
    from pyiceberg.expressions import EqualTo

    started = time.perf_counter()
    files = len(list(table.scan(row_filter=EqualTo("part", part)).plan_files()))
    return time.perf_counter() - started, files


def http_plan(s: requests.Session, uri: str, body: dict) -> int:
    """Files of a plan over HTTP, its plan tasks followed."""
    base = f"{uri}/v1/latest/namespaces/bench/tables/events"
    answer = s.post(f"{base}/plan", json=body, timeout=600).json()
    files, pending = len(answer.get("file-scan-tasks", [])), list(answer.get("plan-tasks", []))
    while pending:
        more = s.post(f"{base}/tasks", json={"plan-task": pending.pop()}, timeout=600).json()
        files += len(more.get("file-scan-tasks", []))
        pending += more.get("plan-tasks", [])
    return files


def spark_planning(settings: Settings, s: requests.Session, uri: str, credential: str) -> tuple[float, float]:
    """Seconds to Spark's executed plan of a query selecting one partition, Iceberg planning on the
    client and on the server (each the median of 5, after one to warm both)."""
    from icebarrier.apps.catalog.clients import configuration
    from icebarrier.iceberg_ext.spark import spark_session

    spark = spark_session(settings, app_name="icebarrier-plan-bench")
    try:
        timed = {}
        for mode in ("client", "server"):
            catalog = f"plan_{mode}"
            for line in configuration("spark", "latest", uri, credential, catalog).splitlines():
                key, value = line.split(" ", 1)
                if key.startswith(f"spark.sql.catalog.{catalog}"):
                    spark.conf.set(key, value)
            spark.conf.set(f"spark.sql.catalog.{catalog}.scan-planning-mode", mode)
            query = f"SELECT count(*) FROM {catalog}.{NAME} WHERE part = 7"
            plans = _plans(s, uri)
            times = []
            for _ in range(6):
                started = time.perf_counter()
                spark.sql(query)._jdf.queryExecution().executedPlan()
                times.append(time.perf_counter() - started)
            planned_here = _plans(s, uri) - plans
            assert planned_here == (6 if mode == "server" else 0), (mode, planned_here)
            timed[mode] = statistics.median(times[1:])
        return timed["client"], timed["server"]
    finally:
        spark.stop()


def _plans(s: requests.Session, uri: str) -> float:
    """The server's count of plans made through latest (``/metrics``)."""
    text = s.get(f"{uri}/metrics", timeout=60).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("icebarrier_catalog_plans_total{") and 'warehouse="latest"' in line
    )


def _client(args) -> int:
    uri, client_id, secret, parts = args
    s = session(uri, client_id, secret)
    for part in parts:
        http_plan(s, uri, {"filter": {"type": "eq", "term": "part", "value": part}})
    return len(parts)


def one_run(args) -> dict:
    warehouse = tempfile.mkdtemp(prefix="icebarrier-plan-")
    try:
        with scratch_database(args.dsn) as dsn:
            settings = Settings(dsn=dsn, warehouse=warehouse).validated()
            upgrade(settings)  # what `icebarrier db upgrade` does: the placements the server checks
            started = time.perf_counter()
            cuts = build(settings, args.partitions, args.commits)
            print(
                f"  built {args.partitions * args.commits} files in {time.perf_counter() - started:.0f} s", flush=True
            )
            with db.connect(dsn, settings.schema) as conn:
                client_id, secret = tokens.create(conn, whole_lake=True)
            proc, uri = start(settings)
            try:
                credential = f"{client_id}:{secret}"
                own_table = rest(uri, credential, "client").load_table(NAME)
                server_table = rest(uri, credential, "server").load_table(NAME)
                cold, files = timed_plan(server_table, 7)
                own = [timed_plan(own_table, 7) for _ in range(3)]
                warm = [timed_plan(server_table, 7) for _ in range(5)]
                assert {f for _, f in own} == {f for _, f in warm} == {files} == {args.commits}, (own, warm, files)
                own_s = statistics.median(t for t, _ in own)
                s = session(uri, client_id, secret)
                t0 = time.perf_counter()
                increment = http_plan(s, uri, {"start-snapshot-id": cuts[0], "end-snapshot-id": cuts[-1]})
                t1 = time.perf_counter()
                full = http_plan(s, uri, {"snapshot-id": cuts[-1]})
                t2 = time.perf_counter()
                assert increment == args.partitions * (args.commits - 1) and full == args.partitions * args.commits
                t0b = time.perf_counter()
                http_plan(s, uri, {"start-snapshot-id": cuts[0], "end-snapshot-id": cuts[-1]})
                t1b = time.perf_counter()
                http_plan(s, uri, {"snapshot-id": cuts[-1]})
                t2b = time.perf_counter()
                parts = list(range(args.partitions)) * (1000 // args.partitions + 1)
                per = [parts[i :: args.clients] for i in range(args.clients)]
                t3 = time.perf_counter()
                with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
                    done = sum(pool.map(_client, [(uri, client_id, secret, p) for p in per]))
                rate = done / (time.perf_counter() - t3)
                rss = tree_rss_mb(proc.pid)
                spark_client_s, spark_server_s = spark_planning(settings, s, uri, credential)
            finally:
                proc.terminate()
                proc.wait(30)
        return {
            "own_s": own_s,
            "cold": cold / own_s,
            "warm": statistics.median(t for t, _ in warm) / own_s,
            "warm_ms": statistics.median(t for t, _ in warm) * 1000,
            "incremental": min(t1 - t0, t1b - t0b) / min(t2 - t1, t2b - t1b),
            "plans_per_s": rate,
            "plans": done,
            "rss_mb": rss,
            "spark_client_s": spark_client_s,
            "spark_server_s": spark_server_s,
        }
    finally:
        shutil.rmtree(warehouse, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--partitions", type=int, default=200)
    parser.add_argument("--commits", type=int, default=101)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = []
    for i in range(args.runs):
        print(f"run {i + 1} of {args.runs} …", flush=True)
        results.append(one_run(args))
    print(
        f"\n{args.partitions * args.commits} data files in {args.partitions} partitions, {args.commits} commits; worst first"
    )
    print(
        "run  own plan  server cold ÷ own  warm ÷ own (goal <= 0.1)  warm  incremental ÷ full  plans/s  RSS after"
        "  Spark planning, client ÷ server"
    )
    for i, r in enumerate(sorted(results, key=lambda r: -r["warm"])):
        print(
            f"{i + 1:>3}  {r['own_s'] * 1000:7.0f} ms  {r['cold']:17.2f}  {r['warm']:24.3f}  {r['warm_ms']:4.0f} ms"
            f"  {r['incremental']:17.2f}  {r['plans_per_s']:7.1f}  {r['rss_mb']:.0f} MB ({r['plans']} plans)"
            f"  {r['spark_client_s'] * 1000:.0f} ÷ {r['spark_server_s'] * 1000:.0f} ms"
            f" = {r['spark_client_s'] / r['spark_server_s']:.2f}"
        )
    return 0 if all(r["warm"] <= 0.1 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
