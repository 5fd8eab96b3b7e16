"""Migrations, version checks and role grants against a real Postgres."""

import psycopg
import pytest

from icebarrier.control_plane import db, schema, schema_version
from icebarrier.control_plane.errors import ControlPlaneUnavailableError, RoleNotFoundError, SchemaOutOfDateError
from tests.workers import run_all, upgrade_worker


def test_upgrade_is_idempotent_and_reports_head(make_db):
    """Upgrading twice leaves the schema at head and changes nothing the second time."""
    dsn = make_db()
    first = schema.upgrade(dsn)
    second = schema.upgrade(dsn)
    assert first.current == second.current == schema_version.head_revision()
    with psycopg.connect(dsn) as c:
        views = {
            r[0] for r in c.execute("SELECT table_name FROM information_schema.views WHERE table_schema = 'icebarrier'")
        }
    assert views == {*schema.VIEWS, *schema.ADMIN_VIEWS}


def test_the_head_revision_written_in_the_code_is_the_migrations_head():
    """The head every connection compares a schema with (written in the code: finding it costs
    alembic a read of every script) is the migrations' own: a new migration fails this until the
    constant follows it."""
    assert schema_version.head_revision() == schema_version.migrations_head()


def test_two_processes_upgrade_at_once(make_db):
    """Concurrent upgrades from two processes both succeed and migrate exactly once."""
    dsn = make_db()
    results = run_all(upgrade_worker, [(dsn,), (dsn,), (dsn,)])
    assert results == [schema_version.head_revision()] * 3


def test_out_of_date_schema_is_refused(make_db):
    """Connecting to a database without the schema says to run `icebarrier db upgrade`."""
    dsn = make_db()
    with pytest.raises(SchemaOutOfDateError, match="run `icebarrier db upgrade`"):
        db.connect(dsn)
    schema.upgrade(dsn)
    schema.downgrade(dsn, revision="base")
    with pytest.raises(SchemaOutOfDateError):
        db.connect(dsn)


def test_schema_name_is_configurable(make_db):
    """Two control planes can live side by side in one database under different schemas."""
    dsn = make_db()
    schema.upgrade(dsn, "cp_one")
    schema.upgrade(dsn, "cp_two")
    with db.connect(dsn, "cp_one") as c:
        c.execute("INSERT INTO barrier VALUES (1, now(), 'x')")
    with db.connect(dsn, "cp_two") as c:
        assert c.execute("SELECT count(*) AS n FROM barrier").fetchone()["n"] == 0


def test_unreachable_server_is_a_clear_error():
    """A DSN nobody answers gives one line that names the DSN (password hidden) and the fix."""
    with pytest.raises(ControlPlaneUnavailableError, match=r"127\.0\.0\.1:1/x.*--dsn") as info:
        db.connect("postgresql://me:secret@127.0.0.1:1/x")
    assert "secret" not in str(info.value)


def test_grant_to_missing_role_is_refused(conn):
    """Granting to a role that does not exist says to create it first."""
    with pytest.raises(RoleNotFoundError, match="CREATE ROLE nobody_here"):
        schema.grant_reader(conn, "nobody_here")


@pytest.mark.parametrize(
    "key, value",
    [
        ("barrier_interval_ms", "abc"),
        ("barrier_interval_ms", "0"),
        ("barrier_interval_ms", "-5"),
        ("barrier_interval_ms", "99999999999"),
        ("no_such_setting", "1"),
    ],
)
def test_a_bad_stored_setting_is_refused_at_write_time(conn, key, value):
    """Even plain SQL cannot store a setting that clients could not parse."""
    import psycopg.errors

    with pytest.raises(psycopg.errors.CheckViolation):
        with conn.transaction():
            conn.execute(
                "INSERT INTO setting (key, value) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE "
                "SET value = excluded.value",
                (key, value),
            )
    assert conn.execute("SELECT value FROM setting WHERE key = 'barrier_interval_ms'").fetchone()["value"] == "10000"
