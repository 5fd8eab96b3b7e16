"""What an ``Idempotency-Key`` costs a commit through ``icebarrier serve``.

    python benchmarks/idempotency.py [--dsn DSN] [--commits 300]

One table commit (a ``set-properties`` update: the server loads the metadata, writes a new
metadata file and swaps the pointer, one transaction) through the REST catalog, alternately
with a fresh key and without one, on one keep-alive connection. Prints the p50 and mean of
each and their ratio (goal <= 1.05): the key's look-up rides on the transaction's first
statement, and the row keeping the answer (by reference: the metadata file the commit wrote)
rides with the transaction's COMMIT (``control_plane.db.transaction``).

It creates a scratch database and warehouse, starts a real server process, and removes both.
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

from catalog import session, start  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import db, tokens  # noqa: E402
from icebarrier.iceberg_ext import catalog as ib_catalog  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402


def uuid7() -> str:
    """A key as clients send it (the spec asks for a UUIDv7)."""
    import uuid6

    return str(uuid6.uuid7())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER)
    parser.add_argument("--commits", type=int, default=300, help="commits of each kind")
    args = parser.parse_args()
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory() as wh:
        settings = Settings(dsn=dsn, warehouse=wh).validated()
        ib_catalog.upgrade(settings)
        lake = ib_catalog.load_catalog(settings)
        lake.create_namespace("free")
        lake.create_table("free.t", schema=pa.schema([("id", pa.int64())]))
        with db.connect(dsn) as conn:
            writer = tokens.create(conn, job="bench", whole_lake=True)
        proc, uri = start(settings)
        try:
            s = session(uri, *writer)
            url = f"{uri}/v1/latest/namespaces/free/tables/t"
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(20 + 2 * args.commits):  # the first 20: warm-up
                keyed = i % 2 == 0
                body = {"requirements": [], "updates": [{"action": "set-properties", "updates": {"n": str(i)}}]}
                headers = {"Idempotency-Key": uuid7()} if keyed else {}
                started = time.perf_counter()
                answer = s.post(url, json=body, headers=headers)
                elapsed = (time.perf_counter() - started) * 1000
                if answer.status_code != 200:
                    raise SystemExit(f"commit {i} answered {answer.status_code}: {answer.text}")
                if i >= 20:
                    times[keyed].append(elapsed)
        finally:
            proc.terminate()
            proc.wait(30)
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    for keyed in (True, False):
        q = statistics.quantiles(times[keyed], n=100)
        print(
            f"{'with a key' if keyed else 'without   '}: p50 {q[49]:5.2f} ms, p90 {q[89]:5.2f}, p99 {q[98]:5.2f}, "
            f"mean {statistics.fmean(times[keyed]):5.2f}"
        )
    print(
        f"commit through the server, {args.commits} of each: p50 ratio {ratio:4.2f} "
        f"(goal <= 1.05: {'met' if ratio <= 1.05 else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
