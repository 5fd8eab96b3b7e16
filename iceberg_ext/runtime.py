"""The PySpark job runtime: jobs that complete barriers, so consistency comes from using it.

    job = SqlJob("user_item_amount", '''
        INSERT INTO lake.shop.user_item_amount
        SELECT user_id, item_id, sum(amount) AS amount FROM lake.shop.shopping GROUP BY user_id, item_id''')
    if __name__ == "__main__":
        job.main()          # python my_job.py --once | --follow   (or: icebarrier run my_job.py)

A job follows the plan the control plane gives it (DESIGN.md, "Cost follows change"): for
the barrier B it completes next, once every source has completed B, it either skips (no
source changed since its progress P: no Spark work, one control-plane statement), or reads
its sources at B — once for every barrier after P up to B when it coalesces them, never past
an anchor — writes its sinks (barrier-tagged, exactly once) and completes B for all of them
in one control-plane transaction. A root job first records its input range (replayed after
a crash; an empty one is a skip); an intermediate job records the barrier it computes, so a
restart finishes that one. A job added to tables with history bootstraps from their latest
common completed barrier. ``--once`` is the batch mode: complete the newest barrier the job
can, with as few computations as the anchors allow, and exit.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from icebarrier.control_plane import db, jobs, reads, runs
from icebarrier.control_plane.errors import IcebarrierError, SnapshotExpiredError
from icebarrier.control_plane.jobs import NextBarrier, Plan
from icebarrier.control_plane.model import JobDefinition, Level, TableName, barrier_label, format_duration_s, parse_duration_s, parse_job_name
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import ancestors, is_compaction, load_catalog, load_table, summary_properties
from icebarrier.iceberg_ext.commits import BarrierCommit
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.lineage import Lineage
from icebarrier.iceberg_ext.reads import ConsistentRead
from icebarrier.iceberg_ext.sources import Source

HEARTBEAT_S = 5.0


class IncrementUnavailableError(IcebarrierError):
    def __init__(self, table: TableName, snapshot_id: int, operation: str, *, changelog_possible: bool = True) -> None:
        way = (f"read its changelog with ctx.changes({str(table)!r}) or " if changelog_possible else "")
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

    def __init__(self, spark, reader: ConsistentRead, catalog, *, barrier: int, previous: int | None,
                 previous_snapshots: dict[TableName, int | None]) -> None:
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
        return (self.spark.read.format("iceberg").option("start-snapshot-id", str(start))
                .option("end-snapshot-id", str(end)).load(str(name)))

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
                raise IncrementUnavailableError(name, snapshot.snapshot_id, "merge-on-read delete",
                                                changelog_possible=False)
        view = f"__icebarrier_changes_{abs(hash((str(name), start, end)))}"
        ident = ".".join((*name.namespace, name.name))
        self.spark.sql(
            f"CALL {name.catalog}.system.create_changelog_view(table => '{ident}', changelog_view => '{view}', "
            f"options => map('start-snapshot-id', '{start}', 'end-snapshot-id', '{end}'))"
        )
        return self.spark.table(view).drop("_change_ordinal", "_commit_snapshot_id")


def record_plan(conn, plan: NextBarrier) -> None:
    """Record the barrier an intermediate job is about to compute (its sources' snapshots at it
    are its input): a restart resumes that barrier — whose commit may already be in a sink, to
    adopt — instead of planning a newer one."""
    runs.record_range(conn, plan.job, plan.barrier, {"plan": plan.plan.value, "from_barrier": plan.from_barrier})


def inputs_at(conn, catalog, job: str, sources: list[TableName], barrier: int, *, bootstrap: bool) -> ConsistentRead:
    """A job's inputs at B. Once the job has progress P < B, S(source, B) is protected for
    as long as it has not completed B (its progress holds the read-committed window's floor
    at P), so no lease is needed and the existence check is left to the engine's own error.
    A bootstrapping job has no progress yet: it takes a lease that also records B as its
    start, atomically (refused if expiry got there first; the job then starts at a newer
    barrier)."""
    if bootstrap:
        return ConsistentRead(conn, catalog, sources, barrier=barrier, level=Level.REPEATABLE_READ,
                              ttl_s=3600, holder=f"bootstrap:{job}", bootstrap_job=job)
    return ConsistentRead(conn, catalog, sources, barrier=barrier, verify_snapshots=False)


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

    needs_spark_to_define = False  # a SqlJob learns its sink and sources from Spark's parser

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

    def outputs(self, ctx: BarrierContext) -> dict[TableName, Output]:
        raise NotImplementedError

    def main(self, argv: list[str] | None = None) -> None:
        """``python my_job.py [--once | --follow] [--poll 1s]``"""
        parser = argparse.ArgumentParser(prog=f"job {self.name}")
        mode = parser.add_mutually_exclusive_group()
        mode.add_argument("--once", action="store_true", help="complete the newest barrier it can (skipping unchanged "
                          "barriers, coalescing the rest up to each anchor), then exit (default)")
        mode.add_argument("--follow", action="store_true", help="keep going until SIGINT/SIGTERM")
        parser.add_argument("--poll", default="1s", help="how often to look for a new barrier in --follow")
        args = parser.parse_args(argv)
        try:
            with Runtime(self) as runtime:
                runtime.run(follow=args.follow, poll_s=parse_duration_s(args.poll))
        except IcebarrierError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(1) from None


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

    def __init__(self, name: str, statement: str, *, mode: str = "overwrite", keys: list[str] = (),
                 sources: list[str] | None = None):
        super().__init__(name=name, sinks=[], sources=list(sources or []))
        self.statement, self.mode, self.keys = statement, mode, list(keys)
        self._declared_sources = sources is not None
        self._parsed = None
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
                raise IcebarrierError(f"SQL job {self.name}: its query reads {', '.join(undeclared)}, which is not "
                                      f"among its sources=; add it, or leave sources= out to take them from the query")
        else:
            self.sources = read
        self.sinks = [str(parsed.sink)]
        self._parsed = parsed

    def definition(self) -> JobDefinition:
        if self._parsed is None:
            raise IcebarrierError(f"SQL job {self.name}: its sink and sources come from Spark's parser; "
                                  f"run it through Runtime / `icebarrier run`, or call job.bind(spark) first")
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
                f"per sink, or a TransformJob that returns {{sink: Output}} from the root table")
        if not self.external_inputs and self.source is not None:
            self.external_inputs = [self.source.describe()]


# -- the runtime ------------------------------------------------------------------------------------------


@dataclass
class RunSummary:
    """``completed``: the barriers the run completed (each the end of a step); ``computations``:
    the steps that ran the job's work (the others were skips)."""

    job: str
    completed: list[int] = field(default_factory=list)
    computations: int = 0
    stopped_by_signal: bool = False


