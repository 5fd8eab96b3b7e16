"""Incremental SqlJobs on real Spark, Iceberg and Postgres: after every barrier the sink equals
the query recomputed in full at that barrier, and each computation says how it was made."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icebarrier.cli.main import cli as command
from icebarrier.control_plane import barriers, jobs, tokens
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.job import SqlJob
from icebarrier.iceberg_ext.maintenance import compact, revise
from icebarrier.iceberg_ext.runtime import Runtime
from tests.iceberg_ext import incremental_pipeline as pipe
from tests.iceberg_ext.catalog_server import access_token
from tests.iceberg_ext.test_status_page import scrape

JOIN_THEN_AGGREGATE = """
SELECT o.user_id, count(*) AS n, count(o.price) AS priced, sum(o.amount) AS amount, avg(o.price) AS avg_price,
       min(o.item) AS first_item, max(o.price) AS top_price
FROM {orders} o JOIN {ships} s ON o.order_id = s.order_id
WHERE o.amount > 0
GROUP BY o.user_id"""


class SqlJobUnderTest:
    """One SqlJob over a fresh ``orders`` / ``ships`` pair, run in the runtime like a job file."""

    _made = itertools.count()

    def __init__(self, lake, spark, query: str, **kw) -> None:
        n = next(self._made)
        self.lake, self.spark, self.query = lake, spark, query
        self.tables = pipe.setup(lake, f"_{n}")
        self.name = f"q_{n}"
        self.sink = lake.T(f"out_{n}")
        text = query.format(**{k: str(t) for k, t in self.tables.items()})
        spark.sql(f"CREATE TABLE {self.sink} USING iceberg AS SELECT * FROM ({text}) WHERE false")
        self.job = SqlJob(self.name, f"INSERT OVERWRITE {self.sink} {text}", **kw)
        self.orders = 0  # order ids handed out

    def runtime(self) -> Runtime:
        return Runtime(self.job, settings=self.lake.settings, spark=self.spark, conn=self.lake.conn, log=lambda _: None)

    def barrier(self, orders: list[dict], ships: list[dict]) -> int:
        b = barriers.issue(self.lake.conn).barrier
        pipe.ingest(self.lake, self.tables, b, orders, ships)
        return b

    def exact_at(self, barrier: int) -> None:
        got = pipe.sink_rows(self.spark, self.lake, self.sink, barrier)
        want = pipe.recomputed(self.spark, self.lake, self.query, self.tables, barrier)
        assert pipe.same_rows(got, want), (self.query, sorted(got, key=repr), sorted(want, key=repr))

    def computation(self) -> dict:
        return jobs.show(self.lake.conn, self.name).computation


def _orders(first: int, n: int, users: int = 3) -> list[dict]:
    return [
        {
            "order_id": first + i,
            "user_id": (first + i) % users if i % 7 else None,
            "item": f"i{(first + i) % 5}",
            "amount": (first + i) % 4,
            "price": None if i % 5 == 0 else (first + i) * 0.1,
        }
        for i in range(n)
    ]


def test_join_then_aggregate_is_incremental_and_exact(lake, spark):
    """The seed's shape: a join, then COUNT/SUM/AVG/MIN/MAX per group (an AVG: a state table)."""
    t = SqlJobUnderTest(lake, spark, JOIN_THEN_AGGREGATE)
    runtime = t.runtime()
    for k in range(4):
        orders = _orders(100 * k, 20)
        ships = [{"order_id": o["order_id"], "carrier": "x"} for o in orders[::2]]
        ships += [{"order_id": 100 * (k - 1) + 1, "carrier": "late"}] if k else []  # an older order ships
        b = t.barrier(orders, ships)
        runtime.run()
        t.exact_at(b)
        assert t.computation()["incremental"] == (k > 0), t.computation()
    assert jobs.show(lake.conn, t.name).definition.sinks == {t.sink, lake.T(t.sink.name + "__icebarrier_state")}


