"""``icebarrier check``: a seeded, randomized consistency checker (in the spirit of Zippy).

Root and intermediate jobs run as separate OS processes (PyIceberg writes, no JVM),
completing barriers at random speeds; some are killed at random fault points and
restarted. Meanwhile readers query at every level, leases pin repeatable-read sessions and
expiry runs. Everything is validated against a model that is a pure function of the seed:

- orders/payments (event-time): a payment is never visible without its order;
- transfers: balances equal opening balance + ledger, and the total never changes;
- paid: the derived count agrees with its source;
- no (table, barrier) is lost or duplicated: every past barrier's cut holds exactly the
  model's rows; no pinned snapshot is expired; repeatable-read sessions never see a change.

Events are numbered; event i has event time i. Barrier number k (the k-th barrier issued)
closes the events with time <= k * WINDOW, so a barrier's input is a pure function of the
barrier, replayable after a crash.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import psycopg

from icebarrier.control_plane import barriers, db, jobs, leases, runs
from icebarrier.control_plane.errors import BarrierNotValidError, IcebarrierError, NoValidCutError, SnapshotExpiredError
from icebarrier.control_plane.model import JobDefinition, Level, TableName
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import create_table, load_catalog, load_table
from icebarrier.iceberg_ext.commits import BarrierCommit
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.maintenance import expire
from icebarrier.iceberg_ext.reads import ConsistentRead
from icebarrier.iceberg_ext.runtime import inputs_at

WINDOW = 4
ACCOUNTS = 5
OPENING = 100
SCHEMAS = {
    "orders": pa.schema([("order_id", pa.int64())]),
    "payments": pa.schema([("order_id", pa.int64()), ("t", pa.int64())]),
    "ledger": pa.schema([("transfer_id", pa.int64()), ("account", pa.int64()), ("delta", pa.int64())]),
    "balances": pa.schema([("account", pa.int64()), ("balance", pa.int64())]),
    "paid": pa.schema([("payments", pa.int64()), ("with_order", pa.int64())]),
}
ROOTS = {"orders_in": "orders", "payments_in": "payments", "ledger_in": "ledger"}
DERIVED = {"balances_job": (["ledger"], "balances"), "paid_job": (["orders", "payments"], "paid")}


# -- the model: a pure function of the seed -----------------------------------------------------------


def payment_time(seed: int, order_id: int) -> int:
    return order_id + random.Random(seed * 7919 + order_id).randrange(0, 3 * WINDOW)


def transfer(seed: int, transfer_id: int) -> tuple[int, int, int]:
    rng = random.Random(seed * 104729 + transfer_id)
    a, b = rng.sample(range(ACCOUNTS), 2)
    return a, b, rng.randrange(1, 20)


def events(seed: int, table: str, t_from: int, t_to: int) -> pa.Table:
    """The model's rows of a root table with event time in (t_from, t_to]."""
    if table == "orders":
        return pa.table({"order_id": pa.array(range(t_from + 1, t_to + 1), pa.int64())}, schema=SCHEMAS["orders"])
    if table == "payments":
        ids = [o for o in range(max(1, t_from - 3 * WINDOW), t_to + 1) if t_from < payment_time(seed, o) <= t_to]
        return pa.table({"order_id": pa.array(ids, pa.int64()),
                         "t": pa.array([payment_time(seed, o) for o in ids], pa.int64())}, schema=SCHEMAS["payments"])
    rows = []
    for tid in range(t_from + 1, t_to + 1):
        a, b, amount = transfer(seed, tid)
        rows += [(tid, a, -amount), (tid, b, amount)]
    return pa.table({"transfer_id": pa.array([r[0] for r in rows], pa.int64()),
                     "account": pa.array([r[1] for r in rows], pa.int64()),
                     "delta": pa.array([r[2] for r in rows], pa.int64())}, schema=SCHEMAS["ledger"])


def check_cut(data: dict[str, pa.Table]) -> str | None:
    """The invariants every consistent cut satisfies; None, or the first violation."""
    orders = set(data["orders"]["order_id"].to_pylist())
    orphan = [o for o in data["payments"]["order_id"].to_pylist() if o not in orders]
    if orphan:
        return f"payment for order {orphan[0]} visible without its order"
    balances = dict(zip(data["balances"]["account"].to_pylist(), data["balances"]["balance"].to_pylist()))
    if balances and sum(balances.values()) != ACCOUNTS * OPENING:
        return f"total balance {sum(balances.values())} != {ACCOUNTS * OPENING}"
    ledger = Counter()
    for account, delta in zip(data["ledger"]["account"].to_pylist(), data["ledger"]["delta"].to_pylist()):
        ledger[account] += delta
    for account, balance in balances.items():
        if balance != OPENING + ledger[account]:
            return f"account {account}: balances {balance} but ledger gives {OPENING + ledger[account]}"
    paid = data["paid"].to_pylist()
    if paid and (paid[0]["payments"] != data["payments"].num_rows or paid[0]["with_order"] != paid[0]["payments"]):
        return f"paid says {paid[0]} but payments has {data['payments'].num_rows} rows"
    return None


