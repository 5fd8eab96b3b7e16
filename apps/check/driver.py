"""The checker's driver: barriers, faults, readers, validation and audits.

The driver issues barriers, launches the job and expiry processes (:mod:`.processes`),
applies the fault schedule (a pure function of the seed: which job is killed when, which
fault point each launch arms, when the control-plane Postgres restarts and for how long),
reads at every level, and checks everything against the model (:mod:`.model`):

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

import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from icebarrier.apps.check.exec_jobs import EXEC_JOBS, QUIET_S, children, exec_command
from icebarrier.apps.check.model import DERIVED, JOBS, ROOTS, SCHEMAS, check_cut, compare, events
from icebarrier.apps.check.processes import Env, Reconnecting, barrier_number
from icebarrier.apps.check.services import CatalogServer, Maintenance
from icebarrier.control_plane import barriers, delays, jobs, leases, reads, tokens
from icebarrier.control_plane.errors import (
    BarrierNotValidError,
    IcebarrierError,
    NoValidCutError,
    SnapshotExpiredError,
)
from icebarrier.control_plane.model import JobDefinition, Level
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import (
    SUMMARY_BARRIER,
    SUMMARY_RUN,
    coalesced_after,
    create_table,
    is_compaction,
    lineage,
    load_catalog,
    load_table,
    summary_properties,
)
from icebarrier.iceberg_ext.errors import LeaseLostError
from icebarrier.iceberg_ext.reads import ConsistentRead

_PROCESS_MAIN = "import sys; from icebarrier.apps.check.processes import main; main(sys.argv[1:])"
COVERAGE_FLOOR = 0.6  # barriers validated / issued and not coalesced
ANCHOR_INTERVAL_S = 3.0
# A job exec job costs a process start and a session per step (2-6 s here): anchors (which
# coalescing never crosses) come no faster than that in a long run, or it could never catch up.
EXEC_ANCHOR_INTERVAL_S = 10.0
RR_TTL_S = 2.0  # short: repeatable-read sessions outlive it, so renewal is exercised


# -- the fault schedule: a pure function of the seed ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float
    # kill (a job process, -9: for a job exec job, `job exec` itself), script (a job exec job's
    # script alone, -9), restart (the control-plane Postgres), server (the catalog server, -9,
    # started again down_s later), server-term (the same with SIGTERM: it drains, then exits),
    # maintain (the maintenance service, -9, started again down_s later)
    kind: str
    job: str | None = None
    down_s: float = 0.0


def fault_schedule(
    seed: int, duration_s: float, fault_rate: float, *, restarts: bool, exec_jobs: bool = False, maintain: bool = False
) -> list[Fault]:
    rng = random.Random(f"{seed}:schedule")
    kills = [
        Fault(at_s=rng.uniform(0.5, duration_s), kind="kill", job=rng.choice(JOBS))
        for _ in range(round(duration_s * fault_rate * 0.7))
    ]
    downs = [
        Fault(at_s=rng.uniform(1.0, duration_s), kind="restart", down_s=round(rng.uniform(0.2, 1.5), 2))
        for _ in range(max(1, round(duration_s / 10)) if restarts else 0)
    ]
    scripts = [
        Fault(at_s=rng.uniform(0.5, duration_s), kind="script", job=rng.choice(list(EXEC_JOBS)))
        for _ in range(round(duration_s * fault_rate * 0.3) if exec_jobs else 0)
    ]
    servers = [  # every other one a SIGTERM (the server drains), the others -9
        Fault(
            at_s=rng.uniform(1.0, duration_s),
            kind="server-term" if i % 2 else "server",
            down_s=round(rng.uniform(0.2, 1.5), 2),
        )
        for i in range(max(2, round(duration_s * fault_rate / 6)) if exec_jobs else 0)
    ]
    maintains = [  # drawn last: the schedule without --maintain stays what it was for a seed
        Fault(at_s=rng.uniform(1.0, duration_s), kind="maintain", down_s=round(rng.uniform(0.2, 1.5), 2))
        for _ in range(max(1, round(duration_s * fault_rate / 6)) if maintain else 0)
    ]
    return sorted(kills + downs + scripts + servers + maintains, key=lambda f: f.at_s)


def launch_fault(seed: int, job: str, launch_no: int, fault_rate: float) -> tuple[str | None, int]:
    """The fault point (and how many times it passes first) armed for a job's n-th launch."""
    rng = random.Random(f"{seed}:{job}:{launch_no}")
    if rng.random() >= fault_rate:
        return None, 0
    return rng.choice(faults.POINTS), rng.randrange(0, 3)


