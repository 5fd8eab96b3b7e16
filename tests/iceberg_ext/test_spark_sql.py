"""SQL pinned by Spark's parser: every query either reads exactly the cut or is refused."""

import pytest

from icebarrier.control_plane import barriers, jobs
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.iceberg_ext import spark_sql
from icebarrier.iceberg_ext.commits import BarrierCommit
from icebarrier.iceberg_ext.errors import StatementNotPinnableError
from icebarrier.iceberg_ext.job import SqlJob
from icebarrier.iceberg_ext.reads import ConsistentRead
from icebarrier.iceberg_ext.spark_io import append_df


@pytest.fixture
def history(lake, spark):
    """events: 4 rows at b1, 8 at b2, 12 now (b3); orders: no snapshot at b1, 2 rows from b2;
    dims: an unmanaged table. Returns (b1, b2)."""
    ns = f"lake.{lake.namespace}"
    spark.sql(f"CREATE TABLE {ns}.events (id bigint, kind string) USING iceberg")
    spark.sql(f"CREATE TABLE {ns}.orders (id bigint) USING iceberg")
    spark.sql(f"CREATE TABLE {ns}.dims (kind string, label string) USING iceberg")
    spark.sql(f"INSERT INTO {ns}.dims VALUES ('a', 'A'), ('b', 'B')")
    jobs.register(
        lake.conn,
        JobDefinition(
            name="ingest_events", sinks=frozenset([lake.T("events")]), external_inputs=frozenset(["gen:events"])
        ),
    )
    jobs.register(
        lake.conn,
        JobDefinition(
            name="ingest_orders", sinks=frozenset([lake.T("orders")]), external_inputs=frozenset(["gen:orders"])
        ),
    )
    marks = []
    for i in range(3):
        b = barriers.issue(lake.conn).barrier
        marks.append(b)
        rows = spark.createDataFrame([(i * 4 + k, "ab"[k % 2]) for k in range(4)], "id bigint, kind string")
        with BarrierCommit(lake.conn, lake.catalog, job="ingest_events", barrier=b) as tx:
            append_df(tx, lake.T("events"), rows)
        with BarrierCommit(lake.conn, lake.catalog, job="ingest_orders", barrier=b) as tx:
            if i == 1:
                append_df(tx, lake.T("orders"), spark.createDataFrame([(1,), (2,)], "id bigint"))
    return marks[0], marks[1]


def _at(lake, spark, barrier, query, tables=("events", "orders")):
    with ConsistentRead(lake.conn, lake.catalog, [lake.T(t) for t in tables], barrier=barrier) as r:
        return [tuple(row) for row in r.sql(spark, query).collect()]


def test_every_spelling_of_a_table_reads_the_cut(lake, spark, history):
    """Backticks in every position, mixed-case keywords, aliases, CTEs, subqueries, joins with an
    unmanaged table and USE with unqualified names all read exactly the past barrier."""
    b1, b2 = history
    ns = lake.namespace
    cases = {
        f"SELECT count(*) FROM `lake`.`{ns}`.`events`": [(4,)],
        f"SELECT count(*) FROM lake.{ns}.`events`": [(4,)],
        f"SELECT count(*) FROM `lake`.{ns}.events": [(4,)],
        f"select COUNT(*) From lake.{ns}.events AS e WHERE e.id >= 0": [(4,)],
        f"SELECT count(*) FROM lake.{ns}.events e": [(4,)],
        f"WITH recent AS (SELECT * FROM lake.{ns}.events) SELECT count(*) FROM recent": [(4,)],
        f"SELECT (SELECT count(*) FROM lake.{ns}.events) AS n": [(4,)],
        f"SELECT count(*) FROM lake.{ns}.dims WHERE kind IN (SELECT kind FROM lake.{ns}.events)": [(2,)],
        f"SELECT count(*) FROM lake.{ns}.events e JOIN lake.{ns}.dims d ON e.kind = d.kind": [(4,)],
        f"SELECT 'lake.{ns}.events' AS literal, count(*) FROM lake.{ns}.events": [(f"lake.{ns}.events", 4)],
        f"SELECT count(*) FROM lake.{ns}.orders": [(0,)],  # no snapshot at b1
        f"SELECT count(orders.id) FROM lake.{ns}.orders": [(0,)],  # qualifier still resolves
        f"SELECT count(*) FROM lake.{ns}.orders o JOIN lake.{ns}.events e ON o.id = e.id": [(0,)],
    }
    for query, expected in cases.items():
        assert _at(lake, spark, b1, query) == expected, query
    assert _at(lake, spark, b2, f"SELECT count(*) FROM lake.{ns}.orders o JOIN lake.{ns}.events e ON o.id = e.id") == [
        (2,)
    ]
    for view in ("events", "dims"):  # a temp view would shadow the table (Spark's rule), e.g. from create_views
        spark.catalog.dropTempView(view)
    spark.sql(f"USE lake.{ns}")
    try:
        assert _at(lake, spark, b1, "SELECT count(*) FROM events") == [(4,)]
        assert _at(lake, spark, b1, "SELECT count(*) FROM `events` JOIN dims USING (kind)") == [(4,)]
        # A CTE shadows the table of the same name: it is not a table read.
        assert _at(lake, spark, b1, "WITH events AS (SELECT 1 AS id) SELECT count(*) FROM events") == [(1,)]
    finally:
        spark.sql("USE spark_catalog.default")
    assert spark.sql(f"SELECT count(*) FROM lake.{ns}.events").collect()[0][0] == 12  # current state untouched


