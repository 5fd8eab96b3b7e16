"""Who may do what, enforced by the database whichever client talks to it (DESIGN.md, "Who may
do what"): the role matrix, each cell tried for real as that Postgres role."""

from __future__ import annotations

import psycopg
import pytest

from icebarrier.control_plane import (
    audit,
    barriers,
    db,
    inputs,
    job_sessions,
    jobs,
    leases,
    reads,
    revisions,
    runs,
    schema,
    schema_version,
    snapshots,
)
from icebarrier.control_plane.errors import IcebarrierError, PermissionDeniedError
from icebarrier.iceberg_ext.catalog import grant
from icebarrier.iceberg_ext.config import Settings
from tests.helpers import T, job, login_roles

ROLES = ("admin", "job_a", "job_b", "reader", "nobody")


@pytest.fixture
def world(dsn, pg_server):
    """Jobs ingest_a -> a_sink and ingest_b -> b_sink (roots), agg -> c; one completed barrier;
    roles: job_a (granted ingest_a), job_b (granted ingest_b), a reader, one with no grant."""
    with login_roles(pg_server, dsn, *(r for r in ROLES if r != "admin")) as names:
        yield _world(dsn, names)


def _world(dsn: str, names: dict[str, str]) -> dict:
    settings = Settings(dsn=dsn).validated()
    grant(settings, names["job_a"], job="ingest_a")
    grant(settings, names["job_b"], job="ingest_b")
    grant(settings, names["reader"])
    with db.connect(dsn) as conn:
        jobs.register(conn, job("ingest_a", sinks=["a_sink"]))
        jobs.register(conn, job("ingest_b", sinks=["b_sink"]))
        jobs.register(conn, job("agg", sources=["a_sink", "b_sink"], sinks=["c"]))
        b1 = barriers.issue(conn).barrier
        jobs.complete(conn, "ingest_a", b1, {T("a_sink"): 11})
        jobs.complete(conn, "ingest_b", b1, {T("b_sink"): 21})
        b2 = barriers.issue(conn).barrier
    dsns = {r: psycopg.conninfo.make_conninfo(dsn, user=n) for r, n in names.items()} | {"admin": dsn}
    with db.connect(dsns["job_a"]) as c:
        lease_a = leases.acquire(c, [T("a_sink")], ttl_s=600, holder="a's reader").lease_id
    return {"dsn": dsns, "roles": names, "b1": b1, "b2": b2, "lease_a": lease_a}


