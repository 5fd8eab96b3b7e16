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
from icebarrier.iceberg_ext.catalog import create_table, load_table
from icebarrier.iceberg_ext.commits import BarrierCommit
from icebarrier.iceberg_ext.spark_io import table_at

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


def setup(lake, suffix: str = "") -> dict[str, TableName]:
    """``orders`` and ``ships`` (names ending in ``suffix``), each with a root job of its own."""
    tables = {"orders": lake.T("orders" + suffix), "ships": lake.T("ships" + suffix)}
    for key, schema in (("orders", ORDERS), ("ships", SHIPS)):
        create_table(lake.catalog, tables[key], schema)
        jobs.register(
            lake.conn,
            JobDefinition(
                name=f"ingest_{tables[key].name}",
                sinks=frozenset([tables[key]]),
                external_inputs=frozenset([f"gen:{key}"]),
            ),
        )
    return tables


def ingest(lake, tables: dict[str, TableName], barrier: int, orders: list[dict], ships: list[dict]) -> None:
    """One barrier of both root jobs: each batch appended (an empty one writes nothing). A root
    job revised to an earlier barrier first completes the barriers since then with nothing."""
    for key, rows, types in (("orders", orders, ORDER_TYPES), ("ships", ships, SHIP_TYPES)):
        job = _caught_up(lake, f"ingest_{tables[key].name}", barrier)
        with BarrierCommit(lake.conn, lake.catalog, job=job, barrier=barrier) as tx:
            tx.append_arrow(tables[key], _arrow(rows, types))


def delete_orders(lake, tables: dict[str, TableName], barrier: int, user_id: int) -> bool:
    """A barrier at which the orders root job deletes a user's orders (not an append); whether
    any was deleted."""
    from pyiceberg.expressions import EqualTo

    table = tables["orders"]
    with BarrierCommit(
        lake.conn, lake.catalog, job=_caught_up(lake, f"ingest_{table.name}", barrier), barrier=barrier
    ) as tx:
        tx.write(table, lambda props: load_table(lake.catalog, table).delete(EqualTo("user_id", user_id), props))
    with BarrierCommit(
        lake.conn, lake.catalog, job=_caught_up(lake, f"ingest_{tables['ships'].name}", barrier), barrier=barrier
    ):
        pass
    return bool(tx.commits)


def _caught_up(lake, job: str, barrier: int) -> str:
    """A root job revised to an earlier barrier first completes the barriers since then with nothing."""
    progress = jobs.show(lake.conn, job).progress
    missed = lake.conn.execute(
        "SELECT barrier FROM barriers WHERE barrier > %s AND barrier < %s ORDER BY barrier", (progress, barrier)
    ).fetchall()
    for row in missed if progress is not None else []:
        jobs.complete(lake.conn, job, row["barrier"])
    return job


def _arrow(rows: list[dict], types: dict) -> pa.Table:
    return pa.table({c: pa.array([r[c] for r in rows], t) for c, t in types.items()})


def sink_rows(spark, lake, sink: TableName, barrier: int) -> list[tuple]:
    """The sink as of barrier B (its snapshot in the control plane's map)."""
    snapshot = reads.resolve(lake.conn, [sink], barrier=barrier).snapshots[sink]
    if snapshot is None:
        return []
    return [tuple(r) for r in table_at(spark, sink, snapshot).collect()]


def recomputed(spark, lake, query: str, tables: dict[str, TableName], barrier: int) -> list[tuple]:
    """The query template over the tables at B, in full (each read at its snapshot at B)."""
    snapshots = reads.resolve(lake.conn, list(tables.values()), barrier=barrier).snapshots
    views = {}
    for key, t in tables.items():
        df = table_at(spark, t, snapshots[t])
        views[key] = f"full_{t.name}"
        df.createOrReplaceTempView(views[key])
    return [tuple(r) for r in spark.sql(query.format(**views)).collect()]


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
