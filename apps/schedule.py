"""``icebarrier schedule``: runs the pipeline so that every table meets its target lag
(DESIGN.md, "Declared freshness").

From the targets it derives when each table's refresh must start: a table T whose watermark
was issued ``freshness`` ago, with target L, refreshed by its writer and every job upstream of
it (the longest chain of their measured durations takes R), must start refreshing within
``L - freshness - R - margin``. Then it runs each of those jobs ``--once`` (a job runs when
none of the jobs it reads from is still to run in the refresh), and not earlier: everything
issued meanwhile is coalesced into one run. Tables falling due within one refresh of each
other refresh together, for one barrier, and so do refreshes sharing a job within half a
cycle; a refresh counts a shared job's run another refresh made, when young enough, so the
tables stay in step. A failed run publishes nothing; it is retried with backoff. At most ``parallel`` runs
at once; a job never runs twice at once (and job sessions fence any other run of it). One
schedule per control plane: it holds a Postgres advisory lock on a connection of its own, and
a second one waits for it.
"""

from __future__ import annotations

import collections
import json
import math
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import psycopg

from icebarrier.apps.catalog.clients import CA_CERT_ENV
from icebarrier.apps.embedded import CLI
from icebarrier.control_plane import barriers, db, jobs, targets, topology
from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import ControlPlaneUnavailableError, JobNotFoundError
from icebarrier.control_plane.fences import Fence
from icebarrier.control_plane.model import JobDefinition
from icebarrier.control_plane.targets import Runner, TableTarget
from icebarrier.iceberg_ext.runtime import ANSWER

DEFAULT_DURATION_S = 2.0  # a job's duration before its first measured run
MEASURED_RUNS = 5  # a job's duration: the slowest of its last runs (see `expected_s`)
MARGIN_S, MARGIN_SHARE = 0.5, 0.25  # a refresh starts this much (+ share of its duration) early
JOIN_SHARE = 0.5  # a refresh sharing a job with one due joins it within this share of its cycle
BACKOFF_S, BACKOFF_MAX_S = 1.0, 60.0
# A `job exec` run's hold on its session: renewed every third of it while the run lives, so
# when a run dies with its schedule, the next schedule's run takes the session over this soon.
HOLD = "6s"
# a run computes once per anchor between its job's progress before and after it, and once more
# (coalescing never crosses an anchor): durations are measured and expected per computation
_COMPUTATIONS = (
    "(1 + (SELECT count(*) FROM barriers b"
    " WHERE b.anchor AND b.barrier > r.progress_from AND b.barrier < r.progress_to))"
)


# -- the plan (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Due:
    """When a table's refresh must start, and what it runs."""

    table: str
    target_s: float
    target_from: str
    freshness_s: float | None
    refresh_s: float  # the longest chain of job durations ending at its writer
    due_in_s: float  # <= 0: due now
    jobs: tuple[str, ...]  # its writer and the jobs upstream of it, sources before readers
    missing: tuple[str, ...] = ()  # of those, jobs that cannot run themselves (no runner)

    @property
    def reachable(self) -> bool:
        """Whether the target can be met at all: its refresh is shorter than the target."""
        return self.refresh_s + MARGIN_S < self.target_s

    @property
    def spare_s(self) -> float:
        """The time a table has to spare after a refresh: target less refresh and margin. A run of
        an upstream job this young can still feed the table's refresh (:func:`to_run`)."""
        return self.target_s - self.refresh_s - margin_s(self.refresh_s)

    def to_json(self) -> dict:
        return {
            "table": self.table,
            "target_lag_s": self.target_s,
            "target_from": self.target_from,
            "freshness_s": self.freshness_s,
            "refresh_s": round(self.refresh_s, 3),
            "due_in_s": None if math.isinf(self.due_in_s) else round(self.due_in_s, 3),
            "jobs": list(self.jobs),
            "missing_runners": list(self.missing),
            "reachable": self.reachable,
        }