# action -> (what it does given a connection and the world, the roles allowed to do it)
ACTIONS = {
    "register its job (redefined)": (
        lambda c, w: jobs.register(c, job("ingest_a", sinks=["a_sink"], external=["ext:new"]), replace=True),
        {"admin", "job_a"},
    ),
    "complete ingest_a's barrier": (
        lambda c, w: jobs.complete(c, "ingest_a", w["b2"], {T("a_sink"): 12}),
        {"admin", "job_a"},
    ),
    "complete ingest_a, committing to b_sink": (
        lambda c, w: jobs.complete(c, "ingest_a", w["b2"], {T("b_sink"): 777}),
        set(),
    ),
    "unregister ingest_a": (lambda c, w: jobs.unregister(c, "ingest_a"), {"admin", "job_a"}),
    "issue a barrier by hand": (lambda c, w: barriers.issue(c), {"admin"}),
    # a job's look (advance_job, run as its caller): the job's role and the admin, no one else
    "look for ingest_a's next barrier": (lambda c, w: jobs.advance(c, "ingest_a"), {"admin", "job_a"}),
    # the catalog server's (the admin's): a job's own role reads its session through the server only
    "open ingest_a's session": (lambda c, w: job_sessions.open_session(c, "ingest_a"), {"admin"}),
    "read ingest_a's session": (lambda c, w: job_sessions.get(c, "ingest_a"), {"admin"}),
    "announce ingest_a's input": (lambda c, w: inputs.announce(c, ["ext:ingest_a"]), {"admin", "job_a"}),
    "announce an input no job reads": (lambda c, w: inputs.announce(c, ["ext:nobody"]), {"admin"}),
    "forget an announced input": (lambda c, w: inputs.forget(c, ["ext:ingest_a"]), {"admin"}),
    "trigger the clock rule for ingest_a": (lambda c, w: barriers.issue_if_due(c, job="ingest_a"), {"admin", "job_a"}),
    "set the barrier interval": (lambda c, w: barriers.set_interval_s(c, 5), {"admin"}),
    "record ingest_a's input range": (
        lambda c, w: runs.record_range(c, "ingest_a", w["b2"], {"files": ["x"]}),
        {"admin", "job_a"},
    ),
    "report ingest_a's status": (lambda c, w: runs.set_status(c, "ingest_a", "running"), {"admin", "job_a"}),
    "record a commit of a_sink": (
        lambda c, w: snapshots.record(
            c, T("a_sink"), barrier=w["b1"], snapshot_id=13, operation="compaction", job_name="ingest_a"
        ),
        {"admin", "job_a"},
    ),
    "resolve a cut": (lambda c, w: reads.resolve(c, [T("a_sink"), T("b_sink")]), {"admin", "job_a", "job_b", "reader"}),
    "read the views": (
        lambda c, w: c.execute("SELECT * FROM table_versions, consistent_barrier").fetchall(),
        {"admin", "job_a", "job_b", "reader"},
    ),
    "acquire a lease (1 h)": (
        lambda c, w: leases.acquire(c, [T("a_sink")], ttl_s=3600, holder="me"),
        {"admin", "job_a", "job_b", "reader"},
    ),
    "acquire a lease (2 days, over the cap)": (
        lambda c, w: leases.acquire(c, [T("a_sink")], ttl_s=2 * 86400, holder="me"),
        {"admin"},
    ),
    "acquire a lease (100 years)": (
        lambda c, w: leases.acquire(c, [T("a_sink")], ttl_s=100 * 365 * 86400, holder="me"),
        set(),
    ),
    "renew job_a's lease": (lambda c, w: leases.renew(c, w["lease_a"], ttl_s=60), {"admin", "job_a"}),
    "release job_a's lease": (lambda c, w: leases.release(c, w["lease_a"]), {"admin", "job_a"}),
    "claim snapshots for expiry": (lambda c, w: leases.claim_expiry(c, T("a_sink"), [11]), {"admin"}),
    "revise a_sink": (lambda c, w: revisions.begin(c, T("a_sink"), w["b1"]), {"admin"}),
    "grant a job to a role": (lambda c, w: schema.grant_job(c, w["roles"]["reader"], "ingest_b"), {"admin"}),
    "insert table_commit directly": (
        lambda c, w: c.execute(
            "INSERT INTO table_commit (table_id, barrier, snapshot_id, job_name) "
            "SELECT table_id, %s, 777, 'x' FROM managed_table WHERE name = 'lake.db.b_sink'",
            (w["b2"],),
        ),
        {"admin"},
    ),
    "extend a lease directly": (
        lambda c, w: c.execute("UPDATE lease SET expires_at = now() + interval '100 years'"),
        {"admin"},
    ),
    "delete expiry tombstones": (lambda c, w: c.execute("DELETE FROM expired_snapshot"), {"admin"}),
    "set alembic_version": (lambda c, w: c.execute("UPDATE alembic_version SET version_num = '0001'"), {"admin"}),
    "read the audit trail": (lambda c, w: c.execute("SELECT * FROM audit").fetchall(), {"admin"}),
    "read the audit table": (lambda c, w: c.execute("SELECT * FROM audit_event").fetchall(), {"admin"}),
    "append to the audit trail": (lambda c, w: audit.append(c, "forged"), {"admin"}),
    "erase the audit trail": (lambda c, w: c.execute("DELETE FROM audit_event"), {"admin"}),
    "store barrier_interval_ms = 'abc'": (
        lambda c, w: c.execute("UPDATE setting SET value = 'abc' WHERE key = 'barrier_interval_ms'"),
        set(),
    ),
}


def _try(dsn: str, action, world) -> str:
    """'allowed', or the refusal's first line; whatever it did is rolled back."""
    try:
        with db.connect(dsn) as c, c.transaction(force_rollback=True):
            action(c, world)
        return "allowed"
    except (IcebarrierError, psycopg.errors.InsufficientPrivilege, psycopg.errors.CheckViolation) as exc:
        return str(exc).splitlines()[0]


