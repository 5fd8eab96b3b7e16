"""Entry points run as separate OS processes by the Iceberg tests.

    python -m tests.iceberg_ext.worker ingest DSN SCHEMA WAREHOUSE NAMESPACE BARRIER BARRIER_NO
    python -m tests.iceberg_ext.worker leases DSN SCHEMA WAREHOUSE NAMESPACE ROUNDS SEED
    python -m tests.iceberg_ext.worker expire DSN SCHEMA WAREHOUSE NAMESPACE ROUNDS

Crash points come from ICEBARRIER_FAULT (see iceberg_ext.faults). Results go to stdout as JSON.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from icebarrier.control_plane import db, leases
from icebarrier.control_plane.errors import SnapshotExpiredError
from icebarrier.iceberg_ext.catalog import load_catalog, require_snapshots
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.maintenance import expire
from tests.iceberg_ext.conftest import Lake
from tests.iceberg_ext.pipeline import ingest


def _lake(dsn, cp_schema, warehouse, namespace) -> Lake:
    settings = Settings(dsn=dsn, schema=cp_schema, warehouse=warehouse).validated()
    return Lake(settings=settings, conn=db.connect(dsn, cp_schema), catalog=load_catalog(settings), namespace=namespace)


def main(argv: list[str]) -> None:
    action, dsn, cp_schema, warehouse, namespace, *rest = argv
    lake = _lake(dsn, cp_schema, warehouse, namespace)
    # Racing workers start together (after their imports), so the race is real.
    time.sleep(max(0.0, float(os.environ.get("RACE_START_AT", "0")) - time.time()))
    if action == "ingest":
        tx = ingest(lake, int(rest[0]), int(rest[1]))
        print(
            json.dumps(
                {
                    "commits": {str(k): v for k, v in tx.commits.items()},
                    "adopted": sorted(map(str, tx.adopted)),
                    "noop": tx.completion.noop,
                }
            )
        )
    elif action == "leases":
        rounds, rng = int(rest[0]), random.Random(int(rest[1]))
        marks = [r["barrier"] for r in lake.conn.execute("SELECT barrier FROM barrier ORDER BY barrier").fetchall()]
        marks = marks[: len(marks) * 2 // 3]  # the newer third is never leased: expiry always has work
        granted, refused = [], 0
        for i in range(rounds):
            # What a repeatable read does on entry: write the lease, then re-check the snapshot
            # exists. The lease is kept to the end: it must protect its snapshot until then.
            try:
                cut = leases.acquire(
                    lake.conn, [lake.T("orders")], barrier=rng.choice(marks), ttl_s=3600, holder=f"race{i}"
                )
            except SnapshotExpiredError:
                refused += 1
                continue
            try:
                require_snapshots(lake.catalog, cut.snapshots, cut.barrier)
            except SnapshotExpiredError:
                leases.release(lake.conn, cut.lease_id)
                refused += 1
                continue
            granted.append([cut.lease_id, cut.snapshots[lake.T("orders")]])
        print(json.dumps({"granted": granted, "refused": refused}))
    elif action == "expire":
        expired = []
        for _ in range(int(rest[0])):
            report = expire(lake.conn, lake.catalog, lake.T("orders"))
            expired += list(report.expired)
        print(json.dumps({"expired": expired}))
    else:
        raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main(sys.argv[1:])
