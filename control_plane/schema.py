"""The control-plane schema: migrations (alembic) and role grants.

``icebarrier db upgrade`` and the tests call :func:`upgrade`; every other entry point refuses an
out-of-date schema (:func:`.schema_version.require_current`, through ``db.connect``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import psycopg
from psycopg import sql

from icebarrier.control_plane.db import Conn, resolve_dsn, resolve_schema, schema_of
from icebarrier.control_plane.errors import (
    GrantNotPerformedError,
    PermissionDeniedError,
    RoleNotFoundError,
    SchemaMigrationError,
)
from icebarrier.control_plane.schema_version import SchemaStatus, alembic_config, status


def upgrade(dsn: str | None = None, schema: str | None = None, revision: str = "head") -> SchemaStatus:
    """Apply migrations up to ``revision``. Idempotent, and safe from two processes at once:
    the whole upgrade runs in one transaction behind a per-schema advisory lock."""
    return _run_alembic(dsn, schema, "upgrade", revision)


def downgrade(dsn: str | None = None, schema: str | None = None, revision: str = "base") -> SchemaStatus:
    return _run_alembic(dsn, schema, "downgrade", revision)


def _run_alembic(dsn: str | None, schema: str | None, direction: str, revision: str) -> SchemaStatus:
    from sqlalchemy import create_engine
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.pool import NullPool

    from alembic import command
    from icebarrier.control_plane.db import connect

    dsn = resolve_dsn(dsn)
    schema = resolve_schema(schema)
    # Fail with our own message when the server is unreachable, before SQLAlchemy does.
    connect(dsn, schema, check_schema=False).close()
    engine = create_engine(
        "postgresql+psycopg://",
        creator=lambda: psycopg.connect(dsn, options=f"-c search_path={schema}"),
        poolclass=NullPool,
    )
    try:
        with engine.begin() as connection:
            key = zlib.crc32(f"icebarrier:{schema}:migrate".encode()) - 2**31
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({key})")
            connection.exec_driver_sql(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)).as_string(None)
            )
            cfg = alembic_config()
            cfg.attributes["connection"] = connection
            cfg.attributes["schema"] = schema
            getattr(command, direction)(cfg, revision)
    except DBAPIError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
        raise SchemaMigrationError(schema, first) from exc
    finally:
        engine.dispose()
    with connect(dsn, schema, check_schema=False) as conn:
        return status(conn, schema)


# What each kind of role may read and call (DESIGN.md, "Who may do what"): the views DESIGN.md
# names and the model's state as read-only views (migration 0009), which is what the library
# reads whichever role it runs as. Base tables and the other functions are the admin's; so are
# tokens, sessions, staged catalog commits and job grants, which no view shows.
VIEWS = (
    "job_sources",
    "job_sinks",
    "table_versions",
    "topology_edges",
    "consistent_barrier",
    "barrier_delay",
    "job_delay",
    "active_leases",
    "barriers",
    "jobs",
    "job_source_tables",
    "job_sink_tables",
    "managed_tables",
    "table_commits",
    "table_completions",
    "expired_snapshots",
    "settings",
    "leases",
    "lease_snapshots",
    "input_ranges",
    "coalesced_ranges",
    "table_targets",
    "targeted_tables",
    "target_misses",
    "schedule_plan",
    "job_computations",
    "maintenance_policies",
    "table_maintenance",
    "external_inputs",
)
ADMIN_VIEWS = ("audit",)  # the admin's only: never granted
READABLE = (*VIEWS, "alembic_version")  # the revision: every client checks it on connect
READER_FUNCTIONS = ("resolve_cut", "acquire_lease", "renew_lease", "release_lease")
JOB_FUNCTIONS = (
    *READER_FUNCTIONS,
    "register_job",
    "unregister_job",
    "plan_barrier",
    "complete_barrier",
    "issue_barrier_if_due",
    "record_commit",
    "record_input_range",
    "set_job_status",
    "set_job_waiting",
    "job_heartbeat",
    "record_computation",
    "announce_inputs",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """What a role was granted, each privilege verified with Postgres afterwards."""

    role: str
    job: str | None
    granted: tuple[str, ...]

    def to_json(self) -> dict:
        return {"role": self.role, "job": self.job, "granted": list(self.granted)}


def grant_reader(conn: Conn, role: str) -> Grant:
    """Let ``role`` read the control plane's views, resolve cuts, and hold leases of
    its own (TTL capped by ``lease_max_ttl_ms``). No writes."""
    with conn.transaction():
        granted = _grant(conn, role, READER_FUNCTIONS)
    return Grant(role=role, job=None, granted=granted)


def grant_job(conn: Conn, role: str, job: str) -> Grant:
    """Let ``role`` act for ``job`` (which need not be registered yet): register and complete
    it, record its commits and input ranges, and hold leases of its own. Several jobs may be
    granted to one role, one grant each."""
    with conn.transaction():
        granted = _grant(conn, role, JOB_FUNCTIONS)
        conn.execute("INSERT INTO job_grant (role_name, job_name) VALUES (%s, %s) ON CONFLICT DO NOTHING", (role, job))
    return Grant(role=role, job=job, granted=(*granted, f"job {job}"))


def _grant(conn: Conn, role: str, functions: tuple[str, ...]) -> tuple[str, ...]:
    """Grant schema usage, SELECT on the views and EXECUTE on ``functions``, then check that
    Postgres granted each (a role that may not grant gets a warning and nothing)."""
    schema = schema_of(conn)
    if not _first(conn.execute("SELECT caller_is_admin()").fetchone()):
        raise PermissionDeniedError(
            conn.info.user,
            "grant",
            None,
            f"role {conn.info.user} may not grant roles: that is for the admin (the owner of schema {schema})",
        )
    _require_role(conn, role)
    s, r = sql.Identifier(schema), sql.Identifier(role)
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
    for relation in READABLE:
        conn.execute(sql.SQL("GRANT SELECT ON {}.{} TO {}").format(s, sql.Identifier(relation), r))
    for fn in functions:
        conn.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {}.{} TO {}").format(s, sql.Identifier(fn), r))
    checks: list[tuple[str, str, tuple]] = [
        (f"USAGE ON SCHEMA {schema}", "has_schema_privilege(%s, %s, 'USAGE')", (schema,))
    ]
    checks += [
        (f"SELECT ON {schema}.{v}", "has_table_privilege(%s, %s, 'SELECT')", (f"{schema}.{v}",)) for v in READABLE
    ]
    checks += [(f"EXECUTE ON {schema}.{fn}", _HAS_FUNCTION, (schema, fn)) for fn in functions]
    require_granted(conn, role, checks)
    return tuple(what for what, _, _ in checks)


_HAS_FUNCTION = (
    "has_function_privilege(%s, (SELECT p.oid FROM pg_proc p WHERE p.pronamespace = %s::regnamespace "
    "AND p.proname = %s), 'EXECUTE')"
)


def require_granted(conn: Conn, role: str, checks: list[tuple[str, str, tuple]]) -> None:
    """Raise :class:`GrantNotPerformedError` naming each privilege ``role`` does not hold; a
    check is (privilege, a ``has_*_privilege(role, …)`` expression, its other arguments)."""
    missing = [
        what for what, test, args in checks if not _first(conn.execute(f"SELECT {test}", (role, *args)).fetchone())
    ]
    if missing:
        raise GrantNotPerformedError(role, missing)


def _require_role(conn: Conn, role: str) -> None:
    row = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    if row is None:
        raise RoleNotFoundError(role)


def _first(row) -> object:
    if row is None:
        return None
    return next(iter(row.values())) if isinstance(row, dict) else row[0]