class Runtime:
    """Runs one job: registers it, completes ready barriers in order, heartbeats, stops cleanly."""

    def __init__(self, job: Job, *, settings: Settings | None = None, spark=None, conn: psycopg.Connection | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.job = job
        self.settings = settings or Settings.load()
        self._owns_conn = conn is None
        self.settings.check_storage()
        self.conn = conn or db.connect(self.settings.dsn, self.settings.schema)
        self.catalog = load_catalog(self.settings)
        self._spark = spark
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.stop = threading.Event()
        self._beat_conn: psycopg.Connection | None = None
        self.lineage = Lineage.for_job(job.name)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections this runtime opened (a connection passed in stays open)."""
        self._close_heartbeat()
        if self._owns_conn:
            self.conn.close()

    def _close_heartbeat(self) -> None:
        if self._beat_conn is not None:
            self._beat_conn.close()
            self._beat_conn = None

    @property
    def spark(self):
        if self._spark is None:
            from icebarrier.iceberg_ext.spark import spark_session

            self._spark = spark_session(self.settings, app_name=f"icebarrier-{self.job.name}")
        return self._spark

    _registered = False

    def register(self) -> None:
        """Register the job's definition (once per Runtime)."""
        if self._registered:
            return
        if self.job.needs_spark_to_define:
            self.job.bind(self.spark)
        result = jobs.register(self.conn, self.job.definition(), replace=True)
        if result.status != "unchanged":
            self.log(f"job {self.job.name}: registered ({result.status})")
        self._registered = True

    def run(self, *, follow: bool = False, poll_s: float = 1.0, max_barriers: int | None = None) -> RunSummary:
        """Complete every ready barrier (then exit, or with ``follow`` keep polling until stopped)."""
        self.stop.clear()
        self.register()
        runs.set_status(self.conn, self.job.name, "running")
        summary = RunSummary(job=self.job.name)
        beat = threading.Thread(target=self._heartbeat, daemon=True, name="icebarrier-heartbeat")
        beat.start()
        if follow:
            # SparkContext replaces the SIGINT handler when it starts: start it first, so that
            # Ctrl-C finishes the current barrier and exits 0 like SIGTERM.
            _ = self.spark
        restore = self._install_signal_handlers() if follow else None
        try:
            while not self.stop.is_set():
                if max_barriers is not None and len(summary.completed) >= max_barriers:
                    break
                plan = self._next_ready()
                if plan is None:
                    if not follow:
                        break
                    self.stop.wait(poll_s)
                    continue
                try:
                    self._complete(plan, summary)
                except SnapshotExpiredError as exc:
                    if jobs.show(self.conn, self.job.name).progress is not None:
                        raise
                    self.log(f"job {self.job.name}: {exc}; bootstrapping from a newer barrier")
        finally:
            self.stop.set()
            if restore:
                restore()
            beat.join(timeout=HEARTBEAT_S)
            self._close_heartbeat()
            runs.set_status(self.conn, self.job.name, "stopped")
        summary.stopped_by_signal = self._signalled
        self.log(f"job {self.job.name}: stopped after {len(summary.completed)} step(s), "
                 f"{summary.computations} computation(s)")
        return summary

    _signalled = False
    _said_waiting: str | None = None

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            self._signalled = True
            self.log(f"job {self.job.name}: {signal.Signals(signum).name}, finishing the current barrier")
            self.stop.set()

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(s, h) for s, h in previous.items()]

    def _heartbeat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            if self._beat_conn is None or self._beat_conn.closed:  # its own connection, opened once
                self._beat_conn = db.connect(self.settings.dsn, self.settings.schema)
            runs.heartbeat(self._beat_conn, self.job.name)

    def _next_ready(self) -> NextBarrier | None:
        """The job's plan if it can follow it now; else records what it waits for."""
        source = getattr(self.job, "source", None)
        nb = jobs.next_barrier(self.conn, self.job.name, skip=not self.job.reads_barrier, coalesce=self.job.coalesce,
                               up_to=source.ready_until() if source is not None else None)
        waiting = nb.describe_wait()
        if source is not None and not nb.ready and nb.barrier is not None:  # its input, past ready_until()
            waiting = source.waiting_for(nb.barrier) or waiting
        runs.set_waiting(self.conn, self.job.name, waiting)
        if waiting is not None and waiting != self._said_waiting:  # said once while idle, not every poll
            self.log(f"job {self.job.name}: waiting for {waiting}")
        self._said_waiting = waiting
        return nb if waiting is None else None

    def _complete(self, plan: NextBarrier, summary: RunSummary) -> None:
        started = time.perf_counter()
        info = jobs.show(self.conn, self.job.name)  # fresh: the job's progress as of now
        behind, barrier = info.barriers_behind, plan.barrier
        if info.progress is None:
            self.log(f"job {self.job.name}: bootstrapping at barrier {barrier_label(barrier)} (full read of its inputs)")
        if plan.plan is Plan.SKIP:
            jobs.complete(self.conn, self.job.name, barrier)
            written = None
        else:
            written = self._computed(plan, info)
        summary.completed.append(barrier)
        summary.computations += written is not None
        if written is None:
            how = "skipped (nothing changed)"
        else:
            how = f"coalesced from {barrier_label(plan.from_barrier)}" if plan.plan is Plan.COALESCE else "completed"
        rows = ", ".join(f"{t}: {'adopted' if s is None else s}" for t, s in (written or {}).items()) or "no changes"
        self.log(f"job {self.job.name}: barrier {barrier_label(barrier)} {how} in {format_duration_s(time.perf_counter() - started)} "
                 f"({rows}); was {behind} behind")

    def _computed(self, plan: NextBarrier, info: jobs.JobInfo) -> dict | None:
        """Compute the plan's barrier (an OpenLineage run when configured: START, then COMPLETE
        with the snapshots read and written, or FAIL)."""
        compute = self._complete_root if isinstance(self.job, RootJob) else self._complete_intermediate
        if self.lineage is None:
            return compute(plan, info)
        run = dict(plan=plan.plan.value, from_barrier=plan.from_barrier)
        sources = [TableName.parse(s) for s in getattr(self.job, "sources", ())]
        inputs = reads.resolve(self.conn, sources, barrier=plan.barrier).snapshots if sources else {}
        self.lineage.start(plan.barrier, inputs=inputs, **run)
        try:
            written = compute(plan, info)
        except BaseException as exc:
            self.lineage.fail(plan.barrier, error=exc, **run)
            raise
        self.lineage.complete(plan.barrier, inputs=inputs, outputs={TableName.parse(t): s for t, s in
                                                                    (written or {}).items()}, **run)
        return written

    def _write(self, tx: BarrierCommit, table: TableName, out: Output):
        from icebarrier.iceberg_ext.spark_io import append_df, merge_df, overwrite_df

        if out.mode == "append":
            return append_df(tx, table, out.df)
        if out.mode == "overwrite":
            return overwrite_df(tx, table, out.df)
        if out.mode == "merge":
            return merge_df(tx, table, out.df, list(out.keys))
        raise IcebarrierError(f"job {self.job.name}: unknown write mode {out.mode!r}; use append, overwrite or merge")

    def _commit(self, plan: NextBarrier, info: jobs.JobInfo) -> BarrierCommit:
        coalesce_after = plan.from_barrier if plan.plan is Plan.COALESCE else None
        return BarrierCommit(self.conn, self.catalog, job=self.job.name, barrier=plan.barrier, job_info=info,
                             coalesce_after=coalesce_after)

    def _complete_root(self, plan: NextBarrier, info: jobs.JobInfo) -> dict | None:
        """Record (or re-read) the input range of the barrier; an empty range is a skip."""
        job: RootJob = self.job
        spec = runs.recorded_range(self.conn, job.name, plan.barrier)
        if spec is None:
            spec = runs.record_range(self.conn, job.name, plan.barrier,
                                     job.source.plan(self.conn, job.name, plan.barrier))
        faults.point(faults.AFTER_INPUT_RANGE)
        if job.source.is_empty(spec) and not job.reads_barrier:
            jobs.complete(self.conn, job.name, plan.barrier)  # nothing arrived: the barriers change nothing
            return None
        df = job.source.read(self.spark, spec)
        if job.transform is not None:
            df = job.transform(df)
        sink = TableName.parse(job.sinks[0])
        with self._commit(plan, info) as tx:
            self._write(tx, sink, Output(df, job.mode, tuple(job.keys)))
        return {str(t): s for t, s in tx.commits.items()}

    def _complete_intermediate(self, plan: NextBarrier, info: jobs.JobInfo) -> dict:
        previous = info.progress
        sources = [TableName.parse(s) for s in self.job.sources]
        previous_snapshots = {}
        if previous is not None:
            record_plan(self.conn, plan)
            previous_snapshots = reads.resolve(self.conn, sources, barrier=previous).snapshots
        with inputs_at(self.conn, self.catalog, self.job.name, sources, plan.barrier,
                       bootstrap=previous is None) as reader:
            ctx = BarrierContext(self.spark, reader, self.catalog, barrier=plan.barrier, previous=previous,
                                 previous_snapshots=previous_snapshots)
            outputs = self.job.outputs(ctx)
            with self._commit(plan, info) as tx:
                for table in sorted(outputs):
                    self._write(tx, table, outputs[table])
        return {str(t): s for t, s in tx.commits.items()}