# -- jobs (run in worker processes) -----------------------------------------------------------------------


@dataclass
class Env:
    settings: Settings
    ns: str
    seed: int

    def t(self, name: str) -> TableName:
        return TableName.parse(f"lake.{self.ns}.{name}")

    def argv(self) -> list[str]:
        return [self.settings.dsn, self.settings.schema, self.settings.warehouse, self.ns, str(self.seed)]


def barrier_number(conn: psycopg.Connection, barrier: int) -> int:
    return conn.execute("SELECT count(*) AS n FROM barrier WHERE barrier <= %s", (barrier,)).fetchone()["n"]


def root_step(env: Env, conn, catalog, job: str, barrier: int, previous: int | None) -> None:
    table = ROOTS[job]
    spec = runs.recorded_range(conn, job, barrier)
    if spec is None:
        t_from = barrier_number(conn, previous) * WINDOW if previous is not None else 0
        spec = runs.record_range(conn, job, barrier, {"t_from": t_from, "t_to": barrier_number(conn, barrier) * WINDOW})
    faults.point(faults.AFTER_INPUT_RANGE)
    with BarrierCommit(conn, catalog, job=job, barrier=barrier) as tx:
        tx.append_arrow(env.t(table), events(env.seed, table, spec["t_from"], spec["t_to"]))


def derived_step(env: Env, conn, catalog, job: str, barrier: int, previous: int | None) -> None:
    sources, sink = DERIVED[job]
    with inputs_at(conn, catalog, job, [env.t(s) for s in sources], barrier, bootstrap=previous is None) as r:
        _, data = r.read()
    data = {t.name: d for t, d in data.items()}
    if sink == "balances":
        totals = Counter({a: OPENING for a in range(ACCOUNTS)})
        for account, delta in zip(data["ledger"]["account"].to_pylist(), data["ledger"]["delta"].to_pylist()):
            totals[account] += delta
        out = pa.table({"account": pa.array(sorted(totals), pa.int64()),
                        "balance": pa.array([totals[a] for a in sorted(totals)], pa.int64())}, schema=SCHEMAS[sink])
    else:
        orders = set(data["orders"]["order_id"].to_pylist())
        pays = data["payments"]["order_id"].to_pylist()
        out = pa.table({"payments": pa.array([len(pays)], pa.int64()),
                        "with_order": pa.array([sum(1 for p in pays if p in orders)], pa.int64())}, schema=SCHEMAS[sink])
    with BarrierCommit(conn, catalog, job=job, barrier=barrier) as tx:
        tx.overwrite_arrow(env.t(sink), out)


def worker(env: Env, job: str, until_barrier: int, speed_seed: int) -> None:
    """Complete the job's barriers, at a random pace, up to ``until_barrier``."""
    rng = random.Random(speed_seed)
    catalog = load_catalog(env.settings)
    with db.connect(env.settings.dsn, env.settings.schema) as conn:
        while True:
            info = jobs.show(conn, job)
            if info.progress is not None and info.progress >= until_barrier:
                return
            nb = jobs.next_barrier(conn, job)
            if not nb.ready:
                time.sleep(0.05)
                continue
            time.sleep(rng.random() * 0.15)
            if job in ROOTS:
                root_step(env, conn, catalog, job, nb.barrier, info.progress)
                continue
            try:
                derived_step(env, conn, catalog, job, nb.barrier, info.progress)
            except SnapshotExpiredError:
                if info.progress is not None:
                    raise  # with progress, its inputs are protected: this would be a bug
                # bootstrapping: expiry took the start snapshot first; start at a newer barrier


# -- the driver ------------------------------------------------------------------------------------------------


