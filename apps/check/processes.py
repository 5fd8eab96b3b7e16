"""The checker's processes: the jobs and the expiry, each a separate OS process.

    main(["job", ENV_JSON, JOB, UNTIL, SPEED_SEED])  |  main(["expiry", ENV_JSON, SEED])

each in a process forked from the run's fork server (:class:`~.supervision.Forked`).

Both survive a restart of the control-plane Postgres: every unit of work goes through
:class:`Reconnecting`, which retries it on a lost connection for a bounded time and
reports how long it waited (a JSON line in the run's report folder). A unit of work that
broke halfway is simply done again: a root job re-reads its recorded range and adopts its
own Iceberg commit, a derived job reads its sources at the same barrier.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import psycopg
import pyarrow as pa

from icebarrier.apps.check.model import DERIVED, ROOTS, SCHEMAS, WINDOW, derive, events
from icebarrier.control_plane import db, jobs, runs
from icebarrier.control_plane.errors import SnapshotExpiredError
from icebarrier.control_plane.jobs import NextBarrier, Plan
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import load_catalog, outages
from icebarrier.iceberg_ext.commits import BarrierCommit
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.maintenance import expire
from icebarrier.iceberg_ext.runtime import inputs_at, record_plan
from icebarrier.iceberg_ext.storage import Storage

T = TypeVar("T")
RECONNECT_LIMIT_S = 60.0


@dataclass(frozen=True)
class Env:
    dsn: str
    schema: str
    warehouse: str
    ns: str
    seed: int
    reports: str  # folder for the processes' JSON-line reports
    storage: dict = field(default_factory=dict)  # FileIO settings (a warehouse on S3)
    readers: dict = field(default_factory=dict)  # ``[storage.readers]``: keys the catalog vends to readers
    kafka: str = ""  # a broker's bootstrap address: orders_in reads its orders from topic <ns>_orders

    @property
    def topic(self) -> str:
        return f"{self.ns}_orders"

    @property
    def settings(self) -> Settings:
        return Settings(
            dsn=self.dsn,
            schema=self.schema,
            warehouse=self.warehouse,
            storage=Storage(properties=self.storage, readers=self.readers),
        ).validated()

    def t(self, name: str) -> TableName:
        return TableName.parse(f"lake.{self.ns}.{name}")

    def report(self, who: str, record: dict) -> None:
        with open(Path(self.reports) / f"{who}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class Reconnecting:
    """A control-plane connection that units of work run on, reconnecting when it is lost."""

    def __init__(self, env: Env, who: str, *, on_wait: Callable[[str, float], None] | None = None) -> None:
        self.env, self.who = env, who
        self.on_wait = on_wait or (lambda what, s: env.report(who, {"waited_s": round(s, 3), "for": what}))
        self._conn: psycopg.Connection | None = None

    @property
    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = db.connect(self.env.dsn, self.env.schema)
        return self._conn

    def run(self, what: str, fn: Callable[[psycopg.Connection], T]) -> T:
        """Run ``fn(conn)``; on a lost connection, again (for at most RECONNECT_LIMIT_S)."""
        lost_at = None
        while True:
            try:
                result = fn(self.conn)
            except outages():
                lost_at = lost_at or time.monotonic()
                if time.monotonic() - lost_at > RECONNECT_LIMIT_S:
                    raise
                self.close()
                time.sleep(0.2)
                continue
            if lost_at is not None:
                self.on_wait(what, time.monotonic() - lost_at)
            return result

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close
                pass
            self._conn = None


def barrier_number(conn: psycopg.Connection, barrier: int) -> int:
    return conn.execute("SELECT count(*) AS n FROM barrier WHERE barrier <= %s", (barrier,)).fetchone()["n"]


def _commit(conn, catalog, job: str, plan: NextBarrier) -> BarrierCommit:
    return BarrierCommit(
        conn,
        catalog,
        job=job,
        barrier=plan.barrier,
        coalesce_after=plan.from_barrier if plan.plan is Plan.COALESCE else None,
    )


def kafka_step(env: Env, conn, catalog, job: str, plan: NextBarrier, source) -> None:
    """orders_in from Kafka (``check --kafka``, a KafkaSource): the orders the broker stamped up to
    the planned barrier (the driver produces each barrier's orders before issuing it, and aborts a
    transaction of orders that must never appear), their range recorded, read, committed."""
    spec = runs.recorded_range(conn, job, plan.barrier)
    if spec is None:
        while source.ready_until() < plan.barrier:
            time.sleep(0.05)
        spec = source.plan(conn, job, plan.barrier)
        if source.is_empty(spec):
            jobs.complete(conn, job, plan.barrier)
            return
        spec = runs.record_range(conn, job, plan.barrier, spec)
    faults.point(faults.AFTER_INPUT_RANGE)
    ids = [row["order_id"] for row in source.rows(spec)]
    with _commit(conn, catalog, job, plan) as tx:
        tx.append_arrow(env.t(ROOTS[job]), pa.table({"order_id": pa.array(ids, pa.int64())}), source.summary(spec))


def root_step(env: Env, conn, catalog, job: str, plan: NextBarrier) -> None:
    """The model's events up to the planned barrier since the job's progress; none: a skip."""
    table, previous = ROOTS[job], plan.from_barrier
    spec = runs.recorded_range(conn, job, plan.barrier)
    if spec is None:
        t_from = barrier_number(conn, previous) * WINDOW if previous is not None else 0
        spec = runs.record_range(
            conn, job, plan.barrier, {"t_from": t_from, "t_to": barrier_number(conn, plan.barrier) * WINDOW}
        )
    faults.point(faults.AFTER_INPUT_RANGE)
    rows = events(env.seed, table, spec["t_from"], spec["t_to"])
    if rows.num_rows == 0:
        jobs.complete(conn, job, plan.barrier)  # nothing arrived: the barriers change nothing
        return
    with _commit(conn, catalog, job, plan) as tx:
        tx.append_arrow(env.t(table), rows)


def derived_step(env: Env, conn, catalog, job: str, plan: NextBarrier) -> None:
    """Skip (no computation), or derive the sink from the sources at the planned barrier."""
    if plan.plan is Plan.SKIP:
        jobs.complete(conn, job, plan.barrier)
        return
    sources, sink = DERIVED[job]
    if plan.from_barrier is not None:
        record_plan(conn, plan)
    with inputs_at(
        conn, catalog, job, [env.t(s) for s in sources], plan.barrier, bootstrap=plan.from_barrier is None
    ) as r:
        _, data = r.read()
    out = derive(sink, {t.name: d for t, d in data.items()})
    with _commit(conn, catalog, job, plan) as tx:
        tx.overwrite_arrow(env.t(sink), out)


def job_process(env: Env, job: str, until_barrier: int, speed_seed: int) -> None:
    """Complete the job's barriers, at a random pace, up to ``until_barrier``, following its
    plans: coalescing at random, and (half of the launches) as a batch job that catches up
    at random moments and idles in between."""
    rng = random.Random(speed_seed)
    batch = rng.random() < 0.5
    cp = Reconnecting(env, job)
    catalog = cp.run("catalog", lambda _conn: load_catalog(env.settings))
    kafka = None
    if env.kafka:
        from icebarrier.iceberg_ext.kafka import KafkaSource

        kafka = KafkaSource(env.kafka, env.topic, "order_id bigint")

    def step(conn) -> bool:
        info = jobs.show(conn, job)
        if info.progress is not None and info.progress >= until_barrier:
            return True
        nb = jobs.next_barrier(conn, job, coalesce=rng.random() < 0.5)
        if not nb.ready:
            time.sleep(rng.uniform(1.0, 3.0) if batch else 0.05)
            return False
        time.sleep(rng.random() * 0.15)
        if job in ROOTS and kafka is not None and ROOTS[job] == "orders":
            kafka_step(env, conn, catalog, job, nb, kafka)
            return False
        if job in ROOTS:
            root_step(env, conn, catalog, job, nb)
            return False
        try:
            derived_step(env, conn, catalog, job, nb)
        except SnapshotExpiredError:
            if info.progress is not None:
                raise  # with progress, its inputs are protected: this would be a bug
            # bootstrapping: expiry took the start snapshot first; start at a newer barrier
        return False

    while not cp.run(f"job {job}", step):
        pass
    cp.close()


def expiry_process(env: Env, seed: int) -> None:
    """Expire random tables until the driver removes the run's ``running`` file."""
    rng = random.Random(seed)
    cp = Reconnecting(env, "expiry")
    catalog = cp.run("catalog", lambda _conn: load_catalog(env.settings))
    names = [env.t(n) for n in SCHEMAS]
    running = Path(env.reports) / "running"
    while running.exists():
        table = rng.choice(names)
        report = cp.run("expiry", lambda conn: expire(conn, catalog, table))
        env.report("expiry", {"table": str(table), "expired": list(report.expired)})
        time.sleep(rng.random() * 0.1)
    cp.close()


def main(argv: list[str]) -> None:
    usage = "usage: main(['job', ENV_JSON, JOB, UNTIL, SPEED_SEED]) | main(['expiry', ENV_JSON, SEED])"
    if len(argv) < 2 or argv[0] not in ("job", "expiry"):
        raise SystemExit(usage)
    env = Env(**json.loads(argv[1]))
    if argv[0] == "job":
        job_process(env, argv[2], int(argv[3]), int(argv[4]))
    else:
        expiry_process(env, int(argv[2]))
