"""The checker's driver: barriers, faults, readers, validation and audits.

The driver issues barriers, launches the job and expiry processes (:mod:`.processes`, supervised
by :mod:`.supervision`) and services (:mod:`.services`), applies the fault schedule (:mod:`.fault_plan`: a pure function of
the seed), reads at every level and validates every barrier (:mod:`.reading`), audits what the
processes did (:mod:`.audits`) and reports (:mod:`.report`), checking everything against the
model (:mod:`.model`):

- every barrier is pinned with a lease as soon as its cut is valid (by a thread of its own,
  while its snapshots are protected), then validated: the cut holds exactly the model's
  rows. Barriers whose snapshots expired first, or that a table coalesced (the cut is
  refused), are excused and counted; an anchor is never refused; coverage (validated /
  issued and not coalesced) below the floor fails the run. The jobs coalesce at random and
  some run as batch jobs, catching up at random moments;
- coalescing, independently of the control plane's records: a commit that says it coalesced
  the barriers after P into B (``icebarrier.coalesced-after``) means no cut strictly between
  was valid, so one accepted there is a violation; a skipped or coalesced barrier left no
  snapshot of its own;
- read-committed and repeatable-read reads satisfy the invariants; one that errors is an
  anomaly, except "no valid cut yet" (counted apart); a repeatable-read session re-reads and
  compares rows with its first read and with the model at its barrier;
- pins: no snapshot protected by a lease or a job's progress is ever missing from its table;
- commits: each Iceberg snapshot carrying a barrier is the one recorded for (table,
  barrier), no (table, barrier) is written twice, and (at the end) every barrier a root job
  took model rows for has its commit record.
"""

from __future__ import annotations

import bisect
import json
import queue
import random
import subprocess
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from icebarrier.apps.check.audits import Audits
from icebarrier.apps.check.exec_jobs import EXEC_JOBS
from icebarrier.apps.check.fault_plan import Fault, fault_schedule
from icebarrier.apps.check.model import DERIVED, JOBS, ROOTS, SCHEMAS, WINDOW
from icebarrier.apps.check.processes import Env, Reconnecting
from icebarrier.apps.check.reading import Reading
from icebarrier.apps.check.report import CheckReport
from icebarrier.apps.check.services import CatalogServer, Maintenance
from icebarrier.apps.check.supervision import Forked, Supervision
from icebarrier.apps.pg_pair import PostgresPair
from icebarrier.control_plane import barriers, jobs, leases, reads, tokens
from icebarrier.control_plane.errors import (
    BarrierNotValidError,
    IcebarrierError,
    NoValidCutError,
    SnapshotExpiredError,
)
from icebarrier.control_plane.model import JobDefinition
from icebarrier.iceberg_ext.catalog import (
    create_table,
    load_catalog,
)
from icebarrier.iceberg_ext.reads import ConsistentRead
from icebarrier.iceberg_ext.storage import Storage

ANCHOR_INTERVAL_S = 3.0
# A job exec job costs a process start and a session per step (2-6 s here): anchors (which
# coalescing never crosses) come no faster than that in a long run, or it could never catch up.
EXEC_ANCHOR_INTERVAL_S = 10.0
# a SIGTERM due while the catalog server is down, or a kill due while it drains after one, is
# tried again this much later
TERM_RETRY_S = 0.5


class KafkaOrders:
    """``check --kafka``: the model's orders produced to the run's topic, each barrier's window just
    before the barrier is issued (so the broker stamps them at or before it), in a transaction;
    each window also gets an aborted transaction of negative ids, which no cut may ever show."""

    def __init__(self, env: Env) -> None:
        from confluent_kafka import Producer

        from icebarrier.iceberg_ext.kafka import log

        self.producer = Producer({"bootstrap.servers": env.kafka, "transactional.id": f"check-{env.ns}", "logger": log})
        self.producer.init_transactions(30)
        self.topic = env.topic

    def window(self, number: int) -> None:
        ids = range((number - 1) * WINDOW + 1, number * WINDOW + 1)
        for abort, values in ((True, [-i for i in ids]), (False, list(ids))):
            self.producer.begin_transaction()
            for i in values:
                self.producer.produce(self.topic, json.dumps({"order_id": i}).encode(), key=str(abs(i)).encode())
            self.producer.flush(30)
            if abort:
                self.producer.abort_transaction(30)
            else:
                self.producer.commit_transaction(30)


# -- setup -----------------------------------------------------------------------------------------------------


