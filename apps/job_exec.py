"""``icebarrier job exec NAME -- COMMAND…``: any command as a barrier-completing job.

The runner is a client of ``icebarrier serve`` (it needs the catalog's address and a token of
the job, or an admin token; no database access). Per planned barrier it opens the job's session
(:mod:`icebarrier.apps.catalog.sessions`), holds it while it lives, runs COMMAND with the
catalog configuration of every engine in its environment (warehouse ``job:<JOB>@<RUN>``), and
publishes the barrier when COMMAND exits 0 — else releases the session (what COMMAND staged is
dropped; the next run computes the same barrier again). A skipped barrier
is published without running COMMAND; a session a dead run left after its command succeeded
is adopted (published) without running it again.

What COMMAND finds in its environment (see docs/job-exec.md):

- ``ICEBARRIER_JOB``, ``ICEBARRIER_BARRIER``, ``ICEBARRIER_PLAN``, ``ICEBARRIER_FROM_BARRIER``,
  ``ICEBARRIER_RUN_ID``; ``ICEBARRIER_CATALOG`` (the catalog's name), ``…_CATALOG_URI``,
  ``…_CATALOG_WAREHOUSE``, ``…_CATALOG_CREDENTIAL``;
- PyIceberg: ``PYICEBERG_CATALOG__<CATALOG>__*`` (``load_catalog("<catalog>")`` works as is);
- Spark: ``SPARK_CONF_DIR`` with a ``spark-defaults.conf`` (a plain ``SparkSession.builder
  .getOrCreate()`` or ``spark-submit`` picks it up; the user's own configuration directory is
  copied, our properties appended; without one, Spark logs errors only and shows no progress
  bars) and ``ICEBARRIER_SPARK_PROPERTIES``, the same file for ``--properties-file``;
- DuckDB: ``ICEBARRIER_DUCKDB_INIT``, a SQL file that loads the iceberg extension and attaches
  the catalog (``duckdb -init "$ICEBARRIER_DUCKDB_INIT"``, or execute its text).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from icebarrier.apps.catalog.clients import (
    CA_CERT_ENV,
    configuration,
    pyiceberg_environment,
    spark_conf,
    trusted_pem,
    write_truststore,
)
from icebarrier.apps.session_client import CatalogRequestError, SessionClient
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.job_sessions import HOLD_S, MAX_WAIT_S
from icebarrier.control_plane.model import TableName, barrier_label, format_duration_s
from icebarrier.iceberg_ext.lineage import Lineage
from icebarrier.iceberg_ext.spark import SPARK_LOG4J2

# each long poll this much shorter at most, at random: jobs started together do not renew together
WAIT_SPREAD = 0.25
RECONNECT_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # --follow: back-off while no catalog answers
# --follow: a barrier refused at publish (409), or whose command failed (a catalog failing over
# under it, a flaky source), runs again after these, in a row; then job exec gives up
AGAIN_S = (0.0, 1.0, 2.0, 5.0, 10.0)


# -- the command's environment ------------------------------------------------------------------------


def command_environment(
    session: dict, *, catalog: str, uri: str, credential: str, workdir: Path, ca_cert: str | None = None
) -> dict[str, str]:
    """Environment variables that give COMMAND the session and every engine's configuration
    (files written under ``workdir``); with ``ca_cert``, each engine trusts it (the Python clients
    through ``REQUESTS_CA_BUNDLE`` and ``SSL_CERT_FILE``: it beside the public CAs)."""
    warehouse = f"job:{session['job']}@{session['run_id']}"
    env = {
        "ICEBARRIER_JOB": session["job"],
        "ICEBARRIER_BARRIER": str(session["barrier"]),
        "ICEBARRIER_PLAN": session["plan"],
        "ICEBARRIER_FROM_BARRIER": str(session["from_barrier"] or ""),
        "ICEBARRIER_RUN_ID": session["run_id"],
        "ICEBARRIER_CATALOG": catalog,
        "ICEBARRIER_CATALOG_URI": uri,
        "ICEBARRIER_CATALOG_WAREHOUSE": warehouse,
        "ICEBARRIER_CATALOG_CREDENTIAL": credential,
        **pyiceberg_environment(warehouse, uri, credential, catalog),
    }
    truststore = None
    if ca_cert:
        bundle = workdir / "ca-bundle.pem"
        bundle.write_bytes(trusted_pem(ca_cert))
        env.update({CA_CERT_ENV: ca_cert, "REQUESTS_CA_BUNDLE": str(bundle), "SSL_CERT_FILE": str(bundle)})
        truststore = workdir / "truststore.p12"
    duckdb_init = workdir / "duckdb-init.sql"
    duckdb_init.write_text(configuration("duckdb", warehouse, uri, credential, catalog, ca_cert=ca_cert) + "\n")
    env["ICEBARRIER_DUCKDB_INIT"] = str(duckdb_init)
    try:
        conf = spark_conf(warehouse, uri, credential, catalog, truststore=truststore)
    except IcebarrierError:  # no Spark here: the command is not a Spark one
        return env
    conf_dir = workdir / "spark-conf"
    conf_dir.mkdir()
    theirs = Path(os.environ.get("SPARK_CONF_DIR") or Path(os.environ.get("SPARK_HOME", "/nonexistent")) / "conf")
    if theirs.is_dir():  # keep the user's Spark configuration; ours wins where both set a key
        shutil.copytree(theirs, conf_dir, dirs_exist_ok=True)
    defaults = conf_dir / "spark-defaults.conf"
    kept = defaults.read_text() if defaults.exists() else "spark.ui.showConsoleProgress false\n"
    defaults.write_text(kept + "\n# icebarrier job exec\n" + "".join(f"{k} {v}\n" for k, v in conf.items()))
    if not (conf_dir / "log4j2.properties").exists():
        (conf_dir / "log4j2.properties").write_text(SPARK_LOG4J2)
    env["SPARK_CONF_DIR"] = str(conf_dir)
    env["ICEBARRIER_SPARK_PROPERTIES"] = str(defaults)
    if ca_cert and truststore is not None:
        write_truststore(ca_cert, truststore)
    return env


# -- running ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """What one planned barrier came to."""

    barrier: int
    plan: str
    outcome: str  # published, skipped, adopted or failed
    seconds: float
    exit_code: int | None = None  # the command's (None: not run)
    commits: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "barrier": self.barrier,
            "plan": self.plan,
            "outcome": self.outcome,
            "seconds": round(self.seconds, 3),
            "exit_code": self.exit_code,
            "commits": self.commits,
        }


@dataclass(slots=True, kw_only=True)
class ExecSummary:
    job: str
    steps: list[Step] = field(default_factory=list)
    waiting: str | None = None  # what the job waits for when it stopped for want of a barrier
    exit_code: int = 0
    stopped_by_signal: bool = False

    def to_json(self) -> dict:
        return {
            "job": self.job,
            "steps": [s.to_json() for s in self.steps],
            "waiting": self.waiting,
            "exit_code": self.exit_code,
            "stopped_by_signal": self.stopped_by_signal,
        }


class _StopWaiting(BaseException):
    """SIGINT/SIGTERM while the run waits for work."""


class JobExec:
    """Runs COMMAND once per planned barrier of job ``job`` (see the module docstring)."""

    _waiting = False  # in a long poll for work (a signal then stops the run at once)

    def __init__(
        self,
        job: str,
        command: list[str],
        *,
        uri: str,
        credential: str,
        ca_cert: str | None = None,
        skip: bool = True,
        coalesce: bool = True,
        hold_s: float = HOLD_S,
        log: Callable[[str], None] = print,
    ) -> None:
        self.job, self.command, self.skip, self.coalesce, self.hold_s = job, command, skip, coalesce, hold_s
        self.uri, self.credential, self.log = uri.rstrip("/"), credential, log
        self.ca_cert = ca_cert
        self.client = SessionClient(uri, credential, ca_cert)
        self.stop = threading.Event()
        self._child: subprocess.Popen | None = None
        self.lineage = Lineage.for_job(job)

    def run(self, *, follow: bool = False, poll_s: float = MAX_WAIT_S) -> ExecSummary:
        """Complete every barrier due now (``follow``: keep going until SIGINT/SIGTERM; each open
        waits at the server up to ``poll_s`` for work, which wakes it at once)."""
        summary = ExecSummary(job=self.job)
        restore = self._install_signal_handlers()
        newest = None  # --once stops at the newest barrier issued when it started
        again = 0  # --follow: runs of one barrier refused or failed in a row, each run again
        try:
            while not self.stop.is_set():
                try:
                    self._waiting = follow
                    opened = self._open(poll_s if follow else None, lambda line: self._heard(line, summary))
                except _StopWaiting:
                    break
                finally:
                    self._waiting = False
                if opened is None:
                    continue
                self._skipped(opened, summary)
                if newest is None:
                    newest = opened.get("newest_barrier")
                session = opened.get("session")
                if not opened["ready"] or (not follow and newest is not None and session["barrier"] > newest):
                    if session is not None:  # past where --once stops: leave it for the next run
                        self.client.release(self.job, session["run_id"])
                    if follow and opened.get("waiting") != summary.waiting:  # say what it waits for, once
                        self.log(f"job {self.job}: waiting for {opened.get('waiting')}")
                    summary.waiting = opened.get("waiting")
                    if not follow:
                        break
                    continue  # the server waited for it (wait_s) already
                try:
                    step = self._step(opened["opened"], session)
                except CatalogRequestError as exc:
                    if not follow or not exc.retriable or again >= len(AGAIN_S):
                        raise
                    self.client.release(self.job, session["run_id"])  # what it staged goes; the plan stays
                    if self._wait_again(session["barrier"], f"was refused at publish ({exc})", again):
                        break
                    again += 1
                    continue
                summary.steps.append(step)
                summary.waiting = None
                if step.outcome == "failed":
                    if not follow or again >= len(AGAIN_S):
                        summary.exit_code = step.exit_code
                        break
                    if self._wait_again(step.barrier, "failed", again):
                        break
                    again += 1
                    continue
                again = 0
                if not follow and newest is not None and step.barrier >= newest:
                    break  # --once: caught up with the newest barrier issued when it started
        finally:
            restore()
        summary.stopped_by_signal = self.stop.is_set()
        if summary.waiting and not summary.steps:
            self.log(f"job {self.job}: nothing to do: it waits for {summary.waiting}")
        return summary

    def _wait_again(self, barrier: int, why: str, again: int) -> bool:
        """--follow: say barrier runs again, and wait for it; whether stopped meanwhile."""
        self.log(
            f"job {self.job}: barrier {barrier_label(barrier)} {why}; running it again in {AGAIN_S[again]:g}s "
            f"({again + 1} of {len(AGAIN_S)} in a row before job exec gives up)"
        )
        return self.stop.wait(AGAIN_S[again])

    def _heard(self, line: dict, summary: ExecSummary) -> None:
        """A line of a long poll: barriers skipped, or what the job waits for (said once)."""
        self._skipped(line, summary)
        if "waiting" in line and line["waiting"] != summary.waiting:
            self.log(f"job {self.job}: waiting for {line['waiting']}")
            summary.waiting = line["waiting"]

    def _skipped(self, answer: dict, summary: ExecSummary) -> None:
        """Barriers the server completed for the job with no computation (no source changed)."""
        for barrier in answer.get("skipped", ()):
            summary.steps.append(Step(barrier=barrier, plan="skip", outcome="skipped", seconds=0.0))
        if answer.get("skipped"):
            self.log(f"job {self.job}: barrier {barrier_label(answer['skipped'][-1])} skipped (no source changed)")

    def _poll_s(self, wait_s: float) -> float:
        """The next long poll's length: ``wait_s``, up to a quarter shorter at random."""
        return min(wait_s, MAX_WAIT_S) * (1 - WAIT_SPREAD * random.random())

    def _open(self, wait_s: float | None, on_line: Callable[[dict], None]) -> dict | None:
        """Open the job's session; with ``wait_s`` (--follow) the server waits up to that long for
        work, and a catalog that does not answer (a server process restarting, another taking
        over) is asked again after a back-off (None: ask again)."""
        follow = wait_s is not None
        attempt = 0
        while True:
            try:
                opened = self.client.open(
                    self.job,
                    skip=self.skip,
                    coalesce=self.coalesce,
                    hold_s=self.hold_s,
                    wait_s=self._poll_s(wait_s) if follow else 0.0,
                    on_line=on_line,
                )
            except CatalogRequestError as exc:
                # 409: another run holds the job's session (one killed a moment ago holds it until
                # its hold lapses, or one still running): --follow waits for it, as a standby would
                if not follow or not (exc.transient or exc.retriable):
                    raise
                if attempt == 0:
                    self.log(f"job {self.job}: {exc}; asking again until it {'ends' if exc.retriable else 'answers'}")
                if self.stop.wait(RECONNECT_S[min(attempt, len(RECONNECT_S) - 1)]):
                    return None
                attempt += 1
                continue
            if attempt:
                self.log(f"job {self.job}: the catalog answers again")
            return opened

    def _step(self, opened: str, session: dict) -> Step:
        started = time.perf_counter()
        barrier, plan, run_id = session["barrier"], session["plan"], session["run_id"]
        how = f"coalescing from {barrier_label(session['from_barrier'])}" if plan == "coalesce" else plan
        if opened == "adopted" or plan == "skip":
            completion = self.client.publish(self.job, run_id)
            outcome = "adopted" if opened == "adopted" else "skipped"
            self.log(
                f"job {self.job}: barrier {barrier_label(barrier)} {outcome} "
                f"({'a previous run had staged it' if outcome == 'adopted' else 'no source changed'})"
            )
            return Step(
                barrier=barrier,
                plan=plan,
                outcome=outcome,
                seconds=time.perf_counter() - started,
                commits=completion["commits"],
            )
        if opened == "resumed":
            self.log(
                f"job {self.job}: barrier {barrier_label(barrier)}: a previous run died before publishing it; computing it again"
            )
        self.log(f"job {self.job}: barrier {barrier_label(barrier)} ({how}), run {run_id}: {' '.join(self.command)}")
        run = dict(plan=plan, from_barrier=session["from_barrier"], session_run=run_id)
        inputs = {TableName.parse(t): s for t, s in session.get("inputs", {}).items()}
        if self.lineage:
            self.lineage.start(barrier, inputs=inputs, **run)
        code = self._run_command(session)
        seconds = time.perf_counter() - started
        if code != 0:
            if self.lineage:
                self.lineage.fail(barrier, error=f"the command failed ({describe_exit(code)})", **run)
            self.client.release(self.job, run_id)
            self.log(
                f"job {self.job}: the command failed ({describe_exit(code)}) after {format_duration_s(seconds)}; "
                f"barrier {barrier_label(barrier)} is not published (nothing it wrote is visible; the next run computes it "
                f"again)"
            )
            return Step(barrier=barrier, plan=plan, outcome="failed", seconds=seconds, exit_code=code)
        completion = self.client.publish(self.job, run_id)
        seconds = time.perf_counter() - started
        if self.lineage:
            self.lineage.complete(
                barrier, inputs=inputs, outputs={TableName.parse(t): s for t, s in completion["commits"].items()}, **run
            )
        written = ", ".join(sorted(completion["commits"])) or "no sink changed"
        self.log(
            f"job {self.job}: barrier {barrier_label(barrier)} published in {format_duration_s(seconds)} ({written})"
        )
        return Step(
            barrier=barrier, plan=plan, outcome="published", seconds=seconds, exit_code=0, commits=completion["commits"]
        )

    def _run_command(self, session: dict) -> int:
        """Run COMMAND in its own process group while a thread renews the session's hold; its
        exit code (128 + N if signal N killed it)."""
        with tempfile.TemporaryDirectory(prefix="icebarrier-exec-") as workdir:
            env = {
                **os.environ,
                **command_environment(
                    session,
                    catalog=session["catalog"],
                    uri=self.uri,
                    credential=self.credential,
                    workdir=Path(workdir),
                    ca_cert=self.ca_cert,
                ),
            }
            try:
                self._child = subprocess.Popen(self.command, env=env, process_group=0)
            except OSError as exc:
                raise IcebarrierError(f"cannot run {self.command[0]!r}: {exc.strerror}; check the command") from None
            done = threading.Event()
            holder = threading.Thread(target=self._hold, args=(session, done), daemon=True, name="icebarrier-hold")
            holder.start()
            try:
                code = self._child.wait()
                if code != 0:  # what the failed command left running (a JVM, workers) writes no more
                    self._signal_child(signal.SIGKILL, group_only=True)
            finally:
                done.set()
                holder.join()
                self._child = None
        return 128 - code if code < 0 else code

    def _hold(self, session: dict, done: threading.Event) -> None:
        """Renew the run's hold on its session; if the session is lost, stop the command."""
        while not done.wait(self.hold_s / 3):
            try:
                self.client.hold(self.job, session["run_id"], self.hold_s)
            except CatalogRequestError as exc:
                if exc.status in (401, 403, 404):
                    self.log(f"job {self.job}: {exc}; stopping the command")
                    self._signal_child(signal.SIGTERM)
                    return
                self.log(f"job {self.job}: renewing the session's hold failed ({exc}); retrying")

    def _signal_child(self, signum: int, *, group_only: bool = False) -> None:
        """Signal the command's process group (``group_only``: even once the command itself exited)."""
        child = self._child
        if child is not None and (group_only or child.poll() is None):
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

    def _install_signal_handlers(self) -> Callable[[], None]:
        """SIGINT/SIGTERM: pass it to the running command (it decides; nothing is published unless
        it exits 0) and stop after the current barrier."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, frame):
            self.stop.set()
            if self._waiting:  # idle in a long poll: stop now (a session opened in that instant is taken over
                # by the next run once its hold lapses, like a dead run's)
                self.log(f"job {self.job}: {signal.Signals(signum).name}, stopping")
                raise _StopWaiting
            self.log(f"job {self.job}: {signal.Signals(signum).name}, passed to the command; stopping")
            self._signal_child(signum)

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(s, h) for s, h in previous.items()]


def describe_exit(code: int) -> str:
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exit code {code}"
