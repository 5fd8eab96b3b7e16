"""The PySpark job runtime: runs a job (:mod:`icebarrier.iceberg_ext.job`) so that it completes
barriers, and consistency comes from using it.

A job follows the plan the control plane gives it (DESIGN.md, "Cost follows change"): for
the barrier B it completes next, once every source has completed B, it either skips (no
source changed since its progress P: no Spark work, one control-plane statement), or reads
its sources at B — once for every barrier after P up to B when it coalesces them, never past
an anchor — writes its sinks (barrier-tagged, exactly once) and completes B for all of them
in one control-plane transaction. A root job first records its input range (replayed after
a crash; an empty one is a skip); an intermediate job records the barrier it computes, so a
restart finishes that one. A job added to tables with history bootstraps from their latest
common completed barrier. ``--once`` is the batch mode: complete the newest barrier the job
can, with as few computations as the anchors allow, and exit. ``--follow`` keeps going: between
barriers it waits on its own listening connection for the control plane's notices (a barrier
issued, a source's watermark moved), costing no transaction while nothing concerns it, and
looks anyway every ``--poll`` (docs/model.md, "Waiting, and what a barrier costs").
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from icebarrier.control_plane import db, jobs, reads, runs
from icebarrier.control_plane.errors import IcebarrierError, SnapshotExpiredError
from icebarrier.control_plane.jobs import NextBarrier, Plan
from icebarrier.control_plane.model import Level, TableName, barrier_label, format_duration_s, parse_duration_s
from icebarrier.control_plane.notices import SAFETY_POLL_S, Listener, Wait
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.barrier_context import BarrierContext, Computation, Output
from icebarrier.iceberg_ext.catalog import load_catalog, load_table
from icebarrier.iceberg_ext.commits import BarrierCommit
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.job import Job, RootJob
from icebarrier.iceberg_ext.lineage import Lineage
from icebarrier.iceberg_ext.reads import ConsistentRead

HEARTBEAT_S = 30.0  # a running job's heartbeat at least this often (with its safety poll when idle)


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
        return ConsistentRead(
            conn,
            catalog,
            sources,
            barrier=barrier,
            level=Level.REPEATABLE_READ,
            ttl_s=3600,
            holder=f"bootstrap:{job}",
            bootstrap_job=job,
        )
    return ConsistentRead(conn, catalog, sources, barrier=barrier, verify_snapshots=False)


# -- the runtime ------------------------------------------------------------------------------------------


@dataclass
class RunSummary:
    """``completed``: the barriers the run completed (each the end of a step); ``computations``:
    the steps that ran the job's work (the others were skips)."""

    job: str
    completed: list[int] = field(default_factory=list)
    computations: int = 0
    stopped_by_signal: bool = False


# How `icebarrier run FILE --on-request` answers each request: this, then a JSON object, on a
# line of its own on stdout (everything else it prints is log).
ANSWER = "icebarrier-run: "


