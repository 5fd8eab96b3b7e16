"""Spark: generated configuration, barrier-tagged writes, pinned reads, compaction, tags, query."""

import json
import os

from click.testing import CliRunner

from icebarrier.cli.main import cli as command
from icebarrier.control_plane import barriers, jobs, leases, reads, tables
from icebarrier.control_plane.model import JobDefinition, Level
from icebarrier.iceberg_ext import maven
from icebarrier.iceberg_ext.catalog import (
    OPERATION_COMPACTION,
    SUMMARY_BARRIER,
    SUMMARY_OPERATION,
    load_table,
    summary_properties,
)
from icebarrier.iceberg_ext.commits import BarrierCommit
from icebarrier.iceberg_ext.maintenance import compact, expire, tag
from icebarrier.iceberg_ext.reads import ConsistentRead
from icebarrier.iceberg_ext.spark import spark_conf
from icebarrier.iceberg_ext.spark_io import append_df, merge_df, overwrite_df, sql_write, table_at
from icebarrier.iceberg_ext.spark_lines import ICEBERG_VERSION, installed


def test_spark_conf_is_complete_with_iceberg_jars_from_the_maven_cache(lake):
    """The generated conf names the catalog, JDBC V1 schema, no cache, extensions, and Iceberg's
    own runtime jar at the pinned version, from the local Maven repository."""
    conf = spark_conf(lake.settings)
    assert conf["spark.sql.catalog.lake.type"] == "jdbc"
    assert conf["spark.sql.catalog.lake.jdbc.schema-version"] == "V1"
    assert conf["spark.sql.catalog.lake.cache-enabled"] == "false"
    assert conf["spark.sql.catalog.lake.uri"].endswith("currentSchema=icebarrier_catalog")
    assert "IcebergSparkSessionExtensions" in conf["spark.sql.extensions"]
    jars = conf["spark.jars"].split(",")
    line = installed()
    assert jars[0] == str(line.runtime.path_in(maven.repository())) and jars[1].endswith(".jar")
    assert jars[0].endswith(f"iceberg-spark-runtime-{line.version}_{line.scala}-{ICEBERG_VERSION}.jar")
    out = CliRunner().invoke(command, ["spark-conf"])
    assert out.exit_code == 0 and "--conf spark.sql.catalog.lake=org.apache.iceberg.spark.SparkCatalog" in out.stdout


def test_a_local_session_copies_no_jar_its_launcher_put_on_the_class_path(lake, spark):
    """The suite's drivers have Iceberg's jars on their class path (``SPARK_DIST_CLASSPATH``,
    tests/spark_cds.py): a local session adds none of them to ``spark.jars`` (Spark would copy
    each, 118 MB, into the session's folder), and Iceberg works from the class path's copy."""
    from pathlib import Path

    on_path = os.environ["SPARK_DIST_CLASSPATH"].split(os.pathsep)
    assert any("iceberg-spark-runtime" in jar for jar in on_path)
    added = spark.sparkContext.getConf().get("spark.jars", "")
    assert not any(Path(jar).name in added for jar in on_path), added
    spark.sql(f"CREATE TABLE lake.{lake.namespace}.from_class_path (a bigint) USING iceberg")
    spark.sql(f"INSERT INTO lake.{lake.namespace}.from_class_path VALUES (1)")
    assert spark.sql(f"SELECT count(*) FROM lake.{lake.namespace}.from_class_path").collect()[0][0] == 1


def _setup(lake, spark):
    ns = f"lake.{lake.namespace}"
    spark.sql(f"CREATE TABLE {ns}.events (id bigint, user_id bigint, amount bigint) USING iceberg")
    spark.sql(f"CREATE TABLE {ns}.balances (user_id bigint, total bigint) USING iceberg")
    jobs.register(
        lake.conn,
        JobDefinition(name="ingest", sinks=frozenset([lake.T("events")]), external_inputs=frozenset(["gen:events"])),
    )
    jobs.register(
        lake.conn,
        JobDefinition(name="balance", sources=frozenset([lake.T("events")]), sinks=frozenset([lake.T("balances")])),
    )


def _ingest(lake, spark, barrier, start, n=4):
    df = spark.createDataFrame([(start + i, i % 2, 10) for i in range(n)], "id bigint, user_id bigint, amount bigint")
    with BarrierCommit(lake.conn, lake.catalog, job="ingest", barrier=barrier) as tx:
        append_df(tx, lake.T("events"), df)
    return tx