# -- the report ----------------------------------------------------------------------------------------------


@dataclass
class CheckReport:
    seed: int
    barriers: int = 0
    validated: int = 0
    excused: Counter = field(default_factory=Counter)
    reads: dict[str, int] = field(default_factory=lambda: {lvl.value: 0 for lvl in Level})
    anomalies: dict[str, int] = field(default_factory=lambda: {lvl.value: 0 for lvl in Level})
    examples: dict[str, str] = field(default_factory=dict)
    no_valid_cut: int = 0
    coalesced_refused: int = 0  # cuts refused at a barrier a table coalesced
    anchors_validated: int = 0
    completions: Counter = field(default_factory=Counter)  # exact / skip / coalesce, from the control plane
    read_uncommitted_errors: int = 0
    rr_sessions: int = 0
    leases_renewed: int = 0
    leases_lost: int = 0
    leases_refused: int = 0
    expiry_runs: int = 0
    snapshots_expired: int = 0
    faults: Counter = field(default_factory=Counter)
    restarts: int = 0
    waits: list[tuple[str, str, float]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    coverage_floor: float = COVERAGE_FLOOR
    exec_jobs: list[str] = field(default_factory=list)  # the jobs run under `icebarrier job exec`
    mutation: str | None = None  # the deliberate bug the catalog server ran with
    catalog_reads: int = 0  # read-committed reads through the catalog server
    catalog_validated: int = 0  # cuts validated through the catalog's barrier-<B> warehouse too
    catalog_unavailable: int = 0  # catalog reads that found the server down (killed by the schedule)
    catalog_anomalies: int = 0
    catalog_stop_s: list[float] = field(default_factory=list)  # each SIGTERM of the server to its exit
    maintenance: dict[str, int] | None = None  # with --maintain: "action result" -> how many

    @property
    def coverage(self) -> float:
        validatable = self.barriers - self.coalesced_refused
        return self.validated / validatable if validatable else 0.0

    def waited(self) -> dict[str, dict]:
        """Per process (driver, each job, expiry): how many reconnects and the longest wait."""
        out: dict[str, dict] = {}
        for who, _what, seconds in self.waits:
            entry = out.setdefault(who, {"reconnects": 0, "max_wait_s": 0.0})
            entry["reconnects"] += 1
            entry["max_wait_s"] = round(max(entry["max_wait_s"], seconds), 3)
        return out

    def anomaly(self, level: Level, problem: str) -> None:
        self.anomalies[level.value] += 1
        self.examples.setdefault(level.value, problem)

    @property
    def ok(self) -> bool:
        return (
            not self.violations
            and self.anomalies["read-committed"] == 0
            and self.catalog_anomalies == 0
            and self.anomalies["repeatable-read"] == 0
            and self.coverage >= self.coverage_floor
        )

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "ok": self.ok,
            "barriers": self.barriers,
            "validated": self.validated,
            "coverage": round(self.coverage, 3),
            "coverage_floor": self.coverage_floor,
            "excused": dict(self.excused),
            "reads": self.reads,
            "anomalies": self.anomalies,
            "examples": self.examples,
            "no_valid_cut": self.no_valid_cut,
            "coalesced_refused": self.coalesced_refused,
            "anchors_validated": self.anchors_validated,
            "completions": dict(self.completions),
            "read_uncommitted_errors": self.read_uncommitted_errors,
            "rr_sessions": self.rr_sessions,
            "leases_renewed": self.leases_renewed,
            "leases_lost": self.leases_lost,
            "leases_refused": self.leases_refused,
            "expiry_runs": self.expiry_runs,
            "snapshots_expired": self.snapshots_expired,
            "faults": dict(self.faults),
            "restarts": self.restarts,
            "reconnects": len(self.waits),
            "max_wait_s": round(max((w[2] for w in self.waits), default=0), 3),
            "waited": self.waited(),
            "exec_jobs": self.exec_jobs,
            "mutation": self.mutation,
            "maintenance": self.maintenance,
            "catalog": {
                "reads": self.catalog_reads,
                "validated": self.catalog_validated,
                "unavailable": self.catalog_unavailable,
                "anomalies": self.catalog_anomalies,
                "stop_s": [round(x, 3) for x in self.catalog_stop_s],
            },
            "violations": self.violations,
        }


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