def setup(env: Env, conn, catalog, *, anchor_interval_s: float = ANCHOR_INTERVAL_S) -> None:
    for name, schema in SCHEMAS.items():
        create_table(catalog, env.t(name), schema)
    for job, table in ROOTS.items():
        jobs.register(
            conn,
            JobDefinition(name=job, sinks=frozenset([env.t(table)]), external_inputs=frozenset([f"model:{table}"])),
        )
    for job, (sources, sink) in DERIVED.items():
        jobs.register(
            conn, JobDefinition(name=job, sources=frozenset(env.t(s) for s in sources), sinks=frozenset([env.t(sink)]))
        )
    barriers.set_interval_s(conn, 86400)  # only the driver issues barriers
    barriers.set_anchor_interval_s(conn, anchor_interval_s)


class _Pinner:
    """Pins each barrier's cut with a lease as soon as it is valid, from a thread and connection of
    its own, and queues it for the driver to validate. A cut stops being protected once a newer
    one is valid (DESIGN.md, "Leases and snapshot retention"), which a slow job catching up can
    make a matter of one job step; the driver, between reads, would come too late for expiry."""

    POLL_S = 0.02

    def __init__(self, env: Env, names, report: CheckReport) -> None:
        self.names = names
        self.cp = Reconnecting(env, "pinner", on_wait=lambda what, s: report.waits.append(("pinner", what, s)))
        self.queue: queue.SimpleQueue[tuple[int, bool, int, str | None]] = queue.SimpleQueue()
        self.examined = 0  # barriers (by number) queued so far
        self.last = 0  # the newest of them
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="check-pinner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.POLL_S):
                self.pin_new()
        except BaseException as exc:  # noqa: BLE001 - raised in the driver (raise_error)
            self.error = exc

    def pin_new(self, upto: int | None = None) -> None:
        """Pin and queue, in order, every barrier up to ``upto`` or the newest valid cut."""
        try:
            newest_valid = upto or self.cp.run("cut", lambda conn: reads.resolve(conn, self.names).barrier)
        except NoValidCutError:
            return
        if newest_valid <= self.last:  # the cut has not moved since the last poll
            return
        marks = self.cp.run(
            "barriers",
            lambda conn: conn.execute(
                "SELECT barrier, anchor FROM barrier WHERE barrier > %s AND barrier <= %s ORDER BY barrier",
                (self.last, newest_valid),
            ).fetchall(),
        )
        for mark in marks:
            self.examined += 1
            self.last = mark["barrier"]
            self.queue.put((mark["barrier"], mark["anchor"], self.examined, self._pin(mark["barrier"])))

    def _pin(self, barrier: int) -> str | None:
        """A lease on the cut at ``barrier`` until it is validated (None: not valid or expired)."""
        try:
            return self.cp.run(
                "pin",
                lambda conn: leases.acquire(conn, self.names, ttl_s=60, holder="check-pin", barrier=barrier).lease_id,
            )
        except (BarrierNotValidError, SnapshotExpiredError):
            return None


# -- the run -----------------------------------------------------------------------------------------------------