def plan(
    definitions: dict[str, JobDefinition],
    tables: list[TableTarget],
    durations: dict[str, float],
    runnable: set[str],
) -> list[Due]:
    """Each table with a target and a writer: when its refresh must start, soonest first."""
    upstream = topology.jobs_read_from(definitions.values())
    chain: dict[str, float] = {}

    def refresh_s(job: str) -> float:  # the DAG has no cycles (the database refuses them)
        if job not in chain:
            chain[job] = durations.get(job, DEFAULT_DURATION_S) + max(map(refresh_s, upstream[job]), default=0.0)
        return chain[job]

    def closure(job: str, into: list[str]) -> list[str]:
        for u in upstream[job]:
            closure(u, into)
        if job not in into:
            into.append(job)
        return into

    dues = []
    for t in tables:
        # a table with a target of its own drives a refresh; one that inherits its target is
        # refreshed by the refreshes of the tables it inherits from (its writer is upstream)
        if t.target_lag_s is None or t.writer_job not in definitions:
            continue
        r = refresh_s(t.writer_job)
        left = -math.inf if t.freshness_s is None else t.effective_s - t.freshness_s
        run = tuple(closure(t.writer_job, []))
        dues.append(
            Due(
                table=str(t.name),
                target_s=t.effective_s,
                target_from=t.target_from or str(t.name),
                freshness_s=t.freshness_s,
                refresh_s=r,
                due_in_s=left - r - margin_s(r),
                jobs=run,
                missing=tuple(j for j in run if j not in runnable),
            )
        )
    return sorted(dues, key=lambda d: (d.due_in_s, d.table))


def margin_s(refresh_s: float) -> float:
    """How much earlier than strictly needed a refresh starts: its estimate can be short."""
    return MARGIN_S + MARGIN_SHARE * refresh_s


def to_run(
    due: Due, upstream: Mapping[str, Iterable[str]], last_start: Mapping[str, float], now: float
) -> tuple[str, ...]:
    """The jobs a refresh runs: its writer, and each job upstream that a job it runs reads from,
    unless that job's last run can count. It counts if the reader has not consumed it yet (it
    started after the reader's last run) and it is young enough that the table, refreshed from
    it, still stays within its target until the next refresh (it started within the refresh's
    spare time, :attr:`Due.spare_s`). That run then feeds this table too, at the barrier it was run for.

    This brings tables sharing a job back in step: when one table's refresh falls due while
    another's is under way (after a slow run, say), it takes the shared job's run that refresh
    made instead of running it again, and both tables then hold the same barrier, so they fall
    due together again."""
    run = {due.jobs[-1]}
    for reader in reversed(due.jobs):  # readers before what they read
        if reader not in run:
            continue
        for job in upstream.get(reader, ()):
            started = last_start.get(job, -math.inf)
            if not (started > last_start.get(reader, -math.inf) and now - started <= due.spare_s):
                run.add(job)
    return tuple(j for j in due.jobs if j in run)


def due_now(dues: list[Due]) -> list[Due]:
    """The refreshes to start now: those due, and those falling due within the longest of them
    (they refresh together, for one barrier, instead of a moment later for another). A refresh
    that shares a job with one due joins it if it is due within half its own cycle (target less
    refresh): its table refreshes a little early, the shared jobs run once instead of twice, and
    tables with one target stay in step from then on (they drifted apart, each refresh
    running the shared jobs again)."""
    due = [d for d in dues if d.due_in_s <= 0]
    if not due:
        return []
    horizon = max(d.refresh_s for d in due)
    shared = {j for d in due for j in d.jobs}
    return [
        d
        for d in dues
        if d.due_in_s <= horizon or (shared & set(d.jobs) and d.due_in_s <= JOIN_SHARE * (d.target_s - d.refresh_s))
    ]


# -- the process --------------------------------------------------------------------------------


