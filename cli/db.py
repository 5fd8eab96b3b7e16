"""``icebarrier db``: schema migrations and role grants."""

from __future__ import annotations

import click

from icebarrier.cli.render import emit
from icebarrier.control_plane import db as cp_db
from icebarrier.control_plane import replication, schema_version
from icebarrier.control_plane.model import parse_job_name


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
    """Show the schema's current revision against the migrations' head, and every pair of
    tables whose locations overlap (left by versions that did not confine locations)."""
    settings = obj.settings()
    with cp_db.connect(settings.dsn, settings.schema, check_schema=False) as conn:
        st = schema_version.status(conn, cp_db.schema_of(conn))
        pairs = _overlapping_locations(conn, settings) if st.up_to_date else []
    state = "up to date" if st.up_to_date else "out of date: run `icebarrier db upgrade`"
    lines = [f"schema {st.schema}: current {st.current or '(none)'}, head {st.head} ({state})"]
    lines += [
        f"table {inner.table} at {inner.location} lies under table {outer.table}'s location; move one of "
        f"them (drop and register elsewhere) before purging or expiring either"
        for outer, inner in pairs
    ]
    found = replication.standbys(settings.dsn)
    lines += [
        f"standby {s.host}:{s.port}: replays " + ("nothing yet" if s.lag_s is None else f"{s.lag_s:.1f} s behind")
        for s in found
    ]
    replication.check_lag(found)  # past the bound: one line, exit 1
    payload = {
        **st.to_json(),
        "overlapping_locations": [
            {"table": inner.table, "location": inner.location, "under": outer.table, "under_location": outer.location}
            for outer, inner in pairs
        ],
        "standbys": [s.to_json() for s in found],
    }
    emit(obj, payload, "\n".join(lines))


def _overlapping_locations(conn, settings) -> list:
    from icebarrier.iceberg_ext import locations

    if (
        not settings.is_default_catalog
        or conn.execute(
            "SELECT to_regclass(%s) IS NULL AS missing", (f"{settings.catalog_schema}.iceberg_tables",)
        ).fetchone()["missing"]
    ):
        return []
    read = locations.reader(settings.pyiceberg_properties())
    return locations.overlapping(locations.catalog_tables(conn, settings.catalog_schema, settings.catalog, read))


@db_group.command("grant-reader")
@click.argument("role")
@click.pass_obj
def grant_reader(obj, role: str) -> None:
    """Let ROLE read: the control-plane views and tables, cuts, leases of its own (TTL capped by
    the lease_max_ttl_ms setting), and the Iceberg catalog (no writes). Run as the admin."""
    from icebarrier.iceberg_ext.catalog import grant

    _report_grants(obj, grant(obj.settings(), role))


@db_group.command("grant-job")
@click.argument("role")
@click.argument("job")
@click.pass_obj
def grant_job(obj, role: str, job: str) -> None:
    """Let ROLE act for JOB: register and complete it, record its input ranges, hold leases of
    its own, and commit to JOB's sinks (and to unmanaged tables) through the Iceberg catalog.
    Nothing else: not another job's barriers, commits or leases. Run as the admin."""
    from icebarrier.iceberg_ext.catalog import grant

    _report_grants(obj, grant(obj.settings(), role, job=parse_job_name(job)))


def _report_grants(obj, done) -> None:
    emit(obj, done.to_json(), "\n".join(f"granted {g} to {done.role}" for g in done.granted))


COMMANDS = [db_group]
