"""What the maintenance service's passes cost as the lake grows: CPU per 1,000 tables.

    python benchmarks/maintain_scale.py [--dsn DSN] [--tables 1000] [--managed 100000] [--reps 5]

A lake of ``--tables`` Iceberg tables (one small commit each, one job), then the service's passes
in this process (``Maintainer``, what ``icebarrier maintain`` runs), timed with this process's CPU:

- the first pass (every table loaded and looked at once; nothing is due yet), with 1 worker
  and again from scratch with 2 (wall seconds: workers overlap the loads' waits);
- an idle pass (nothing moved, no time came), the p50 of ``--reps``; then again once the
  control plane holds ``--managed`` tables (rows only, as a lake of that size has them), to show
  that what an idle pass reads follows what changed, not the lake;
- a pass after one table in 100 moved (a commit each).

Printed per 1,000 tables of the catalog. It creates a scratch database and warehouse and removes both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalog import add_managed, build_lake  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.apps.maintain import Maintainer  # noqa: E402
from icebarrier.control_plane import barriers, db, jobs  # noqa: E402
from icebarrier.control_plane.model import TableName  # noqa: E402
from icebarrier.iceberg_ext import catalog as ib_catalog  # noqa: E402
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402


def timed(work) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of ``work()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--tables", type=int, default=1000)
    parser.add_argument("--managed", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    per_k = 1000 / args.tables
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory() as wh:
        settings = Settings(dsn=dsn, warehouse=wh).validated()
        ib_catalog.upgrade(settings)
        barrier, names = build_lake(settings, args.tables)
        catalog = ib_catalog.load_catalog(settings)
        with db.connect(dsn, actor="bench") as conn:
            for workers in (1, 2):
                service = Maintainer(settings, log=lambda _: None, workers=workers)
                cpu, wall = timed(lambda s=service: s.once(conn, catalog))
                print(
                    f"first pass, {workers} worker(s): {cpu * per_k:5.2f} s CPU, {wall * per_k:5.2f} s wall "
                    f"per 1,000 tables"
                )
            idle = [timed(lambda: service.maintain(conn, catalog))[0] for _ in range(args.reps)]
            print(
                f"idle pass, {args.tables:,d} tables:   {statistics.median(idle) * per_k * 1000:7.1f} ms CPU per 1,000 tables"
            )
            add_managed(conn, args.managed - args.tables, barrier)
            grown = [timed(lambda: service.maintain(conn, catalog))[0] for _ in range(args.reps)]
            print(
                f"idle pass, {args.tables:,d} tables in a control plane of {args.managed:,d}: "
                f"{statistics.median(grown) * per_k * 1000:7.1f} ms CPU per 1,000 tables of the catalog"
            )
            moved = names[::100]
            b = barriers.issue(conn).barrier
            commits = {}
            for name in moved:
                table = catalog.load_table(name)
                table.append(pa.table({"id": [2]}), snapshot_properties={SUMMARY_BARRIER: str(b)})
                commits[TableName.parse(f"lake.{name}")] = table.current_snapshot().snapshot_id
            jobs.complete(conn, "bench", b, commits, coalesce=False)
            cpu, _ = timed(lambda: service.maintain(conn, catalog))
            print(f"a pass after {len(moved)} of {args.tables:,d} tables moved: {cpu * 1000:7.1f} ms CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
