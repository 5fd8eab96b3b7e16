"""Spark on object storage, end to end (moto's S3 server on 127.0.0.1): the runtime's root and SQL
jobs in processes of their own, killed with SIGKILL at random moments of their work; lease-aware
expiry and orphan removal after them; the demo; Spark reading every warehouse of `icebarrier serve`
with only the catalog URI and a token."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict

import psycopg
import pytest

from icebarrier.apps.catalog.clients import configuration
from icebarrier.control_plane import barriers, leases, reads, tables, tokens
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER, SUMMARY_RUN, lineage, load_table, summary_properties
from icebarrier.iceberg_ext.maintenance import expire
from tests.iceberg_ext.catalog_server import Pipeline, every_warehouse
from tests.iceberg_ext.test_runtime import generate, shop

pytestmark = pytest.mark.slow

ALL_JOBS = "ingest_shopping,ingest_shipments,user_item_amount,user_item_price,shipped_orders"


def worker(lake, input_dir, job_keys: str) -> subprocess.Popen:
    """`tests.iceberg_ext.runtime_worker` in a process of its own (its Spark, its JVM), on the
    test's warehouse; the S3 settings reach it through ICEBARRIER_CONFIG."""
    s = lake.settings
    args = [s.dsn, s.schema, s.warehouse, lake.namespace, str(input_dir), job_keys]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.iceberg_ext.runtime_worker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


def kill_when(proc: subprocess.Popen, marker: str, delay_s: float) -> bool:
    """SIGKILL ``proc`` ``delay_s`` after its log first shows ``marker``; False if it ended first."""
    seen = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            if marker in line:
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    while not seen.is_set() and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(delay_s)
    if proc.poll() is not None:
        return False
    proc.kill()
    proc.wait(timeout=60)
    return True


def rows_at(lake, table: TableName, snapshot_id: int) -> list[dict]:
    return load_table(lake.catalog, table).scan(snapshot_id=snapshot_id).to_arrow().to_pylist()


