"""Trino through `icebarrier serve`: what a consistent read costs Trino, against latest in the same run.

    python benchmarks/trino_reads.py [--dsn DSN] [--queries 40] [--barriers 20]

A real Trino (tests/trino.py: Trino 483 from Maven Central, on Temurin 25) with two catalogs on one
server, configured exactly as `icebarrier connect --engine trino` prints them: ``latest`` and
``read-committed``. Two managed tables with ``--barriers`` barriers of history. Prints:

- a two-table join's p50 through read-committed ÷ through latest, queries interleaved (goal <= 1.2);
- the catalog's share of Trino's planning time: the server's time in table loads
  (``icebarrier_catalog_load_seconds`` on /metrics) ÷ Trino's planning time of the same queries
  (``queryStats.planningTime``), per warehouse.

It creates a scratch database and warehouse, starts a server and Trino, and removes them.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.trino: the suite's Trino

from catalog import build_lake, start  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, jobs, tokens  # noqa: E402
from icebarrier.control_plane.model import TableName  # noqa: E402
from icebarrier.iceberg_ext import catalog as ib_catalog  # noqa: E402
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402

WAREHOUSES = {"rc": "read-committed", "ru": "latest"}
JOIN = "SELECT count(*) FROM {c}.bench.t0 x JOIN {c}.bench.t1 y USING (id)"
_DURATION = re.compile(r"(?P<n>[\d.]+)(?P<unit>ns|us|ms|s|m|h|d)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def grow(settings: Settings, names: list[str], n: int) -> None:
    """``n`` more barriers, each appending 100 rows to both tables (history for the loads)."""
    catalog = ib_catalog.load_catalog(settings)
    with db.connect(settings.dsn, settings.schema) as conn:
        for i in range(n):
            b = barriers.issue(conn).barrier
            commits = {}
            for name in names:
                table = catalog.load_table(name)
                table.append(
                    pa.table({"id": list(range(i * 100, i * 100 + 100))}), snapshot_properties={SUMMARY_BARRIER: str(b)}
                )
                commits[TableName.parse(f"lake.{name}")] = table.current_snapshot().snapshot_id
            jobs.complete(conn, "bench", b, commits)


def seconds(text: str) -> float:
    m = _DURATION.fullmatch(text)
    return float(m["n"]) * _UNIT_S[m["unit"]]


def load_seconds(uri: str, credential: str) -> dict[str, float]:
    """The server's total seconds in table loads so far, per warehouse kind (its /metrics)."""
    token = requests.post(
        f"{uri}/v1/oauth/tokens",
        data=dict(zip(("client_id", "client_secret"), credential.split(":")), grant_type="client_credentials"),
        timeout=30,
    ).json()["access_token"]
    text = requests.get(f"{uri}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
    found = re.findall(r'icebarrier_catalog_load_seconds_sum\{warehouse="([^"]+)"\} ([\d.e+-]+)', text)
    return {kind: float(value) for kind, value in found}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--queries", type=int, default=40, help="joins per warehouse (after 5 to warm up)")
    parser.add_argument("--barriers", type=int, default=20, help="barriers of history in each table")
    args = parser.parse_args()
    from tests.trino import catalog_file, trino_server

    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(dsn=dsn, warehouse=f"{tmp}/wh").validated()
        ib_catalog.upgrade(settings)  # what `icebarrier db upgrade` does before a server starts
        _, names = build_lake(settings, 2)
        grow(settings, names, args.barriers)
        with db.connect(dsn) as conn:
            reader = ":".join(tokens.create(conn, whole_lake=True))
        proc, uri = start(settings)
        try:
            catalogs = {c: catalog_file(uri, w, reader, c) for c, w in WAREHOUSES.items()}
            with trino_server(Path(tmp) / "trino", catalogs) as trino:
                wall: dict[str, list[float]] = {c: [] for c in WAREHOUSES}
                planning: dict[str, float] = dict.fromkeys(WAREHOUSES, 0.0)
                loads_before = load_seconds(uri, reader)
                for i in range(5 + args.queries):
                    for c in WAREHOUSES if i % 2 else reversed(WAREHOUSES):  # interleaved, alternating first
                        cursor = trino.connect().cursor()
                        started = time.perf_counter()
                        cursor.execute(JOIN.format(c=c))
                        cursor.fetchall()
                        if i >= 5:
                            wall[c].append(time.perf_counter() - started)
                            info = requests.get(
                                f"http://127.0.0.1:{trino.port}/v1/query/{cursor.query_id}",
                                headers={"X-Trino-User": "icebarrier"},
                                timeout=30,
                            ).json()
                            planning[c] += seconds(info["queryStats"]["planningTime"])
                        if i == 4:
                            loads_before = load_seconds(uri, reader)
                loads = {k: v - loads_before.get(k, 0.0) for k, v in load_seconds(uri, reader).items()}
        finally:
            proc.terminate()
            proc.wait(30)
    rc, ru = (statistics.median(wall[c]) for c in ("rc", "ru"))
    ratio = rc / ru
    print(f"two managed tables, {args.barriers + 1} barriers of history; {args.queries} joins per warehouse")
    print(
        f"trino, two-table join p50: read-committed {rc * 1000:6.1f} ms, latest {ru * 1000:6.1f} ms, "
        f"ratio {ratio:.2f} (goal <= 1.2: {'met' if ratio <= 1.2 else 'MISSED'})"
    )
    for c, kind in (("rc", "read-committed"), ("ru", "latest")):
        share = loads.get(kind, 0.0) / planning[c] if planning[c] else float("nan")
        print(
            f"catalog's share of Trino's planning through {kind}: {loads.get(kind, 0.0) * 1000:.0f} ms in loads "
            f"/ {planning[c] * 1000:.0f} ms planning = {share:.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
