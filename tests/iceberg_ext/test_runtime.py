"""The job runtime on real Spark, Iceberg and Postgres: the shopping pipeline end to end."""

import importlib.util
import sys
from pathlib import Path

import pytest

from icebarrier.control_plane import barriers, jobs, runs, tables
from icebarrier.control_plane.model import Level, TableName
from icebarrier.iceberg_ext.job import IncrementUnavailableError, TransformJob, append, overwrite
from icebarrier.iceberg_ext.reads import ConsistentRead
from icebarrier.iceberg_ext.runtime import Runtime

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "shopping"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"shop_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


shop = _load("pipeline")
generate = _load("generate")


@pytest.fixture
def shopping(lake, spark, tmp_path):
    shop.create_tables(spark, lake.namespace)
    built = shop.build(lake.namespace, str(tmp_path / "input"))
    runtimes = {
        k: Runtime(j, settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None) for k, j in built.items()
    }
    return built, runtimes, tmp_path / "input"


def _round(conn, runtimes, input_dir, batch_no, rows):
    rows += generate.write_batch(str(input_dir), batch_no, orders=30)
    barriers.issue(conn)
    done = {k: rt.run().completed for k, rt in runtimes.items()}
    return done


@pytest.mark.other_line
def test_shopping_pipeline_end_to_end(lake, spark, shopping):
    """Root jobs ingest files per barrier, SQL jobs keep aggregates, the delta join appends
    its increment; every table completes every barrier and the avg-price query is consistent."""
    built, runtimes, input_dir = shopping
    rows = []
    for batch_no in range(1, 4):
        done = _round(lake.conn, runtimes, input_dir, batch_no, rows)
        assert all(len(v) == 1 for v in done.values()), done
    t = shop.tables(lake.namespace)
    names = [TableName.parse(x) for x in t.values()]
    with ConsistentRead(lake.conn, lake.catalog, names, level=Level.READ_COMMITTED) as r:
        amounts = {
            (x.user_id, x.item_id): x.amount for x in r.df(spark, TableName.parse(t["user_item_amount"])).collect()
        }
        shipped = r.df(spark, TableName.parse(t["shipped_orders"])).count()
        ships = r.df(spark, TableName.parse(t["shipments"])).count()
    expected = {}
    for row in rows:
        key = (row["user_id"], row["item_id"])
        expected[key] = expected.get(key, 0) + row["amount"]
    assert amounts == expected
    assert shipped == ships  # every shipment has its order: the delta join lost and duplicated nothing
    states = tables.list_versions(lake.conn)
    assert len({s.watermark for s in states}) == 1


def test_sql_job_sources_come_from_its_select(shopping, spark):
    """A SQL job's sources are the tables its SELECT reads (Spark's parser); its sink the INSERT target."""
    built, _, _ = shopping
    job = built["user_item_amount"]
    job.bind(spark)
    assert job.sources == [built["ingest_shopping"].sinks[0]] and job.sinks[0].endswith("user_item_amount")


def test_a_job_added_later_bootstraps_then_continues(lake, spark, shopping):
    """A new intermediate job starts at its sources' latest common barrier with a full read,
    then continues with increments."""
    built, runtimes, input_dir = shopping
    rows = []
    for batch_no in range(1, 3):
        _round(lake.conn, runtimes, input_dir, batch_no, rows)
    t = shop.tables(lake.namespace)
    spark.sql(f"CREATE TABLE {t['shopping']}_count (n bigint) USING iceberg")
    seen = []

    def count_increment(ctx):
        seen.append((ctx.bootstrap, ctx.increment(t["shopping"]).count()))
        return append(ctx.increment(t["shopping"]).groupBy().count().withColumnRenamed("count", "n"))

    late = TransformJob(
        name=f"{lake.namespace}_late",
        sources=[t["shopping"]],
        sinks=[t["shopping"] + "_count"],
        transform=count_increment,
    )
    rt = Runtime(late, settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None)
    assert len(rt.run().completed) == 1
    _round(lake.conn, runtimes, input_dir, 3, rows)
    rt.run()
    assert seen == [(True, 60), (False, 30)]
    total = spark.table(t["shopping"] + "_count").groupBy().sum("n").collect()[0][0]
    assert total == spark.table(t["shopping"]).count() == 90


def test_increment_of_a_non_append_source_asks_for_a_full_recompute(lake, spark, shopping):
    """An overwrite in a source's history makes ctx.increment refuse with a clear message."""
    built, runtimes, input_dir = shopping
    rows = []
    _round(lake.conn, runtimes, input_dir, 1, rows)
    t = shop.tables(lake.namespace)
    spark.sql(f"CREATE TABLE {t['user_item_amount']}_copy (n bigint) USING iceberg")
    job = TransformJob(
        name=f"{lake.namespace}_bad",
        sources=[t["user_item_amount"]],
        sinks=[t["user_item_amount"] + "_copy"],
        transform=lambda ctx: append(ctx.increment(t["user_item_amount"]).selectExpr("amount AS n")),
    )
    rt = Runtime(job, settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None)
    rt.run()  # bootstrap reads everything
    _round(lake.conn, runtimes, input_dir, 2, rows)
    with pytest.raises(IncrementUnavailableError, match="ctx.changes.*full recompute"):
        rt.run()


def test_changes_of_a_copy_on_write_source_replay_its_overwrites(lake, spark, shopping):
    """ctx.changes gives the changelog of an overwritten source since the previous barrier:
    applying it to the previous state yields the state at B."""
    built, runtimes, input_dir = shopping
    rows = []
    _round(lake.conn, runtimes, input_dir, 1, rows)
    t = shop.tables(lake.namespace)
    src = t["user_item_amount"]
    spark.sql(f"CREATE TABLE {src}_mirror (user_id bigint, item_id bigint, amount bigint) USING iceberg")
    seen = []

    def mirror(ctx):
        changes = ctx.changes(src)
        seen.append(sorted(r._change_type for r in changes.select("_change_type").distinct().collect()))
        before = {tuple(r) for r in ctx.previous_table(src).collect()}
        inserted = {tuple(r)[:3] for r in changes.where("_change_type = 'INSERT'").collect()}
        deleted = {tuple(r)[:3] for r in changes.where("_change_type = 'DELETE'").collect()}
        assert (before - deleted) | inserted == {tuple(r) for r in ctx.table(src).collect()}
        return overwrite(ctx.table(src))

    job = TransformJob(name=f"{lake.namespace}_mirror", sources=[src], sinks=[src + "_mirror"], transform=mirror)
    rt = Runtime(job, settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None)
    rt.run()
    _round(lake.conn, runtimes, input_dir, 2, rows)
    assert len(rt.run().completed) == 1
    assert seen[0] == ["INSERT"] and "DELETE" in seen[1] and "INSERT" in seen[1]


def test_input_ranges_are_recorded_before_writing(lake, shopping):
    """Each root barrier records its file list; the next barrier takes only new files."""
    built, runtimes, input_dir = shopping
    rows = []
    _round(lake.conn, runtimes, input_dir, 1, rows)
    _round(lake.conn, runtimes, input_dir, 2, rows)
    recorded = runs.ranges(lake.conn, built["ingest_shopping"].name)
    assert [len(r["files"]) for r in recorded] == [1, 1]
    assert recorded[0]["files"] != recorded[1]["files"]
    info = jobs.show(lake.conn, built["ingest_shopping"].name)
    assert info.status == "stopped" and info.heartbeat_at is not None
