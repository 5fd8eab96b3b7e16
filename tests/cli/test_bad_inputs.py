"""Every bad input, across every command: exit 1 (refused) or 2 (bad usage), exactly one line
on stderr naming the object, no traceback, no raw control characters, and the database
unchanged (a dump of every row of the control-plane and catalog schemas, before and after)."""

import uuid

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

from icebarrier.cli.main import cli as command
from icebarrier.cli.render import one_line
from icebarrier.control_plane import barriers, db, jobs
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.iceberg_ext.catalog import upgrade
from icebarrier.iceberg_ext.config import Settings
from tests.helpers import new_database

ORDERS, REPORT = "lake.db.orders", "lake.db.report"

BAD_TABLES = [
    "lake.db",
    "lake..orders",
    "lake.db.orders;drop",
    "lake.db.ord-ers",
    "lake.db.\x1b[31mred",
    "lake.db.a\nb",
    "'lake.db.x'",
    "lake.db.ghost",
]
TABLE_COMMANDS = [
    ("cut", "{t}"),
    ("cut", "{t}", "--level", "repeatable-read"),
    ("lease", "acquire", "{t}"),
    ("protected", "{t}"),
    ("lineage", "{t}"),
    ("tag", "eod", "{t}"),
    ("revise", "{t}", "--to-barrier", "{B}"),
    ("expire", "--table", "{t}"),
    ("reconcile", "{t}"),
    ("delay", "--table", "{t}"),
    ("compact", "{t}"),
]
# Registering may name a table nobody writes yet (it becomes managed): only malformed names are bad.
REGISTER_COMMANDS = [
    ("job", "register", "newjob", "--source", "{t}", "--sink", "lake.db.z"),
    ("job", "register", "newjob", "--external", "ext:x", "--sink", "{t}"),
]
BAD_JOBS = ["1job", "job name", "job;drop", "j\x1b[2J", "ghost", "a" * 200]
JOB_COMMANDS = [
    ("job", "show", "{j}"),
    ("job", "unregister", "{j}"),
    ("job", "next-barrier", "{j}"),
    ("job", "ranges", "{j}"),
    ("job", "complete", "{j}", "--barrier", "1"),
    ("delay", "--job", "{j}"),
]
BAD_DURATIONS = ["abc", "-5s", "10 parsecs", "1e9999s", "5 h m", "∞"]
DURATION_COMMANDS = [
    ("barrier", "interval", "{d}"),
    ("barrier", "anchor-interval", "{d}"),
    ("lease", "acquire", ORDERS, "--ttl", "{d}"),
    ("lease", "renew", "00000000-0000-0000-0000-000000000001", "--ttl", "{d}"),
    ("cut", ORDERS, "--level", "repeatable-read", "--ttl", "{d}"),
    ("expire", "--older-than", "{d}"),
    ("tag", "eod", ORDERS, "--max-age", "{d}"),
    ("cut", ORDERS, "--wait", "{d}"),
]
BAD_BARRIERS = ["-1", "0", "abc", str(2**63), "1.5"]
BARRIER_COMMANDS = [
    ("cut", ORDERS, "--barrier", "{b}"),
    ("lease", "acquire", ORDERS, "--barrier", "{b}"),
    ("job", "complete", "ingest", "--barrier", "{b}"),
    ("revise", ORDERS, "--to-barrier", "{b}"),
    ("tag", "eod", ORDERS, "--barrier", "{b}"),
    ("query", "SELECT 1", "--barrier", "{b}"),
]


