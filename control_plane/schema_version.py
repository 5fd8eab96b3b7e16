"""The control-plane schema's version: the migrations' head (alembic's scripts) and the revision a
database's schema is at. Every entry point but ``icebarrier db upgrade`` refuses a schema that is
not at the head (:func:`require_current`, called by ``db.connect``); the migrations themselves run
in :mod:`.schema`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from psycopg import sql

from icebarrier.control_plane.errors import IcebarrierError, PermissionDeniedError, SchemaOutOfDateError


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


def alembic_config():
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    return cfg


# The newest migration's revision, which every process that connects asks for. Written here, not
# read from the migrations: alembic reads every script of the folder to find it (0.5 CPU-s, paid by
# each `icebarrier` command, server, job and job exec wrapper at its first connection). A new
# migration changes it; tests/control_plane/test_schema.py fails until it does.
HEAD_REVISION = "0037"


def head_revision() -> str:
    return HEAD_REVISION


def migrations_head() -> str:
    """The head revision of the migrations' scripts, as alembic finds it (``db upgrade``)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise IcebarrierError("icebarrier's migrations have no head revision; reinstall icebarrier")
    return head


def current_revision(conn, schema: str) -> str | None:
    """The revision ``schema`` is at (None: no migration ran there)."""
    access = conn.execute(
        "SELECT has_schema_privilege(n.oid, 'USAGE') AS ok FROM pg_namespace n WHERE nspname = %s", (schema,)
    ).fetchone()
    if access is not None and not _first(access):
        raise PermissionDeniedError(
            conn.info.user,
            "connect",
            None,
            f"role {conn.info.user} has no access to control-plane schema {schema}",
            f"ask the admin for `icebarrier db grant-job {conn.info.user} JOB` or `db grant-reader {conn.info.user}`",
        )
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL AS ok", (f"{schema}.alembic_version",)).fetchone()
    if not _first(exists):
        return None
    row = conn.execute(sql.SQL("SELECT version_num FROM {}.alembic_version").format(sql.Identifier(schema))).fetchone()
    return str(_first(row)) if row else None


def status(conn, schema: str) -> SchemaStatus:
    return SchemaStatus(schema=schema, current=current_revision(conn, schema), head=head_revision())


def require_current(conn, schema: str) -> None:
    st = status(conn, schema)
    if not st.up_to_date:
        raise SchemaOutOfDateError(st.schema, st.current, st.head)


def _first(row) -> object:
    if row is None:
        return None
    return next(iter(row.values())) if isinstance(row, dict) else row[0]
