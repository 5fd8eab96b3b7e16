"""``icebarrier db``: schema migrations and role grants."""

from __future__ import annotations

import click

from icebarrier.cli.render import emit
from icebarrier.control_plane import db as cp_db
from icebarrier.control_plane import schema


@click.group("db")
def db_group() -> None:
    """Create, upgrade and inspect the control-plane schema; grant roles."""


@db_group.command("upgrade")
@click.pass_obj
def upgrade(obj) -> None:
    """Apply migrations up to head and create the Iceberg catalog's schema and tables
    (idempotent; safe from two processes at once). Plain Spark with `icebarrier spark-conf`
    works right after."""
    from icebarrier.iceberg_ext.catalog import upgrade as run

    st = run(obj.settings())
    emit(obj, st.to_json(), f"schema {st.schema} is at revision {st.current} (head)")


@db_group.command("status")
@click.pass_obj
def status(obj) -> None:
    """Show the schema's current revision against the migrations' head."""
    settings = obj.settings()
    with cp_db.connect(settings.dsn, settings.schema, check_schema=False) as conn:
        st = schema.status(conn)
    state = "up to date" if st.up_to_date else "out of date: run `icebarrier db upgrade`"
    emit(obj, st.to_json(), f"schema {st.schema}: current {st.current or '(none)'}, head {st.head} ({state})")


@db_group.command("grant-reader")
@click.argument("role")
@click.pass_obj
def grant_reader(obj, role: str) -> None:
    """Let ROLE SELECT the control-plane views only (no base tables, no writes)."""
    _report_grants(obj, role, schema.grant_reader(obj.conn(), role))


@db_group.command("grant-writer")
@click.argument("role")
@click.pass_obj
def grant_writer(obj, role: str) -> None:
    """Let ROLE do what a job needs: read and write control-plane tables (no DDL)."""
    _report_grants(obj, role, schema.grant_writer(obj.conn(), role))


def _report_grants(obj, role: str, granted: list[str]) -> None:
    emit(obj, {"role": role, "granted": granted}, "\n".join(f"granted {g} to {role}" for g in granted))


COMMANDS = [db_group]
