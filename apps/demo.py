"""The demo scenarios: a real pipeline on Spark + Iceberg + Postgres, jobs committing at
different speeds, and a reader checking an invariant at every consistency level.

- ``shopping`` (the seed's pipeline): shopping events -> user_item_amount (SQL) and
  user_item_price (SQL, a slower job). Invariant: both views were computed from the same
  shopping data — their totals match the source's (the avgPrice join is then sound).
- ``transfers`` (the seed's accounts): money moves between accounts in source transactions;
  ledger (root, event-time: a transfer's two legs land together) -> balances (SQL). The
  invariant: each balance equals opening balance + its ledger entries, and the total never
  changes.

Read-uncommitted reads each table's latest snapshot and sees anomalies whenever the jobs
are at different barriers; read-committed and repeatable-read see none.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from icebarrier.control_plane import barriers, delays, jobs, reads, topology
from icebarrier.control_plane.errors import NoValidCutError
from icebarrier.control_plane.model import Level, TableName, barrier_label
from icebarrier.iceberg_ext.job import RootJob, SqlJob
from icebarrier.iceberg_ext.maintenance import expire
from icebarrier.iceberg_ext.reads import ConsistentRead
from icebarrier.iceberg_ext.runtime import Runtime
from icebarrier.iceberg_ext.sources import PostgresSource

ACCOUNTS = 8
OPENING = 1000


@dataclass
class LevelStats:
    queries: int = 0
    anomalies: int = 0
    example: str = ""


@dataclass
class DemoResult:
    scenario: str
    topology_text: str
    topology_mermaid: str
    barriers: int
    levels: dict[str, LevelStats] = field(default_factory=dict)
    repeatable_read_changes: int = 0
    table_delays: list = field(default_factory=list)
    job_delays: list = field(default_factory=list)
    expiry: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {
            "scenario": self.scenario,
            "barriers": self.barriers,
            "seconds": round(self.seconds, 1),
            "levels": {
                k: {"queries": v.queries, "anomalies": v.anomalies, "example": v.example}
                for k, v in self.levels.items()
            },
            "repeatable_read_changes": self.repeatable_read_changes,
            "table_delays": [d.to_json() for d in self.table_delays],
            "job_delays": [d.to_json() for d in self.job_delays],
            "expiry": self.expiry,
        }


class Scenario:
    name: str
    tables: dict[str, TableName]

    def __init__(self, ns: str, dsn: str, seed: int) -> None:
        self.ns, self.dsn, self.rng = ns, dsn, random.Random(seed)

    def t(self, name: str) -> TableName:
        return self.tables[name]

    def setup(self, spark) -> list:
        raise NotImplementedError

    def produce(self, round_no: int) -> None:
        """New input for the next barrier."""

    def check(self, spark, reader: ConsistentRead) -> str | None:
        """None if the cut is consistent, else a short description of the anomaly."""
        raise NotImplementedError


class Shopping(Scenario):
    name = "shopping"

    def setup(self, spark):
        self.tables = {
            n: TableName.parse(f"lake.{self.ns}.{n}") for n in ("shopping", "user_item_amount", "user_item_price")
        }
        ddl = {
            "shopping": "user_id bigint, item_id bigint, amount bigint, price double",
            "user_item_amount": "user_id bigint, item_id bigint, amount bigint",
            "user_item_price": "user_id bigint, item_id bigint, price double",
        }
        spark.sql(f"CREATE NAMESPACE IF NOT EXISTS lake.{self.ns}")
        for n, cols in ddl.items():
            spark.sql(f"CREATE TABLE IF NOT EXISTS {self.t(n)} ({cols}) USING iceberg")
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute(
                "CREATE TABLE IF NOT EXISTS public.demo_shopping (id bigserial PRIMARY KEY, user_id bigint, "
                "item_id bigint, amount bigint, price double precision)"
            )
        source = PostgresSource(self.dsn, "public.demo_shopping", ["user_id", "item_id", "amount", "price"], key="id")
        return [
            RootJob(name=f"{self.ns}_ingest", sinks=[str(self.t("shopping"))], source=source),
            SqlJob(
                f"{self.ns}_user_item_amount",
                f"INSERT INTO {self.t('user_item_amount')} SELECT user_id, item_id, "
                f"sum(amount) AS amount FROM {self.t('shopping')} GROUP BY user_id, item_id",
            ),
            SqlJob(
                f"{self.ns}_user_item_price",
                f"INSERT INTO {self.t('user_item_price')} SELECT user_id, item_id, "
                f"sum(amount * price) AS price FROM {self.t('shopping')} GROUP BY user_id, item_id",
            ),
        ]

    def produce(self, round_no):
        rows = [
            (self.rng.randrange(10), self.rng.randrange(5), self.rng.randrange(1, 5), float(self.rng.randrange(1, 50)))
            for _ in range(40)
        ]
        with psycopg.connect(self.dsn, autocommit=True) as c, c.cursor() as cur:
            cur.executemany(
                "INSERT INTO public.demo_shopping (user_id, item_id, amount, price) VALUES (%s, %s, %s, %s)", rows
            )

    def check(self, spark, reader):
        q = reader.sql(
            spark,
            f"""
            SELECT (SELECT sum(amount) FROM {self.t("shopping")}) AS src_amount,
                   (SELECT sum(amount * price) FROM {self.t("shopping")}) AS src_price,
                   (SELECT sum(amount) FROM {self.t("user_item_amount")}) AS amount,
                   (SELECT sum(price) FROM {self.t("user_item_price")}) AS price""",
        ).collect()[0]
        if (q.src_amount or 0) != (q.amount or 0) or abs((q.src_price or 0) - (q.price or 0)) > 1e-6:
            return (
                f"shopping has amount {_sum(q.src_amount)} / revenue {_sum(q.src_price)}, but user_item_amount "
                f"says {_sum(q.amount)} and user_item_price {_sum(q.price)}"
            )
        return None


def _sum(value) -> str:
    """A SUM as a person reads it: an empty table sums to no row, not to None."""
    return "no rows" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


class Transfers(Scenario):
    name = "transfers"

    def setup(self, spark):
        self.tables = {n: TableName.parse(f"lake.{self.ns}.{n}") for n in ("ledger", "balances")}
        spark.sql(f"CREATE NAMESPACE IF NOT EXISTS lake.{self.ns}")
        spark.sql(
            f"CREATE TABLE IF NOT EXISTS {self.t('ledger')} (transfer_id bigint, account bigint, delta bigint, "
            f"ts timestamp) USING iceberg"
        )
        spark.sql(f"CREATE TABLE IF NOT EXISTS {self.t('balances')} (account bigint, balance bigint) USING iceberg")
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute(
                "CREATE TABLE IF NOT EXISTS public.demo_transfer_legs (id bigserial PRIMARY KEY, "
                "transfer_id bigint, account bigint, delta bigint, ts timestamptz NOT NULL DEFAULT now())"
            )
        source = PostgresSource(
            self.dsn, "public.demo_transfer_legs", ["transfer_id", "account", "delta", "ts"], event_time="ts"
        )
        opening = " UNION ALL ".join(f"SELECT {a} AS account, {OPENING} AS delta" for a in range(ACCOUNTS))
        return [
            RootJob(name=f"{self.ns}_ledger", sinks=[str(self.t("ledger"))], source=source),
            SqlJob(
                f"{self.ns}_balances",
                f"INSERT INTO {self.t('balances')} SELECT account, sum(delta) AS balance "
                f"FROM (SELECT account, delta FROM {self.t('ledger')} UNION ALL {opening}) GROUP BY account",
            ),
        ]

    def produce(self, round_no):
        with psycopg.connect(self.dsn, autocommit=True) as c:
            for i in range(10):
                a, b = self.rng.sample(range(ACCOUNTS), 2)
                amount = self.rng.randrange(1, 100)
                with c.transaction():  # one source transaction, both legs stamped now()
                    tid = round_no * 1000 + i
                    c.execute(
                        "INSERT INTO public.demo_transfer_legs (transfer_id, account, delta) "
                        "VALUES (%s, %s, %s), (%s, %s, %s)",
                        (tid, a, -amount, tid, b, amount),
                    )

    def check(self, spark, reader):
        rows = reader.sql(
            spark,
            f"""
            SELECT b.account, b.balance, {OPENING} + coalesce(sum(l.delta), 0) AS from_ledger
            FROM {self.t("balances")} b LEFT JOIN {self.t("ledger")} l ON l.account = b.account
            GROUP BY b.account, b.balance""",
        ).collect()
        total = sum(r.balance for r in rows)
        if rows and total != ACCOUNTS * OPENING:
            return f"total balance is {total}, not {ACCOUNTS * OPENING}"
        wrong = [r for r in rows if r.balance != r.from_ledger]
        if wrong:
            r = wrong[0]
            return f"account {r.account}: balances says {r.balance}, its ledger says {r.from_ledger}"
        return None


SCENARIOS = {"shopping": Shopping, "transfers": Transfers}


def run_demo(
    conn: psycopg.Connection,
    settings,
    spark,
    catalog,
    *,
    scenario: str,
    rounds: int = 6,
    seed: int = 7,
    progress: Callable[[str], None] = print,
    step: Callable[[int, int, str], None] | None = None,
) -> DemoResult:
    """Run one scenario; ``progress`` gets a line per barrier, ``step`` (barriers done, of, what
    runs now) drives a live display."""
    step = step or (lambda done, of, what: None)
    started = time.perf_counter()
    sc = SCENARIOS[scenario](f"demo_{scenario}", settings.dsn, seed)
    chain = sc.setup(spark)
    runtimes = [Runtime(j, settings=settings, spark=spark, conn=conn, log=lambda _: None) for j in chain]
    for rt in runtimes:
        rt.register()
    barriers.set_interval_s(conn, 3600)  # the demo issues its own barriers
    definitions = list(jobs.load_definitions(conn).values())
    result = DemoResult(
        scenario=scenario,
        topology_text=topology.render_text(definitions),
        topology_mermaid=topology.render_mermaid(topology.edges_of(definitions)),
        barriers=rounds,
    )
    result.levels = {lvl.value: LevelStats() for lvl in Level}
    names = list(sc.tables.values())

    def read_all(tag: str) -> None:
        for level in (Level.READ_UNCOMMITTED, Level.READ_COMMITTED):
            with ConsistentRead(conn, catalog, names, level=level, holder="demo") as r:
                stats = result.levels[level.value]
                try:
                    problem = sc.check(spark, r)
                except NoValidCutError:
                    continue  # not every table has completed a barrier yet: nothing to read
                stats.queries += 1
                if problem:
                    stats.anomalies += 1
                    stats.example = stats.example or f"{tag}: {problem}"

    rr_reader = None
    rr_first = None
    for round_no in range(1, rounds + 1):
        sc.produce(round_no)
        b = barriers.issue(conn).barrier
        progress(f"[{scenario}] barrier {round_no}/{rounds}, {barrier_label(b)}: jobs run at different speeds")
        for i, rt in enumerate(runtimes):
            # The last job is slow: it catches up only every other barrier.
            if i == len(runtimes) - 1 and round_no % 2 == 1 and round_no != rounds:
                continue
            step(round_no - 1, rounds, f"barrier {round_no}/{rounds}: job {rt.job.name} runs")
            while True:
                done = rt.run(max_barriers=1).completed
                read_all(f"barrier {round_no}, after {rt.job.name}")
                if not done:
                    break
        if round_no == 2:
            # A session needs a first consistent cut: wait for it (bounded), running the jobs meanwhile.
            reads.wait_for_cut(
                conn,
                names,
                timeout_s=120,
                progress=lambda line: progress(f"[{scenario}] {line}"),
                idle=lambda: [rt.run(max_barriers=1) for rt in runtimes],
            )
            rr_reader = ConsistentRead(conn, catalog, names, level=Level.REPEATABLE_READ, holder="demo-session")
            rr_reader.__enter__()
            rr_first = _snapshot_of(spark, rr_reader, names)
        if rr_reader is not None:
            stats = result.levels[Level.REPEATABLE_READ.value]
            stats.queries += 1
            problem = sc.check(spark, rr_reader)
            if problem:
                stats.anomalies += 1
                stats.example = stats.example or problem
            if _snapshot_of(spark, rr_reader, names) != rr_first:
                result.repeatable_read_changes += 1
    step(rounds, rounds, "lease-protected expiry")
    pinned_barrier = rr_reader.cut().barrier if rr_reader else None
    progress(
        f"[{scenario}] lease-protected expiry of {names[0]} (a repeatable-read session pins barrier "
        f"{barrier_label(pinned_barrier)})"
    )
    report = expire(conn, catalog, names[0])
    held = [s for s, why in report.protected.items() if any(w.startswith("lease:") for w in why)]
    result.expiry = {
        "table": str(names[0]),
        "expired": len(report.expired),
        "kept": len(report.protected),
        "kept_by_lease": held,
        "files_deleted": report.files_deleted,
    }
    if rr_reader is not None:
        stats = result.levels[Level.REPEATABLE_READ.value]
        stats.queries += 1
        if sc.check(spark, rr_reader):
            stats.anomalies += 1
        rr_reader.__exit__(None, None, None)
    result.table_delays = delays.table_delays(conn, last=rounds)
    result.job_delays = delays.job_delays(conn, last=rounds)
    result.seconds = time.perf_counter() - started
    return result


def _snapshot_of(spark, reader: ConsistentRead, names: list[TableName]) -> list:
    """What a repeatable-read session sees, as plain values (to detect any change)."""
    return [sorted(map(tuple, reader.df(spark, n).collect())) for n in names]