@dataclass
class CheckReport:
    seed: int
    barriers: int = 0
    reads: dict[str, int] = field(default_factory=lambda: {lvl.value: 0 for lvl in Level})
    anomalies: dict[str, int] = field(default_factory=lambda: {lvl.value: 0 for lvl in Level})
    examples: dict[str, str] = field(default_factory=dict)
    faults: Counter = field(default_factory=Counter)
    leases_refused: int = 0
    snapshots_expired: int = 0
    pinned_expired: int = 0
    repeatable_read_changes: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.violations and not self.pinned_expired and not self.repeatable_read_changes
                and self.anomalies["read-committed"] == 0 and self.anomalies["repeatable-read"] == 0)

    def to_json(self) -> dict:
        return {"seed": self.seed, "ok": self.ok, "barriers": self.barriers, "reads": self.reads,
                "anomalies": self.anomalies, "examples": self.examples, "faults": dict(self.faults),
                "leases_refused": self.leases_refused, "snapshots_expired": self.snapshots_expired,
                "pinned_snapshots_expired": self.pinned_expired,
                "repeatable_read_changes": self.repeatable_read_changes, "violations": self.violations}


def setup(env: Env, conn) -> None:
    catalog = load_catalog(env.settings)
    for name, schema in SCHEMAS.items():
        create_table(catalog, env.t(name), schema)
    for job, table in ROOTS.items():
        jobs.register(conn, JobDefinition(name=job, sinks=frozenset([env.t(table)]),
                                          external_inputs=frozenset([f"model:{table}"])))
    for job, (sources, sink) in DERIVED.items():
        jobs.register(conn, JobDefinition(name=job, sources=frozenset(env.t(s) for s in sources),
                                          sinks=frozenset([env.t(sink)])))
    barriers.set_interval_s(conn, 86400)  # only the driver issues barriers


