"""The control plane losing its primary: how long until clients are served again, and what
synchronous replication costs a commit.

    python benchmarks/failover.py [--runs 3] [--commits 300]

Each run starts a Postgres primary and its synchronous standby (apps/pg_pair.py), a lake on them
and a real `icebarrier serve`, all given the two-host DSN. Three clients go on at once, each as
fast as it can: a load through the server, a commit through the server (a ``set-properties``
update), and a barrier completed by a root job (issued, its commit appended through PyIceberg's
SQL catalog, completed in the control plane). The primary is SIGKILLed; the standby is promoted
at once, as an HA manager would. Printed per run, worst first: the promotion, and from the
primary's death the first success of each client after it (goal: at most 10 s past the
promotion); every commit acknowledged before the death is counted on the new primary (goal: 0
lost).

Then, on one pair, the p50 of a control-plane commit (a barrier issued, one transaction) with
the standby synchronous against with ``synchronous_standby_names`` cleared (asynchronous),
alternating in blocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalog import session, start  # noqa: E402

from icebarrier.apps.pg_pair import PostgresPair  # noqa: E402
from icebarrier.control_plane import barriers, db, jobs, tokens  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402
from icebarrier.iceberg_ext import catalog as ib_catalog  # noqa: E402
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402

ROW = pa.schema([("id", pa.int64())])


class Client(threading.Thread):
    """Calls ``step`` until stopped; remembers when each call that succeeded started and ended, and what
    it acknowledged."""

    def __init__(self, name: str, step) -> None:
        super().__init__(daemon=True, name=name)
        self.step, self.stop, self.ok_at, self.acked = step, threading.Event(), [], []

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()  # a call in flight at the death does not count as one after it
            try:
                if answer := self.step():
                    self.ok_at.append((started, time.monotonic()))
                    self.acked.append(answer)
            except Exception:  # noqa: BLE001 - the control plane is away: not acknowledged
                time.sleep(0.02)

    def first_after(self, moment: float) -> float | None:
        """When the first call that started after ``moment`` succeeded (s after it)."""
        return next((done - moment for started, done in self.ok_at if started > moment), None)


def one_run(work: Path) -> dict[str, float]:
    pair = PostgresPair(work / "pg").start()
    try:
        settings = Settings(dsn=pair.dsn(), warehouse=str(work / "wh")).validated()
        ib_catalog.upgrade(settings)
        lake = ib_catalog.load_catalog(settings)
        lake.create_namespace("bench")
        sink = lake.create_table("bench.orders", schema=ROW)
        lake.create_table("bench.free", schema=ROW)
        with db.connect(settings.dsn) as conn:
            jobs.register(
                conn,
                JobDefinition(
                    name="root",
                    sinks=frozenset([TableName.parse("lake.bench.orders")]),
                    external_inputs=frozenset(["x"]),
                ),
            )
            writer = tokens.create(conn, job="root", whole_lake=True)
        proc, uri = start(settings)
        try:
            http = {name: session(uri, *writer) for name in ("load", "commit")}
            url = f"{uri}/v1/latest/namespaces/bench/tables/free"
            body = {"requirements": [], "updates": [{"action": "set-properties", "updates": {"n": "1"}}]}
            conn_box: list = [None]

            def barrier() -> int | None:
                """A root job's step: the barrier it owes (issued if none is due), its commit (unless
                made before a failure), its completion."""
                if conn_box[0] is None or conn_box[0].closed:
                    conn_box[0] = db.connect(settings.dsn)
                conn = conn_box[0]
                try:
                    plan = jobs.next_barrier(conn, "root")
                    if plan.barrier is None or not plan.ready:
                        barriers.issue(conn)
                        return None
                    b = plan.barrier
                    current = sink.refresh().current_snapshot()
                    if current is None or current.summary.additional_properties.get(SUMMARY_BARRIER) != str(b):
                        sink.append(pa.table({"id": [b]}, schema=ROW), snapshot_properties={SUMMARY_BARRIER: str(b)})
                    commits = {TableName.parse("lake.bench.orders"): sink.current_snapshot().snapshot_id}
                    jobs.complete(conn, "root", b, commits)
                    barriers.issue(conn)
                    return b
                except Exception:
                    conn.close()
                    raise

            clients = [
                Client("load", lambda: http["load"].get(url, timeout=10).status_code == 200),
                Client("commit", lambda: http["commit"].post(url, json=body, timeout=10).status_code == 200),
                Client("barrier", barrier),
            ]
            for c in clients:
                c.start()
            time.sleep(3)
            died = pair.kill_primary()
            acked = list(clients[2].acked)  # barriers completed and acknowledged before the death
            promotion_s = pair.promote()
            deadline = time.monotonic() + 60
            while any(c.first_after(died + promotion_s) is None for c in clients) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1)
            for c in clients:
                c.stop.set()
            for c in clients:
                c.join(30)
            figures = {"promotion": promotion_s}
            figures |= {c.name: c.first_after(died) or float("inf") for c in clients}
            with db.connect(settings.dsn) as conn:  # every barrier acknowledged before the death is there
                kept = {
                    r["barrier"] for r in conn.execute("SELECT barrier FROM table_completions WHERE job_name = 'root'")
                }
            figures["lost"] = len(set(acked) - kept)
            figures["acked"] = len(acked)
            return figures
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        pair.stop()


def commit_cost(work: Path, commits: int) -> tuple[float, float]:
    """p50 (ms) of a barrier issued with the standby synchronous, and asynchronous."""
    pair = PostgresPair(work / "pg").start()
    try:
        settings = Settings(dsn=pair.dsn(), warehouse=str(work / "wh")).validated()
        ib_catalog.upgrade(settings)
        times: dict[bool, list[float]] = {True: [], False: []}
        with db.connect(settings.dsn) as conn, db.connect(pair.primary.dsn(), check_schema=False) as admin:
            for block in range(20):
                synchronous = block % 2 == 0
                admin.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{'standby' if synchronous else ''}'")
                admin.execute("SELECT pg_reload_conf()")
                time.sleep(0.2)
                for _ in range(commits // 10):
                    started = time.perf_counter()
                    barriers.issue(conn)
                    times[synchronous].append((time.perf_counter() - started) * 1000)
        return statistics.median(times[True]), statistics.median(times[False])
    finally:
        pair.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--commits", type=int, default=300, help="barriers issued in each mode")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="failover-") as work:
            runs.append(one_run(Path(work)))
            print(f"run {i + 1}: done", file=sys.stderr)
    runs.sort(key=lambda r: -max(r["load"], r["commit"], r["barrier"]))
    print("from the primary's death (s), worst run first:")
    for r in runs:
        past = max(r["load"], r["commit"], r["barrier"]) - r["promotion"]
        print(
            f"  promotion {r['promotion']:.2f}; first load {r['load']:.2f}, first commit {r['commit']:.2f}, "
            f"first completed barrier {r['barrier']:.2f} ({past:.2f} past the promotion, goal <= 10: "
            f"{'met' if past <= 10 else 'MISSED'}); barriers completed before the death: {r['acked']:.0f}, lost {r['lost']:.0f}"
        )
    with tempfile.TemporaryDirectory(prefix="failover-") as work:
        sync_ms, async_ms = commit_cost(Path(work), args.commits)
    print(
        f"a barrier issued (one commit), p50: synchronous standby {sync_ms:.2f} ms, asynchronous {async_ms:.2f} ms, "
        f"ratio {sync_ms / async_ms:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