class _Run(Reading, Audits, Supervision):
    def __init__(
        self,
        env: Env,
        report: CheckReport,
        *,
        fault_rate: float,
        server,
        progress,
        exec_jobs: bool = False,
        mutation: str | None = None,
        maintain: bool = False,
    ) -> None:
        self.env, self.report, self.fault_rate, self.server, self.progress = env, report, fault_rate, server, progress
        self.exec_jobs = set(EXEC_JOBS) - ({"orders_in"} if env.kafka else set()) if exec_jobs else set()
        self.mutation = mutation
        self.catalog_server = CatalogServer(env, Path(env.reports), mutation=mutation) if exec_jobs else None
        self.maintenance = Maintenance(env, Path(env.reports), mutation=mutation) if maintain else None
        self.barriers_file = Path(env.reports) / "barriers.jsonl"
        self.numbered = 0  # barriers written to barriers_file
        self.credentials: dict[str, str] = {}
        self.exec_errors: dict[str, str] = {}
        self.outages: list[tuple[float, str, str | None]] = []  # (excused until, what, for which job)
        self.moved: dict[str, tuple[int | None, float]] = {}  # job -> (progress, when it last moved)
        self.said_behind = time.monotonic()  # when the jobs short of the final barrier were last named
        self.rng = random.Random(env.seed)
        self.catalog = load_catalog(env.settings)
        self.names = [env.t(n) for n in SCHEMAS]
        self.cp = Reconnecting(env, "driver", on_wait=lambda what, s: report.waits.append(("driver", what, s)))
        self.procs: dict[str, subprocess.Popen | Forked] = {}
        self.launches: Counter = Counter()
        self.pinner = _Pinner(env, self.names, report)
        self.accepted: dict[int, int] = {}  # barrier -> number, of the cuts the validator read
        self.rr: ConsistentRead | None = None
        self.rr_first = None
        self.orders = KafkaOrders(env) if env.kafka else None

    # -- barriers and the catalog server

    def issue(self) -> None:
        """Issue a barrier, and number every barrier issued since the last (the job exec scripts
        read their ranges' numbers from the file)."""
        if self.orders is not None:
            self.orders.window(self.numbered + 1)
        self.cp.run("barrier", lambda conn: barriers.issue(conn))
        marks = self.cp.run(
            "barriers",
            lambda conn: conn.execute(
                "SELECT barrier, n FROM (SELECT barrier, row_number() OVER (ORDER BY barrier) AS n FROM barrier) b "
                "WHERE n > %s ORDER BY n",
                (self.numbered,),
            ).fetchall(),
        )
        with open(self.barriers_file, "a") as f:
            f.writelines(json.dumps({"barrier": m["barrier"], "number": m["n"]}) + "\n" for m in marks)
        self.numbered = self.report.barriers = marks[-1]["n"] if marks else self.numbered

    def start_catalog(self) -> None:
        """Tokens for the job exec jobs and the validator (a reader); the catalog server."""
        if self.catalog_server is None:
            return
        for who in (*sorted(self.exec_jobs), "reader"):
            self.credentials[who] = ":".join(
                self.cp.run(
                    "token",
                    lambda conn, who=who: tokens.create(
                        conn, job=None if who == "reader" else who, name=f"check {who}", whole_lake=who == "reader"
                    ),
                )
            )
        self.catalog_server.start()

    def maintained(self, final_at: float) -> bool:
        """The run may end as far as the maintenance service goes: it is not part of the run, has
        done each of MAINTAIN_PROVES, or had MAINTAIN_GRACE_S since the run's end (a slow start,
        kills and failovers can leave a short run's service little done by then; the tables are
        still there to do)."""
        if self.maintenance is None or time.monotonic() - final_at > MAINTAIN_GRACE_S:
            return True
        return not unproven(self.cp.run("maintenance", self.maintenance.actions))

    def stalled(self, final: int) -> dict[str, int | None]:
        """The jobs short of ``final`` whose progress has not moved for STALL_S (each call looks)."""
        now, out, behind = time.monotonic(), {}, {}
        for job in JOBS:
            at = self.cp.run("progress", lambda c, j=job: jobs.show(c, j).progress)
            if at != final:
                behind[job] = at
            if self.moved.get(job, (None, 0.0))[0] != at or job not in self.moved:
                self.moved[job] = (at, now)
            elif at != final and now - self.moved[job][1] > STALL_S:
                out[job] = at
        if behind and now - self.said_behind >= BEHIND_EVERY_S:
            self.said_behind = now
            self.progress(
                f"check: short of the last barrier {final}: " + ", ".join(f"{j} at {a}" for j, a in behind.items())
            )
        return out

    def wait_for_start(self, timeout_s: float = 180) -> None:
        """Every job completes the first barrier before the clock starts: a derived job
        bootstraps at its sources' latest common barrier, so barriers issued before it
        started could never be validated."""
        self.progress("check: waiting for every job to complete the first barrier")
        deadline = time.monotonic() + timeout_s
        while not all(self.cp.run("progress", lambda c, j=j: jobs.show(c, j).progress) is not None for j in JOBS):
            if time.monotonic() > deadline:
                raise IcebarrierError(f"check: the jobs did not complete the first barrier in {timeout_s:g}s")
            self.reap(None)
            time.sleep(0.1)

    # -- reports of the processes

    def collect(self) -> None:
        for path in Path(self.env.reports).glob("*.jsonl"):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if "waited_s" in record:
                    self.report.waits.append((path.stem, record["for"], record["waited_s"]))
                elif path.stem == "expiry":
                    self.report.expiry_runs += 1
                    self.report.snapshots_expired += len(record["expired"])


BEHIND_EVERY_S = 10.0  # after the run, how often the jobs short of the final barrier are named
MAINTAIN_GRACE_S = 120.0  # after the run, how long the maintenance service has to do each of MAINTAIN_PROVES
# What a run with the maintenance service must have seen done for it to prove anything about it: a
# compaction (rewrites the files readers and jobs hold) and an expiry (deletes snapshots they pin).
MAINTAIN_PROVES = ("compact done", "expire done")
STALL_S = 180.0  # after the run, a job whose progress does not move for this long fails it (slow is fine)
DRAIN_S = 30.0  # a catalog server stopped with SIGTERM drains for up to this long first