def run_check(env: Env, *, duration_s: float = 20, fault_rate: float = 0.3, progress=print) -> CheckReport:
    rng = random.Random(env.seed)
    report = CheckReport(seed=env.seed)
    catalog = load_catalog(env.settings)
    names = [env.t(n) for n in SCHEMAS]
    with db.connect(env.settings.dsn, env.settings.schema) as conn:
        setup(env, conn)
        target_count = max(3, int(duration_s / 1.0))
        first = barriers.issue(conn).barrier
        report.barriers = 1
        procs: dict[str, subprocess.Popen] = {}
        launches = Counter()

        def launch(job: str, until: int) -> None:
            launches[job] += 1
            env_vars = {**os.environ, faults.FAULT_ENV: "", faults.FAULT_AFTER_ENV: "0"}
            point = rng.choice(faults.POINTS) if rng.random() < fault_rate else None
            if point:
                env_vars.update({faults.FAULT_ENV: point, faults.FAULT_AFTER_ENV: str(rng.randrange(0, 3))})
            procs[job] = subprocess.Popen(
                [sys.executable, "-m", "icebarrier.apps.check", "worker", *env.argv(), job, str(until),
                 str(env.seed * 31 + launches[job])],
                env=env_vars, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs[job].fault = point  # type: ignore[attr-defined]

        final = None
        all_jobs = [*ROOTS, *DERIVED]
        deadline = time.monotonic() + duration_s
        for job in all_jobs:
            launch(job, 2**62)
        rr: ConsistentRead | None = None
        rr_seen = None
        while True:
            now = time.monotonic()
            if final is None and (now > deadline or report.barriers >= target_count * 3):
                final = barriers.newest(conn).barrier
                progress(f"check: {report.barriers} barriers issued; waiting for every job to complete the last")
                for job in all_jobs:  # a hard kill mid-work, then a run that stops at the final barrier
                    procs[job].kill()
                    procs[job].wait()
                    report.faults[f"{job}@killed"] += 1
                    launch(job, final)
            if final is None and rng.random() < 0.5:
                barriers.issue(conn)
                report.barriers += 1
            if final is None and rng.random() < 0.04 * fault_rate / 0.3:  # a kill -9 at a random moment
                victim = rng.choice(all_jobs)
                if procs[victim].poll() is None:
                    procs[victim].kill()
                    procs[victim].wait()
                    report.faults[f"{victim}@killed"] += 1
            for job in all_jobs:  # restart crashed workers
                p = procs[job]
                code = p.poll()
                if code is None:
                    continue
                if code == faults.CRASH_EXIT_CODE:
                    report.faults[f"{job}@{p.fault}"] += 1
                elif code != 0 and code != -9:
                    raise IcebarrierError(f"check worker {job} failed (exit {code}): {p.stderr.read()[-2000:]}")
                if final is None or code != 0 or jobs.show(conn, job).progress != final:
                    launch(job, final or 2**62)
            _read_at_levels(conn, catalog, names, report, rng)
            if rr is None and rng.random() < 0.2:
                try:
                    rr = ConsistentRead(conn, catalog, names, level=Level.REPEATABLE_READ, ttl_s=600, holder="check")
                    rr.__enter__()
                    rr_seen = _read(rr)
                except (NoValidCutError, SnapshotExpiredError):
                    report.leases_refused += 1
                    rr = None
            elif rr is not None:
                report.reads["repeatable-read"] += 1
                again = _read(rr)
                if again != rr_seen:
                    report.repeatable_read_changes += 1
                problem = check_cut({t.name: d for t, d in rr.read()[1].items()})
                if problem:
                    report.anomalies["repeatable-read"] += 1
                    report.examples.setdefault("repeatable-read", problem)
                if rng.random() < 0.3:
                    rr.__exit__(None, None, None)
                    rr = None
            if rng.random() < 0.3:
                _expire(conn, catalog, names, report, rng)
            if final is not None and all(
                    procs[j].poll() is not None and jobs.show(conn, j).progress == final for j in all_jobs):
                break
            time.sleep(0.05)
        if rr is not None:
            rr.__exit__(None, None, None)
        _validate_history(env, conn, catalog, names, first, final, report)
    return report


def _read(reader: ConsistentRead) -> dict:
    _, data = reader.read()
    return {t.name: sorted(map(tuple, (tuple(r.values()) for r in d.to_pylist()))) for t, d in data.items()}


def _read_at_levels(conn, catalog, names, report: CheckReport, rng) -> None:
    for level in (Level.READ_UNCOMMITTED, Level.READ_COMMITTED):
        try:
            with ConsistentRead(conn, catalog, names, level=level) as r:
                data = {t.name: d for t, d in r.read()[1].items()}
        except (NoValidCutError, SnapshotExpiredError):
            continue
        except Exception as exc:  # a snapshot expired under a read-uncommitted reader, etc.
            if level is Level.READ_UNCOMMITTED:
                continue
            raise IcebarrierError(f"read at {level.value} failed: {exc}") from exc
        report.reads[level.value] += 1
        problem = check_cut(data)
        if problem:
            report.anomalies[level.value] += 1
            report.examples.setdefault(level.value, problem)


def _expire(conn, catalog, names, report: CheckReport, rng) -> None:
    table = rng.choice(names)
    before = {lease.lease_id: lease.snapshots for lease in leases.list_leases(conn)}
    result = expire(conn, catalog, table)
    report.snapshots_expired += len(result.expired)
    pinned = {s for snaps in before.values() for t, s in snaps.items() if t == table}
    report.pinned_expired += len(pinned & set(result.expired))
    present = {s.snapshot_id for s in load_table(catalog, table).metadata.snapshots}
    live = {s for lease in leases.list_leases(conn) for t, s in lease.snapshots.items() if t == table and s}
    report.pinned_expired += len(live - present)


def _validate_history(env: Env, conn, catalog, names, first: int, final: int, report: CheckReport) -> None:
    """Every barrier's cut holds exactly the model's rows: nothing lost, nothing doubled."""
    marks = [r["barrier"] for r in conn.execute(
        "SELECT barrier FROM barrier WHERE barrier BETWEEN %s AND %s ORDER BY barrier", (first, final)).fetchall()]
    for b in marks:
        try:
            with ConsistentRead(conn, catalog, names, barrier=b) as r:
                data = {t.name: d for t, d in r.read()[1].items()}
        except (SnapshotExpiredError, NoValidCutError, BarrierNotValidError):
            continue  # expired history (unpinned), or before every job had started
        k = barrier_number(conn, b)
        for table in ROOTS.values():
            expected = sorted(map(tuple, (tuple(x.values()) for x in events(env.seed, table, 0, k * WINDOW).to_pylist())))
            got = sorted(map(tuple, (tuple(x.values()) for x in data[table].to_pylist())))
            if got != expected:
                dup = len(got) - len(set(got))
                report.violations.append(f"{table} at barrier #{k}: {len(got)} rows ({dup} duplicated), "
                                         f"model has {len(expected)}")
        problem = check_cut(data)
        if problem:
            report.violations.append(f"cut at barrier #{k}: {problem}")


def main(argv: list[str]) -> None:
    if argv[0] != "worker":
        raise SystemExit("usage: python -m icebarrier.apps.check worker DSN SCHEMA WAREHOUSE NS SEED JOB UNTIL SPEED_SEED")
    dsn, schema_name, warehouse, ns, seed, job, until, speed = argv[1:]
    env = Env(settings=Settings(dsn=dsn, schema=schema_name, warehouse=warehouse).validated(), ns=ns, seed=int(seed))
    worker(env, job, int(until), int(speed))


if __name__ == "__main__":
    main(sys.argv[1:])