def _balance(lake, spark, barrier, mode="merge"):
    with ConsistentRead(lake.conn, lake.catalog, [lake.T("events")], barrier=barrier) as r:
        totals = (
            r.df(spark, lake.T("events")).groupBy("user_id").sum("amount").withColumnRenamed("sum(amount)", "total")
        )
        with BarrierCommit(lake.conn, lake.catalog, job="balance", barrier=barrier) as tx:
            if mode == "merge":
                merge_df(tx, lake.T("balances"), totals, ["user_id"])
            else:
                overwrite_df(tx, lake.T("balances"), totals)
    return tx


def test_spark_writes_are_tagged_recorded_and_adopted(lake, spark):
    """Append, MERGE, overwrite and SQL writes carry the barrier; a pre-existing tagged commit
    is adopted instead of written twice."""
    _setup(lake, spark)
    b1 = barriers.issue(lake.conn).barrier
    _ingest(lake, spark, b1, 0)
    _balance(lake, spark, b1, mode="merge")
    b2 = barriers.issue(lake.conn).barrier
    # Simulate a crash after the Iceberg commit: the tagged snapshot exists, no record.
    spark.createDataFrame([(100, 0, 10)], "id bigint, user_id bigint, amount bigint").writeTo(
        str(lake.T("events"))
    ).option(f"snapshot-property.{SUMMARY_BARRIER}", str(b2)).append()
    tx = _ingest(lake, spark, b2, 100)
    assert tx.adopted == {lake.T("events")}
    assert spark.table(str(lake.T("events"))).count() == 5
    _balance(lake, spark, b2, mode="overwrite")
    b3 = barriers.issue(lake.conn).barrier
    _ingest(lake, spark, b3, 200)
    with BarrierCommit(lake.conn, lake.catalog, job="balance", barrier=b3) as tx:
        sql_write(tx, lake.T("balances"), f"DELETE FROM {lake.T('balances')} WHERE user_id = 1", spark)
    snap = load_table(lake.catalog, lake.T("balances")).current_snapshot()
    assert summary_properties(snap)[SUMMARY_BARRIER] == str(b3) and snap.summary.operation.value in (
        "delete",
        "overwrite",
    )
    cut = reads.resolve(lake.conn, [lake.T("events"), lake.T("balances")])
    assert cut.barrier == b3 and cut.snapshots[lake.T("balances")] == snap.snapshot_id


