"""Per-table storage credentials cost a load almost nothing once made (issue 49).

    python benchmarks/scoped_credentials.py [--dsn DSN] [--tables 100] [--readers 16] [--runs 3]

A lake of ``--tables`` tables on SeaweedFS (tests/seaweedfs.py: it enforces STS session
policies), served by ``icebarrier serve`` with ``[storage.sessions] role-arn``: each table's
credentials are made by AssumeRole with a session policy for its location. ``--readers``
reader tokens, each granted the namespace, load every table once (the credentials are made and
cached), then:

- the load p50 through ``latest`` with ``X-Iceberg-Access-Delegation: vended-credentials`` ÷
  the p50 of the same loads without delegation, blocks of each alternating on one client
  (goal <= 1.2);
- STS calls per 1,000 delegated loads from the readers, 16 threads (each credential made is an
  audit event: they are counted there; goal 0 while the credentials are fresh).

Reports each run and the worst first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))  # tests.seaweedfs

from catalog import session, start  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import db, tokens  # noqa: E402
from icebarrier.iceberg_ext.catalog import load_catalog, watch_pointers  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402
from tests.seaweedfs import BUCKET, seaweed  # noqa: E402

DELEGATED = {"X-Iceberg-Access-Delegation": "vended-credentials"}


def one_run(dsn: str, store, work: Path, tables: int, readers: int) -> dict:
    import pyarrow as pa

    config = work / "icebarrier.toml"
    config.write_text(store.storage_toml())
    settings = Settings(
        dsn=dsn, warehouse=f"s3://{BUCKET}/bench-{time.time_ns()}", storage=Settings.load_storage(config)
    )
    catalog = load_catalog(settings.validated())
    watch_pointers(settings)  # what `db upgrade` does: the server answers loads from memory
    catalog.create_namespace("bench")
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False)])
    for i in range(tables):
        catalog.create_table(f"bench.t{i}", schema=schema).append(pa.table({"id": [i]}, schema=schema))
    with db.connect(dsn) as conn:
        made = [tokens.create(conn) for _ in range(readers)]
        for client_id, _ in made:
            tokens.grant(conn, client_id, [tokens.Grant("namespace", "bench", "read")])
    proc, uri = start(settings, str(config))
    try:
        clients = [session(uri, *m) for m in made]
        paths = [f"{uri}/v1/latest/namespaces/bench/tables/t{i}" for i in range(tables)]

        def load(client, path, headers) -> float:
            began = time.perf_counter()
            r = client.get(path, headers=headers)
            r.raise_for_status()
            return (time.perf_counter() - began) * 1000

        for client in clients:  # every credential made once (cached from then on)
            for path in paths:
                load(client, path, DELEGATED)
        issued_before = _issued(dsn)
        with ThreadPoolExecutor(len(clients)) as pool:
            list(pool.map(lambda i: load(clients[i % len(clients)], paths[i % len(paths)], DELEGATED), range(1000)))
        sts_per_1000 = _issued(dsn) - issued_before
        plain, delegated = [], []
        for block in range(10):  # alternating blocks on one client: the machine's drift hits both
            for i in range(100):
                path = paths[(block * 100 + i) % len(paths)]
                plain.append(load(clients[0], path, {}))
                delegated.append(load(clients[0], path, DELEGATED))
        return {
            "ratio": statistics.median(delegated) / statistics.median(plain),
            "delegated_p50_ms": statistics.median(delegated),
            "plain_p50_ms": statistics.median(plain),
            "sts_per_1000": sts_per_1000,
        }
    finally:
        proc.terminate()
        proc.wait(30)


def _issued(dsn: str) -> int:
    with db.connect(dsn) as conn:
        return conn.execute("SELECT count(*) AS n FROM audit_event WHERE action = 'storage credentials'").fetchone()[
            "n"
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER)
    parser.add_argument("--tables", type=int, default=100)
    parser.add_argument("--readers", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        with seaweed(Path(tmp) / "seaweedfs") as store:
            print(f"seaweedfs up in {time.monotonic() - started:.1f}s (binary cached)", flush=True)
            for run in range(args.runs):
                with scratch_database(args.dsn) as dsn:
                    result = one_run(dsn, store, Path(tmp), args.tables, args.readers)
                print(
                    f"run {run + 1}: delegated load p50 {result['delegated_p50_ms']:.2f} ms / plain "
                    f"{result['plain_p50_ms']:.2f} ms = {result['ratio']:.2f} (goal <= 1.2); "
                    f"STS calls per 1,000 loads from {args.readers} readers: {result['sts_per_1000']}",
                    flush=True,
                )
                results.append(result)
    worst = sorted(results, key=lambda r: -r["ratio"])
    print("worst first: " + ", ".join(f"{r['ratio']:.2f}" for r in worst))


if __name__ == "__main__":
    main()