class Runtime:
    """Runs one job: registers it, completes ready barriers in order, heartbeats, stops cleanly."""

    def __init__(
        self,
        job: Job,
        *,
        settings: Settings | None = None,
        spark=None,
        conn: db.Conn | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.job = job
        self.settings = settings or Settings.load()
        self._owns_conn = conn is None
        self.settings.check_storage()
        self.conn = conn or db.connect(self.settings.dsn, self.settings.schema)
        self.catalog = load_catalog(self.settings)
        self._spark = spark
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.stop = threading.Event()
        self._beat_conn: db.Conn | None = None
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
        source = getattr(self.job, "source", None)
        if source is not None:
            source.check()  # a source that cannot be read is refused before anything is written
        result = jobs.register(self.conn, self.job.definition(), replace=True)
        if result.status != "unchanged":
            self.log(f"job {self.job.name}: registered ({result.status})")
        self._registered = True

    def run(
        self, *, follow: bool = False, poll_s: float = SAFETY_POLL_S, max_barriers: int | None = None
    ) -> RunSummary:
        """Complete every ready barrier (then exit, or with ``follow`` keep going until stopped:
        waiting for the control plane's notices, and planning again every ``poll_s`` anyway)."""
        self.stop.clear()
        self.register()
        runs.set_status(self.conn, self.job.name, "running")
        self._beat_at = time.monotonic()
        summary = RunSummary(job=self.job.name)
        beat = threading.Thread(target=self._heartbeat, daemon=True, name="icebarrier-heartbeat")
        beat.start()
        if follow and not self.job.writes_arrow:
            # SparkContext replaces the SIGINT handler when it starts: start it first, so that
            # Ctrl-C finishes the current barrier and exits 0 like SIGTERM.
            _ = self.spark
        restore = self._install_signal_handlers() if follow else None
        listener = Listener(self.settings.dsn, self.settings.schema).open() if follow else None  # before planning
        plan: NextBarrier | None = None  # a plan the wait found ready (its source caught up): no planning again
        try:
            while not self.stop.is_set():
                if max_barriers is not None and len(summary.completed) >= max_barriers:
                    break
                plan = self._next_ready(summary) if plan is None else plan
                if plan is None:
                    if not follow:
                        break
                    plan = self._wait(listener, poll_s)
                    continue
                try:
                    self._complete(plan, summary)
                    plan = None
                except SnapshotExpiredError as exc:
                    plan = None
                    if jobs.show(self.conn, self.job.name).progress is not None:
                        raise
                    self.log(f"job {self.job.name}: {exc}; bootstrapping from a newer barrier")
        finally:
            self.stop.set()
            if listener is not None:
                listener.close()
            if restore:
                restore()
            beat.join(timeout=HEARTBEAT_S)
            self._close_heartbeat()
            runs.set_status(self.conn, self.job.name, "stopped")
        summary.stopped_by_signal = self._signalled
        self.log(
            f"job {self.job.name}: stopped after {len(summary.completed)} step(s), "
            f"{summary.computations} computation(s)"
        )
        return summary

    def on_request(self, requests: Iterable[str], answer: Callable[[dict], None]) -> None:
        """Complete every ready barrier once per request (a line of ``requests``), the Spark
        session kept warm between them: what `icebarrier schedule` runs a job file with. Each
        request is answered (``ok``, ``completed``); a refusal (an IcebarrierError) is answered
        and the next request runs; any other failure is answered, then ends the process."""
        _ = self.spark
        answer({"ready": True})
        for _request in requests:
            try:
                summary = self.run()
            except IcebarrierError as exc:
                answer({"ok": False, "error": str(exc)})
                continue
            except Exception as exc:
                answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                raise
            answer({"ok": True, "completed": summary.completed, "computations": summary.computations})

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

    _beat_at = 0.0  # time.monotonic() of the last heartbeat

    def _heartbeat(self) -> None:
        """Beat while the job computes a long barrier (an idle job beats with its safety poll)."""
        while not self.stop.wait(HEARTBEAT_S / 6):
            if time.monotonic() - self._beat_at < HEARTBEAT_S:
                continue
            if self._beat_conn is None or self._beat_conn.closed:  # its own connection, opened once
                self._beat_conn = db.connect(self.settings.dsn, self.settings.schema)
            runs.heartbeat(self._beat_conn, self.job.name)
            self._beat_at = time.monotonic()

    _last: jobs.Advance | None = None
    _computation: Computation | None = None  # how the barrier being completed was computed, if the job says

    def _next_ready(self, summary: RunSummary) -> NextBarrier | None:
        """The job's plan if it can follow it now, in one transaction that completes the barriers
        it may skip (and beats, records what it waits for); else None."""
        source = getattr(self.job, "source", None)
        beat = time.monotonic() - self._beat_at >= HEARTBEAT_S / 3
        said: dict = {}

        def source_wait(plan: NextBarrier) -> str | None:  # what holds a root job's planned barrier back
            if source is not None and not plan.ready and plan.barrier is not None:
                said["wait"] = source.waiting_for(plan.barrier)
            return said.get("wait")

        step = jobs.advance(
            self.conn,
            self.job.name,
            skip=not self.job.reads_barrier,
            coalesce=self.job.coalesce,
            up_to=source.ready_until() if source is not None else None,
            heartbeat=beat,
            record_wait=source_wait,
        )
        if beat:
            self._beat_at = time.monotonic()
        self._last, nb = step, step.plan
        for done in step.skipped:
            summary.completed.append(done.barrier)
            self.log(f"job {self.job.name}: barrier {barrier_label(done.barrier)} skipped (nothing changed)")
        waiting = said.get("wait") or nb.describe_wait()
        if waiting is not None and waiting != self._said_waiting:  # said once while idle, not every look
            self.log(f"job {self.job.name}: waiting for {waiting}")
        self._said_waiting = waiting
        return nb if waiting is None else None

    def _wait(self, listener: Listener, poll_s: float) -> NextBarrier | None:
        """Wait until a notice concerns the job (its sources moved, a barrier was issued for a
        root job), a root job's next barrier is due, or ``poll_s`` passed; costs no transaction.
        A root job whose input is not ready for its planned barrier (an event-time source, a Kafka
        topic's newest records) asks its source every ``source.recheck_s`` and, once it is, returns
        that plan ready: no planning again."""
        step = self._last
        source = getattr(self.job, "source", None)
        if source is not None and step.plan.barrier is not None and source.ready_until() is not None:
            deadline = time.monotonic() + poll_s  # its input: asked of the source, not of Postgres
            while not self.stop.is_set() and time.monotonic() < deadline:
                listener.wait(source.recheck_s)
                if source.ready_until() >= step.plan.barrier:  # the plan stands (only this job moves it)
                    self._said_waiting = None
                    return replace(step.plan, ready=True) if not step.plan.waiting_for else None
            return None
        wait = Wait.of(step.plan, root=step.plan.root, due_in_s=step.due_in_s, safety_s=poll_s)
        while not self.stop.is_set() and wait.remaining_s() > 0:
            notices = listener.wait(min(wait.remaining_s(), 1.0))  # SIGTERM is seen within a second
            if any([wait.wakes(n) for n in notices]):
                return None
        return None

    def _complete(self, plan: NextBarrier, summary: RunSummary) -> None:
        started = time.perf_counter()
        info = jobs.show(self.conn, self.job.name)  # fresh: the job's progress as of now
        behind, barrier = info.barriers_behind, plan.barrier
        if info.progress is None:
            self.log(
                f"job {self.job.name}: bootstrapping at barrier {barrier_label(barrier)} (full read of its inputs)"
            )
        self._computation = None
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
        if self._computation is not None:
            how += f", {self._computation.describe()}"
        self.log(
            f"job {self.job.name}: barrier {barrier_label(barrier)} {how} in {format_duration_s(time.perf_counter() - started)} "
            f"({rows}); was {behind} behind"
        )

    def _computed(self, plan: NextBarrier, info: jobs.JobInfo) -> dict | None:
        """Compute the plan's barrier (an OpenLineage run when configured: START, then COMPLETE
        with the snapshots read and written, or FAIL)."""
        compute = self._ansi_said(self._complete_root if isinstance(self.job, RootJob) else self._complete_intermediate)
        if self.lineage is None:
            return compute(plan, info)
        how, after = plan.plan.value, plan.from_barrier
        sources = [TableName.parse(s) for s in getattr(self.job, "sources", ())]
        inputs = reads.resolve(self.conn, sources, barrier=plan.barrier).snapshots if sources else {}
        self.lineage.start(plan.barrier, plan=how, from_barrier=after, inputs=inputs)
        try:
            written = compute(plan, info)
        except BaseException as exc:
            self.lineage.fail(plan.barrier, plan=how, from_barrier=after, error=exc)
            raise
        outputs = {TableName.parse(t): s for t, s in (written or {}).items()}
        self.lineage.complete(plan.barrier, plan=how, from_barrier=after, inputs=inputs, outputs=outputs)
        return written

    def _ansi_said(self, compute):
        """``compute``, with a failure only Spark's ANSI mode raises said in one line that names the
        setting (Spark 4 turns it on by default: a job written for Spark 3.5 may meet it first)."""

        def computed(plan: NextBarrier, info: jobs.JobInfo) -> dict | None:
            from icebarrier.iceberg_ext.spark_io import ansi_failure

            try:
                return compute(plan, info)
            except IcebarrierError:
                raise
            except Exception as exc:
                said = ansi_failure(exc)
                if said is None:
                    raise
                raise IcebarrierError(
                    f"job {self.job.name}: barrier {barrier_label(plan.barrier)} failed only because Spark's ANSI "
                    f"mode is on ({said}); make the query tolerate the value (try_cast, try_divide, try_add…) or "
                    f"set spark.sql.ansi.enabled=false for this job (spark-defaults.conf in SPARK_CONF_DIR)"
                ) from exc

        return computed

    def _write(self, tx: BarrierCommit, table: TableName, out: Output):
        from icebarrier.iceberg_ext.spark_io import append_df, merge_df, overwrite_df

        if out.mode == "append":
            return append_df(tx, table, out.df, out.properties)
        if out.mode == "overwrite":
            return overwrite_df(tx, table, out.df, out.properties)
        if out.mode == "merge":
            return merge_df(tx, table, out.df, list(out.keys), out.properties)
        raise IcebarrierError(f"job {self.job.name}: unknown write mode {out.mode!r}; use append, overwrite or merge")

    def _commit(self, plan: NextBarrier, info: jobs.JobInfo) -> BarrierCommit:
        coalesce_after = plan.from_barrier if plan.plan is Plan.COALESCE else None
        return BarrierCommit(
            self.conn,
            self.catalog,
            job=self.job.name,
            barrier=plan.barrier,
            job_info=info,
            coalesce_after=coalesce_after,
        )

    def _complete_root(self, plan: NextBarrier, info: jobs.JobInfo) -> dict | None:
        """Record (or re-read) the input range of the barrier; an empty range is a skip."""
        job = self.job
        assert isinstance(job, RootJob)
        spec = runs.recorded_range(self.conn, job.name, plan.barrier)
        if spec is None:
            spec = job.source.plan(self.conn, job.name, plan.barrier)
            if job.source.is_empty(spec) and not job.reads_barrier:
                jobs.complete(self.conn, job.name, plan.barrier)  # nothing arrived, nothing to replay: a skip
                return None
            spec = runs.record_range(self.conn, job.name, plan.barrier, spec)
        faults.point(faults.AFTER_INPUT_RANGE)
        if job.source.is_empty(spec) and not job.reads_barrier:  # a range recorded empty, replayed
            jobs.complete(self.conn, job.name, plan.barrier)
            return None
        sink = TableName.parse(job.sinks[0])
        if job.writes_arrow:  # no Spark: PyIceberg appends the rows the source read
            rows = job.source.read_arrow(spec, load_table(self.catalog, sink).schema().as_arrow())
            with self._commit(plan, info) as tx:
                tx.append_arrow(sink, rows, job.source.summary(spec))
            return {str(t): s for t, s in tx.commits.items()}
        df = job.source.read(self.spark, spec)
        if job.transform is not None:
            df = job.transform(df)
        with self._commit(plan, info) as tx:
            self._write(tx, sink, Output(df, job.mode, tuple(job.keys), job.source.summary(spec)))
        return {str(t): s for t, s in tx.commits.items()}

    def _complete_intermediate(self, plan: NextBarrier, info: jobs.JobInfo) -> dict:
        previous = info.progress
        sources = [TableName.parse(s) for s in self.job.sources]
        previous_snapshots = {}
        if previous is not None:
            record_plan(self.conn, plan)
            previous_snapshots = reads.resolve(self.conn, sources, barrier=previous).snapshots
        with inputs_at(
            self.conn, self.catalog, self.job.name, sources, plan.barrier, bootstrap=previous is None
        ) as reader:
            ctx = BarrierContext(
                self.spark,
                reader,
                self.catalog,
                barrier=plan.barrier,
                previous=previous,
                previous_snapshots=previous_snapshots,
            )
            outputs = self.job.outputs(ctx)
            with self._commit(plan, info) as tx:
                for table in sorted(outputs):
                    self._write(tx, table, outputs[table])
        self._computation = ctx.computation
        if ctx.computation is not None:
            runs.record_computation(
                self.conn, self.job.name, plan.barrier, ctx.computation.incremental, ctx.computation.reason
            )
        return {str(t): s for t, s in tx.commits.items()}


def main(job: Job, argv: list[str] | None = None) -> None:
    """A job file's entry point: ``python my_job.py [--once | --follow] [--poll 60s]``.

    if __name__ == "__main__":
        main(job)
    """
    parser = argparse.ArgumentParser(prog=f"job {job.name}")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--once",
        action="store_true",
        help="complete the newest barrier it can (skipping unchanged "
        "barriers, coalescing the rest up to each anchor), then exit (default)",
    )
    mode.add_argument("--follow", action="store_true", help="keep going until SIGINT/SIGTERM")
    parser.add_argument(
        "--poll",
        default="60s",
        help="--follow waits for the control plane's notices; this is how often it looks anyway",
    )
    args = parser.parse_args(argv)
    try:
        with Runtime(job) as runtime:
            runtime.run(follow=args.follow, poll_s=parse_duration_s(args.poll))
    except IcebarrierError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