def test_spark_jobs_on_s3_killed_at_random_moments_write_each_barrier_once_and_lose_nothing(s3_lake, s3, tmp_path):
    """The shopping pipeline (two root jobs, two SQL jobs, a delta join) on an s3:// warehouse,
    its Spark in a process that is killed with SIGKILL at a seeded random moment of each round's
    work, then run again: every table completes every barrier, each (table, barrier) has one
    run's commits, every input row is in the cut once. Then lease-aware expiry and orphan removal
    on the bucket: what the lease and the cut use stays readable, the killed runs' files go."""
    lake, input_dir = s3_lake, tmp_path / "input"
    barriers.set_interval_s(lake.conn, 3600)  # only the barriers this test issues
    finish(worker(lake, input_dir, "tables"))
    rng, rows, killed, issued = random.Random(35), [], 0, []
    for batch in (1, 2, 3):
        rows += generate.write_batch(str(input_dir), batch, orders=25)
        issued.append(barriers.issue(lake.conn).barrier)
        victim = rng.choice(list(shop.build(lake.namespace, str(input_dir)).values())).name
        killed += kill_when(worker(lake, input_dir, ALL_JOBS), victim, rng.uniform(0, 2.5))
    assert killed >= 2  # the kills landed in the pipeline's work, not after it
    finish(worker(lake, input_dir, ALL_JOBS))

    names = [TableName.parse(t) for t in shop.tables(lake.namespace).values()]
    assert {s.watermark for s in tables.states(lake.conn, names)} == {issued[-1]}
    for table in names:
        runs_of = defaultdict(set)
        for snap in lineage(load_table(lake.catalog, table)):
            props = summary_properties(snap)
            runs_of[props.get(SUMMARY_BARRIER)].add(props.get(SUMMARY_RUN))
        assert all(len(r) == 1 for b, r in runs_of.items() if b), (table, runs_of)
    cut = reads.resolve(lake.conn, names)
    t = {k: TableName.parse(v) for k, v in shop.tables(lake.namespace).items()}
    shopping = rows_at(lake, t["shopping"], cut.snapshots[t["shopping"]])
    assert sorted(r["order_id"] for r in shopping) == sorted(r["order_id"] for r in rows)  # once each
    amounts = rows_at(lake, t["user_item_amount"], cut.snapshots[t["user_item_amount"]])
    assert sum(r["amount"] for r in amounts) == sum(r["amount"] for r in rows)

    # maintenance on the bucket after the killed runs
    shop_prefix = f"wh/{lake.namespace}/shopping/"
    first = reads.resolve(lake.conn, [t["shopping"]], barrier=issued[0])
    lease = leases.acquire(lake.conn, [t["shopping"]], ttl_s=600, holder="test", barrier=issued[0])
    expire(lake.conn, lake.catalog, t["shopping"], older_than_s=0, retain_last=1)
    assert rows_at(lake, t["shopping"], first.snapshots[t["shopping"]])  # the lease's snapshot survives
    before = s3.keys(f"wh/{lake.namespace}/")
    done = subprocess.run(
        [f"{os.path.dirname(sys.executable)}/icebarrier", "--output", "json", "remove-orphans", "--older-than", "0s"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    removed = {path for report in json.loads(done.stdout) for path in report["orphans"]}
    after = s3.keys(f"wh/{lake.namespace}/")
    assert after == {k for k in before if f"s3://{s3.bucket}/{k}" not in removed}
    cut = reads.resolve(lake.conn, names)
    for table in names:  # every table of the newest cut still reads, every file it needs is there
        rows_at(lake, table, cut.snapshots[table])
    assert rows_at(lake, t["shopping"], first.snapshots[t["shopping"]])
    assert any(k.startswith(shop_prefix) for k in after)
    leases.release(lake.conn, lease.lease_id)


def test_the_demo_runs_on_s3(pg_server, s3, tmp_path):
    """`icebarrier demo --warehouse s3://…` with the [storage] settings of icebarrier.toml: both
    scenarios on Spark, anomalies only at read-uncommitted, every table's files in the bucket."""
    config = tmp_path / "icebarrier.toml"
    config.write_text(s3.storage_toml())
    prefix = f"demo-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, "-m", "icebarrier.cli.main", "--dsn", pg_server, "--output", "json"]
        + ["demo", "--rounds", "3", "--keep", "--warehouse", f"s3://{s3.bucket}/{prefix}"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ICEBARRIER_CONFIG": str(config)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    try:
        for result in out["results"]:
            levels = result["levels"]
            assert levels["read-committed"]["anomalies"] == 0 and levels["read-committed"]["queries"] > 0
            assert levels["repeatable-read"]["anomalies"] == 0
            assert result["expiry"]["kept_by_lease"]
        assert any(r["levels"]["read-uncommitted"]["anomalies"] for r in out["results"])
        keys = s3.keys(prefix)
        for scenario in ("demo_shopping", "demo_transfers"):
            assert any(f"/{scenario}/" in k and k.endswith(".parquet") for k in keys), scenario
    finally:
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{out["database"]}" WITH (FORCE)')


@pytest.mark.other_line
def test_spark_reads_every_warehouse_on_s3_with_only_the_catalog_uri_and_a_token(s3_lake, s3_server, spark):
    """Spark's REST client as `icebarrier connect --engine spark` prints it (both Iceberg jars, the
    access-delegation header, no storage settings): latest, read-committed, read-committed:<ns>,
    barrier-<B> and lease-<ID> at exact row counts on the S3 lake."""
    lake = s3_lake
    p = Pipeline(lake, {"ingest": ["orders", "payments"]})
    marks = [p.advance(rows=10) for _ in range(3)]
    reader = ":".join(tokens.create(lake.conn, whole_lake=True))
    for warehouse, count in every_warehouse(lake, marks).items():
        name = f"s3_{uuid.uuid4().hex[:8]}"
        conf = dict(
            line.split(" ", 1) for line in configuration("spark", warehouse, s3_server, reader, name).splitlines()
        )
        assert not any(k.startswith(f"spark.sql.catalog.{name}.s3.") for k in conf)  # storage comes from the catalog
        for key, value in conf.items():
            if key.startswith(f"spark.sql.catalog.{name}"):
                spark.conf.set(key, value)
        assert spark.table(f"{name}.{lake.namespace}.orders").count() == count, warehouse
