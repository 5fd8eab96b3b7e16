"""What a job is, for the people who write them: ``Job``, ``SqlJob``, ``TransformJob``,
``RootJob``, what a transform returns (``Output``: ``append``, ``overwrite``, ``merge``) and what it
sees of barrier B (``BarrierContext``, ``delta_join``).

    from icebarrier import SqlJob, main

    job = SqlJob("user_item_amount", '''
        INSERT INTO lake.shop.user_item_amount
        SELECT user_id, item_id, sum(amount) AS amount FROM lake.shop.shopping GROUP BY user_id, item_id''')
    if __name__ == "__main__":
        main(job)           # python my_job.py --once | --follow   (or: icebarrier run my_job.py)

How a job is run (planning, waiting, completing barriers) is :mod:`icebarrier.iceberg_ext.runtime`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import JobDefinition, TableName, parse_job_name
from icebarrier.iceberg_ext.catalog import ancestors, is_compaction, load_table, summary_properties
from icebarrier.iceberg_ext.reads import ConsistentRead
from icebarrier.iceberg_ext.sources import Source

if TYPE_CHECKING:
    from icebarrier.iceberg_ext import spark_sql


class IncrementUnavailableError(IcebarrierError):
    def __init__(self, table: TableName, snapshot_id: int, operation: str, *, changelog_possible: bool = True) -> None:
        way = f"read its changelog with ctx.changes({str(table)!r}) or " if changelog_possible else ""
        super().__init__(
            f"source {table} has snapshot {snapshot_id} (operation {operation}) since the previous barrier, which "
            f"incremental reads skip silently; {way}do a full recompute from ctx.table({str(table)!r})"
        )


# -- what a transform returns ------------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    df: object
    mode: str = "append"  # append, overwrite or merge
    keys: tuple[str, ...] = ()


def append(df) -> Output:
    return Output(df, "append")


def overwrite(df) -> Output:
    return Output(df, "overwrite")


def merge(df, keys: list[str]) -> Output:
    return Output(df, "merge", tuple(keys))


# -- the per-barrier context -----------------------------------------------------------------------------


class BarrierContext:
    """A job's view of barrier B: its sources at B and at its previous barrier P (the job's
    progress). When the job coalesces, P is older than the barrier before B: increments and
    changes cover every barrier after P up to B."""

    def __init__(
        self,
        spark,
        reader: ConsistentRead,
        catalog,
        *,
        barrier: int,
        previous: int | None,
        previous_snapshots: dict[TableName, int | None],
    ) -> None:
        self.spark, self.barrier, self.previous = spark, barrier, previous
        self._reader, self._catalog = reader, catalog
        self._cut = reader.cut()
        self._previous_snapshots = previous_snapshots

    @property
    def bootstrap(self) -> bool:
        """True for the job's first barrier: inputs are read in full."""
        return self.previous is None

    def snapshot(self, table: str | TableName) -> int | None:
        return self._cut.snapshots[_name(table)]

    def table(self, table: str | TableName):
        """The source as of barrier B (full snapshot)."""
        from icebarrier.iceberg_ext.spark_io import table_at

        return table_at(self.spark, _name(table), self.snapshot(table))

    def previous_table(self, table: str | TableName):
        """The source as of the job's previous barrier (empty at bootstrap)."""
        from icebarrier.iceberg_ext.spark_io import table_at

        name = _name(table)
        return table_at(self.spark, name, self._previous_snapshots.get(name))

    def _since_previous(self, name: TableName, start: int, end: int):
        """The source's snapshots after the previous barrier's, up to B's, newest first."""
        tbl = load_table(self._catalog, name)
        return ancestors(tbl, tbl.snapshot_by_id(end), stop_at=start)

    def increment(self, table: str | TableName):
        """Rows appended to the source since the previous barrier (all rows at bootstrap).

        Only for append-only history: an overwrite or delete snapshot in between raises
        :class:`IncrementUnavailableError` (incremental reads would silently skip it).
        Compaction snapshots add nothing and are skipped.
        """
        name = _name(table)
        start, end = self._previous_snapshots.get(name), self.snapshot(name)
        if end is None or start == end:
            return self.table(name).limit(0)
        if start is None:  # bootstrap, or the source was empty at the previous barrier
            return self.table(name)
        for snapshot in self._since_previous(name, start, end):
            operation = snapshot.summary.operation.value if snapshot.summary else "unknown"
            if operation != "append" and not (operation == "replace" and is_compaction(snapshot)):
                raise IncrementUnavailableError(name, snapshot.snapshot_id, operation)
        return (
            self.spark.read.format("iceberg")
            .option("start-snapshot-id", str(start))
            .option("end-snapshot-id", str(end))
            .load(str(name))
        )

    def changes(self, table: str | TableName):
        """The source's changelog since the previous barrier: its rows plus ``_change_type``
        (INSERT / DELETE / UPDATE_BEFORE / UPDATE_AFTER), for sources written copy-on-write
        (overwrites, MERGE, DELETE included). At bootstrap: every row as an INSERT. A
        merge-on-read history (delete files) raises :class:`IncrementUnavailableError`."""
        from pyspark.sql import functions as F

        name = _name(table)
        start, end = self._previous_snapshots.get(name), self.snapshot(name)
        if end is None or start == end:
            return self.table(name).limit(0).withColumn("_change_type", F.lit("INSERT"))
        if start is None:
            return self.table(name).withColumn("_change_type", F.lit("INSERT"))
        for snapshot in self._since_previous(name, start, end):
            if int(summary_properties(snapshot).get("added-delete-files", "0")) > 0:
                raise IncrementUnavailableError(
                    name, snapshot.snapshot_id, "merge-on-read delete", changelog_possible=False
                )
        view = f"__icebarrier_changes_{abs(hash((str(name), start, end)))}"
        ident = ".".join((*name.namespace, name.name))
        self.spark.sql(
            f"CALL {name.catalog}.system.create_changelog_view(table => '{ident}', changelog_view => '{view}', "
            f"options => map('start-snapshot-id', '{start}', 'end-snapshot-id', '{end}'))"
        )
        return self.spark.table(view).drop("_change_ordinal", "_commit_snapshot_id")


