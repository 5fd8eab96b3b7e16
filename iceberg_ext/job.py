"""What a job is, for the people who write them: ``Job``, ``SqlJob``, ``TransformJob``,
``RootJob``. What a transform returns (``Output``: ``append``, ``overwrite``, ``merge``) and what it
sees of barrier B (``BarrierContext``, ``delta_join``) are :mod:`.barrier_context`'s, importable
from here too.

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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import JobDefinition, TableName, parse_job_name
from icebarrier.iceberg_ext.barrier_context import (  # noqa: F401 - append, overwrite, merge, delta_join: the jobs' API here too
    BarrierContext,
    Computation,
    IncrementUnavailableError,
    Output,
    append,
    delta_join,
    merge,
    overwrite,
    table_name,
)
from icebarrier.iceberg_ext.sources import Source

if TYPE_CHECKING:
    from icebarrier.iceberg_ext import incremental as incremental_sql
    from icebarrier.iceberg_ext import spark_sql

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
        return {table_name(k): v for k, v in result.items()}


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
