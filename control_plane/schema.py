"""The control-plane schema: migrations (alembic), version checks and role grants.

``icebarrier db upgrade`` and the tests call :func:`upgrade`; every other entry point calls
:func:`require_current` (through ``db.connect``) and refuses an out-of-date schema.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from icebarrier.control_plane.db import resolve_dsn, resolve_schema, schema_of
from icebarrier.control_plane.errors import RoleNotFoundError, SchemaMigrationError, SchemaOutOfDateError

# Views users may read; grant-reader exposes these and nothing else.
VIEWS = (
    "job_sources", "job_sinks", "table_versions", "topology_edges",
    "consistent_barrier", "barrier_delay", "job_delay", "active_leases",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemaStatus:
    schema: str
    current: str | None
    head: str

    @property
    def up_to_date(self) -> bool:
        return self.current == self.head

    def to_json(self) -> dict:
        return {"schema": self.schema, "current": self.current, "head": self.head, "up_to_date": self.up_to_date}


def script_location() -> Path:
    """The migrations folder: shipped in the wheel as control_plane/_migrations, else ../alembic."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_migrations", here.parent / "alembic"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(f"icebarrier migrations not found next to {here}; reinstall icebarrier")


def _alembic_config():
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    return cfg


@functools.cache
def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


def current_revision(conn: psycopg.Connection) -> str | None:
    schema = schema_of(conn)
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL AS ok", (f"{schema}.alembic_version",)).fetchone()
    if not _first(exists):
        return None
    row = conn.execute(
        sql.SQL("SELECT version_num FROM {}.alembic_version").format(sql.Identifier(schema))
    ).fetchone()
    return _first(row) if row else None


def status(conn: psycopg.Connection) -> SchemaStatus:
    return SchemaStatus(schema=schema_of(conn), current=current_revision(conn), head=head_revision())


def require_current(conn: psycopg.Connection) -> None:
    st = status(conn)
    if not st.up_to_date:
        raise SchemaOutOfDateError(st.schema, st.current, st.head)


def upgrade(dsn: str | None = None, schema: str | None = None, revision: str = "head") -> SchemaStatus:
    """Apply migrations up to ``revision``. Idempotent, and safe from two processes at once:
    the whole upgrade runs in one transaction behind a per-schema advisory lock."""
    return _run_alembic(dsn, schema, "upgrade", revision)


def downgrade(dsn: str | None = None, schema: str | None = None, revision: str = "base") -> SchemaStatus:
    return _run_alembic(dsn, schema, "downgrade", revision)


def _run_alembic(dsn: str | None, schema: str | None, direction: str, revision: str) -> SchemaStatus:
    from alembic import command
    from sqlalchemy import create_engine
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.pool import NullPool

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
            cfg = _alembic_config()
            cfg.attributes["connection"] = connection
            cfg.attributes["schema"] = schema
            getattr(command, direction)(cfg, revision)
    except DBAPIError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
        raise SchemaMigrationError(schema, first) from exc
    finally:
        engine.dispose()
    with connect(dsn, schema, check_schema=False) as conn:
        return status(conn)


def grant_reader(conn: psycopg.Connection, role: str) -> list[str]:
    """Let ``role`` SELECT the views, and nothing else (no base tables, no writes)."""
    schema = schema_of(conn)
    with conn.transaction():
        _require_role(conn, role)
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), sql.Identifier(role)))
        for view in VIEWS:
            conn.execute(
                sql.SQL("GRANT SELECT ON {}.{} TO {}").format(
                    sql.Identifier(schema), sql.Identifier(view), sql.Identifier(role)
                )
            )
    return [f"USAGE ON SCHEMA {schema}", *(f"SELECT ON {schema}.{v}" for v in VIEWS)]


def grant_writer(conn: psycopg.Connection, role: str) -> list[str]:
    """What a job needs: read and write the control-plane tables (not DDL)."""
    schema = schema_of(conn)
    s, r = sql.Identifier(schema), sql.Identifier(role)
    with conn.transaction():
        _require_role(conn, role)
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
        conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO {}").format(s, r))
        conn.execute(sql.SQL("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {} TO {}").format(s, r))
    return [
        f"USAGE ON SCHEMA {schema}",
        f"SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema}",
        f"USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema}",
    ]


def _require_role(conn: psycopg.Connection, role: str) -> None:
    row = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    if row is None:
        raise RoleNotFoundError(role)


def _first(row) -> object:
    if row is None:
        return None
    return next(iter(row.values())) if isinstance(row, dict) else row[0]
