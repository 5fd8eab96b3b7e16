"""Kafka into a consistent pipeline: freshness, the root job's throughput, and an idle topic's cost.

    python benchmarks/kafka.py [--dsn SERVER_DSN] [--seconds 40] [--rates 1000,10000]
                               [--steps 10000,40000,80000] [--only freshness,throughput,idle]

The pipeline is examples/kafka_orders (a root job from Kafka, then two SQL jobs: per-user totals
and a join), each job under ``icebarrier run FILE --follow`` in a process of its own, 1-s barriers,
a broker of its own (icebarrier's pinned Kafka, KRaft), a scratch database.

1. **Freshness.** Orders produced at each of ``--rates`` records/s for ``--seconds`` (transactions
   of rate/20 records, so 20 a second; every tenth aborted). A record is visible when the
   pipeline's read-committed cut (all three tables, polled every 50 ms) reaches the first barrier
   at or after its broker timestamp. Lag = visible − the time the record's transaction began
   producing (its first record: the worst in it), after 20 s of the same load not measured (the
   JVMs' JIT warming up). p50 and p95 over the window, and p95 of its first
   and second halves (steady: the second no worse than the first by more than one barrier).
   Goal: p95 <= 3 s. The baseline printed beside it is the barrier interval (1 s): the ratio says
   how many intervals a record waits.
2. **Throughput** of the root job alone at 1-s barriers, both ways (``consumer``: KafkaSource
   under the runtime; ``stream``: Spark Structured Streaming, examples/kafka_orders/stream_orders.py):
   for each of ``--steps`` records/s, 30 s of production; the job keeps up when its lag (now − its
   progress barrier) over the last 10 s stays under 5 s. The most records/s it kept up with.
3. **Idle.** The root job (consumer way) on a topic nobody writes, 30 s, its Postgres traffic through
   a counting proxy (tests/pg_counter.py): transactions per barrier issued.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.apps.embedded import CLI  # noqa: E402
from icebarrier.apps.kafka_broker import Broker  # noqa: E402
from icebarrier.control_plane import barriers, db, jobs, reads  # noqa: E402
from icebarrier.control_plane.errors import NoValidCutError  # noqa: E402
from icebarrier.control_plane.model import TableName  # noqa: E402
from icebarrier.iceberg_ext.spark import SMALL_JOBS_JVM_OPTIONS  # noqa: E402

EXAMPLE = ROOT / "examples" / "kafka_orders"
NS = "kshop"
WARMUP_S = 20.0
TABLES = [TableName.parse(f"lake.{NS}.{t}") for t in ("orders", "user_totals", "user_shares")]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Producer(threading.Thread):
    """Orders at ``rate``/s in 20 transactions a second (every tenth aborted); per committed
    transaction (when it began producing, its records' newest broker timestamp in ms, its size)."""

    def __init__(self, bootstrap: str, topic: str, rate: float, seconds: float) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import Producer as KafkaProducer

        self.rate, self.seconds, self.topic = rate, seconds, topic
        self.size = max(1, int(rate / 20))
        self.kafka = KafkaProducer(
            {"bootstrap.servers": bootstrap, "transactional.id": f"bench-{os.getpid()}-{rate}-{time.time()}",
             "linger.ms": 5, "log_level": 3}
        )  # fmt: skip
        self.kafka.init_transactions(30)
        self.batches: list[tuple[float, int, int]] = []
        self.produced = 0

    def run(self) -> None:
        started, n, next_id = time.monotonic(), 0, 0
        while time.monotonic() - started < self.seconds:
            n += 1
            newest = [0]

            def stamped(err, msg, newest=newest):
                if err is None:
                    newest[0] = max(newest[0], msg.timestamp()[1])

            began = time.time()
            self.kafka.begin_transaction()
            for _ in range(self.size):
                next_id += 1
                value = b'{"id": %d, "user_id": %d, "amount": %d}' % (next_id, next_id % 20, next_id % 97 + 1)
                self.kafka.produce(self.topic, value, on_delivery=stamped)
            if n % 10 == 0:
                self.kafka.flush(30)
                self.kafka.abort_transaction(30)
            else:
                self.kafka.commit_transaction(30)  # delivery callbacks have run
                self.batches.append((began, newest[0], self.size))
                self.produced += self.size
            time.sleep(max(0.0, n * self.size / self.rate - (time.monotonic() - started)))
        self.achieved = self.produced / (time.monotonic() - started)


class Visibility(threading.Thread):
    """(time, read-committed barrier) of the pipeline's tables every 50 ms."""

    def __init__(self, dsn: str, tables: list[TableName]) -> None:
        super().__init__(daemon=True)
        self.dsn, self.tables = dsn, tables
        self.seen: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with db.connect(self.dsn, "icebarrier") as conn:
            while not self.stop.wait(0.05):
                try:
                    self.seen.append((time.time(), reads.resolve(conn, self.tables).barrier))
                except NoValidCutError:
                    pass

    def visible_at(self, stamp_ms: int) -> float | None:
        for t, barrier in self.seen:
            if barrier // 1000 >= stamp_ms:
                return t
        return None


@contextmanager
def pipeline(server: str, work: Path, files: list[str], *, dsn_for_jobs=None):
    """A scratch database, a broker with topic ``orders`` (3 partitions), the tables, and ``files``
    (examples/kafka_orders job files, or ``stream_orders.py``) each in a process of its own."""
    with scratch_database(server) as dsn:
        broker = Broker(work / "kafka").start()
        try:
            broker.create_topic("orders", partitions=3, config={"message.timestamp.type": "LogAppendTime"})
            env = {
                **os.environ,
                "ICEBARRIER_DSN": dsn_for_jobs(dsn) if dsn_for_jobs else dsn,
                "ICEBARRIER_WAREHOUSE": str(work / "warehouse"),
                "KAFKA_BOOTSTRAP": broker.bootstrap,
                "KAFKA_TOPIC": "orders",
                "KSHOP_NS": NS,
                "SPARK_SUBMIT_OPTS": SMALL_JOBS_JVM_OPTIONS,  # warm runners' options (docs/declared-freshness.md)
            }
            subprocess.run([sys.executable, str(EXAMPLE / "pipeline.py"), "create-tables"], env=env, check=True)
            with db.connect(dsn, "icebarrier") as conn:
                barriers.set_interval_s(conn, 1)
            procs = []
            for f in files:
                log = open(work / f"{f}.log", "a")
                cmd = (
                    [sys.executable, str(EXAMPLE / f), str(work / "checkpoint")]
                    if f == "stream_orders.py"
                    else [*CLI, "run", str(EXAMPLE / f), "--follow", "--poll", "5s"]
                )
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
            try:
                yield dsn, broker
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    try:
                        p.wait(60)
                    except subprocess.TimeoutExpired:
                        p.kill()
        finally:
            broker.stop()


def wait_running(dsn: str, job: str, timeout_s: float = 180) -> None:
    """Until ``job`` completed a first barrier (its JVM started, the tables bootstrapped)."""
    deadline = time.monotonic() + timeout_s
    with db.connect(dsn, "icebarrier") as conn:
        while time.monotonic() < deadline:
            try:
                if jobs.show(conn, job).progress is not None:
                    return
            except Exception:  # noqa: BLE001 - not registered yet
                pass
            time.sleep(0.2)
    raise SystemExit(f"job {job} did not start in {timeout_s:g} s")


def workdir():
    """A temporary folder (``KAFKA_BENCH_KEEP=DIR``: a new folder under DIR, kept, with the jobs' logs)."""
    keep = os.environ.get("KAFKA_BENCH_KEEP")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        return contextlib.nullcontext(tempfile.mkdtemp(dir=keep))
    return tempfile.TemporaryDirectory()


def freshness(server: str, rate: float, seconds: float) -> dict:
    with (
        workdir() as tmp,
        pipeline(server, Path(tmp), ["ingest_orders.py", "user_totals.py", "user_shares.py"]) as (dsn, broker),
    ):
        for job in ("ingest_orders", "user_totals", "user_shares"):
            wait_running(dsn, f"{NS}_{job}")
        warm = Producer(broker.bootstrap, "orders", rate, WARMUP_S)  # the JVMs' JIT at work, not measured
        warm.start()
        warm.join()
        seen = Visibility(dsn, TABLES)
        seen.start()
        producer = Producer(broker.bootstrap, "orders", rate, seconds)
        producer.start()
        producer.join()
        time.sleep(8)
        seen.stop.set()
        seen.join()
    lags, halves = [], ([], [])
    start = producer.batches[0][0] if producer.batches else 0
    for began, stamp, size in producer.batches:
        at = seen.visible_at(stamp)
        lag = (at - began) if at is not None else float("inf")
        lags += [lag] * size
        halves[began - start > seconds / 2].extend([lag] * size)
    return {
        "rate": rate,
        "achieved": round(producer.achieved),
        "p50_s": round(pct(lags, 0.5), 2),
        "p95_s": round(pct(lags, 0.95), 2),
        "p95_first_half_s": round(pct(halves[0], 0.95), 2),
        "p95_second_half_s": round(pct(halves[1], 0.95), 2),
        "not_visible": sum(1 for v in lags if v == float("inf")),
    }


def lag_of(conn, job: str) -> float:
    progress = jobs.show(conn, job).progress
    return float("inf") if progress is None else time.time() - progress / 1e6


def throughput(server: str, way: str, steps: list[int]) -> dict:
    file = "ingest_orders.py" if way == "consumer" else "stream_orders.py"
    best, tried = 0, []
    with workdir() as tmp, pipeline(server, Path(tmp), [file]) as (dsn, broker):
        job = f"{NS}_ingest_orders"
        producer = Producer(broker.bootstrap, "orders", 200, 3)  # a first record: the stream's first batch
        producer.start()
        producer.join()
        wait_running(dsn, job)
        with db.connect(dsn, "icebarrier") as conn:
            for rate in steps:
                producer = Producer(broker.bootstrap, "orders", rate, 30)
                producer.start()
                time.sleep(20)
                samples = []
                while producer.is_alive():
                    samples.append(lag_of(conn, job))
                    time.sleep(0.5)
                kept = bool(samples) and max(samples) < 5.0
                tried.append({"rate": rate, "achieved": round(producer.achieved), "max_lag_s": round(max(samples), 1)})
                if not kept:
                    break
                best = round(producer.achieved)
                deadline = time.monotonic() + 60  # let it drain before the next step
                while lag_of(conn, job) > 3 and time.monotonic() < deadline:
                    time.sleep(0.5)
    return {"way": way, "kept_up_with": best, "steps": tried}


def idle(server: str, seconds: float = 30) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.pg_counter import TransactionCounter

    counters = []

    def through_counter(dsn: str) -> str:
        counters.append(TransactionCounter(dsn))
        return counters[0].dsn

    with (
        workdir() as tmp,
        pipeline(server, Path(tmp), ["ingest_orders.py"], dsn_for_jobs=through_counter) as (dsn, broker),
    ):
        job = f"{NS}_ingest_orders"
        wait_running(dsn, job)
        time.sleep(3)
        with db.connect(dsn, "icebarrier") as conn:
            first = barriers.newest(conn).barrier
            before = counters[0].transactions
            time.sleep(seconds)
            after = counters[0].transactions
            issued = conn.execute("SELECT count(*) AS n FROM barrier WHERE barrier > %s", (first,)).fetchone()["n"]
            snapshots = conn.execute("SELECT count(*) AS n FROM table_commit").fetchone()["n"]
    counters[0].close()
    return {
        "barriers": issued,
        "transactions": after - before,
        "per_barrier": round((after - before) / max(issued, 1), 2),
        "commits_recorded": snapshots,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a Postgres server where a scratch database may be made")
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--rates", default="1000,10000")
    parser.add_argument("--steps", default="10000,40000,80000")
    parser.add_argument("--only", default="freshness,throughput,idle")
    args = parser.parse_args()
    only = set(args.only.split(","))
    results: dict = {}
    if "freshness" in only:
        for rate in (float(r) for r in args.rates.split(",")):
            r = freshness(args.dsn, rate, args.seconds)
            results.setdefault("freshness", []).append(r)
            print(
                f"freshness at {r['rate']:.0f} records/s (achieved {r['achieved']}): p50 {r['p50_s']} s, "
                f"p95 {r['p95_s']} s (goal <= 3 s; {r['p95_s'] / 1.0:.1f} barrier intervals); p95 first half "
                f"{r['p95_first_half_s']} s, second half {r['p95_second_half_s']} s; never visible: {r['not_visible']}",
                flush=True,
            )
    if "throughput" in only:
        steps = [int(s) for s in args.steps.split(",")]
        for way in ("consumer", "stream"):
            r = throughput(args.dsn, way, steps)
            results.setdefault("throughput", []).append(r)
            print(f"root job ({way}) kept up with {r['kept_up_with']} records/s at 1-s barriers; steps {r['steps']}",
                  flush=True)  # fmt: skip
    if "idle" in only:
        r = idle(args.dsn)
        results["idle"] = r
        print(
            f"idle topic: {r['transactions']} Postgres transactions over {r['barriers']} barriers "
            f"({r['per_barrier']} per barrier); commits recorded: {r['commits_recorded']}",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