# -- streaming root jobs -------------------------------------------------------------------------------------


def foreach_batch(job: RootJob | Job, *, settings: Settings | None = None, wait_s: float = 0.2,
                  log: Callable[[str], None] | None = None):
    """A ``foreachBatch`` function for Spark Structured Streaming in which each micro-batch
    completes the job's planned barrier: the newest one, coalescing the barriers since the
    previous micro-batch (never past an anchor). The batch id is recorded as the barrier's
    input range before writing (Spark's checkpoint maps it to source offsets); a restarted
    query that replays a batch id completes the same barrier again, which writes nothing twice.

        query = (stream_df.writeStream.foreachBatch(foreach_batch(job))
                 .option("checkpointLocation", ...).start())
    """
    if len(job.sinks) != 1:
        raise IcebarrierError(f"job {job.name} names {len(job.sinks)} sinks; a streaming root job writes exactly one")
    runtime: dict = {}

    def run(df, batch_id: int) -> None:
        if "rt" not in runtime:
            runtime["rt"] = Runtime(job, settings=settings, spark=df.sparkSession, log=log)
            runtime["rt"].register()
            runs.set_status(runtime["rt"].conn, job.name, "running")
        rt: Runtime = runtime["rt"]
        key = f"batch:{batch_id}"
        barrier = runs.barrier_for_key(rt.conn, job.name, key)
        if barrier is None:
            plan = _wait_for_barrier(rt, wait_s)
            runs.record_range(rt.conn, job.name, plan.barrier, {"batch_id": batch_id}, range_key=key)
        else:  # a replayed batch: its barrier again (resumed, or completed already: nothing written twice)
            plan = jobs.next_barrier(rt.conn, job.name)
            if plan.barrier != barrier:
                plan = NextBarrier(job=job.name, barrier=barrier, ready=True)
        faults.point(faults.AFTER_INPUT_RANGE)
        data = job.transform(df) if getattr(job, "transform", None) else df
        sink = TableName.parse(job.sinks[0])
        with rt._commit(plan, jobs.show(rt.conn, job.name)) as tx:
            rt._write(tx, sink, Output(data, getattr(job, "mode", "append"), tuple(getattr(job, "keys", ()))))
        runs.heartbeat(rt.conn, job.name)
        rt.log(f"job {job.name}: micro-batch {batch_id} completed barrier {barrier_label(plan.barrier)}"
               f"{f' (coalesced from {barrier_label(plan.from_barrier)})' if plan.plan is Plan.COALESCE else ''}")

    return run


def _wait_for_barrier(rt: Runtime, wait_s: float) -> NextBarrier:
    """The job's plan; a micro-batch waits until a barrier is due (bounded by the interval)."""
    from icebarrier.control_plane import barriers

    deadline = time.monotonic() + max(barriers.get_interval_s(rt.conn) * 2, 5)
    while True:
        nb = jobs.next_barrier(rt.conn, rt.job.name)
        if nb.ready:
            return nb
        if time.monotonic() > deadline:
            raise IcebarrierError(f"job {rt.job.name}: no barrier became due; check `icebarrier barrier interval`")
        time.sleep(wait_s)
