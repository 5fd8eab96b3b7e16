"""The run's processes, supervised as a supervisor would: each job's process launched (a job
process with its fault point, or ``icebarrier job exec`` for the job exec jobs), killed when the
schedule says, and restarted when it ended before its work was done; an exit no injected fault
explains is a violation (a part of the run, :class:`~.driver._Run`)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time
from pathlib import Path

from icebarrier.apps.check.exec_jobs import HOLD, exec_command
from icebarrier.apps.check.fault_plan import launch_fault
from icebarrier.apps.embedded import children
from icebarrier.control_plane import jobs
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import parse_duration_s
from icebarrier.iceberg_ext import faults

# The job and expiry processes are forked from a server process that imported their modules
# once (multiprocessing's fork server, started with the run's first launch): a launch costs a
# fork instead of an interpreter's start and its imports, PyIceberg's SQL catalog among them (1.4
# CPU-s a launch on a quiet machine; the suite's check runs took 642 CPU-s before, 448 after, on
# 2026-12-03). Each is still an OS process of its own, killed with SIGKILL.
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["icebarrier.apps.check.processes", "pyiceberg.catalog.sql"])
# A job exec job's exit is an injected fault's for this long after the fault ends (the server or
# Postgres back: job exec's bounded retries of one request take up to ~8 s, a script's own longer).
EXIT_EXCUSED_S = 30.0


def _forked_main(args: list[str], environ: dict[str, str], errors: str) -> None:
    """A forked process's start: its environment its own, its output to ``errors`` (stdout,
    which is the run's report, to nowhere)."""
    os.environ.clear()
    os.environ.update(environ)
    with open(os.devnull, "w") as nowhere:
        os.dup2(nowhere.fileno(), 1)
    with open(errors, "a") as log:
        os.dup2(log.fileno(), 2)
    from icebarrier.apps.check.processes import main

    main(args)


class Forked:
    """A job or expiry process forked from the run's fork server, polled, waited for and killed
    as a ``subprocess.Popen``; what it printed is in ``errors``."""

    def __init__(self, args: list[str], environ: dict[str, str], errors: Path) -> None:
        self.errors = errors
        self._process = _FORKS.Process(target=_forked_main, args=(args, environ, str(errors)), daemon=True)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"check process {self.pid}", timeout or 0)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    def printed(self, most: int) -> str:
        """The end of what it printed (a traceback, when it failed)."""
        return self.errors.read_text(errors="replace")[-most:] if self.errors.exists() else ""


class Supervision:
    """The run's processes (mixed into the run: its environment, report, catalog server and
    control-plane connection; ``procs``, ``launches``, ``outages`` and ``exec_errors`` are its)."""

    def _spawn(self, name: str, *args: str, extra_env: dict | None = None) -> Forked:
        """A job or expiry process (``args``: :func:`~.processes.main`'s), its output in the run's
        report folder as ``name``.err (one file a launch)."""
        return Forked(
            list(args),
            {**os.environ, faults.FAULT_ENV: "", faults.FAULT_AFTER_ENV: "0", **(extra_env or {})},
            Path(self.env.reports) / f"{name}.err",
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
        if self.mutation == faults.KAFKA_UNCOMMITTED:  # the job processes' bug (the others are the services')
            extra[faults.MUTATION_ENV] = self.mutation
        proc = self._spawn(
            f"{job}-{self.launches[job]}",
            "job",
            self.env.to_json(),
            job,
            str(until),
            str(self.env.seed * 31 + self.launches[job]),
            extra_env=extra,
        )
        proc.fault = point  # type: ignore[attr-defined]
        self.procs[job] = proc

    def kill(self, job: str) -> None:
        if self.procs[job].poll() is None:
            self.procs[job].kill()
            self.procs[job].wait()
            self.report.faults[f"{job}@{'job exec ' if job in self.exec_jobs else ''}killed"] += 1
            if job in self.exec_jobs:  # its session stays held: a run started meanwhile with --once is refused
                self.outage("its previous job exec killed", parse_duration_s(HOLD), job=job)

    def kill_script(self, job: str) -> None:
        """SIGKILL of the script a job exec job runs (job exec itself lives on)."""
        for pid in children(self.procs[job].pid):
            try:
                os.kill(pid, 9)
                self.report.faults[f"{job}@script killed"] += 1
                self.outage("its script killed", 0.0, job=job)
            except ProcessLookupError:
                pass

    def outage(self, what: str, down_s: float, *, job: str | None = None) -> None:
        """An injected fault that may make a job exec job exit (``job``: that one only, else any)
        until ``down_s`` plus :data:`EXIT_EXCUSED_S` from now."""
        now = time.monotonic()
        self.outages.append((now + down_s + EXIT_EXCUSED_S, what, job))

    def cause_of_exit(self, job: str) -> str | None:
        """The injected fault a job exec job's exit now comes from (None: none; a violation)."""
        now = time.monotonic()
        return next(
            (what for until, what, only in reversed(self.outages) if now <= until and only in (None, job)), None
        )

    def reap(self, final: int | None) -> None:
        """Restart job processes that ended before their work was done."""
        for job, proc in self.procs.items():
            code = proc.poll()
            if code is None:
                continue
            if job in self.exec_jobs:
                if code not in (0, -9):  # -9: the schedule killed job exec itself
                    with open(Path(self.env.reports) / f"{job}.log") as log:
                        log.seek(proc.log_offset)
                        lines = log.read().strip().splitlines()
                    self.exec_errors[job] = next((ln for ln in reversed(lines) if ln.startswith("error")), "")
                    cause = self.cause_of_exit(job)
                    if cause is not None:  # the script killed (137), the catalog unreachable too long (1)
                        self.report.faults[f"{job}@job exec exit {code} ({cause})"] += 1
                    else:  # restarted all the same, as a supervisor would; the run fails
                        self.report.violations.append(
                            f"job exec {job} exited {code} with no injected fault to cause it: "
                            f"{self.exec_errors[job] or 'no error line'}"
                        )
            elif code == faults.CRASH_EXIT_CODE:
                self.report.faults[f"{job}@{proc.fault}"] += 1
            elif code not in (0, -9):
                raise IcebarrierError(f"check process {job} failed (exit {code}): {proc.printed(2000)}")
            if final is None or code != 0 or self.cp.run("progress", lambda c: jobs.show(c, job).progress) != final:
                self.launch(job, final or 2**62)
