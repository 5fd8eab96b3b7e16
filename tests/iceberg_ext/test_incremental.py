"""Incremental SqlJobs on real Spark, Iceberg and Postgres: after every barrier the sink equals
the query recomputed in full at that barrier, and each computation says how it was made."""

from __future__ import annotations

from icebarrier.control_plane import barriers, jobs
from icebarrier.iceberg_ext.job import SqlJob
from icebarrier.iceberg_ext.runtime import Runtime
from tests.iceberg_ext import incremental_pipeline as pipe

JOIN_THEN_AGGREGATE = """
SELECT o.user_id, count(*) AS n, count(o.price) AS priced, sum(o.amount) AS amount, avg(o.price) AS avg_price,
       min(o.item) AS first_item, max(o.price) AS top_price
FROM {orders} o JOIN {ships} s ON o.order_id = s.order_id
WHERE o.amount > 0
GROUP BY o.user_id"""


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


def _job(lake, spark, name: str, query: str, **kw) -> tuple[SqlJob, Runtime]:
    sink = lake.T(name)
    spark.sql(
        f"CREATE TABLE {sink} AS SELECT * FROM ({query.format(orders=lake.T('orders'), ships=lake.T('ships'))}) WHERE false"
    )
    job = SqlJob(name, f"INSERT OVERWRITE {sink} {query.format(orders=lake.T('orders'), ships=lake.T('ships'))}", **kw)
    return job, Runtime(job, settings=lake.settings, spark=spark, conn=lake.conn, log=print)


def test_join_then_aggregate_is_incremental_and_exact(lake, spark):
    pipe.setup(lake)
    job, runtime = _job(lake, spark, "by_user", JOIN_THEN_AGGREGATE)
    sources = [lake.T("orders"), lake.T("ships")]
    for k in range(4):
        b = barriers.issue(lake.conn).barrier
        orders = _orders(100 * k, 20)
        ships = [{"order_id": o["order_id"], "carrier": "x"} for o in orders[::2]]
        ships += [{"order_id": 100 * (k - 1) + 1, "carrier": "late"}] if k else []  # a ship for an older order
        pipe.ingest(lake, b, orders, ships)
        runtime.run()
        got = pipe.sink_rows(spark, lake, lake.T("by_user"), b)
        want = pipe.recomputed(spark, lake, JOIN_THEN_AGGREGATE, sources, b)
        assert pipe.same_rows(got, want), (k, sorted(got, key=str), sorted(want, key=str))
        computation = jobs.show(lake.conn, "by_user").computation
        assert computation["incremental"] == (k > 0), computation
