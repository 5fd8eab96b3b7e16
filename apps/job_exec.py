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

import http.client
import json
import math
import os
import random
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import uuid6

from icebarrier.apps.catalog.clients import (
    CA_CERT_ENV,
    configuration,
    pyiceberg_environment,
    spark_conf,
    tls_context,
    trusted_pem,
    write_truststore,
)
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.job_sessions import HOLD_S, MAX_HEARTBEAT_S, MAX_WAIT_S
from icebarrier.control_plane.model import TableName, barrier_label, format_duration_s
from icebarrier.iceberg_ext.lineage import Lineage
from icebarrier.iceberg_ext.spark import SPARK_LOG4J2

# a long poll (up to MAX_WAIT_S) hears a line every `serve --heartbeat` (at most MAX_HEARTBEAT_S)
REQUEST_TIMEOUT_S = MAX_HEARTBEAT_S + 15.0
# each long poll this much shorter at most, at random: jobs started together do not renew together
WAIT_SPREAD = 0.25
# a long poll ends this long before its access token expires (it plans again until its end)
TOKEN_SPARE_S = 15.0
RECONNECT_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # --follow: back-off while no catalog answers
RETRY_S = (0.1, 0.3, 1.0, 2.0, 4.0)  # one request whose answer was lost: sent again (same key) after these
# --follow: a barrier refused at publish (409), or whose command failed (a catalog failing over
# under it, a flaky source), runs again after these, in a row; then job exec gives up
AGAIN_S = (0.0, 1.0, 2.0, 5.0, 10.0)