@pytest.mark.parametrize(
    "query, refusal",
    [
        ("SELECT * FROM lake.{ns}.events VERSION AS OF 1", "already has VERSION AS OF 1"),
        ("SELECT * FROM lake.{ns}.events FOR SYSTEM_TIME AS OF '2020-01-01'", "already has TIMESTAMP AS OF"),
        ("SELECT * FROM lake.{ns}.events.snapshots", "metadata table"),
        ("SELECT * FROM some_tvf('lake.{ns}.events')", "table-valued function some_tvf"),
        ("INSERT INTO lake.{ns}.dims SELECT 'x', 'y'", "only queries"),
        ("SELEC nonsense", "cannot parse"),
    ],
)
def test_statements_that_cannot_be_pinned_are_refused(lake, spark, history, query, refusal):
    """Time travel, metadata tables, table functions and writes are refused naming the table."""
    b1, _ = history
    with pytest.raises(StatementNotPinnableError, match=refusal):
        _at(lake, spark, b1, query.format(ns=lake.namespace))


def test_a_managed_table_outside_the_read_is_refused(lake, spark, history):
    """A query naming a managed table the read does not include is refused, not read at its current snapshot."""
    b1, _ = history
    with pytest.raises(StatementNotPinnableError, match=f"table lake.{lake.namespace}.orders: .*add it to the read"):
        _at(
            lake,
            spark,
            b1,
            f"SELECT * FROM lake.{lake.namespace}.events, lake.{lake.namespace}.orders",
            tables=("events",),
        )


def test_sql_job_takes_sink_and_sources_from_the_parser(spark):
    """A struct path, a literal and a CTE are not sources; USE resolves unqualified names."""
    job = SqlJob(
        "city",
        "\n  INSERT INTO lake.db.out WITH c AS (SELECT * FROM lake.db.src)\n"
        "  SELECT s.addr.city, 'lake.db.decoy' FROM `lake`.db.src s JOIN c ON s.id = c.id GROUP BY 1",
    )
    job.bind(spark)
    assert (job.sinks, job.sources) == (["lake.db.out"], ["lake.db.src"])
    assert job._parsed.query.strip().startswith("WITH c AS")
    spark.sql("USE lake")
    try:
        job = SqlJob("plain", "INSERT OVERWRITE db.out2 SELECT * FROM db.src2")
        job.bind(spark)
        assert (job.sinks, job.sources) == (["lake.db.out2"], ["lake.db.src2"])
    finally:
        spark.sql("USE spark_catalog.default")
    undeclared = SqlJob("x", "INSERT INTO lake.db.o SELECT * FROM lake.db.a JOIN lake.db.b", sources=["lake.db.a"])
    with pytest.raises(Exception, match="reads lake.db.b, which is not among its sources"):
        undeclared.bind(spark)
    with pytest.raises(Exception, match="write it as INSERT INTO"):
        SqlJob("y", "SELECT * FROM lake.db.a").bind(spark)


def test_relations_carry_exact_spans(spark):
    """The parser's spans cover the identifier as written, so pinning never touches literals."""
    text = "SELECT 'lake.db.t' FROM `lake`.db.`t` x WHERE x.a IN (SELECT a FROM lake.db.u)"
    statement = spark_sql.parse(spark, text)
    spans = sorted(text[r.start : r.stop + 1] for r in statement.relations)
    assert spans == ["`lake`.db.`t`", "lake.db.u"]
    assert statement.tables() == [TableName.parse("lake.db.t"), TableName.parse("lake.db.u")]


@pytest.mark.parametrize(
    "text",
    [
        "INSERT INTO lake.db.t SELECT 1",
        "CREATE TABLE lake.db.t2 AS SELECT 1",
        "DELETE FROM lake.db.t WHERE true",
        "CACHE TABLE lake.db.t",
        "DROP TABLE lake.db.t",
        "MERGE INTO lake.db.t USING lake.db.u ON t.a = u.a WHEN MATCHED THEN DELETE",
    ],
)
def test_only_queries_are_read(spark, text):
    """Writes, DDL and commands are not queries; a consistent read refuses them."""
    with pytest.raises(StatementNotPinnableError, match="only queries"):
        spark_sql.parse(spark, text)


@pytest.mark.parametrize(
    "statement, refusal",
    [
        ("INSERT INTO lake.db.o SELECT * FROM lake.db.a VERSION AS OF 3", "already has VERSION AS OF 3"),
        ("INSERT INTO lake.db.o SELECT * FROM some_tvf('lake.db.a')", "table-valued function some_tvf"),
        ("INSERT INTO lake.db.o SELEC nonsense", "cannot parse"),
    ],
)
def test_sql_job_refuses_what_a_barrier_cannot_pin(spark, statement, refusal):
    """A SQL job's query is refused for the same reasons as a consistent read's, naming the job."""
    with pytest.raises(Exception, match=f"SQL job j: .*{refusal}"):
        SqlJob("j", statement).bind(spark)