def test_repeatable_read_in_spark_is_stable_while_jobs_commit(lake, spark):
    """Every statement of a repeatable-read block returns the same result while jobs commit;
    read-committed moves on; plain spark.sql works through pinned temp views."""
    _setup(lake, spark)
    for i in range(2):
        b = barriers.issue(lake.conn).barrier
        _ingest(lake, spark, b, i * 100)
        _balance(lake, spark, b)
    query = (
        f"SELECT (SELECT sum(amount) FROM {lake.T('events')}) AS events_total, "
        f"(SELECT sum(total) FROM {lake.T('balances')}) AS balance_total"
    )
    names = [lake.T("events"), lake.T("balances")]
    with ConsistentRead(lake.conn, lake.catalog, names, level=Level.REPEATABLE_READ) as rr:
        first = rr.sql(spark, query).collect()
        rr.create_views(spark)
        views_first = spark.sql("SELECT count(*) FROM events").collect()
        for i in range(2, 4):
            b = barriers.issue(lake.conn).barrier
            _ingest(lake, spark, b, i * 100)
            _balance(lake, spark, b)
        assert rr.sql(spark, query).collect() == first
        assert spark.sql("SELECT count(*) FROM events").collect() == views_first
    assert first[0]["events_total"] == first[0]["balance_total"] == 80
    with ConsistentRead(lake.conn, lake.catalog, names, level=Level.READ_COMMITTED) as rc:
        row = rc.sql(spark, query).collect()[0]
        assert row["events_total"] == row["balance_total"] == 160
    result = CliRunner().invoke(command, ["--output", "json", "query", query, "--level", "repeatable-read"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["rows"] == [[160, 160]] and out["cut"]["level"] == "repeatable-read"
    assert leases.list_leases(lake.conn) == []


def test_compaction_under_a_lease(lake, spark):
    """Compaction writes a same-content snapshot for the barrier it compacted; new readers get
    it, a leased older snapshot stays readable through expiry."""
    _setup(lake, spark)
    marks = []
    for i in range(4):
        b = barriers.issue(lake.conn).barrier
        _ingest(lake, spark, b, i * 100)
        marks.append(b)
    pinned = leases.acquire(lake.conn, [lake.T("events")], ttl_s=600, holder="long-query", barrier=marks[1])
    old = pinned.snapshots[lake.T("events")]
    before = sorted(spark.table(str(lake.T("events"))).collect())
    report = compact(spark, lake.conn, lake.catalog, lake.T("events"))
    assert report.barrier == marks[-1] and report.snapshot_id
    snap = load_table(lake.catalog, lake.T("events")).current_snapshot()
    assert snap.snapshot_id == report.snapshot_id
    assert summary_properties(snap)[SUMMARY_OPERATION] == OPERATION_COMPACTION
    cut = reads.resolve(lake.conn, [lake.T("events")])
    assert cut.barrier == marks[-1] and cut.snapshots[lake.T("events")] == report.snapshot_id
    with ConsistentRead(lake.conn, lake.catalog, [lake.T("events")]) as r:
        assert sorted(r.df(spark, lake.T("events")).collect()) == before
    expired = expire(lake.conn, lake.catalog, lake.T("events"))
    assert old not in expired.expired and expired.expired
    assert table_at(spark, lake.T("events"), old).count() == 8
    b = barriers.issue(lake.conn).barrier
    _ingest(lake, spark, b, 900)  # the job continues on top of the compaction
    assert tables.states(lake.conn, [lake.T("events")])[0].watermark == b


def test_tag_lets_any_engine_read_the_cut(lake, spark):
    """A tag on every table at the cut's snapshot is readable with VERSION AS OF 'tag'."""
    _setup(lake, spark)
    b1 = barriers.issue(lake.conn).barrier
    _ingest(lake, spark, b1, 0)
    _balance(lake, spark, b1)
    tag(lake.conn, lake.catalog, "eod", [lake.T("events"), lake.T("balances")])
    b2 = barriers.issue(lake.conn).barrier
    _ingest(lake, spark, b2, 100)
    assert spark.sql(f"SELECT count(*) AS n FROM {lake.T('events')} VERSION AS OF 'eod'").collect()[0]["n"] == 4
    assert spark.table(str(lake.T("events"))).count() == 8


def test_a_barrier_that_changes_nothing_leaves_no_snapshot(lake, spark):
    """An empty append completes the barrier but leaves the table's current snapshot as it was."""
    _setup(lake, spark)
    b1 = barriers.issue(lake.conn).barrier
    _ingest(lake, spark, b1, 0)
    before = load_table(lake.catalog, lake.T("events")).metadata.current_snapshot_id
    b2 = barriers.issue(lake.conn).barrier
    with BarrierCommit(lake.conn, lake.catalog, job="ingest", barrier=b2) as tx:
        assert (
            append_df(tx, lake.T("events"), spark.createDataFrame([], "id bigint, user_id bigint, amount bigint"))
            is None
        )
    assert load_table(lake.catalog, lake.T("events")).metadata.current_snapshot_id == before
    assert tables.states(lake.conn, [lake.T("events")])[0].watermark == b2
    assert reads.resolve(lake.conn, [lake.T("events")]).snapshots[lake.T("events")] == before


def test_a_table_is_read_at_the_snapshot_asked_for(lake, spark):
    """`table_at`, how the runtime reads a source at S(T, B), reads that snapshot and not the newest
    on the Spark line installed (Spark 3.5 ignores `versionAsOf` given to `DataFrameReader.table`,
    and Iceberg's 4.1 runtime refuses `snapshot-id`)."""
    name = lake.T("at_snapshot")
    spark.sql(f"CREATE TABLE {name} (id bigint) USING iceberg")
    spark.sql(f"INSERT INTO {name} VALUES (1)")
    first = load_table(lake.catalog, name).current_snapshot().snapshot_id
    spark.sql(f"INSERT INTO {name} VALUES (2), (3)")
    assert [r.id for r in table_at(spark, name, first).collect()] == [1]
    assert table_at(spark, name, None).count() == 0 and table_at(spark, name, None).columns == ["id"]