# -- streaming root jobs -------------------------------------------------------------------------------------


def foreach_batch(
    job: Job,
    *,
    settings: Settings | None = None,
    wait_s: float = 0.2,
    log: Callable[[str], None] | None = None,
    kafka=None,
    lock: threading.Lock | None = None,
):
    """A ``foreachBatch`` function for Spark Structured Streaming in which each micro-batch
    completes the job's planned barrier: the newest one, coalescing the barriers since the
    previous micro-batch (never past an anchor). The batch id is recorded as the barrier's
    input range before writing (Spark's checkpoint maps it to source offsets); a restarted
    query that replays a batch id completes the same barrier again, which writes nothing twice.
    From Kafka (``kafka``, a :class:`~icebarrier.iceberg_ext.kafka.KafkaLog`, which
    :func:`icebarrier.iceberg_ext.kafka_stream.stream` gives; the runtime knows only its ``batch_spec``
    and ``batch_summary``) the batch's offsets per partition are recorded with it and written into
    the snapshot summary.

        query = (stream_df.writeStream.foreachBatch(foreach_batch(job))
                 .option("checkpointLocation", ...).start())
    """
    if len(job.sinks) != 1:
        raise IcebarrierError(f"job {job.name} names {len(job.sinks)} sinks; a streaming root job writes exactly one")
    runtime: dict = {}
    lock = lock or threading.Lock()

    def run(df, batch_id: int) -> None:
        if kafka is not None:
            df = df.cache()
        with lock:
            if "rt" not in runtime:
                runtime["rt"] = Runtime(job, settings=settings, spark=df.sparkSession, log=log)
                runtime["rt"].register()
                runs.set_status(runtime["rt"].conn, job.name, "running")
            rt: Runtime = runtime["rt"]
            key = f"batch:{batch_id}"
            barrier = runs.barrier_for_key(rt.conn, job.name, key)
            if barrier is None:
                plan = _wait_for_barrier(rt, wait_s)
                spec: dict = {"batch_id": batch_id}
                if kafka is not None:
                    previous = runs.last_range(rt.conn, job.name, before_barrier=plan.barrier)
                    spec = kafka.batch_spec(df, previous, batch_id)
                spec = runs.record_range(rt.conn, job.name, plan.barrier, spec, range_key=key)
            else:  # a replayed batch: its barrier again (resumed, or completed already: nothing written twice)
                spec = runs.recorded_range(rt.conn, job.name, barrier)
                plan = jobs.next_barrier(rt.conn, job.name)
                if plan.barrier != barrier:
                    plan = NextBarrier(job=job.name, barrier=barrier, ready=True)
        faults.point(faults.AFTER_INPUT_RANGE)
        properties = {}
        if kafka is not None:
            properties = kafka.batch_summary(spec)
        transform = getattr(job, "transform", None)
        data = transform(df) if transform is not None else df
        sink = TableName.parse(job.sinks[0])
        with rt._commit(plan, jobs.show(rt.conn, job.name)) as tx:
            out = Output(data, getattr(job, "mode", "append"), tuple(getattr(job, "keys", ())), properties)
            rt._write(tx, sink, out)
        runs.heartbeat(rt.conn, job.name)
        if kafka is not None:
            df.unpersist()
        rt.log(
            f"job {job.name}: micro-batch {batch_id} completed barrier {barrier_label(plan.barrier)}"
            f"{f' (coalesced from {barrier_label(plan.from_barrier)})' if plan.plan is Plan.COALESCE else ''}"
        )

    run.runtime = lambda: runtime.get("rt")  # type: ignore[attr-defined]
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