def test_a_failure_only_ansi_mode_raises_is_one_line_naming_the_setting(lake, spark):
    """Spark 4 runs SQL in ANSI mode by default: a job whose query casts a value that is not a
    number fails its barrier in one line naming the condition and `spark.sql.ansi.enabled`, and
    completes nothing; with ANSI mode off the same barrier computes (the cast gives NULL)."""
    t = SqlJobUnderTest(
        lake,
        spark,
        "SELECT o.order_id, CAST(o.item AS INT) AS item_no FROM {orders} o JOIN {ships} s ON o.order_id = s.order_id",
    )
    orders = _orders(0, 4)
    b = t.barrier(orders, [{"order_id": o["order_id"], "carrier": "x"} for o in orders])
    was = spark.conf.get("spark.sql.ansi.enabled")
    try:
        spark.conf.set("spark.sql.ansi.enabled", "true")
        with pytest.raises(IcebarrierError) as failed:
            t.runtime().run()
        said = str(failed.value)
        assert "[CAST_INVALID_INPUT]" in said and "spark.sql.ansi.enabled=false" in said, said
        assert "\n" not in said and "SQLSTATE" not in said, said
        assert jobs.show(lake.conn, t.name).progress is None
        spark.conf.set("spark.sql.ansi.enabled", "false")
        t.runtime().run()
        assert jobs.show(lake.conn, t.name).progress == b
        assert {r.item_no for r in spark.table(str(t.sink)).collect()} == {None}
    finally:
        spark.conf.set("spark.sql.ansi.enabled", was)


# -- the property: any query of the class, any history, equals the full recompute -------------------------------

FILTERS = ("", "WHERE o.amount > 1", "WHERE o.price IS NOT NULL AND o.amount <> 2", "WHERE o.item IN ('i1', 'i2')")
JOIN = "JOIN {ships} s ON o.order_id = s.order_id"
ROWS = (
    "SELECT o.order_id, o.user_id, o.amount * 2 AS a2, upper(o.item) AS item FROM {orders} o {where}",
    "SELECT o.order_id, o.user_id, s.carrier FROM {orders} o " + JOIN + " {where}",
    # three occurrences, one table twice: every pair of a user's orders that both shipped
    "SELECT o.order_id, p.order_id AS other, s.carrier FROM {orders} o " + JOIN + " JOIN {orders} p "
    "ON p.user_id = o.user_id AND p.order_id < o.order_id {where}",
    "SELECT o.order_id, o.user_id FROM {orders} o {where} UNION ALL "
    "SELECT o.order_id, o.user_id FROM {orders} o " + JOIN + " WHERE s.carrier IS NOT NULL",
)
KEYS = ("o.user_id", "o.item", "s.carrier")  # s.carrier: with the join only
AGGREGATES = (
    "count(*)",
    "count(o.price)",
    "sum(o.amount)",
    "sum(o.price)",
    "min(o.item)",
    "max(o.price)",
    "avg(o.price)",
    "avg(o.amount)",
    "min(o.amount * 2 + 1)",
)


@st.composite
def queries(draw) -> str:
    where = draw(st.sampled_from(FILTERS))
    if draw(st.booleans()):
        return draw(st.sampled_from(ROWS)).replace("{where}", where)
    join = draw(st.booleans())
    keys = draw(st.lists(st.sampled_from(KEYS if join else KEYS[:2]), max_size=2, unique=True))
    aggregates = draw(st.lists(st.sampled_from(AGGREGATES), min_size=1, max_size=4, unique=True))
    items = keys + [f"{a} AS a{i}" for i, a in enumerate(aggregates)]
    group = f" GROUP BY {', '.join(keys)}" if keys else ""
    return f"SELECT {', '.join(items)} FROM {{orders}} o {JOIN if join else ''} {where}{group}"


def order_rows(first: int):
    """A batch of new orders (ids from ``first``): NULLs, skewed and new keys."""
    row = st.fixed_dictionaries(
        {
            "user_id": st.one_of(st.none(), st.sampled_from([0, 0, 0, 1, 2]), st.integers(3, 50)),
            "item": st.one_of(st.none(), st.sampled_from(["i1", "i2", "i3"])),
            "amount": st.one_of(st.none(), st.integers(0, 5)),
            "price": st.one_of(st.none(), st.integers(0, 100_000).map(lambda c: c / 100)),
        }
    )
    return st.lists(row, max_size=12).map(lambda rows: [{"order_id": first + i, **r} for i, r in enumerate(rows)])


class _Crash(BaseException):
    """A process killed at a fault point: what it committed stays, the rest is gone."""


def _crashing_at(monkeypatch, point: str, after: int) -> None:
    passed = itertools.count()

    def crash(name: str) -> None:
        if name == point and next(passed) >= after:
            raise _Crash(name)

    monkeypatch.setattr(faults, "point", crash)


STEPS = st.sampled_from(["append", "append", "append", "hold", "crash", "revise", "delete", "compact"])