class _Run:
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
        self.exec_jobs = set(EXEC_JOBS) if exec_jobs else set()
        self.catalog_server = CatalogServer(env, Path(env.reports), mutation=mutation) if exec_jobs else None
        self.maintenance = Maintenance(env, Path(env.reports), mutation=mutation) if maintain else None
        self.barriers_file = Path(env.reports) / "barriers.jsonl"
        self.numbered = 0  # barriers written to barriers_file
        self.credentials: dict[str, str] = {}
        self.exec_errors: dict[str, str] = {}
        self.moved: dict[str, tuple[int | None, float]] = {}  # job -> (progress, when it last moved)
        self.rng = random.Random(env.seed)
        self.catalog = load_catalog(env.settings)
        self.names = [env.t(n) for n in SCHEMAS]
        self.cp = Reconnecting(env, "driver", on_wait=lambda what, s: report.waits.append(("driver", what, s)))
        self.procs: dict[str, subprocess.Popen] = {}
        self.launches: Counter = Counter()
        self.pinner = _Pinner(env, self.names, report)
        self.accepted: dict[int, int] = {}  # barrier -> number, of the cuts the validator read
        self.rr: ConsistentRead | None = None
        self.rr_first = None

    # -- barriers and the catalog server

    def issue(self) -> None:
        """Issue a barrier, and number every barrier issued since the last (the job exec scripts
        read their ranges' numbers from the file)."""
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
                        conn, job=None if who == "reader" else who, name=f"check {who}"
                    ),
                )
            )
        self.catalog_server.start()

    def catalog_read(self, warehouse: str) -> dict | None:
        """Every table as the catalog serves it through ``warehouse`` (one session); None if the
        server was down or answered 503 (the schedule killed it, or Postgres restarted), or a
        read-committed session's loads came slower than its quiet window (it may have moved)."""
        import requests
        from pyiceberg.catalog.rest import RestCatalog
        from pyiceberg.exceptions import ServiceUnavailableError

        if self.catalog_server.down_until is not None:
            self.report.catalog_unavailable += 1
            return None
        credential = self.credentials["reader"]
        if warehouse == "read-committed":  # an independent reader: a client (token) of its own, so a moment of its own
            credential = ":".join(
                self.cp.run("token", lambda conn: tokens.create(conn, name="check read-committed reader"))
            )
        try:
            catalog = RestCatalog(
                f"check-{warehouse}",
                uri=self.catalog_server.uri,
                warehouse=warehouse,
                credential=credential,
            )
            tables, previous = {}, None
            for name in SCHEMAS:
                began = time.monotonic()
                tables[name] = catalog.load_table(f"{self.env.ns}.{name}")
                # The server takes a load's moment somewhere inside it: two loads' moments are at
                # most (this one's end - the previous one's start) apart. Past --session-quiet, the
                # session may have moved to a newer cut between them.
                if warehouse == "read-committed" and previous is not None and time.monotonic() - previous >= QUIET_S:
                    self.report.excused["catalog read-committed: loads slower than the session's quiet"] += 1
                    return None
                previous = began
            return {name: table.scan().to_arrow() for name, table in tables.items()}
        except (requests.ConnectionError, ServiceUnavailableError):
            self.report.catalog_unavailable += 1
            return None

    # -- processes

    def _spawn(self, *args: str, extra_env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", _PROCESS_MAIN, *args],
            env={**os.environ, faults.FAULT_ENV: "", faults.FAULT_AFTER_ENV: "0", **(extra_env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def launch(self, job: str, until: int) -> None:
        self.launches[job] += 1
        if job in self.exec_jobs:  # `icebarrier job exec --follow` (--once for the final barrier)
            log = open(Path(self.env.reports) / f"{job}.log", "a")
            offset = log.tell()
            proc = subprocess.Popen(
                exec_command(
                    job,
                    uri=self.catalog_server.uri,
                    credential=self.credentials[job],
                    namespace=self.env.ns,
                    seed=self.env.seed,
                    barriers_file=self.barriers_file,
                    follow=until == 2**62,
                ),
                env={k: v for k, v in os.environ.items() if k not in (faults.FAULT_ENV, faults.MUTATION_ENV)},
                stdout=log,
                stderr=log,
                text=True,
            )
            log.close()
            proc.fault = None  # type: ignore[attr-defined]
            proc.log_offset = offset  # type: ignore[attr-defined]  # where this launch's lines begin
            self.procs[job] = proc
            return
        point, after = launch_fault(self.env.seed, job, self.launches[job], self.fault_rate)
        extra = {faults.FAULT_ENV: point, faults.FAULT_AFTER_ENV: str(after)} if point else {}
        proc = self._spawn(
            "job", self.env.to_json(), job, str(until), str(self.env.seed * 31 + self.launches[job]), extra_env=extra
        )
        proc.fault = point  # type: ignore[attr-defined]
        self.procs[job] = proc

    def kill(self, job: str) -> None:
        if self.procs[job].poll() is None:
            self.procs[job].kill()
            self.procs[job].wait()
            self.report.faults[f"{job}@{'job exec ' if job in self.exec_jobs else ''}killed"] += 1

    def kill_script(self, job: str) -> None:
        """SIGKILL of the script a job exec job runs (job exec itself lives on)."""
        for pid in children(self.procs[job].pid):
            try:
                os.kill(pid, 9)
                self.report.faults[f"{job}@script killed"] += 1
            except ProcessLookupError:
                pass

    def reap(self, final: int | None) -> None:
        """Restart job processes that ended before their work was done."""
        for job, proc in self.procs.items():
            code = proc.poll()
            if code is None:
                continue
            if job in self.exec_jobs:
                if code not in (0, -9):  # the script killed (137), the catalog unreachable too long (1)
                    self.report.faults[f"{job}@job exec exit {code}"] += 1
                    with open(Path(self.env.reports) / f"{job}.log") as log:
                        log.seek(proc.log_offset)
                        lines = log.read().strip().splitlines()
                    self.exec_errors[job] = next((ln for ln in reversed(lines) if ln.startswith("error")), "")
            elif code == faults.CRASH_EXIT_CODE:
                self.report.faults[f"{job}@{proc.fault}"] += 1
            elif code not in (0, -9):
                raise IcebarrierError(f"check process {job} failed (exit {code}): {proc.stderr.read()[-2000:]}")
            if final is None or code != 0 or self.cp.run("progress", lambda c: jobs.show(c, job).progress) != final:
                self.launch(job, final or 2**62)

    def stalled(self, final: int) -> dict[str, int | None]:
        """The jobs short of ``final`` whose progress has not moved for STALL_S (each call looks)."""
        now, out = time.monotonic(), {}
        for job in JOBS:
            at = self.cp.run("progress", lambda c, j=job: jobs.show(c, j).progress)
            if self.moved.get(job, (None, 0.0))[0] != at or job not in self.moved:
                self.moved[job] = (at, now)
            elif at != final and now - self.moved[job][1] > STALL_S:
                out[job] = at
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

    # -- reads

    def read_levels(self) -> None:
        for level in (Level.READ_UNCOMMITTED, Level.READ_COMMITTED):
            try:
                cut, data = self.cp.run(f"read {level.value}", lambda conn: self._read(conn, level))
            except NoValidCutError:
                self.report.no_valid_cut += 1
                continue
            except Exception as exc:  # noqa: BLE001 - classified below
                if level is Level.READ_UNCOMMITTED:
                    self.report.read_uncommitted_errors += 1  # no protection at this level: expected
                    continue
                self.report.reads[level.value] += 1
                self.report.anomaly(level, f"read failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            self.report.reads[level.value] += 1
            problem = check_cut(data)
            if level is Level.READ_COMMITTED:  # a valid cut holds exactly the model's rows at its barrier
                problem = problem or compare(self.env.seed, self._number(cut.barrier), data)
            if problem:
                self.report.anomaly(level, problem)
        if self.catalog_server is not None and self.rng.random() < 0.3:  # a catalog read costs ~10 requests
            self.catalog_read_committed()

    def catalog_read_committed(self) -> None:
        """A read-committed read through the catalog server: the invariants hold across its tables."""
        try:
            data = self.catalog_read("read-committed")
        except FileNotFoundError:
            self.report.excused["catalog read-committed: files expired mid-scan"] += 1
            return
        except Exception as exc:  # noqa: BLE001 - an error reading a valid cut is an anomaly
            self.report.catalog_reads += 1
            self.report.catalog_anomalies += 1
            self.report.examples.setdefault("catalog read-committed", f"{type(exc).__name__}: {str(exc)[:200]}")
            return
        if data is None:
            return
        self.report.catalog_reads += 1
        problem = check_cut(data)
        if problem:
            self.report.catalog_anomalies += 1
            self.report.examples.setdefault("catalog read-committed", problem)

    def _read(self, conn, level: Level):
        with ConsistentRead(conn, self.catalog, self.names, level=level, holder="check") as r:
            cut, data = r.read()
        return cut, {t.name: d for t, d in data.items()}

    def repeatable_read(self) -> None:
        """Open a session now and then; re-read it; close it now and then."""
        if self.rr is None:
            if self.rng.random() >= 0.2:
                return
            try:
                self.rr = self.cp.run(
                    "rr open",
                    lambda conn: ConsistentRead(
                        conn,
                        self.catalog,
                        self.names,
                        level=Level.REPEATABLE_READ,
                        ttl_s=RR_TTL_S,
                        holder="check-session",
                    ).__enter__(),
                )
            except NoValidCutError:
                self.report.no_valid_cut += 1
                return
            except SnapshotExpiredError:
                self.report.leases_refused += 1
                return
            self.report.rr_sessions += 1
            self.rr_first = self._rr_read()
            return
        if self.rr_first is not None:
            again = self._rr_read()
            if again is not None and again != self.rr_first:
                self.report.anomaly(Level.REPEATABLE_READ, "a repeatable-read session saw its rows change")
        if self.rr is not None and self.rng.random() < 0.15:
            self.close_rr()

    def _rr_read(self):
        self.report.reads["repeatable-read"] += 1
        try:
            cut, data = self._with_connection_retry(self.rr.read)
        except LeaseLostError:
            self.report.leases_lost += 1  # the read stopped instead of reading unprotected
            self.close_rr()
            return None
        except Exception as exc:  # noqa: BLE001
            self.report.anomaly(Level.REPEATABLE_READ, f"read failed: {type(exc).__name__}: {str(exc)[:200]}")
            self.close_rr()
            return None
        data = {t.name: d for t, d in data.items()}
        problem = check_cut(data) or compare(self.env.seed, self._number(cut.barrier), data)
        if problem:
            self.report.anomaly(Level.REPEATABLE_READ, problem)
        return {t: sorted(map(tuple, (tuple(r.values()) for r in d.to_pylist()))) for t, d in data.items()}

    def close_rr(self) -> None:
        if self.rr is not None:
            self.report.leases_renewed += self.rr.lease_renewals
            try:
                self._with_connection_retry(lambda: self.rr.__exit__(None, None, None))
            except Exception:  # noqa: BLE001 - an unrenewable lease lapses on its own
                pass
            self.rr, self.rr_first = None, None

    def _with_connection_retry(self, fn):
        return self.cp.run("read", lambda _conn: fn())

    def _number(self, barrier: int) -> int:
        return self.cp.run("barrier number", lambda conn: barrier_number(conn, barrier))

    # -- history

    def validate_new(self, upto: int | None = None) -> None:
        """Validate, in order, every barrier the pinner queued (with ``upto``: after pinning, here,
        every barrier up to it), releasing its pin."""
        if upto is not None:
            self.pinner.pin_new(upto)
        self.pinner.raise_error()
        while not self.pinner.queue.empty():
            barrier, anchor, number, lease_id = self.pinner.queue.get()
            try:
                self._validate(barrier, number, anchor=anchor)
            finally:
                if lease_id is not None:
                    self.cp.run("unpin", lambda conn: leases.release(conn, lease_id))

    def _validate(self, barrier: int, number: int, *, anchor: bool) -> None:
        def read(conn):
            with ConsistentRead(
                conn,
                self.catalog,
                self.names,
                level=Level.REPEATABLE_READ,
                barrier=barrier,
                ttl_s=60,
                holder="check-validator",
            ) as r:
                return r.read()[1]

        try:
            data = {t.name: d for t, d in self.cp.run("validate", read).items()}
        except SnapshotExpiredError:
            self.report.excused["expired before validation"] += 1
            return
        except BarrierNotValidError as exc:
            coalesced = any("coalesced" in why for why in exc.reasons.values())
            if coalesced and anchor:
                self._violation(f"anchor #{number} was refused: {exc}")
            elif coalesced:
                self.report.coalesced_refused += 1
                self.report.excused["coalesced"] += 1
            else:
                self.report.excused["before every job started"] += 1
            return
        except Exception as exc:  # noqa: BLE001 - a pinned cut that cannot be read is damage to report
            self._violation(f"cut at barrier #{number} could not be read: {type(exc).__name__}: {str(exc)[:200]}")
            return
        self.report.validated += 1
        self.report.anchors_validated += anchor
        self.accepted[barrier] = number
        problem = compare(self.env.seed, number, data) or check_cut(data)
        if problem:
            self.report.violations.append(f"cut at barrier #{number}: {problem}")
        if self.catalog_server is not None:  # the same cut through the catalog's barrier-<B> warehouse
            try:
                served = self.catalog_read(f"barrier-{barrier}")
            except Exception as exc:  # noqa: BLE001 - a pinned cut the catalog cannot serve is damage
                self._violation(f"cut at barrier #{number} through the catalog: {type(exc).__name__}: {str(exc)[:200]}")
                return
            if served is not None:
                self.report.catalog_validated += 1
                problem = compare(self.env.seed, number, served) or check_cut(served)
                if problem:
                    self._violation(f"cut at barrier #{number} through the catalog: {problem}")

    # -- audits

    def audit_pins(self) -> None:
        """No snapshot protected (by a lease, job progress, the read window or as current)
        before and after loading a table's metadata is missing from it."""
        for table in self.names:

            def audit(conn):
                before = leases.protected(conn, table)
                present = {s.snapshot_id for s in load_table(self.catalog, table).metadata.snapshots}
                after = leases.protected(conn, table)
                return [
                    (sid, sorted(set(before[sid].reasons) | set(after[sid].reasons)))
                    for sid in before.keys() & after.keys()
                    if sid not in present
                ]

            for sid, reasons in self.cp.run("audit pins", audit):
                violation = f"snapshot {sid} of {table} is protected ({', '.join(reasons)}) but was expired"
                if violation not in self.report.violations:
                    self.report.violations.append(violation)

    def audit_commits(self, *, final: bool) -> None:
        """In each table's current lineage, the snapshots carrying a barrier come from one run
        (an overwrite is a delete and an append, both tagged) and include the one recorded for
        (table, barrier) as its data (a compaction's record maps the barrier to its rewrite).
        Unrecorded barriers are checked at the end only: a crashed job adopts
        its own snapshot on restart."""
        for table in self.names:
            tbl = load_table(self.catalog, table)
            runs_of, ids_of = defaultdict(set), defaultdict(set)
            for snap in lineage(tbl):
                props = summary_properties(snap)
                if SUMMARY_BARRIER in props and not is_compaction(snap):
                    runs_of[int(props[SUMMARY_BARRIER])].add(props.get(SUMMARY_RUN))
                    ids_of[int(props[SUMMARY_BARRIER])].add(snap.snapshot_id)
                    after = coalesced_after(snap)
                    for b, number in self.accepted.items() if after is not None else ():
                        if after < b < int(props[SUMMARY_BARRIER]):
                            self._violation(
                                f"cut at barrier #{number} was accepted, but {table} coalesced it: its "
                                f"snapshot {snap.snapshot_id} covers barriers {after}.."
                                f"{props[SUMMARY_BARRIER]}"
                            )
            for barrier, runs in runs_of.items():
                if len(runs) > 1:
                    self._violation(
                        f"{table} was written {len(runs)} times for barrier {barrier} "
                        f"(snapshots {sorted(ids_of[barrier])})"
                    )
            if not final:
                continue
            records = self.cp.run(
                "audit commits",
                lambda conn: conn.execute(
                    """SELECT c.barrier, c.snapshot_id,
                          EXISTS (SELECT 1 FROM expired_snapshot e WHERE e.table_id = c.table_id
                                  AND e.snapshot_id = c.snapshot_id) AS expired
                   FROM table_commit c JOIN managed_table m USING (table_id)
                   WHERE m.name = %s AND c.revoked_by IS NULL AND c.operation <> 'compaction'""",
                    (str(table),),
                ).fetchall(),
            )
            recorded = {r["barrier"]: r for r in records}
            present = {s.snapshot_id for s in tbl.metadata.snapshots}
            passed = self.cp.run(
                "completions",
                lambda conn: conn.execute(
                    """SELECT c.from_barrier, c.barrier, c.coalesced FROM table_completion c JOIN managed_table m
                   USING (table_id) WHERE m.name = %s AND c.from_barrier IS NOT NULL""",
                    (str(table),),
                ).fetchall(),
            )
            for barrier, ids in ids_of.items():
                record = recorded.get(barrier)
                inside = [p for p in passed if p["from_barrier"] < barrier < p["barrier"]]
                if record is None and inside:
                    how = "coalesced" if inside[0]["coalesced"] else "skipped"
                    self._violation(
                        f"snapshot(s) {sorted(ids)} of {table} carry barrier {barrier}, which the table "
                        f"{how} ({inside[0]['from_barrier']}..{inside[0]['barrier']}): no computation "
                        f"may write there"
                    )
                elif record is None:
                    self._violation(
                        f"snapshot(s) {sorted(ids)} of {table} carry barrier {barrier} but the control "
                        f"plane has no record of that barrier"
                    )
                elif record["snapshot_id"] not in ids and not record["expired"]:
                    self._violation(
                        f"{table}: barrier {barrier} is recorded as snapshot {record['snapshot_id']}, "
                        f"but the table's lineage has {sorted(ids)} for it"
                    )
            for r in records:
                if r["snapshot_id"] not in present and not r["expired"]:
                    self._violation(
                        f"{table}: the record of barrier {r['barrier']} names snapshot "
                        f"{r['snapshot_id']}, which is neither in the table nor expired"
                    )

    def audit_inputs(self) -> None:
        """Each barrier a root job took input for (its recorded range) and completed has a commit
        record if the model has rows in that range: no (table, barrier) lost from the map."""
        for job, table in ROOTS.items():

            def ranges(conn, job=job, table=table):
                return conn.execute(
                    """SELECT r.barrier, r.spec, c.snapshot_id
                       FROM input_range r JOIN managed_table m ON m.name = %s
                       LEFT JOIN table_commit c ON c.table_id = m.table_id AND c.barrier = r.barrier
                                               AND c.revoked_by IS NULL
                       WHERE r.job_name = %s AND r.barrier <= m.watermark""",
                    (str(self.env.t(table)), job),
                ).fetchall()

            for r in self.cp.run("audit inputs", ranges):
                if (
                    r["snapshot_id"] is None
                    and events(self.env.seed, table, r["spec"]["t_from"], r["spec"]["t_to"]).num_rows
                ):
                    self._violation(
                        f"{self.env.t(table)} completed barrier {r['barrier']} with input "
                        f"({r['spec']['t_from']}, {r['spec']['t_to']}] but has no commit record for it"
                    )

    def audit_publishes(self) -> None:
        """A job exec job's sinks never show a barrier its job has not completed: the catalog
        swaps a session's pointers and completes its barrier in one transaction. Pointer and
        watermark are read in one statement (one snapshot of the database)."""
        from psycopg import sql
        from pyiceberg.io import load_file_io
        from pyiceberg.serializers import FromInputFile

        settings = self.env.settings
        query = sql.SQL(
            "SELECT m.name, m.watermark, t.metadata_location FROM managed_table m JOIN {}.iceberg_tables t "
            "ON t.catalog_name = %s AND t.table_namespace = %s AND m.name = t.catalog_name || '.' || "
            "t.table_namespace || '.' || t.table_name WHERE m.name = ANY(%s)"
        ).format(sql.Identifier(settings.catalog_schema))
        sinks = [str(self.env.t(DERIVED[j][1] if j in DERIVED else ROOTS[j])) for j in sorted(self.exec_jobs)]
        for row in self.cp.run(
            "audit publishes", lambda conn: conn.execute(query, (settings.catalog, self.env.ns, sinks)).fetchall()
        ):
            io = load_file_io(settings.pyiceberg_properties(), row["metadata_location"])
            current = FromInputFile.table_metadata(io.new_input(row["metadata_location"])).current_snapshot()
            shown = int(summary_properties(current).get(SUMMARY_BARRIER, 0)) if current is not None else 0
            if shown > (row["watermark"] or 0):
                self._violation(
                    f"{row['name']} shows barrier {shown} while its job has completed only "
                    f"{row['watermark']}: a session's commits were visible before its barrier completed"
                )

    def count_completions(self) -> None:
        """How the jobs completed barriers: one exact barrier, a skipped run, a coalesced range."""
        for kinds in self.cp.run("completions", delays.completion_kinds).values():
            self.report.completions.update(kinds)

    def _violation(self, text: str) -> None:
        if text not in self.report.violations:
            self.report.violations.append(text)

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


STALL_S = 180.0  # after the run, a job whose progress does not move for this long fails it (slow is fine)


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
) -> CheckReport:
    """One seeded run. ``server`` (an :class:`~icebarrier.apps.embedded.EmbeddedPostgres` the run
    owns) is restarted by the fault schedule; without it the schedule has no restarts. With
    ``exec_jobs``, two jobs run under ``icebarrier job exec`` through a catalog server the run
    starts (and kills), which runs with the deliberate bug ``mutation`` if given
    (:data:`icebarrier.iceberg_ext.faults.MUTATIONS`). With ``maintain``, the maintenance
    service runs in place of the expiry process, with aggressive policies (it compacts too), and
    the schedule kills it. Pass a ``report`` to watch a live run from another thread."""
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
    report.exec_jobs, report.mutation = sorted(run.exec_jobs), mutation
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
        expiry = run._spawn("expiry", env.to_json(), str(env.seed))
    run.pinner.start()
    started, final = time.monotonic(), None
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
                    run.catalog_server.kill(fault.down_s)
                    report.faults["catalog server@killed"] += 1
                elif fault.kind == "server-term":
                    run.catalog_server.terminate(fault.down_s)
                    report.faults["catalog server@SIGTERM"] += 1
                elif fault.kind == "maintain":
                    run.maintenance.kill(fault.down_s)
                    report.faults["maintain@killed"] += 1
                else:
                    progress(f"check: restarting the control-plane Postgres ({fault.down_s}s down)")
                    server.restart(down_s=fault.down_s)
                    report.restarts += 1
            for service in (run.catalog_server, run.maintenance):
                if service is not None:
                    service.tend()
            if final is None and elapsed > duration_s:
                if run.catalog_server is not None:
                    run.catalog_server.restarted()
                final = run.cp.run("barrier", lambda conn: barriers.newest(conn).barrier)
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
            if (
                final is not None
                and all(run.procs[j].poll() is not None for j in JOBS)
                and all(run.cp.run("progress", lambda c, j=j: jobs.show(c, j).progress) == final for j in JOBS)
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
            report.violations.append(f"the expiry process failed: {expiry.stderr.read()[-1000:]}")
        run.validate_new(upto=final)
        run.audit_pins()
        run.audit_commits(final=True)
        run.audit_inputs()
        run.count_completions()
        if report.anchors_validated == 0:
            report.violations.append("no anchor was validated: the run proves nothing about anchors")
        if run.catalog_server is not None and report.catalog_validated == 0:
            report.violations.append("no cut was validated through the catalog: the run proves nothing about it")
        if run.maintenance is not None:
            report.maintenance = run.cp.run("maintenance", run.maintenance.actions)
            if not report.maintenance.get("compact done"):
                report.violations.append("the maintenance service compacted nothing: the run proves nothing about it")
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


def private_env(dsn: str, home: Path, seed: int, *, warehouse: str | None = None, storage: dict | None = None) -> Env:
    """An Env for a run on ``dsn``, with the processes' reports under ``home`` (a folder the caller
    owns and removes), and its warehouse there too unless given (e.g. a prefix on S3)."""
    return Env(
        dsn=dsn,
        schema="icebarrier",
        warehouse=warehouse or (home / "warehouse").as_uri(),
        ns=f"check_{seed}",
        seed=seed,
        reports=str(home / "reports"),
        storage=dict(storage or {}),
    )