def unproven(done: dict[str, int]) -> list[str]:
    """What of MAINTAIN_PROVES the maintenance service's counts (``action result`` -> how many) lack."""
    return [action for action in MAINTAIN_PROVES if not done.get(action)]


def _retry_later(schedule: list[Fault], fault: Fault, now_s: float) -> None:
    """``fault`` back in the (sorted) ``schedule``, :data:`TERM_RETRY_S` after ``now_s``."""
    bisect.insort(schedule, replace(fault, at_s=now_s + TERM_RETRY_S), key=lambda f: f.at_s)


def run_check(
    env: Env,
    *,
    duration_s: float = 20,
    fault_rate: float = 0.3,
    server=None,
    progress=print,
    report: CheckReport | None = None,
    exec_jobs: bool = True,
    mutation: str | None = None,
    maintain: bool = False,
    fail_fast: bool = False,
) -> CheckReport:
    """One seeded run. ``server`` (an :class:`~icebarrier.apps.embedded.EmbeddedPostgres` the run
    owns) is restarted by the fault schedule; a :class:`~icebarrier.apps.pg_pair.PostgresPair`
    fails over there instead; without it the schedule has no restarts. With
    ``exec_jobs``, two jobs run under ``icebarrier job exec`` through a catalog server the run
    starts (and kills), which runs with the deliberate bug ``mutation`` if given
    (:data:`icebarrier.iceberg_ext.faults.MUTATIONS`). With ``maintain``, the maintenance
    service runs in place of the expiry process, with aggressive policies (it compacts too), and
    the schedule kills it. With ``fail_fast`` the run ends at its first violation, without
    waiting for the jobs or the final audits. Pass a ``report`` to watch a live run from another
    thread."""
    report = report or CheckReport(seed=env.seed)
    Path(env.reports).mkdir(parents=True, exist_ok=True)
    running = Path(env.reports) / "running"
    running.touch()
    run = _Run(
        env,
        report,
        fault_rate=fault_rate,
        server=server,
        progress=progress,
        exec_jobs=exec_jobs,
        mutation=mutation,
        maintain=maintain,
    )
    report.exec_jobs, report.mutation, report.kafka = sorted(run.exec_jobs), mutation, bool(env.kafka)
    anchors_s = min(EXEC_ANCHOR_INTERVAL_S, max(ANCHOR_INTERVAL_S, duration_s / 20)) if exec_jobs else ANCHOR_INTERVAL_S
    run.cp.run("setup", lambda conn: setup(env, conn, run.catalog, anchor_interval_s=anchors_s))
    schedule = fault_schedule(
        env.seed, duration_s, fault_rate, restarts=server is not None, exec_jobs=exec_jobs, maintain=maintain
    )
    run.issue()
    run.start_catalog()
    for job in JOBS:
        run.launch(job, 2**62)
    run.wait_for_start()
    if run.maintenance is not None:
        run.cp.run("policies", lambda conn: run.maintenance.configure(conn, run.names))
        run.maintenance.start()
        expiry = None
    else:
        expiry = run._spawn("expiry", "expiry", env.to_json(), str(env.seed))
    run.pinner.start()
    started, final, final_at = time.monotonic(), None, 0.0
    try:
        while True:
            elapsed = time.monotonic() - started
            while final is None and schedule and schedule[0].at_s <= elapsed:
                fault = schedule.pop(0)
                if fault.kind == "kill":
                    run.kill(fault.job)
                elif fault.kind == "script":
                    run.kill_script(fault.job)
                elif fault.kind == "server":
                    if run.catalog_server.stopping is not None:  # draining after a SIGTERM: killed once
                        _retry_later(schedule, fault, elapsed)  # it has stopped: every SIGTERM's stop measured
                        continue
                    run.catalog_server.kill(fault.down_s)
                    report.faults["catalog server@killed"] += 1
                    run.outage("the catalog server killed", fault.down_s)
                elif fault.kind == "server-term":
                    if run.catalog_server.terminate(fault.down_s):
                        report.faults["catalog server@SIGTERM"] += 1
                        run.outage("the catalog server stopped", fault.down_s + DRAIN_S)
                    else:  # a fault before it has the server down: sent once it runs again
                        _retry_later(schedule, fault, elapsed)
                elif fault.kind == "maintain":
                    run.maintenance.kill(fault.down_s)
                    report.faults["maintain@killed"] += 1
                else:
                    failover = isinstance(server, PostgresPair)
                    progress(
                        f"check: failing over: the primary killed, the standby promoted {fault.down_s}s later"
                        if failover
                        else f"check: restarting the control-plane Postgres ({fault.down_s}s down)"
                    )
                    server.restart(down_s=fault.down_s)
                    report.restarts += 1
                    report.failovers += failover
                    run.outage("Postgres failed over" if failover else "Postgres restarted", fault.down_s)
            for service in (run.catalog_server, run.maintenance):
                if service is not None:
                    service.tend()
            if final is None and elapsed > duration_s:
                if run.catalog_server is not None:
                    run.catalog_server.restarted()
                final = run.cp.run("barrier", lambda conn: barriers.newest(conn).barrier)
                final_at = time.monotonic()
                progress(f"check: {report.barriers} barriers issued; waiting for every job to complete the last")
                for job in JOBS:  # a hard kill mid-work, then a run that stops at the final barrier
                    run.kill(job)
                    run.launch(job, final)
            for _ in range(run.rng.randrange(0, 4) if final is None else 0):  # faster than some jobs keep up
                run.issue()
            if final is not None and (stalled := run.stalled(final)):
                for job, at in stalled.items():
                    report.violations.append(
                        f"job {job} stopped short of the final barrier (at {at} for {STALL_S:g}s, final {final})"
                        f"{': ' + run.exec_errors[job] if run.exec_errors.get(job) else ''}"
                    )
                break
            run.reap(final)
            if run.exec_jobs:
                run.audit_publishes()
            run.read_levels()
            run.repeatable_read()
            run.validate_new()
            if run.rng.random() < 0.2:
                run.audit_pins()
                run.audit_commits(final=False)
            if fail_fast:
                run.audit_refusals()  # the jobs' logs: a read of two files, each loop
            if fail_fast and report.violations:
                progress("check: a violation found; ending the run there (--fail-fast)")
                break
            if (
                final is not None
                and all(run.procs[j].poll() is not None for j in JOBS)
                and all(run.cp.run("progress", lambda c, j=j: jobs.show(c, j).progress) == final for j in JOBS)
                and run.maintained(final_at)
            ):
                break
            time.sleep(0.05)
    except BaseException:
        if run.catalog_server is not None:  # the run ends here: its server must not outlive it
            run.catalog_server.stop()
        raise
    finally:
        run.pinner.stop()
        run.close_rr()
        running.unlink(missing_ok=True)
        if run.maintenance is not None:
            run.maintenance.stop()
        try:
            if expiry is not None:
                expiry.wait(timeout=60)
        except subprocess.TimeoutExpired:
            expiry.kill()
        for proc in run.procs.values():
            if proc.poll() is None:
                proc.kill()
    try:
        if expiry is not None and expiry.returncode not in (0, None):
            report.violations.append(f"the expiry process failed: {expiry.printed(1000)}")
        if fail_fast and report.violations:
            run.count_completions()
            run.collect()
            return report  # the finally below still stops the catalog server
        run.validate_new(upto=final)
        run.audit_pins()
        run.audit_commits(final=True)
        run.audit_inputs()
        run.audit_refusals()
        run.count_completions()
        if report.anchors_validated == 0:
            report.violations.append("no anchor was validated: the run proves nothing about anchors")
        if run.catalog_server is not None and report.catalog_validated == 0:
            report.violations.append("no cut was validated through the catalog: the run proves nothing about it")
        if run.maintenance is not None:
            report.maintenance = run.cp.run("maintenance", run.maintenance.actions)
            if missing := unproven(report.maintenance):
                report.violations.append(
                    f"the maintenance service had no {' or '.join(missing)} in {MAINTAIN_GRACE_S:g}s after the"
                    f" run: the run proves nothing about it; its last lines: {run.maintenance.tail()}"
                )
        run.collect()
    finally:
        if run.catalog_server is not None:
            run.catalog_server.stop()
            report.catalog_stop_s = run.catalog_server.stop_s
            if cut := run.catalog_server.cut_off():
                report.violations.append(
                    f"the catalog server's SIGTERM cut off requests in flight {cut} time(s): its grace ran out"
                )
        run.cp.close()
        run.pinner.cp.close()
    return report


def private_env(
    dsn: str, home: Path, seed: int, *, warehouse: str | None = None, storage: Storage | None = None, kafka: str = ""
) -> Env:
    """An Env for a run on ``dsn``, with the processes' reports under ``home`` (a folder the caller
    owns and removes), and its warehouse there too unless given (e.g. a prefix on S3)."""
    return Env(
        dsn=dsn,
        schema="icebarrier",
        warehouse=warehouse or (home / "warehouse").as_uri(),
        ns=f"check_{seed}",
        seed=seed,
        reports=str(home / "reports"),
        storage=storage.fileio() if storage else {},
        readers=dict(storage.readers) if storage else {},
        kafka=kafka,
    )