class _Warm:
    """A PySpark job file's process (``icebarrier run FILE --on-request``): its Spark session
    stays up between runs, so a run costs the job's work, not a JVM's start."""

    def __init__(self, runner: Runner, args: list[str], env: dict[str, str], relay: Callable[[str], None]) -> None:
        self.runner = runner
        self.proc = subprocess.Popen(
            args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.answers: queue.Queue[dict] = queue.Queue()
        self.ready_at: float | None = None
        self.requests = 0
        threading.Thread(target=self._read, args=(relay,), daemon=True).start()

    def _read(self, relay: Callable[[str], None]) -> None:
        for line in self.proc.stdout or ():
            if line.startswith(ANSWER):
                answer = json.loads(line[len(ANSWER) :])
                if answer.get("ready"):
                    self.ready_at = time.monotonic()
                else:
                    self.answers.put(answer)
            else:
                relay(line)

    def request(self) -> None:
        assert self.proc.stdin is not None
        self.requests += 1
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()  # end of requests: it exits


class _Run:
    """One run in flight: a command's `job exec` process, or a request to a warm runner."""

    def __init__(
        self,
        run_id: int,
        progress_from: int | None,
        proc: subprocess.Popen | None = None,
        warm: _Warm | None = None,
        *,
        counts: bool = True,
    ) -> None:
        self.run_id, self.progress_from = run_id, progress_from  # its schedule_run row; the job's progress before
        self.proc, self.warm = proc, warm
        self.started = time.monotonic()
        self.counts = counts  # whether its duration is the job's (a runner's first run warms Spark up)

    def exit_code(self) -> int | None:
        """None while it runs; 0 when it completed what was due."""
        if self.proc is not None:
            return self.proc.poll()
        assert self.warm is not None
        try:
            return 0 if self.warm.answers.get_nowait()["ok"] else 1
        except queue.Empty:
            code = self.warm.proc.poll()
            return None if code is None else code or 1

    def took_s(self) -> float:
        """How long the run took (a warm runner's start is not part of it)."""
        begun = max(self.started, self.warm.ready_at or self.started) if self.warm else self.started
        return time.monotonic() - begun

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


@dataclass(slots=True)
class _Job:
    name: str
    durations: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=MEASURED_RUNS))
    last_start: float = -math.inf  # time.monotonic() of its last successful run's start
    run: _Run | None = None
    warm: _Warm | None = None
    reason: str = ""
    failures: int = 0
    retry_at: float = 0.0
    wanted_since: float | None = None  # a refresh that began then needs a run of it


@dataclass(slots=True)
class _Refresh:
    since: dict[str, float]  # each job's run counts if it started then or later (time.monotonic())


