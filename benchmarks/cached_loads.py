"""Cached loads (``ETag``, ``If-None-Match``, ``304``) as Iceberg 1.12's Spark client and a plain
HTTP client meet them, in the same run (issue 69).

    python benchmarks/cached_loads.py [--queries 50] [--loads 2000] [--runs 3]

A managed table of 100 snapshots (one barrier each, a job completing them), ``icebarrier serve``:

- **Spark** (local, the Iceberg 1.12 runtime, configured as ``icebarrier connect --engine spark``
  prints) queries the table ``--queries`` times through ``read-committed`` while nothing commits:
  the share of its loads answered 304 (from the server's ``/metrics``);
- **a plain client** loads the table through ``read-committed`` ``--loads`` times on one
  keep-alive connection, alternately with the current tag and without one: load p50 with 304 ÷
  without (the time until the answer is read).

Runs worst first. A scratch database and warehouse; removed afterwards.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalog import session, start  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, jobs, tokens  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER, load_catalog, upgrade  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402

TABLE = TableName.parse("lake.bench.orders")


def build(settings: Settings, snapshots: int) -> None:
    catalog = load_catalog(settings)
    catalog.create_namespace_if_not_exists("bench")
    table = catalog.create_table("bench.orders", schema=pa.schema([("id", pa.int64())]))
    with db.connect(settings.dsn, settings.schema) as conn:
        jobs.register(conn, JobDefinition(name="writer", sinks=frozenset([TABLE]), external_inputs=frozenset(["x"])))
        for i in range(snapshots):
            b = barriers.issue(conn).barrier
            table.append(pa.table({"id": [i]}), snapshot_properties={SUMMARY_BARRIER: str(b)})
            jobs.complete(conn, "writer", b, {TABLE: table.current_snapshot().snapshot_id})


def counted(s, uri: str) -> tuple[float, float]:
    """(loads, loads answered 304) through read-committed, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {"icebarrier_catalog_load_seconds_count": 0.0, "icebarrier_catalog_loads_not_modified_total": 0.0}
    for family in text_string_to_metric_families(s.get(f"{uri}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in found and sample.labels.get("warehouse") == "read-committed":
                found[sample.name] = sample.value
    return found["icebarrier_catalog_load_seconds_count"], found["icebarrier_catalog_loads_not_modified_total"]


def one_run(args, spark) -> dict:
    from icebarrier.apps.catalog.clients import configuration

    warehouse = tempfile.mkdtemp(prefix="icebarrier-etag-")
    try:
        with scratch_database(args.dsn) as dsn:
            settings = Settings(dsn=dsn, warehouse=warehouse).validated()
            upgrade(settings)
            build(settings, 100)
            with db.connect(dsn, settings.schema) as conn:
                client_id, secret = tokens.create(conn, whole_lake=True)
            proc, uri = start(settings)
            try:
                s = session(uri, client_id, secret)
                name = f"etag_{uuid.uuid4().hex[:6]}"
                for line in configuration("spark", "read-committed", uri, f"{client_id}:{secret}", name).splitlines():
                    key, value = line.split(" ", 1)
                    if key.startswith(f"spark.sql.catalog.{name}"):
                        spark.conf.set(key, value)
                spark.sql(f"SELECT count(*) FROM {name}.bench.orders").collect()  # the first load: 200
                loads0, cached0 = counted(s, uri)
                for _ in range(args.queries):
                    spark.sql(f"SELECT count(*) FROM {name}.bench.orders").collect()
                loads1, cached1 = counted(s, uri)
                url = f"{uri}/v1/read-committed/namespaces/bench/tables/orders"
                tag = s.get(url, timeout=30).headers["ETag"]
                with_tag, without = [], []
                for i in range(args.loads):
                    headers = {"If-None-Match": tag} if i % 2 else {}
                    began = time.perf_counter()
                    r = s.get(url, headers=headers, timeout=30)
                    _ = r.content
                    (with_tag if i % 2 else without).append(time.perf_counter() - began)
                    assert r.status_code == (304 if i % 2 else 200), r.status_code
                size = len(s.get(url, timeout=30).content)
            finally:
                proc.terminate()
                proc.wait(30)
        return {
            "share": (cached1 - cached0) / (loads1 - loads0),
            "spark_loads": loads1 - loads0,
            "p50_304_ms": statistics.median(with_tag) * 1000,
            "p50_200_ms": statistics.median(without) * 1000,
            "ratio": statistics.median(with_tag) / statistics.median(without),
            "size_kb": size / 1024,
        }
    finally:
        shutil.rmtree(warehouse, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--loads", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    from icebarrier.iceberg_ext.spark import iceberg_jar

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.jars", str(iceberg_jar()))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    results = []
    try:
        for i in range(args.runs):
            print(f"run {i + 1} of {args.runs} …", flush=True)
            results.append(one_run(args, spark))
    finally:
        spark.stop()
    print(f"\n{args.queries} Spark queries through read-committed, nothing committing; worst first")
    print("run  Spark's loads answered 304  plain load p50: 304 / 200 (answer size)  304 ÷ 200")
    for i, r in enumerate(sorted(results, key=lambda r: (r["share"], -r["ratio"]))):
        print(
            f"{i + 1:>3}  {r['share'] * 100:5.1f}% of {r['spark_loads']:.0f}"
            f"{'':14}{r['p50_304_ms']:.2f} / {r['p50_200_ms']:.2f} ms ({r['size_kb']:.0f} KB)"
            f"{'':8}{r['ratio']:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
