"""Spark reads and writes through icebarrier (the module that imports pyspark, lazily).

Writes go through a :class:`~icebarrier.iceberg_ext.commits.BarrierCommit`: DataFrame writes carry the
barrier as ``snapshot-property.*`` options; SQL writes (MERGE, INSERT OVERWRITE, DELETE)
run inside ``org.apache.iceberg.spark.CommitMetadata.withCommitProperties`` called through
py4j, which works in PySpark's default pinned-thread mode.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.commits import BarrierCommit
from icebarrier.iceberg_ext.spark import require_pyspark


class _SqlCallable:
    """A java.util.concurrent.Callable that runs one SQL statement from the JVM's side."""

    def __init__(self, spark, statement: str) -> None:
        self.spark, self.statement = spark, statement

    def call(self):
        self.spark.sql(self.statement).collect()
        return None

    class Java:
        implements = ["java.util.concurrent.Callable"]


def run_with_commit_properties(spark, statement: str, properties: dict[str, str]) -> None:
    """Run a SQL write so that the snapshot it commits carries ``properties``."""
    require_pyspark()
    from pyspark.java_gateway import ensure_callback_server_started

    sc = spark.sparkContext
    ensure_callback_server_started(sc._gateway)
    jvm = sc._jvm
    props = jvm.java.util.HashMap()
    for key, value in properties.items():
        props.put(key, value)
    exc_class = jvm.java.lang.Class.forName("java.lang.RuntimeException")
    jvm.org.apache.iceberg.spark.CommitMetadata.withCommitProperties(props, _SqlCallable(spark, statement), exc_class)


def rewrite_data_files(spark, table: TableName, *, options: Mapping[str, str], properties: dict[str, str]) -> None:
    """Spark's rewrite-data-files action (its ``options``, e.g. ``min-input-files``,
    ``target-file-size-bytes``) with ``properties`` in the new snapshot's summary.

    The action commits from its own threads, so CommitMetadata's thread-local would not reach
    it: the properties go to the action itself."""
    _run_action(spark, table, "rewriteDataFiles", options, properties)


def rewrite_manifests(spark, table: TableName, *, properties: dict[str, str]) -> None:
    """Spark's rewrite-manifests action (manifests regrouped by partition, one per target
    manifest size), with ``properties`` in the new snapshot's summary."""
    _run_action(spark, table, "rewriteManifests", {}, properties)


def _run_action(spark, table: TableName, action_name: str, options: Mapping[str, str], properties: dict[str, str]):
    jvm = spark.sparkContext._jvm
    # PySpark pins each Python thread to a JVM thread: one other than the session's own (a
    # maintenance worker) has no active session, and the rewrite's staging catalog would be missing
    jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)
    jtable = jvm.org.apache.iceberg.spark.Spark3Util.loadIcebergTable(spark._jsparkSession, str(table))
    # Spark's catalog caches tables: one another process changed (an expiry through PyIceberg, a
    # job's commit) would be planned as it was, and the rewrite refused for manifests it no longer has.
    jtable.refresh()
    action = getattr(jvm.org.apache.iceberg.spark.actions.SparkActions.get(spark._jsparkSession), action_name)(jtable)
    for key, value in options.items():
        action = action.option(key, value)
    for key, value in properties.items():
        action = action.snapshotProperty(key, value)
    return action.execute()


def _options(properties: dict[str, str]) -> dict[str, str]:
    return {f"snapshot-property.{k}": v for k, v in properties.items()}


def append_df(tx: BarrierCommit, table: TableName, df, properties: Mapping[str, str] | None = None) -> int | None:
    """Append a DataFrame to ``table`` for the barrier (an empty DataFrame leaves no snapshot)."""
    return tx.write(table, lambda props: df.writeTo(str(table)).options(**_options(props)).append(), properties)


def overwrite_df(tx: BarrierCommit, table: TableName, df, properties: Mapping[str, str] | None = None) -> int | None:
    """Replace all rows of ``table`` with the DataFrame, in one snapshot."""
    from pyspark.sql import functions as F

    return tx.write(
        table, lambda props: df.writeTo(str(table)).options(**_options(props)).overwrite(F.lit(True)), properties
    )


def merge_df(
    tx: BarrierCommit, table: TableName, df, keys: list[str], properties: Mapping[str, str] | None = None
) -> int | None:
    """Upsert the DataFrame into ``table`` by ``keys`` with one MERGE (one snapshot)."""
    if not keys or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in keys):
        raise ValueError(f"merge keys {keys!r} must be plain column names")
    view = f"__icebarrier_merge_{abs(hash((str(table), tx.barrier)))}"
    on = " AND ".join(f"t.`{k}` = s.`{k}`" for k in keys)
    statement = (
        f"MERGE INTO {table} t USING {view} s ON {on} WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"
    )

    def write(props):
        df.createOrReplaceTempView(view)
        try:
            run_with_commit_properties(df.sparkSession, statement, props)
        finally:
            df.sparkSession.catalog.dropTempView(view)

    return tx.write(table, write, properties)


def sql_write(tx: BarrierCommit, table: TableName, statement: str, spark) -> int | None:
    """Run one SQL write statement (INSERT, INSERT OVERWRITE, MERGE, DELETE, UPDATE) on ``table``."""
    return tx.write(table, lambda props: run_with_commit_properties(spark, statement, props))


# -- reads -----------------------------------------------------------------------------------------


def table_at(spark, table: TableName, snapshot_id: int | None):
    """``table`` as of a snapshot; an empty DataFrame with its schema when it had none."""
    if snapshot_id is None:
        return spark.table(str(table)).limit(0)
    return spark.read.format("iceberg").option("versionAsOf", str(snapshot_id)).load(str(table))


# -- errors --------------------------------------------------------------------------------------------

# Error conditions Spark raises only in ANSI mode (``spark.sql.ansi.enabled``, on by default from
# Spark 4.0; off, the same expressions give NULL or wrap around)
ANSI_ONLY = frozenset(
    {
        "ARITHMETIC_OVERFLOW",
        "BINARY_ARITHMETIC_OVERFLOW",
        "CANNOT_PARSE_TIMESTAMP",
        "CAST_INVALID_INPUT",
        "CAST_OVERFLOW",
        "CAST_OVERFLOW_IN_TABLE_INSERT",
        "DATETIME_FIELD_OUT_OF_BOUNDS",
        "DIVIDE_BY_ZERO",
        "INTERVAL_DIVIDED_BY_ZERO",
        "INVALID_ARRAY_INDEX",
        "INVALID_ARRAY_INDEX_IN_ELEMENT_AT",
        "INVALID_FRACTION_OF_SECOND",
        "MAP_KEY_DOES_NOT_EXIST",
        "NUMERIC_VALUE_OUT_OF_RANGE",
    }
)
_CONDITION = re.compile(r"\[([A-Z][A-Z0-9_]+)(?:\.[A-Z0-9_]+)?\]")


def ansi_failure(exc: BaseException) -> str | None:
    """What a Spark failure says in one line, if it is one only ANSI mode raises (a task's failure
    reaches the driver wrapped: the condition is looked for in the whole text); else None."""
    text = str(exc)
    found = next((m for m in _CONDITION.finditer(text) if m.group(1) in ANSI_ONLY), None)
    if found is None:
        return None
    line = text[found.start() :].splitlines()[0]
    return line.split(" SQLSTATE:")[0].strip()
