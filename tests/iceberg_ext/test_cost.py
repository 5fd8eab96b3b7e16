"""Cost follows change in the runtime, on real Spark, Iceberg and Postgres (DESIGN.md, "Cost
follows change"): the shopping pipeline falls behind, then catches up in as few
computations as the anchors allow.

The anchor interval is a week in these tests (only a test's first barrier is an anchor)
except where :func:`tests.helpers.anchor` issues one.
"""

import pytest

from icebarrier.control_plane import barriers, jobs, reads, tables
from icebarrier.control_plane.errors import BarrierNotValidError
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.catalog import coalesced_after, lineage, load_table
from icebarrier.iceberg_ext.job import TransformJob, overwrite
from icebarrier.iceberg_ext.runtime import Runtime
from tests.helpers import anchor
from tests.iceberg_ext.test_runtime import _round, generate, shop, shopping  # noqa: F401 - the fixture

ROOTS = ("ingest_shopping", "ingest_shipments")


@pytest.fixture
def behind(lake, spark, shopping):  # noqa: F811
    """The pipeline after one barrier together; ``ingest(k)`` then runs only the root jobs on
    input batch k at a new barrier (the others stay behind)."""
    built, runtimes, input_dir = shopping
    _round(lake.conn, runtimes, input_dir, 1, [])

    def ingest(k: int) -> int:
        generate.write_batch(str(input_dir), k, orders=30)
        b = barriers.issue(lake.conn).barrier
        for name in ROOTS:
            runtimes[name].run()
        return b

    return built, runtimes, ingest


def _snapshots(lake, name: str) -> int:
    return len(load_table(lake.catalog, TableName.parse(name)).metadata.snapshots)


def test_unchanged_barriers_cost_no_computation(lake, spark, behind):
    """30 barriers with no new input: every root job completes the newest in one step (its input
    brought nothing), with no Spark work and no snapshot, and the control plane skips every other
    job with it (nothing left for them to run); every skipped barrier is a valid cut."""
    built, runtimes, _ = behind
    t = shop.tables(lake.namespace)
    before = {name: _snapshots(lake, full) for name, full in t.items()}
    marks = [barriers.issue(lake.conn).barrier for _ in range(30)]
    for name in sorted(runtimes, key=lambda n: n not in ROOTS):
        summary = runtimes[name].run()
        expected = [marks[-1]] if name in ROOTS else []
        assert (summary.completed, summary.computations) == (expected, 0), name
        assert jobs.show(lake.conn, runtimes[name].job.name).progress == marks[-1], name
    assert {name: _snapshots(lake, full) for name, full in t.items()} == before
    names = [TableName.parse(x) for x in t.values()]
    assert reads.resolve(lake.conn, names, barrier=marks[3]).snapshots == reads.resolve(lake.conn, names).snapshots


def test_a_job_behind_with_changes_computes_once(lake, spark, behind):
    """Five barriers of input while the SQL and delta-join jobs are away: each computes once,
    coalescing the barriers between; the output equals a full recompute at the newest
    barrier; a cut at a coalesced barrier is refused, naming the table; the delta join's
    increment covers the whole range (every shipment has its order, none twice)."""
    built, runtimes, ingest = behind
    t = shop.tables(lake.namespace)
    marks = [ingest(k) for k in range(2, 7)]
    for name in ("user_item_amount", "shipped_orders"):
        summary = runtimes[name].run()
        assert (summary.completed, summary.computations) == ([marks[-1]], 1), name
    shopping_at = reads.resolve(lake.conn, [TableName.parse(t["shopping"])]).snapshots[TableName.parse(t["shopping"])]
    recompute = spark.sql(
        f"SELECT user_id, item_id, sum(amount) AS amount FROM {t['shopping']} "
        f"VERSION AS OF {shopping_at} GROUP BY user_id, item_id"
    ).collect()
    assert sorted(map(tuple, spark.table(t["user_item_amount"]).collect())) == sorted(map(tuple, recompute))
    assert spark.table(t["shipped_orders"]).count() == spark.table(t["shipments"]).count() > 0
    table = load_table(lake.catalog, TableName.parse(t["user_item_amount"]))
    assert coalesced_after(next(lineage(table))) is not None  # the commit says what it coalesced
    with pytest.raises(BarrierNotValidError, match=f"{t['user_item_amount']} coalesced it into barrier {marks[-1]}"):
        reads.resolve(lake.conn, [TableName.parse(t["user_item_amount"])], barrier=marks[2])


def test_batch_once_computes_once_per_anchor(lake, spark, behind):
    """A batch run (`--once`) over a backlog with an anchor in it: one computation up to the
    anchor, one after it, and the cut at the anchor is valid over every table."""
    built, runtimes, ingest = behind
    ingest(2)
    ingest(3)
    a = anchor(lake.conn)
    for name in ROOTS:
        runtimes[name].run()
    newest = [ingest(k) for k in range(4, 6)][-1]
    summary = runtimes["user_item_price"].run()
    assert (summary.completed, summary.computations) == ([a, newest], 2)
    names = [
        TableName.parse(x)
        for x in (shop.tables(lake.namespace)["user_item_price"], shop.tables(lake.namespace)["shopping"])
    ]
    assert reads.resolve(lake.conn, names, barrier=a).barrier == a
    assert tables.states(lake.conn, names[:1])[0].coalesced[-1][1] == newest


def test_a_job_that_reads_the_barrier_is_never_skipped(lake, spark, behind):
    """A transform declaring reads_barrier computes although its source did not change."""
    built, runtimes, _ = behind
    t = shop.tables(lake.namespace)
    spark.sql(f"CREATE TABLE {t['shopping']}_clock (barrier bigint) USING iceberg")
    clock = TransformJob(
        name=f"{lake.namespace}_clock",
        sources=[t["shopping"]],
        sinks=[t["shopping"] + "_clock"],
        transform=lambda ctx: overwrite(ctx.spark.range(1).selectExpr(f"{ctx.barrier} AS barrier")),
        reads_barrier=True,
    )
    rt = Runtime(clock, settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None)
    rt.run()
    newest = [barriers.issue(lake.conn).barrier for _ in range(3)][-1]
    for name in ROOTS:
        runtimes[name].run()
    summary = rt.run()
    assert (summary.completed, summary.computations) == ([newest], 1)
    assert spark.table(t["shopping"] + "_clock").collect()[0][0] == newest
    assert jobs.next_barrier(lake.conn, clock.name).ready is False