def test_the_role_matrix_is_enforced_by_the_database(world):
    """Each role may do exactly what DESIGN.md grants it; every other action is refused by
    Postgres (through a function's check or a missing privilege), with one line that says why."""
    matrix = {
        (action, role): _try(world["dsn"][role], fn, world) for action, (fn, _) in ACTIONS.items() for role in ROLES
    }
    print("\n" + f"{'action':42}" + "".join(f"{r:>9}" for r in ROLES))
    for action in ACTIONS:
        print(f"{action:42}" + "".join(f"{'yes' if matrix[action, r] == 'allowed' else 'no':>9}" for r in ROLES))
    wrong = {cell: got for cell, got in matrix.items() if (got == "allowed") != (cell[1] in ACTIONS[cell[0]][1])}
    assert not wrong, "\n".join(f"{a} by {r}: {got}" for (a, r), got in wrong.items())
    # Refusals say why in one line: the role's name and the fix, or Postgres' own privilege error.
    assert "may not complete barriers of job ingest_a" in matrix["complete ingest_a's barrier", "job_b"]
    assert "does not write lake.db.b_sink" in matrix["complete ingest_a, committing to b_sink", "job_a"]
    assert "at most 86400s" in matrix["acquire a lease (2 days, over the cap)", "reader"]
    assert "it belongs to role" in matrix["release job_a's lease", "reader"]
    assert "has no access to control-plane schema" in matrix["resolve a cut", "nobody"]
    assert "permission denied for table expired_snapshot" in matrix["delete expiry tombstones", "job_a"]
    assert "violates check constraint" in matrix["store barrier_interval_ms = 'abc'", "admin"]
    assert "permission denied for view audit" in matrix["read the audit trail", "job_a"]


def test_a_lease_records_its_owner_and_only_it_or_the_admin_releases_it(world):
    """The lease's owner role is recorded; another role's release is refused and changes nothing,
    the owner's goes through."""
    with db.connect(world["dsn"]["admin"]) as admin:
        assert leases.get(admin, world["lease_a"]).state == "active"
        owner = admin.execute("SELECT owner_role FROM lease WHERE lease_id = %s", (world["lease_a"],)).fetchone()
        assert owner["owner_role"] == world["roles"]["job_a"]
        with db.connect(world["dsn"]["job_b"]) as other, pytest.raises(PermissionDeniedError):
            leases.release(other, world["lease_a"])
        assert leases.get(admin, world["lease_a"]).state == "active"
        with db.connect(world["dsn"]["job_a"]) as owner_conn:
            assert leases.release(owner_conn, world["lease_a"]).state == "released"


def test_the_lease_ttl_cap_is_a_validated_setting(world):
    """Readers' leases are capped by lease_max_ttl_ms; a bad value cannot be stored."""
    with db.connect(world["dsn"]["admin"]) as admin:
        db.call(admin, "set_setting", "lease_max_ttl_ms", "120000")
        with pytest.raises(IcebarrierError, match="10 ms for setting lease_max_ttl_ms is out of range"):
            db.call(admin, "set_setting", "lease_max_ttl_ms", "10")
        assert admin.execute("SELECT value FROM setting WHERE key = 'lease_max_ttl_ms'").fetchone()["value"] == "120000"
    with db.connect(world["dsn"]["reader"]) as reader:
        leases.acquire(reader, [T("a_sink")], ttl_s=120, holder="r")
        with pytest.raises(IcebarrierError, match="at most 120s"):
            leases.acquire(reader, [T("a_sink")], ttl_s=121, holder="r")


