"""A small PyIceberg pipeline used by the Iceberg tests and their worker processes.

orders (root, appends) -> totals (intermediate: sum per customer, overwrite) -> report
(intermediate: grand total, overwrite).
"""

from __future__ import annotations

import pyarrow as pa
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField

from icebarrier.control_plane import barriers, jobs
from icebarrier.control_plane.model import JobDefinition
from icebarrier.iceberg_ext.catalog import create_table
from icebarrier.iceberg_ext.commits import BarrierCommit
from icebarrier.iceberg_ext.reads import ConsistentRead

ORDERS = Schema(
    NestedField(1, "order_id", LongType(), required=False),
    NestedField(2, "customer", LongType(), required=False),
    NestedField(3, "amount", LongType(), required=False),
)
TOTALS = Schema(
    NestedField(1, "customer", LongType(), required=False), NestedField(2, "total", LongType(), required=False)
)
REPORT = Schema(NestedField(1, "grand_total", LongType(), required=False))


def setup(lake) -> None:
    create_table(lake.catalog, lake.T("orders"), ORDERS)
    create_table(lake.catalog, lake.T("totals"), TOTALS)
    create_table(lake.catalog, lake.T("report"), REPORT)
    jobs.register(
        lake.conn,
        JobDefinition(name="ingest", sinks=frozenset([lake.T("orders")]), external_inputs=frozenset(["gen:orders"])),
    )
    jobs.register(
        lake.conn,
        JobDefinition(name="totals", sources=frozenset([lake.T("orders")]), sinks=frozenset([lake.T("totals")])),
    )
    jobs.register(
        lake.conn,
        JobDefinition(name="report", sources=frozenset([lake.T("totals")]), sinks=frozenset([lake.T("report")])),
    )


def orders_batch(barrier_no: int, n: int = 5) -> pa.Table:
    """Deterministic input of the n-th barrier: order ids barrier_no*1000 + i."""
    ids = [barrier_no * 1000 + i for i in range(n)]
    return pa.table(
        {
            "order_id": pa.array(ids, pa.int64()),
            "customer": pa.array([i % 3 for i in ids], pa.int64()),
            "amount": pa.array([10] * n, pa.int64()),
        }
    )


def ingest(lake, barrier: int, barrier_no: int):
    with BarrierCommit(lake.conn, lake.catalog, job="ingest", barrier=barrier) as tx:
        tx.append_arrow(lake.T("orders"), orders_batch(barrier_no))
    return tx


def compute_totals(lake, barrier: int):
    with ConsistentRead(lake.conn, lake.catalog, [lake.T("orders")], barrier=barrier) as r:
        orders = r.arrow(lake.T("orders"))
    sums: dict[int, int] = {}
    for c, a in zip(orders["customer"].to_pylist(), orders["amount"].to_pylist()):
        sums[c] = sums.get(c, 0) + a
    data = pa.table(
        {"customer": pa.array(sorted(sums), pa.int64()), "total": pa.array([sums[c] for c in sorted(sums)], pa.int64())}
    )
    with BarrierCommit(lake.conn, lake.catalog, job="totals", barrier=barrier) as tx:
        tx.overwrite_arrow(lake.T("totals"), data)
    return tx


def compute_report(lake, barrier: int):
    with ConsistentRead(lake.conn, lake.catalog, [lake.T("totals")], barrier=barrier) as r:
        totals = r.arrow(lake.T("totals"))
    data = pa.table({"grand_total": pa.array([sum(totals["total"].to_pylist())], pa.int64())})
    with BarrierCommit(lake.conn, lake.catalog, job="report", barrier=barrier) as tx:
        tx.overwrite_arrow(lake.T("report"), data)
    return tx


def run_barrier(lake, barrier_no: int) -> int:
    b = barriers.issue(lake.conn).barrier
    ingest(lake, b, barrier_no)
    compute_totals(lake, b)
    compute_report(lake, b)
    return b
