"""A pipeline for the incremental SqlJob tests: a root job appends to ``orders`` and ``ships``
(PyIceberg, barrier-tagged); SqlJobs over them run in the real runtime on Spark. After each
barrier a job's sink is compared with the same query recomputed in full at that barrier."""

from __future__ import annotations

import math
from collections import Counter

import pyarrow as pa
from pyiceberg.schema import Schema
from pyiceberg.types import DoubleType, LongType, NestedField, StringType

from icebarrier.control_plane import jobs, reads
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.iceberg_ext.catalog import create_table
from icebarrier.iceberg_ext.commits import BarrierCommit

ORDERS = Schema(
    NestedField(1, "order_id", LongType(), required=False),
    NestedField(2, "user_id", LongType(), required=False),
    NestedField(3, "item", StringType(), required=False),
    NestedField(4, "amount", LongType(), required=False),
    NestedField(5, "price", DoubleType(), required=False),
)
SHIPS = Schema(
    NestedField(1, "order_id", LongType(), required=False),
    NestedField(2, "carrier", StringType(), required=False),
)
ORDER_TYPES = {"order_id": pa.int64(), "user_id": pa.int64(), "item": pa.string(), "amount": pa.int64()}
ORDER_TYPES["price"] = pa.float64()
SHIP_TYPES = {"order_id": pa.int64(), "carrier": pa.string()}


def setup(lake) -> None:
    create_table(lake.catalog, lake.T("orders"), ORDERS)
    create_table(lake.catalog, lake.T("ships"), SHIPS)
    sinks = frozenset([lake.T("orders"), lake.T("ships")])
    jobs.register(lake.conn, JobDefinition(name="ingest", sinks=sinks, external_inputs=frozenset(["gen:orders"])))


def ingest(lake, barrier: int, orders: list[dict], ships: list[dict]) -> None:
    """One barrier of the root job: each batch appended (an empty one writes nothing)."""
    with BarrierCommit(lake.conn, lake.catalog, job="ingest", barrier=barrier) as tx:
        tx.append_arrow(lake.T("orders"), _arrow(orders, ORDER_TYPES))
        tx.append_arrow(lake.T("ships"), _arrow(ships, SHIP_TYPES))


def _arrow(rows: list[dict], types: dict) -> pa.Table:
    return pa.table({c: pa.array([r[c] for r in rows], t) for c, t in types.items()})


def sink_rows(spark, lake, sink: TableName, barrier: int) -> list[tuple]:
    """The sink as of barrier B (its snapshot in the control plane's map)."""
    snapshot = reads.resolve(lake.conn, [sink], barrier=barrier).snapshots[sink]
    if snapshot is None:
        return []
    return [tuple(r) for r in spark.read.option("snapshot-id", str(snapshot)).table(str(sink)).collect()]


def recomputed(spark, lake, query: str, sources: list[TableName], barrier: int) -> list[tuple]:
    """The query over the sources at B, in full (each source read at its snapshot at B)."""
    snapshots = reads.resolve(lake.conn, sources, barrier=barrier).snapshots
    for t, s in snapshots.items():
        df = spark.read.option("snapshot-id", str(s)).table(str(t)) if s is not None else spark.table(str(t)).limit(0)
        df.createOrReplaceTempView(f"full_{t.name}")
    return [tuple(r) for r in spark.sql(query.format(orders="full_orders", ships="full_ships")).collect()]


def same_rows(got: list[tuple], want: list[tuple], rel: float = 1e-9) -> bool:
    """Equal as multisets; floats within ``rel`` of each other (sums in another order)."""
    if len(got) != len(want):
        return False
    if Counter(got) == Counter(want):
        return True
    key = lambda row: tuple((v is None, v if not isinstance(v, float) else round(v, 3)) for v in row)  # noqa: E731
    for a, b in zip(sorted(got, key=key), sorted(want, key=key)):
        for x, y in zip(a, b):
            if isinstance(x, float) and isinstance(y, float):
                if not math.isclose(x, y, rel_tol=rel, abs_tol=1e-12):
                    return False
            elif x != y:
                return False
    return True