@dataclass
class Schedule:
    """The schedule's loop (``run``); ``log`` gets one line per event."""

    dsn: str | None
    schema: str | None
    catalog_uri: str | None
    credential: str | None
    ca_cert: str | None = None
    parallel: int = 4
    tick_s: float = 0.2
    issue_barriers: bool = True
    log: Callable[[str], None] = print
    _jobs: dict[str, _Job] = field(default_factory=dict)
    _refreshes: dict[str, _Refresh] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _published_at: float = 0.0

    def stop(self) -> None:
        self._stop.set()

    # the fence

    def run(self) -> None:
        """Wait for the schedule's lock, then schedule until stopped (SIGTERM/SIGINT), waiting
        again whenever the lock's connection is lost. Runs in flight are stopped on exit."""
        fence = Fence("schedule", "schedule_state", dsn=self.dsn, schema=self.schema, log=self.log)
        try:
            while fence.acquire(self._stop):
                self.log(f"schedule: running ({fence.holder}); at most {self.parallel} runs at once")
                try:
                    self._schedule(fence)
                finally:
                    fence.release()
        finally:
            self._stop_runs()

    def _schedule(self, fence: Fence) -> None:
        try:
            with db.connect(self.dsn, self.schema) as conn:
                self._load_durations(conn)
                while not self._stop.is_set():
                    if not fence.alive():
                        self.log(
                            "schedule: lost the schedule's lock (its connection broke); no new runs until it is back"
                        )
                        return
                    self._tick(conn, fence)
                    self._stop.wait(self.tick_s)
        except (psycopg.OperationalError, ControlPlaneUnavailableError) as exc:  # a restart, a failover
            self.log(f"schedule: control plane unreachable ({str(exc).splitlines()[0]}); no new runs until it is back")

    # one step

    def _tick(self, conn: Conn, fence: Fence) -> None:
        self._reap(conn)
        definitions = jobs.load_definitions(conn)
        runnable = targets.runners(conn)
        for name in definitions:
            job = self._jobs.setdefault(name, _Job(name))
            if name in runnable and runnable[name].kind == "file" and job.warm is None:
                self._warm_up(job, runnable[name])  # once: a runner that died starts again with its next run
        durations = per_run(self._durations(), jobs.anchors_ahead(conn))
        dues = plan(definitions, targets.targets(conn), durations, set(runnable))
        starting = due_now([d for d in dues if d.table not in self._refreshes])  # not a refresh under way
        if self.issue_barriers:
            self._issue_barrier(conn, refresh=bool(starting))
        upstream = topology.jobs_read_from(definitions.values())
        now = time.monotonic()
        for d in starting:
            self._begin(d, upstream, now)  # pulls nothing in: its jobs may have run already
        self._end_refreshes()
        if fence.valid():  # the lease runs: no other schedule can have taken over
            self._start_runs(upstream, runnable, conn)
        if now - self._published_at >= 1.0:
            self._published_at = now
            fence.publish([d.to_json() for d in dues])

    def _issue_barrier(self, conn: Conn, *, refresh: bool) -> None:
        """The barrier clock's barrier when due, and one as a refresh starts (unless the newest is
        younger than a tick): the refresh then computes the pipeline as of its start, not as of a
        barrier up to an interval old, and its tables stay fresh that much longer. The clock's
        next barrier follows an interval later."""
        due_in = barriers.next_due_in_s(conn)
        if due_in is None or due_in <= 0:
            barriers.issue_when_due(conn)  # None: a job issued it meanwhile
        elif refresh and barriers.get_interval_s(conn) - due_in >= self.tick_s:
            barriers.issue(conn, issued_by="schedule")

    def _begin(self, due: Due, upstream: Mapping[str, Iterable[str]], now: float) -> None:
        if due.missing:
            self.log(
                f"table {due.table}: due, but job(s) {', '.join(due.missing)} have no runner; "
                f"register them with --command or --file"
            )
        run = to_run(due, upstream, {n: j.last_start for n, j in self._jobs.items()}, now)
        if counted := [n for n in due.jobs if n not in run]:
            self.log(f"table {due.table}: refresh counts the last run of {', '.join(counted)} (made for another table)")
        # a job already running (for another refresh) counts with that run: it is not run again
        since = {n: r.started if (r := self._jobs[n].run) is not None else now for n in run}
        self._refreshes[due.table] = _Refresh(since)
        for name in run:
            job = self._jobs[name]
            if job.wanted_since is None:
                job.wanted_since, job.reason = (
                    now,
                    f"table {due.table} (target {due.target_s:g}s from {due.target_from})",
                )

    def _end_refreshes(self) -> None:
        """A refresh ends when each of its jobs has run since it began (the table's writer last),
        or with the run it was in when the refresh began."""
        for table, refresh in list(self._refreshes.items()):
            if all(self._jobs[j].last_start >= since for j, since in refresh.since.items() if j in self._jobs):
                del self._refreshes[table]

    def _start_runs(self, upstream: Mapping[str, Iterable[str]], runnable: dict[str, Runner], conn: Conn) -> None:
        now = time.monotonic()
        running = sum(1 for j in self._jobs.values() if j.run is not None)
        for name, job in sorted(self._jobs.items()):
            if running >= self.parallel:
                return
            if job.wanted_since is None or job.run is not None or now < job.retry_at or name not in runnable:
                continue
            if any(
                self._jobs[u].wanted_since is not None or self._jobs[u].run is not None
                for u in upstream.get(name, ())
                if u in self._jobs
            ):
                continue  # what it reads is still to be refreshed
            self._launch(job, runnable[name], conn)
            running += 1

    def _launch(self, job: _Job, runner: Runner, conn: Conn) -> None:
        progress_from = jobs.show(conn, job.name).progress
        run_id = conn.execute(
            "INSERT INTO schedule_run (job_name, reason, progress_from) VALUES (%s, %s, %s) RETURNING run_id",
            (job.name, job.reason, progress_from),
        ).fetchone()["run_id"]
        if runner.kind == "command":
            args = [*CLI, "job", "exec", job.name, "--once", "--hold", HOLD, "--", "sh", "-c", runner.spec]
            proc = subprocess.Popen(
                args,
                env=self._env(runner),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            threading.Thread(target=self._relay, args=(job.name, proc), daemon=True).start()
            job.run = _Run(run_id, progress_from, proc=proc)
        else:
            warm = self._warm_up(job, runner)
            warm.request()
            job.run = _Run(run_id, progress_from, warm=warm, counts=warm.requests > 1)
        self.log(f"job {job.name}: run started ({job.reason})")

    def _env(self, runner: Runner) -> dict[str, str]:
        env = {**os.environ, **runner.env}
        for key, value in (
            ("ICEBARRIER_DSN", self.dsn),
            ("ICEBARRIER_SCHEMA", self.schema),
            ("ICEBARRIER_CATALOG_URI", self.catalog_uri),
            ("ICEBARRIER_CATALOG_CREDENTIAL", self.credential),
            (CA_CERT_ENV, self.ca_cert),
        ):
            if value:
                env.setdefault(key, value)
        return env

    def _warm_up(self, job: _Job, runner: Runner) -> _Warm:
        """The job file's runner, started if it is not running (or its runner changed). Started
        as soon as the schedule runs, not when the job is first due: a Spark session's start is
        then off the refresh's path (after a takeover too)."""
        if job.warm is None or job.warm.proc.poll() is not None or job.warm.runner != runner:
            if job.warm is not None:
                job.warm.stop()
            job.warm = _Warm(
                runner,
                [*CLI, "run", runner.spec, "--on-request"],
                self._env(runner),
                lambda line: self._say(job.name, line),
            )
            self.log(f"job {job.name}: runner started (pid {job.warm.proc.pid}; its Spark session stays up)")
        return job.warm

    def _relay(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout or ():
            self._say(name, line)

    def _say(self, name: str, line: str) -> None:
        self.log(f"  [{name}] {line.rstrip()}")

    def _reap(self, conn: Conn) -> None:
        for job in self._jobs.values():
            run = job.run
            if run is None or (code := run.exit_code()) is None:
                continue
            took, started = run.took_s(), run.started
            try:
                progress = jobs.show(conn, job.name).progress
            except JobNotFoundError:  # unregistered while it ran
                progress = None
            counted = code == 0 and run.counts
            done = conn.execute(
                "UPDATE schedule_run r SET finished_at = clock_timestamp(), exit_code = %s, progress_to = %s, "
                f"seconds = %s WHERE run_id = %s RETURNING {_COMPUTATIONS} AS computations",
                (code, progress, took if counted else None, run.run_id),
            ).fetchone()
            n = done["computations"]
            job.run = None
            if counted:
                job.durations.append(took / n)
            if code == 0:
                job.last_start, job.wanted_since, job.failures = started, None, 0
                note = "" if progress != run.progress_from else " (nothing new to publish)"
                note += f" ({n} computations: it passed {n - 1} anchor(s))" if n > 1 else ""
                self.log(f"job {job.name}: run done in {took:.1f} s, progress {progress}{note}")
            else:
                job.failures += 1
                delay = min(BACKOFF_S * 2 ** (job.failures - 1), BACKOFF_MAX_S)
                job.retry_at = time.monotonic() + delay
                self.log(
                    f"job {job.name}: run failed (exit {code}) after {took:.1f} s; it published nothing; "
                    f"retry {job.failures} in {delay:g} s"
                )

    def _durations(self) -> dict[str, float]:
        return {name: expected_s(j.durations) for name, j in self._jobs.items() if j.durations}

    def _load_durations(self, conn: Conn) -> None:
        for name, seconds in measured(conn).items():
            self._jobs.setdefault(name, _Job(name)).durations.extend(seconds)

    def _stop_runs(self) -> None:
        for job in self._jobs.values():
            if job.run is not None:
                job.run.stop()
            if job.warm is not None:
                job.warm.stop()
        for job in self._jobs.values():
            for proc in (job.run.proc if job.run else None, job.warm.proc if job.warm else None):
                if proc is not None:
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()


def expected_s(durations: Iterable[float]) -> float:
    """What a job's next run is expected to take: the slowest of its last :data:`MEASURED_RUNS`
    runs. A target is a promise, so the plan leans to the slow side: with the median, a machine
    that slows for a while (another load arriving) made every refresh end late until half the
    runs had been slow; an outlier now starts the refreshes it is in a little early for five
    runs, which costs a little coalescing and misses nothing."""
    return max(durations)


def measured(conn: Conn) -> dict[str, list[float]]:
    """Each job's last measured run durations per computation (earlier schedules' too), oldest first."""
    rows = conn.execute(
        "SELECT job_name, array_agg(seconds ORDER BY run_id) AS seconds FROM ("
        f"  SELECT job_name, run_id, seconds / {_COMPUTATIONS} AS seconds,"
        "    row_number() OVER (PARTITION BY job_name ORDER BY run_id DESC) AS n"
        "  FROM schedule_run r WHERE seconds IS NOT NULL) r WHERE n <= %s GROUP BY job_name",
        (MEASURED_RUNS,),
    ).fetchall()
    return {r["job_name"]: list(r["seconds"]) for r in rows}


def per_run(per_computation: Mapping[str, float], anchors: Mapping[str, int]) -> dict[str, float]:
    """Each job's next run's expected duration: one computation per anchor after its progress,
    and one more (a refresh crossing an anchor takes that much longer, and starts that much earlier)."""
    return {name: seconds * (1 + anchors.get(name, 0)) for name, seconds in per_computation.items()}


def dry_run(conn: Conn) -> list[Due]:
    """The plan as the schedule would see it now (with the durations schedules measured)."""
    durations = per_run(
        {name: expected_s(seconds) for name, seconds in measured(conn).items()}, jobs.anchors_ahead(conn)
    )
    return plan(jobs.load_definitions(conn), targets.targets(conn), durations, set(targets.runners(conn)))