def delta_join(ctx: BarrierContext, left: str | TableName, right: str | TableName, on: list[str], how: str = "inner"):
    """The increment of ``left ⋈ right`` at B for append-only inputs, from the tables
    themselves (no copy of either kept in job state):  ΔL ⋈ R(B)  ∪  L(prev) ⋈ ΔR."""
    if ctx.bootstrap:
        return ctx.table(left).join(ctx.table(right), on, how)
    new_left = ctx.increment(left).join(ctx.table(right), on, how)
    new_right = ctx.previous_table(left).join(ctx.increment(right), on, how)
    return new_left.unionByName(new_right)


def _name(table: str | TableName) -> TableName:
    return table if isinstance(table, TableName) else TableName.parse(table)


# -- jobs ------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """``reads_barrier``: the transform reads the barrier itself (e.g. a clock), so an unchanged
    barrier is never skipped; ``coalesce`` False: every barrier is computed exactly."""

    name: str
    sinks: list[str]
    sources: list[str] = field(default_factory=list)
    external_inputs: list[str] = field(default_factory=list)
    reads_barrier: bool = field(default=False, kw_only=True)
    coalesce: bool = field(default=True, kw_only=True)

    def definition(self) -> JobDefinition:
        return JobDefinition(
            name=parse_job_name(self.name),
            sources=frozenset(TableName.parse(t) for t in self.sources),
            sinks=frozenset(TableName.parse(t) for t in self.sinks),
            external_inputs=frozenset(self.external_inputs),
        )

    needs_spark_to_define: ClassVar[bool] = False  # a SqlJob learns its sink and sources from Spark's parser

    def bind(self, spark) -> None:
        """Learn what the definition needs from the Spark session (a SqlJob: its sink and sources)."""

    def outputs(self, ctx: BarrierContext) -> dict[TableName, Output]:
        raise NotImplementedError


@dataclass
class TransformJob(Job):
    """An intermediate job: ``transform(ctx)`` returns an Output (one sink) or {sink: Output}."""

    transform: Callable[[BarrierContext], Output | dict] | None = None

    def outputs(self, ctx):
        result = self.transform(ctx)
        if isinstance(result, Output):
            if len(self.sinks) != 1:
                raise IcebarrierError(f"job {self.name} has several sinks; return {{sink: Output}} from its transform")
            return {TableName.parse(self.sinks[0]): result}
        return {_name(k): v for k, v in result.items()}


class SqlJob(TransformJob):
    """A job defined by ``INSERT INTO|OVERWRITE <sink> <query>`` over managed tables.

    At each barrier the query runs against its sources pinned at B and replaces the sink's
    contents (a materialized view; ``mode="append"`` appends instead, ``mode="merge"`` upserts
    by ``keys``). The sink and the sources come from Spark's parser when the job starts
    (every table the query reads, resolved against the session's current catalog and
    namespace), or from ``sources=``; the statement is never searched with patterns.
    """

    needs_spark_to_define = True

    def __init__(
        self,
        name: str,
        statement: str,
        *,
        mode: str = "overwrite",
        keys: Iterable[str] = (),
        sources: list[str] | None = None,
    ):
        super().__init__(name=name, sinks=[], sources=list(sources or []))
        self.statement, self.mode, self.keys = statement, mode, list(keys)
        self._declared_sources = sources is not None
        self._parsed: spark_sql.Statement | None = None
        self.transform = self._run

    def bind(self, spark) -> None:
        """Parse the statement with the session's parser: sink and sources."""
        from icebarrier.iceberg_ext import spark_sql

        try:
            parsed = spark_sql.parse(spark, self.statement, insert=True)
            # Every table the query reads is a source, pinned at each barrier: the same refusals as a read.
            spark_sql.check_pinnable(parsed, set(parsed.tables()))
        except IcebarrierError as exc:
            raise IcebarrierError(f"SQL job {self.name}: {exc}") from None
        if parsed.sink is None:
            raise IcebarrierError(f"SQL job {self.name}: write it as INSERT INTO <catalog.namespace.table> SELECT …")
        read = [str(t) for t in parsed.tables()]
        if not read:
            raise IcebarrierError(f"SQL job {self.name}: its query reads no table")
        if self._declared_sources:
            undeclared = sorted(set(read) - {str(TableName.parse(s)) for s in self.sources})
            if undeclared:
                raise IcebarrierError(
                    f"SQL job {self.name}: its query reads {', '.join(undeclared)}, which is not "
                    f"among its sources=; add it, or leave sources= out to take them from the query"
                )
        else:
            self.sources = read
        self.sinks = [str(parsed.sink)]
        self._parsed = parsed

    def definition(self) -> JobDefinition:
        if self._parsed is None:
            raise IcebarrierError(
                f"SQL job {self.name}: its sink and sources come from Spark's parser; "
                f"run it through Runtime / `icebarrier run`, or call job.bind(spark) first"
            )
        return super().definition()

    def _run(self, ctx):
        from icebarrier.iceberg_ext import spark_sql

        pinned = spark_sql.pin(ctx.spark, self._parsed, {t: ctx.snapshot(t) for t in self._parsed.tables()})
        return Output(ctx.spark.sql(pinned), self.mode, tuple(self.keys))


@dataclass
class RootJob(Job):
    """A root job: ``source`` -> (optional ``transform(df, ctx)``) -> one sink, ``mode`` append or merge."""

    source: Source | None = None
    transform: Callable | None = None
    mode: str = "append"
    keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.sinks) != 1:
            raise IcebarrierError(
                f"root job {self.name} names {len(self.sinks)} sinks; a RootJob writes exactly one. Use one RootJob "
                f"per sink, or a TransformJob that returns {{sink: Output}} from the root table"
            )
        if not self.external_inputs and self.source is not None:
            self.external_inputs = [self.source.describe()]