def _cases():
    for cmd in TABLE_COMMANDS:
        for t in BAD_TABLES:
            yield [a.format(t=t, B="{B}") for a in cmd], t
    for cmd in REGISTER_COMMANDS:
        for t in BAD_TABLES[:-1]:
            yield [a.format(t=t) for a in cmd], t
    for cmd in JOB_COMMANDS:
        for j in BAD_JOBS:
            yield [a.format(j=j) for a in cmd], j
    for j in BAD_JOBS[:4]:
        yield ["job", "register", j, "--external", "ext:x", "--sink", "lake.db.z"], j
    for cmd in DURATION_COMMANDS:
        for d in BAD_DURATIONS:
            yield [a.format(d=d) for a in cmd], d
    yield ["barrier", "interval", "0.5ms"], "0.0005s"
    yield ["barrier", "anchor-interval", "8d"], "691200s"
    yield ["lease", "acquire", ORDERS, "--ttl", "1ms"], "0.001s"
    yield ["lease", "acquire", ORDERS, "--ttl", "0s"], "0s"
    yield ["lease", "acquire", ORDERS, "--ttl", "8d"], "691200s"
    for d, named in [
        ("0s", "0s"),
        ("500ms", "500 ms for setting lease_max_ttl_ms is out of range"),
        ("8d", "691200000 ms for setting"),
        ("-5s", "-5s"),
        ("abc", "abc"),
    ]:
        yield ["lease", "max-ttl", d], named
    for cmd in BARRIER_COMMANDS:
        for b in BAD_BARRIERS:
            yield [a.format(b=b) for a in cmd], b
    for lease_id in ["nope", "0000", "00000000-0000-0000-0000-000000000000"]:
        yield ["lease", "renew", lease_id], lease_id
        yield ["lease", "release", lease_id], lease_id
    for commit in [
        "lake.db.orders",
        "lake.db.orders=abc",
        "lake.db.orders=-5",
        "lake.db.orders=0",
        "=5",
        "lake.db.orders=99999999999999999999",
        "lake.db.report=5",
    ]:
        yield ["job", "complete", "ingest", "--barrier", "{B}", "--commit", commit], commit.split("=")[0] or "''"
    yield (
        ["job", "complete", "ingest", "--barrier", "{B}", "--commit", f"{ORDERS}=1", "--commit", f"{ORDERS}=2"],
        ORDERS,
    )
    for name in ["Mixed", "pg_x", "information_schema", "a-b", "x" * 70]:
        yield ["--schema", name, "job", "list"], name
    yield ["--schema", "", "job", "list"], "''"
    yield ["--config", "missing.toml", "job", "list"], "missing.toml"
    yield ["--output", "xml", "job", "list"], "xml"
    yield ["--dsn", "postgresql://postgres@127.0.0.1:1/nope", "job", "list"], "127.0.0.1"
    yield ["--dsn", "not a dsn", "job", "list"], "--dsn"
    yield ["db", "grant-reader", "ghost_role"], "ghost_role"
    yield ["db", "grant-job", "ghost_role", "ingest"], "ghost_role"
    yield ["db", "grant-job", "postgres", "bad name!"], "bad name!"
    yield ["tag", "bad!tag", ORDERS], "bad!tag"
    yield ["token", "create"], "--reader"
    yield ["token", "create", "--reader", "--job", "ingest"], "--reader"
    yield ["token", "create", "--job", "bad name!"], "bad name!"
    yield ["token", "revoke", "ib-nope"], "ib-nope"
    yield ["token", "create", "--admin", "--job", "ingest"], "--admin"
    yield ["token", "create", "--reader"], "--whole-lake"
    yield ["token", "create", "--reader", "--namespace", "ghost_ns"], "ghost_ns"
    yield ["token", "create", "--reader", "--namespace", "Bad-NS"], "Bad-NS"
    yield ["token", "create", "--reader", "--table", "lake.db.ghost"], "lake.db.ghost"
    yield ["token", "create", "--reader", "--whole-lake", "--table", ORDERS], "--whole-lake"
    yield ["token", "create", "--admin", "--namespace", "db"], "--namespace"
    yield ["token", "grant", "ib-nope", "--table", ORDERS], "ib-nope"
    yield ["token", "grant", "ib-nope"], "--namespace"
    yield ["namespace", "create"], "NAMESPACE"
    yield ["namespace", "create", "Bad-NS"], "Bad-NS"
    yield ["namespace", "create", "made_first", "bad ns!"], "bad ns!"  # none made: each checked first
    yield ["postgres", "begin"], "begin"  # (no server started: the embedded tests start one)
    yield ["postgres", "start", "extra"], "extra"
    yield ["token", "ungrant", "ib-nope", "--table", ORDERS], "ib-nope"
    for j in BAD_JOBS[:4]:
        yield ["job", "exec", j, "--credential", "a:b", "--", "true"], j
    yield ["job", "exec", "ingest", "--", "true"], "--credential"
    yield ["job", "exec", "ingest", "--credential", "no-colon", "--", "true"], "CLIENT_ID:SECRET"
    yield ["job", "exec", "ingest", "--credential", "a:b"], "COMMAND"
    yield ["job", "exec", "ingest", "--credential", "a:b", "--hold", "soon", "--", "true"], "soon"
    yield (
        ["job", "exec", "ingest", "--credential", "a:b", "--catalog-uri", "http://127.0.0.1:1", "--", "true"],
        "http://127.0.0.1:1",
    )
    for warehouse in [
        "nightly",
        "barrier-0",
        "barrier-x",
        "lease-123",
        "read-committed:Bad-NS",
        "",
        "job:",
        "job:1x",
        "job:ingest@",
        "job:ingest@a b",
    ]:
        yield ["connect", "--engine", "spark", "--warehouse", warehouse], warehouse or "''"
    yield ["connect", "--engine", "presto"], "presto"
    yield ["connect", "--engine", "trino", "--uri", "http://127.0.0.1:1", "--credential", "a:b"], "--uri"
    yield ["connect", "--engine", "trino", "--catalog", "my-lake"], "my-lake"
    yield ["serve", "--port", "0"], "0"
    yield ["spark-conf", "--via", "rest"], "--credential"
    yield ["spark-conf", "--via", "rest", "--credential", "no-colon"], "--credential"
    for version in ("4.0", "4.2.1", "4.3.0", "2.4", "x"):  # lines Iceberg serves no runtime for
        yield ["spark-conf", "--spark-version", version], f"Spark {version} has no Iceberg"
    yield ["connect", "--engine", "spark", "--spark-version", "4.0.1"], "Spark 4.0.1 has no Iceberg"
    yield ["serve", "--session-quiet", "soon"], "soon"
    yield ["serve", "--heartbeat", "90s"], "--heartbeat 90s"
    yield ["serve", "--token-ttl", "10s"], "--token-ttl 10s"
    yield ["cut", "--level", "serializable", ORDERS], "serializable"
    yield ["job", "register", "both", "--source", ORDERS, "--external", "x", "--sink", "lake.db.q"], "both"
    yield ["job", "register", "nothing", "--sink", "lake.db.q"], "nothing"
    yield ["job", "register", "second_writer", "--external", "x", "--sink", ORDERS], ORDERS
    yield ["job", "register", "selfread", "--source", ORDERS, "--sink", ORDERS], ORDERS
    yield ["topology", "--format", "png"], "png"
    yield ["no-such-command"], "no-such-command"
    yield ["run", "missing_job.py"], "missing_job.py"
    yield ["run", "bad_syntax.py"], "bad_syntax.py, line 2"
    yield ["run", "no_job.py"], "no_job.py"
    yield ["run", "no_job.py", "bad_syntax.py"], "no_job.py"  # every file loads before any job runs
    yield ["run", "no_job.py", "empty.sql", "--follow"], "several job files run only with --once"
    yield ["query"], "--file"
    yield ["query", "SELECT 1", "--file", "no_job.py"], "--file"
    yield ["query", "--file", "missing.sql"], "missing.sql"
    yield ["query", "--file", "empty.sql"], "empty"


