"""Incremental SqlJobs on real Spark, Iceberg and Postgres: after every barrier the sink equals
the query recomputed in full at that barrier, and each computation says how it was made."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icebarrier.control_plane import barriers, jobs
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.job import SqlJob
from icebarrier.iceberg_ext.maintenance import compact, revise
from icebarrier.iceberg_ext.runtime import Runtime
from tests.iceberg_ext import incremental_pipeline as pipe

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
    for step in ["append"] + data.draw(st.lists(STEPS, min_size=2, max_size=5), label="steps"):
        if step == "revise":
            if len(computed) < 2:
                continue
            to = data.draw(st.sampled_from(computed[:-1]), label="revise to")
            revise(lake.conn, lake.catalog, t.tables["orders"], to)
            computed = [b for b in computed if b <= to]
            clean = False
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
            pipe.delete_orders(lake, t.tables, b, data.draw(st.sampled_from([0, 1, 2]), label="delete user"))
            clean = False
            if t.runtime().run().computations:
                computed.append(b)
                assert not t.computation()["incremental"] and "operation" in t.computation()["reason"]
                clean = True
            t.exact_at(b)
            continue
        orders = data.draw(order_rows(t.orders), label="orders")
        t.orders += len(orders)
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
            clean = True
        else:
            assert t.computation() == before  # a skip computes nothing
        t.exact_at(b)