def test_the_cli_refuses_forging_another_jobs_progress_in_one_line(world):
    """The issue's reproduction: `job complete` of another job's barrier through the ordinary
    CLI, as a job role, exits 1 with one line naming the role, the job and the fix; nothing moves."""
    from click.testing import CliRunner

    from icebarrier.cli.main import cli as command

    result = CliRunner().invoke(
        command,
        [
            "--dsn",
            world["dsn"]["job_b"],
            "job",
            "complete",
            "ingest_a",
            "--barrier",
            str(world["b2"]),
            "--commit",
            "lake.db.a_sink=777",
        ],
    )
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: role {world['roles']['job_b']} may not complete barriers of job ingest_a: it is "
        f"not granted that job; connect as a role granted job ingest_a (`icebarrier db grant-job "
        f"ROLE ingest_a`, run by the admin)\n"
    )
    with db.connect(world["dsn"]["admin"]) as admin:
        assert jobs.show(admin, "ingest_a").progress == world["b1"]
    denied = CliRunner().invoke(
        command, ["--dsn", world["dsn"]["job_a"], "db", "grant-job", world["roles"]["job_a"], "ingest_b"]
    )
    assert denied.exit_code == 1 and "may not grant roles: that is for the admin" in denied.stderr


def _relations(dsn: str, kind: str) -> list[str]:
    """The control-plane schema's base tables ('r') or views ('v')."""
    with db.connect(dsn) as admin:
        rows = admin.execute(
            "SELECT c.relname FROM pg_class c WHERE c.relnamespace = current_schema()::regnamespace "
            "AND c.relkind = %s ORDER BY 1",
            (kind,),
        ).fetchall()
    return [r["relname"] for r in rows]


def test_readers_and_job_roles_read_views_never_base_tables(world):
    """Every base table (tokens, sessions, staged catalog commits, job grants and the audit trail
    included) is refused to a reader and to a job role; every view but the audit trail is allowed; a job's input ranges show only
    to the roles granted that job. (alembic_version: the revision every client checks.)"""
    tables = [t for t in _relations(world["dsn"]["admin"], "r") if t != "alembic_version"]
    views = _relations(world["dsn"]["admin"], "v")
    assert {
        "catalog_token",
        "catalog_session",
        "catalog_pending",
        "job_grant",
        "table_commit",
        "audit_event",
        "idempotency_key",
    } <= set(tables)
    assert set(views) == {*schema.VIEWS, *schema.ADMIN_VIEWS}  # every view is granted but the admin's
    with db.connect(world["dsn"]["job_a"]) as c:
        runs.record_range(c, "ingest_a", world["b2"], {"files": ["in-a"]})
    for role in ("reader", "job_a"):
        with psycopg.connect(world["dsn"][role], autocommit=True) as c:
            c.execute("SET search_path = icebarrier")
            for table in tables:
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match=f"permission denied for table {table}"):
                    c.execute(f"SELECT 1 FROM {table} LIMIT 1")
            for view in schema.VIEWS:
                c.execute(f"SELECT * FROM {view} LIMIT 1").fetchall()
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied for view audit"):
                c.execute("SELECT 1 FROM audit LIMIT 1")
            seen = c.execute("SELECT job_name FROM input_ranges").fetchall()
            assert seen == ([("ingest_a",)] if role == "job_a" else []), role


def test_upgrade_takes_back_what_earlier_grants_gave(make_db, pg_server):
    """A reader granted by 0008 (SELECT on all tables) reads catalog_token; after `db upgrade`
    it reads the views only."""
    from psycopg import sql

    from icebarrier.iceberg_ext.catalog import upgrade as upgrade_all

    dsn = make_db()
    schema.upgrade(dsn, None, "0008")
    with login_roles(pg_server, dsn, "old_reader") as names:
        role = sql.Identifier(names["old_reader"])
        with psycopg.connect(dsn, autocommit=True) as admin:  # what 0008's grant-reader did
            admin.execute(sql.SQL("GRANT USAGE ON SCHEMA icebarrier TO {}").format(role))
            admin.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA icebarrier TO {}").format(role))
        reader = psycopg.conninfo.make_conninfo(dsn, user=names["old_reader"])
        with psycopg.connect(reader) as c:
            c.execute("SELECT * FROM icebarrier.catalog_token").fetchall()
        upgrade_all(Settings(dsn=dsn))
        with psycopg.connect(reader, autocommit=True) as c:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute("SELECT * FROM icebarrier.catalog_token")
            c.execute("SELECT * FROM icebarrier.table_versions").fetchall()
        with db.connect(reader) as c:  # the version check on connect passes: the views are what it reads
            assert schema_version.status(c, db.schema_of(c)).up_to_date