CASES = list(_cases())


@pytest.fixture(scope="module")
def populated(pg_server):
    """A database with a control plane, a catalog and some history to protect."""
    with new_database(pg_server, "icebarrier_bad") as dsn:
        upgrade(Settings(dsn=dsn, warehouse=f"file:///tmp/{uuid.uuid4().hex}").validated())  # what `db upgrade` does
        with db.connect(dsn) as conn:
            jobs.register(
                conn,
                JobDefinition(
                    name="ingest", sinks=frozenset([TableName.parse(ORDERS)]), external_inputs=frozenset(["ext:orders"])
                ),
            )
            jobs.register(
                conn,
                JobDefinition(
                    name="report",
                    sources=frozenset([TableName.parse(ORDERS)]),
                    sinks=frozenset([TableName.parse(REPORT)]),
                ),
            )
            b1 = barriers.issue(conn).barrier
            jobs.complete(conn, "ingest", b1, {TableName.parse(ORDERS): 11})
            b2 = barriers.issue(conn).barrier
        yield dsn, b2


def _dump(dsn: str) -> dict:
    """Every row of every table in every non-system schema, and the list of schemas."""
    with psycopg.connect(dsn) as c:
        relations = c.execute(
            "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relkind IN ('r', 'p') AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast') "
            "ORDER BY 1, 2"
        ).fetchall()
        dump = {"schemas": c.execute("SELECT nspname FROM pg_namespace ORDER BY 1").fetchall()}
        for nsp, rel in relations:
            dump[f"{nsp}.{rel}"] = c.execute(
                sql.SQL("SELECT coalesce(json_agg(t ORDER BY t::text), '[]') FROM {} t").format(
                    sql.Identifier(nsp, rel)
                )
            ).fetchone()[0]
        return dump


def test_the_suite_is_large_enough():
    """At least 150 bad inputs, across every command group."""
    assert len(CASES) >= 150
    groups = {args[0] if not args[0].startswith("--") else args[2] for args, _ in CASES}
    assert groups >= {
        "cut",
        "lease",
        "protected",
        "lineage",
        "tag",
        "revise",
        "expire",
        "reconcile",
        "job",
        "delay",
        "compact",
        "barrier",
        "query",
        "db",
        "topology",
        "run",
    }


@pytest.mark.parametrize("args, needle", CASES, ids=[f"{i}-{' '.join(a)[:50]!r}" for i, (a, _) in enumerate(CASES)])
def test_a_bad_input_is_one_clear_line_and_writes_nothing(populated, monkeypatch, tmp_path, args, needle):
    """Exit 1 or 2, one line `error: …` naming the object, no traceback or raw control
    characters on stderr, and every row of the database as it was."""
    dsn, barrier = populated
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ICEBARRIER_DSN", dsn)
    monkeypatch.setenv("ICEBARRIER_WAREHOUSE", str(tmp_path / "warehouse"))
    for var in ("ICEBARRIER_SCHEMA", "ICEBARRIER_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    args = [a.replace("{B}", str(barrier)) for a in args]
    (tmp_path / "bad_syntax.py").write_text("from icebarrier import SqlJob\njob = SqlJob(\n")
    (tmp_path / "no_job.py").write_text("x = 1\n")
    (tmp_path / "empty.sql").write_text("  \n")
    before = _dump(dsn)
    result = CliRunner().invoke(command, args)
    assert result.exit_code in (1, 2), (result.exit_code, result.output)
    err = result.stderr
    assert err.endswith("\n") and err.count("\n") == 1 and err.startswith("error: "), (err, result.exception)
    assert "Traceback" not in err and "\x1b" not in err, repr(err)
    assert one_line(needle) in err, f"{needle!r} not named in {err!r}"
    assert result.stdout == "", result.stdout
    assert _dump(dsn) == before, "a refused command changed the database"