@pytest.mark.slow
@settings(
    max_examples=int(os.environ.get("ICEBARRIER_INCREMENTAL_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(query=queries(), data=st.data())
def test_incremental_equals_full_recompute(lake, spark, query, data):
    """Random append batches to ``orders`` and ``ships``, a random query of the class; barriers
    computed one by one, held back and coalesced, skipped (nothing new), crashed after a commit
    and resumed, and revised (cascading into the job's sink and state): at every barrier the job
    computes, its sink equals the query recomputed in full at that barrier, and a barrier after
    only appends since the previous computation is computed incrementally."""
    t = SqlJobUnderTest(lake, spark, query)
    t.runtime().register()
    assert t.job.not_incremental is None, t.job.not_incremental
    computed: list[int] = []  # barriers the job completed by a computation
    clean = False  # only appends since the job's previous computation
    orders_written = False  # orders has a snapshot (rows were appended, or deleted)
    orders_at_previous: bool | None = False  # ... at the job's previous computation (None: unknown)
    for step in ["append"] + data.draw(st.lists(STEPS, min_size=2, max_size=5), label="steps"):
        if step == "revise":
            if len(computed) < 2:
                continue
            to = data.draw(st.sampled_from(computed[:-1]), label="revise to")
            revise(lake.conn, lake.catalog, t.tables["orders"], to)
            computed = [b for b in computed if b <= to]
            clean, orders_at_previous = False, None
            continue
        if step == "compact":  # of a source or of the job's sink: nothing changes, the job stays incremental
            table = data.draw(st.sampled_from([t.tables["orders"], t.sink]), label="compact")
            try:
                compact(spark, lake.conn, lake.catalog, table, min_input_files=1)
            except IcebarrierError:  # nothing committed to compact yet
                pass
            continue
        if step == "delete":  # a user's orders deleted: the job's next computation is in full
            b = barriers.issue(lake.conn).barrier
            deleted = pipe.delete_orders(lake, t.tables, b, data.draw(st.sampled_from([0, 1, 2]), label="delete user"))
            orders_written = orders_written or deleted
            if t.runtime().run().computations:
                computed.append(b)
                # else only appends (held barriers) came since, or orders was empty at the previous
                # computation (every row in it now is new): incremental is right
                if deleted and orders_at_previous:
                    assert not t.computation()["incremental"] and "operation" in t.computation()["reason"]
                clean, orders_at_previous = True, orders_written
            t.exact_at(b)
            continue
        orders = data.draw(order_rows(t.orders), label="orders")
        t.orders += len(orders)
        orders_written = orders_written or bool(orders)
        known = list(range(t.orders))
        ships = data.draw(
            st.lists(
                st.fixed_dictionaries({"order_id": st.sampled_from(known), "carrier": st.sampled_from(["x", "y"])}),
                max_size=8,
            )
            if known
            else st.just([]),
            label="ships",
        )
        b = t.barrier(orders, ships)
        if step == "hold":  # the next computation coalesces this barrier
            continue
        if step == "crash":
            with pytest.MonkeyPatch.context() as mp:
                _crashing_at(mp, faults.AFTER_ICEBERG_COMMIT, data.draw(st.integers(0, 1), label="commits before"))
                try:
                    t.runtime().run()  # a skip (nothing new for the job) reaches no commit
                except _Crash:
                    pass
        before = t.computation()
        summary = t.runtime().run()
        if summary.computations:
            computed.append(b)
            if clean:
                assert t.computation()["incremental"], t.computation()
            clean, orders_at_previous = True, orders_written
        else:
            assert t.computation() == before  # a skip computes nothing
        t.exact_at(b)


# -- killed processes ---------------------------------------------------------------------------------------------


def _worker(lake, t: SqlJobUnderTest, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.iceberg_ext.incremental_worker",
            lake.settings.dsn,
            lake.settings.schema,
            lake.settings.warehouse,
            t.name,
            t.job.statement,
        ],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_job_killed_mid_run_resumes_exactly(lake, spark):
    """The join-then-aggregate job (a sink and a state table) runs in a process of its own:
    killed by the fault point after its first table commit (the sink written, the state not),
    then by SIGKILL at seeded random moments of three runs; each time the next run resumes the
    barrier, incrementally, and the sink equals the full recompute."""
    rng = random.Random(1)
    t = SqlJobUnderTest(lake, spark, JOIN_THEN_AGGREGATE)
    runtime = t.runtime()
    first = t.barrier(_orders(0, 30), [{"order_id": i, "carrier": "x"} for i in range(0, 30, 2)])
    runtime.run()  # the bootstrap, in full
    t.exact_at(first)

    b = t.barrier(_orders(100, 30), [{"order_id": i, "carrier": "y"} for i in range(1, 130, 3)])
    crashed = _worker(lake, t, ICEBARRIER_FAULT=faults.AFTER_ICEBERG_COMMIT, ICEBARRIER_FAULT_AFTER="0")
    assert crashed.wait(timeout=300) == faults.CRASH_EXIT_CODE, crashed.communicate()[1][-3000:]
    assert jobs.show(lake.conn, t.name).progress == first  # killed before completing B
    runtime.run()
    t.exact_at(b)
    assert t.computation()["incremental"], t.computation()

    for k in range(3):
        b = t.barrier(
            _orders(1000 * (k + 2), 40),
            [{"order_id": i, "carrier": "z"} for i in range(1000 * (k + 2), 1000 * (k + 2) + 40, 2)],
        )
        worker = _worker(lake, t)
        time.sleep(rng.uniform(2.0, 14.0))  # the JVM starts in ~6 s; the barrier takes a few more
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=60)
        runtime.run()  # resumes B if the worker had not completed it
        t.exact_at(b)
        assert jobs.show(lake.conn, t.name).progress == b


# -- said aloud ----------------------------------------------------------------------------------------------------


def test_each_computation_says_how_and_why(lake, spark, server):
    """A query outside the class, a job with incremental=False and a source that had rows
    deleted each compute in full, naming why: in the run's log line, in `icebarrier job show`
    and in /metrics (which counts both kinds per job)."""
    lines: list[str] = []
    in_class = SqlJobUnderTest(
        lake, spark, "SELECT o.user_id, sum(o.amount) AS amount FROM {orders} o GROUP BY o.user_id"
    )
    outside = SqlJobUnderTest(
        lake, spark, "SELECT o.order_id, s.carrier FROM {orders} o LEFT JOIN {ships} s ON o.order_id = s.order_id"
    )
    off = SqlJobUnderTest(lake, spark, "SELECT o.order_id FROM {orders} o", incremental=False)
    for t in (in_class, outside, off):
        runtime = Runtime(t.job, settings=lake.settings, spark=spark, conn=lake.conn, log=lines.append)
        for k in range(3):
            b = t.barrier(_orders(100 * k, 10), [{"order_id": 100 * k, "carrier": "x"}])
            if k == 2 and t is in_class:  # then a user's orders deleted: B and this barrier coalesce
                b = barriers.issue(lake.conn).barrier
                pipe.delete_orders(lake, t.tables, b, 1)
            runtime.run()
            t.exact_at(b)

    def said(t: SqlJobUnderTest) -> list[str]:
        done = ("completed", "coalesced from")
        return [x for x in lines if x.startswith(f"job {t.name}: barrier") and any(d in x for d in done)]

    assert [", incremental in" in line for line in said(in_class)] == [False, True, False]
    assert "full (source " in said(in_class)[-1] and "(operation " in said(in_class)[-1], said(in_class)[-1]
    assert all("full (the query has LEFT JOIN (only inner joins are incremental))" in x for x in said(outside))
    assert all("full (incremental=False)" in x for x in said(off))

    shown = CliRunner().invoke(command, ["job", "show", outside.name])
    assert shown.exit_code == 0 and "full: the query has LEFT JOIN" in shown.output, shown.output
    assert "(0 incremental, 3 full so far)" in shown.output, shown.output
    as_json = json.loads(CliRunner().invoke(command, ["--output", "json", "job", "show", in_class.name]).output)
    assert as_json["computation"]["incremental"] is False and "operation" in as_json["computation"]["reason"]

    cid, secret = tokens.create(lake.conn, whole_lake=True)
    samples = scrape(server, {"Authorization": f"Bearer {access_token(server, cid, secret)}"}, {"jobs": "all"})
    counts = {
        (dict(labels)["job"], dict(labels)["kind"]): value
        for (name, labels), value in samples.items()
        if name == "icebarrier_job_computations_total"
    }
    assert counts[(in_class.name, "incremental")] == 1 and counts[(in_class.name, "full")] == 2
    assert counts[(outside.name, "incremental")] == 0 and counts[(outside.name, "full")] == 3