class CatalogRequestError(IcebarrierError):
    """The catalog refused a session request (its one-line message) or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)

    @property
    def transient(self) -> bool:
        """No answer, one a restarting server gives, or the server's limit on requests in flight
        (429: many runs starting at once from one address): asking again may succeed."""
        return self.status is None or self.status in (429, 502, 503, 504)

    @property
    def retriable(self) -> bool:
        """A conflict (409: a sink moved under the run, the session taken over): the server
        planned the barrier again, and running it again may succeed."""
        return self.status == 409


class SessionClient:
    """The job-session endpoints of ``icebarrier serve``, with OAuth2 client credentials."""

    def __init__(self, uri: str, credential: str, ca_cert: str | None = None) -> None:
        client_id, colon, secret = credential.partition(":")
        if not colon or not client_id or not secret:
            raise IcebarrierError(
                "the catalog credential must be CLIENT_ID:SECRET (from `icebarrier token create "
                "--job JOB`); pass --credential or set ICEBARRIER_CATALOG_CREDENTIAL"
            )
        self.uri, self.client_id, self.secret = uri.rstrip("/"), client_id, secret
        self.tls = tls_context(ca_cert)
        self._token: str | None = None
        self._token_until = math.inf  # when the access token expires (monotonic), as the server said

    def _send(
        self, method: str, path: str, data: bytes | None, headers: dict, on_line: Callable[[dict], None] | None = None
    ) -> dict:
        """The answer; a stream of JSON lines (a long poll) goes line by line to ``on_line``, its
        last line is the answer (an ``error`` line is raised as the catalog's refusal)."""
        request = urllib.request.Request(self.uri + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S, context=self.tls) as response:
                if response.headers.get_content_type() != "application/x-ndjson":
                    return json.loads(response.read() or b"{}")
                for line in response:
                    item = json.loads(line)
                    if "error" in item:
                        raise CatalogRequestError(
                            f"the catalog at {self.uri} refused {method} {path}: {item['error'].get('message')}",
                            item["error"].get("code"),
                        )
                    if "ready" in item:
                        return item
                    if on_line is not None:
                        on_line(item)
                raise http.client.IncompleteRead(b"")
        except (http.client.IncompleteRead, ValueError) as exc:  # the server went away mid-answer
            raise CatalogRequestError(
                f"the catalog at {self.uri} cut its answer to {method} {path} short ({type(exc).__name__})"
            ) from None
        except urllib.error.HTTPError as exc:
            body = exc.read()
            try:
                parsed = json.loads(body)
                message = (
                    parsed["error"]["message"]
                    if "error" in parsed and isinstance(parsed["error"], dict)
                    else parsed.get("error_description") or parsed.get("error")
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                message = body[:300].decode(errors="replace")
            raise CatalogRequestError(
                f"the catalog at {self.uri} refused {method} {path}: {message}", exc.code
            ) from None
        except OSError as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLCertVerificationError):  # not retried: it will not change
                raise IcebarrierError(
                    f"the catalog at {self.uri} presented a certificate this client does not trust "
                    f"({reason.verify_message}, CERTIFICATE_VERIFY_FAILED); pass --ca-cert with the CA that "
                    f"issued it (or set ICEBARRIER_CA_CERT)"
                ) from None
            raise CatalogRequestError(
                f"no catalog answers at {self.uri} ({reason}); start one with `icebarrier serve` or pass --catalog-uri"
            ) from None

    def token(self, lasts_s: float = 0.0) -> str:
        """An access token live for ``lasts_s`` more (and :data:`TOKEN_SPARE_S`): the one held, or a
        new one."""
        if self._token is None or time.monotonic() + lasts_s + TOKEN_SPARE_S > self._token_until:
            form = urllib.parse.urlencode(
                {"grant_type": "client_credentials", "client_id": self.client_id, "client_secret": self.secret}
            ).encode()
            asked = time.monotonic()
            answer = self._send("POST", "/v1/oauth/tokens", form, {"Content-Type": "application/x-www-form-urlencoded"})
            self._token, self._token_until = answer["access_token"], asked + answer.get("expires_in", math.inf)
        return self._token

    def call(
        self,
        method: str,
        job: str,
        path: str = "",
        body: dict | None = None,
        on_line: Callable[[dict], None] | None = None,
    ) -> dict:
        """One logical request under one idempotency key: a request whose answer was lost (no
        answer, an answer cut short, a server restarting) is sent again with the same key, and
        the server answers it with the first outcome instead of acting twice."""
        route = f"/icebarrier/v1/jobs/{urllib.parse.quote(job, safe='')}/session{path}"
        data = json.dumps(body).encode() if body is not None else None
        key = str(uuid6.uuid7())
        lost = 0
        authenticated = False
        while True:
            try:  # the token too: a token request refused for a while (429) or unanswered is sent again
                headers = {
                    "Authorization": f"Bearer {self.token()}",
                    "Content-Type": "application/json",
                    "Idempotency-Key": key,
                }
                return self._send(method, route, data, headers, on_line)
            except CatalogRequestError as exc:
                if exc.status == 401 and not authenticated:
                    self._token, authenticated = None, True  # the access token expired: authenticate again
                    continue
                if not exc.transient or lost >= len(RETRY_S):
                    raise
                time.sleep(RETRY_S[lost])
                lost += 1

    def open(
        self,
        job: str,
        *,
        skip: bool,
        coalesce: bool,
        hold_s: float,
        wait_s: float = 0.0,
        on_line: Callable[[dict], None] | None = None,
    ) -> dict:
        """Open the job's session; ``wait_s``: a long poll, whose progress (barriers the server
        skipped for the job) goes to ``on_line`` as it happens. Each plan the poll makes checks
        its token again, so it goes with one that outlives it (a new one if the one held would
        not), and ends sooner where the server's tokens live less long (`serve --token-ttl`)."""
        if wait_s > 0:
            self.token(wait_s)
            wait_s = max(0.0, min(wait_s, self._token_until - time.monotonic() - TOKEN_SPARE_S))
        return self.call(
            "POST", job, body={"skip": skip, "coalesce": coalesce, "hold_s": hold_s, "wait_s": wait_s}, on_line=on_line
        )

    def hold(self, job: str, run_id: str, hold_s: float) -> dict:
        return self.call("PUT", job, "/hold", {"run_id": run_id, "hold_s": hold_s})

    def publish(self, job: str, run_id: str) -> dict:
        return self.call("POST", job, "/publish", {"run_id": run_id})["completion"]

    def release(self, job: str, run_id: str) -> bool:
        return self.call("POST", job, "/release", {"run_id": run_id})["released"]


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
