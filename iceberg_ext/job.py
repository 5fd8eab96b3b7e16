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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from icebarrier.control_plane import reads
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import JobDefinition, TableName, parse_job_name, quote_name
from icebarrier.iceberg_ext.catalog import ancestors, is_compaction, load_table, summary_properties
from icebarrier.iceberg_ext.reads import ConsistentRead
from icebarrier.iceberg_ext.sources import Source

if TYPE_CHECKING:
    from icebarrier.iceberg_ext import incremental as incremental_sql
    from icebarrier.iceberg_ext import spark_sql


class IncrementUnavailableError(IcebarrierError):
    def __init__(self, table: TableName, snapshot_id: int, what: str, *, changelog_possible: bool = True) -> None:
        way = f"read its changelog with ctx.changes({str(table)!r}) or " if changelog_possible else ""
        super().__init__(
            f"source {table} has snapshot {snapshot_id} ({what}) since the previous barrier, which "
            f"incremental reads skip silently; {way}do a full recompute from ctx.table({str(table)!r})"
        )


# -- what a transform returns ------------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    df: object
    mode: str = "append"  # append, overwrite or merge
    keys: tuple[str, ...] = ()
    properties: Mapping[str, str] = field(default_factory=dict)  # more snapshot summary properties


@dataclass(frozen=True)
class Computation:
    """How a job computed a barrier, when it says (an SqlJob): from the changes since its
    previous barrier, or in full and why."""

    incremental: bool
    reason: str | None = None  # why in full

    def describe(self) -> str:
        return "incremental" if self.incremental else f"full ({self.reason})"


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
        self.spark, self.barrier, self.previous, self.catalog = spark, barrier, previous, catalog
        self._reader = reader
        self._cut = reader.cut()
        self._previous_snapshots = dict(previous_snapshots)
        self.computation: Computation | None = None  # set by a job that says how it computed B

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

    def previous_snapshot(self, table: str | TableName) -> int | None:
        """A source's or one of the job's sinks' snapshot at the previous barrier (None: none)."""
        name = _name(table)
        if name not in self._previous_snapshots:
            snapshot = None
            if self.previous is not None:
                try:
                    snapshot = reads.resolve(self._reader.conn, [name], barrier=self.previous).snapshots[name]
                except IcebarrierError:  # a sink added to the job after its previous barrier
                    pass
            self._previous_snapshots[name] = snapshot
        return self._previous_snapshots[name]

    def previous_table(self, table: str | TableName):
        """A source (or sink of the job) as of the job's previous barrier (empty at bootstrap)."""
        from icebarrier.iceberg_ext.spark_io import table_at

        name = _name(table)
        return table_at(self.spark, name, self.previous_snapshot(name))

    def _since_previous(self, name: TableName, start: int, end: int):
        """The source's snapshots after the previous barrier's, up to B's, newest first."""
        tbl = load_table(self.catalog, name)
        return ancestors(tbl, tbl.snapshot_by_id(end), stop_at=start)

    def not_appended(self, table: str | TableName) -> tuple[int, str] | None:
        """The first snapshot of the source since the previous barrier that is not an append
        (a compaction adds nothing and counts as one), as (snapshot id, what it is); None if
        the source only had rows appended since then."""
        name = _name(table)
        start, end = self._previous_snapshots.get(name), self.snapshot(name)
        if end is None or start is None or start == end:  # unchanged, or everything is new
            return None
        oldest = None
        for snapshot in self._since_previous(name, start, end):
            operation = snapshot.summary.operation.value if snapshot.summary else "unknown"
            if operation != "append" and not (operation == "replace" and is_compaction(snapshot)):
                return snapshot.snapshot_id, f"operation {operation}"
            oldest = snapshot
        if oldest is None or oldest.parent_snapshot_id != start:
            return end, f"not a descendant of snapshot {start} at the previous barrier: a rollback or revision"
        return None

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
        found = self.not_appended(name)
        if found is not None:
            raise IncrementUnavailableError(name, *found)
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
                    name, snapshot.snapshot_id, "operation merge-on-read delete", changelog_possible=False
                )
        view = f"__icebarrier_changes_{abs(hash((str(name), start, end)))}"
        ident = quote_name(name.identifier)  # as Spark's SQL catalog (JDBC) stores it
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

    @property
    def writes_arrow(self) -> bool:
        """Its barriers need no Spark (a RootJob appending what its source reads as Arrow)."""
        return False

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

    At each barrier the sink holds the query over its sources pinned at B (a materialized
    view; ``mode="append"`` appends the query's result instead, ``mode="merge"`` upserts by
    ``keys``). When the query is in the incremental class (docs/incremental.md) the view is
    kept from the sources' appends since the job's previous barrier (``incremental=False``:
    always in full); a computation that cannot be incremental is full, and says why. The
    sink and the sources come from Spark's parser when the job starts (every table the query
    reads, resolved against the session's current catalog and namespace), or from
    ``sources=``; the statement is never searched with patterns.
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
        incremental: bool = True,
    ):
        super().__init__(name=name, sinks=[], sources=list(sources or []))
        self.statement, self.mode, self.keys = statement, mode, list(keys)
        self.incremental = incremental
        self._declared_sources = sources is not None
        self._parsed: spark_sql.Statement | None = None
        self._query: incremental_sql.Query | None = None
        self.not_incremental: str | None = None  # why no computation can be incremental (after bind)
        self.transform = self._run

    def bind(self, spark) -> None:
        """Parse the statement with the session's parser: sink and sources; then whether the
        query is in the incremental class (and its state table, if it needs one)."""
        from icebarrier.iceberg_ext import incremental as incremental_sql
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
        self._query, self.not_incremental = self._analyse(spark, parsed)
        if self._query is not None and self._query.needs_state:
            state = incremental_sql.state_table(parsed.sink)
            incremental_sql.create_state_table(spark, self._query, state)
            self.sinks.append(str(state))

    def _analyse(self, spark, parsed: spark_sql.Statement) -> tuple[incremental_sql.Query | None, str | None]:
        from icebarrier.iceberg_ext import incremental as incremental_sql

        if not self.incremental:
            return None, "incremental=False"
        if self.mode != "overwrite":
            return None, f"mode={self.mode!r} (only the default, a materialized view, is kept incrementally)"
        written = {tuple(p.lower() for p in r.parts): r.table for r in parsed.relations if r.kind == "table"}
        analysis = incremental_sql.analyse(
            parsed.query, lambda parts: written.get(tuple(p.lower() for p in parts)), salt=str(parsed.sink)
        )
        if analysis.query is None:
            return None, f"the query has {analysis.reason}"
        from pyspark.errors import AnalysisException

        try:
            deterministic = spark.sql(parsed.query)._jdf.queryExecution().analyzed().deterministic()
        except AnalysisException as exc:  # a source not created yet: the full run will say what is missing
            return None, f"Spark cannot analyse the query yet ({str(exc).splitlines()[0]})"
        if not deterministic:
            return None, "the query has a nondeterministic expression (Spark's analyser says so)"
        return analysis.query, None

    def definition(self) -> JobDefinition:
        if self._parsed is None:
            raise IcebarrierError(
                f"SQL job {self.name}: its sink and sources come from Spark's parser; "
                f"run it through Runtime / `icebarrier run`, or call job.bind(spark) first"
            )
        return super().definition()

    def _run(self, ctx: BarrierContext) -> dict[TableName, Output]:
        from icebarrier.iceberg_ext import incremental as incremental_sql

        assert self._parsed is not None and self._parsed.sink is not None
        sink, query = self._parsed.sink, self._query
        reason = self.not_incremental if query is None else incremental_sql.why_full(ctx, query, sink)
        ctx.computation = Computation(incremental=reason is None, reason=reason)
        if query is None:
            return {sink: self._full(ctx)}
        properties = {incremental_sql.SUMMARY_PLAN: query.fingerprint}
        if reason is None:
            changes = incremental_sql.delta_outputs(ctx, query, sink)
            return {t: Output(df, mode, (), properties) for t, (df, mode) in changes.items()}
        outputs = {sink: replace(self._full(ctx), properties=properties)}
        if query.needs_state:
            view = incremental_sql.Views(ctx, query)
            partials = ctx.spark.sql(query.full_partials(view))
            outputs[incremental_sql.state_table(sink)] = Output(partials, "overwrite", (), properties)
        return outputs

    def _full(self, ctx: BarrierContext) -> Output:
        from icebarrier.iceberg_ext import spark_sql

        assert self._parsed is not None
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

    @property
    def writes_arrow(self) -> bool:
        """Appends what its source reads as Arrow (no transform): written with PyIceberg, no Spark."""
        return self.source is not None and self.source.reads_arrow and self.transform is None and self.mode == "append"
