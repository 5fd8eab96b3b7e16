"""The Iceberg side through PyIceberg (no JVM): catalog, tables, barrier-tagged snapshots.

The control plane's barrier -> snapshot map is the source of truth; the snapshot summary
properties below are the copy that lets it be rebuilt and lets a crashed job find its own
commit.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import cast

from icebarrier.control_plane import upkeep
from icebarrier.control_plane.errors import IcebarrierError, SnapshotExpiredError
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext import pyiceberg_fixes
from icebarrier.iceberg_ext.config import Settings

SUMMARY_BARRIER = "icebarrier.barrier"
SUMMARY_JOB = "icebarrier.job"
SUMMARY_RUN = "icebarrier.run"
SUMMARY_OPERATION = "icebarrier.operation"
# On a commit that coalesced barriers: the job's progress before it (the barriers strictly
# between it and icebarrier.barrier were coalesced; DESIGN.md, "Cost follows change").
SUMMARY_COALESCED_AFTER = "icebarrier.coalesced-after"
# A root job's input range as JSON, in a commit made through the catalog (job exec): the catalog
# records it in the control plane in the transaction that publishes the barrier.
SUMMARY_INPUT_RANGE = "icebarrier.input-range"
OPERATION_COMPACTION = "compaction"
OPERATION_REVISION = "revision"

# Properties every managed table gets: busy tables need more commit retries (bounded).
MANAGED_TABLE_PROPERTIES = {
    "commit.retry.num-retries": "20",
    "commit.retry.min-wait-ms": "20",
    "commit.retry.max-wait-ms": "2000",
    "commit.retry.total-timeout-ms": str(upkeep.COMMIT_RETRY_S * 1000),  # the least metadata grace
    # Iceberg keeps the last 100 metadata files in every metadata file's log; nothing of ours reads
    # them, and at 1-s barriers 100 of them are 100 s of history every commit rewrites and every
    # load parses (a fifth of a maintained table's metadata file). Older ones go with orphans.
    "write.metadata.previous-versions-max": "20",
}


class IcebergTableNotFoundError(IcebarrierError):
    def __init__(self, table: TableName) -> None:
        self.table = table
        super().__init__(f"Iceberg table {table} does not exist in catalog {table.catalog}; create it first")


class CatalogMismatchError(IcebarrierError):
    def __init__(self, table: TableName, catalog: str) -> None:
        super().__init__(
            f"table {table} is in catalog {table.catalog}, but icebarrier is configured for catalog {catalog}; "
            f"set ICEBARRIER_CATALOG={table.catalog} or use {catalog}.<namespace>.<table>"
        )


@functools.lru_cache(maxsize=8)
def _catalog(name: str, props: tuple[tuple[str, str], ...]):
    from pyiceberg.catalog import load_catalog

    return load_catalog(name, **dict(props))


def load_catalog(settings: Settings):
    """The PyIceberg catalog named like Spark's, so both see the same tables."""
    try:
        import pyiceberg  # noqa: F401
    except ImportError:
        raise IcebarrierError("this needs PyIceberg; pip install 'icebarrier[iceberg]'") from None
    settings.require_catalog_schema()
    return _catalog_of(settings)


def catalog_properties(settings: Settings) -> dict[str, str]:
    """The properties of the catalog :func:`load_catalog` makes (PyIceberg's configuration for
    its name, then ours, merged as PyIceberg merges them), without making it: its FileIO's."""
    from pyiceberg.utils.config import Config, merge_config

    ours: dict = settings.pyiceberg_properties()
    return cast(dict[str, str], merge_config(Config().get_catalog_config(settings.catalog) or {}, ours))


def _catalog_of(settings: Settings, *, cached: bool = True):
    make = _catalog if cached else _catalog.__wrapped__
    return make(settings.catalog, tuple(sorted(settings.pyiceberg_properties().items())))


def upgrade(settings: Settings):
    """Everything ``icebarrier db upgrade`` does: migrate the control-plane schema, then create
    the default catalog's schema and tables and the local warehouse folder, so plain Spark with
    ``icebarrier spark-conf`` works right after. Idempotent. Returns the schema status."""
    from icebarrier.control_plane import schema

    settings.check_storage()  # a wrong bucket, endpoint or key: one line, before anything is written
    status = schema.upgrade(settings.dsn, settings.schema)
    settings.ensure_catalog_schema()
    try:
        import pyiceberg  # noqa: F401
    except ImportError:
        return status  # Spark's JDBC catalog creates its tables in the schema on first use
    # Constructing the SQL catalog creates its tables; not the cached one: leave no session open.
    _catalog_of(settings, cached=False).engine.dispose()
    secure_catalog(settings)
    watch_pointers(settings)
    return status


# Row-level security on the SQL catalog's pointer table (DESIGN.md, "Who may do what"): a job
# role inserts and updates only the rows of its jobs' sinks and of unmanaged tables (a refused
# write raises, naming the writer, so Iceberg fails fast instead of retrying a lost commit);
# deletes silently skip rows it may not write; everyone may read.
_POLICIES = """
ALTER TABLE {cs}.iceberg_tables ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS icebarrier_read ON {cs}.iceberg_tables;
DROP POLICY IF EXISTS icebarrier_insert ON {cs}.iceberg_tables;
DROP POLICY IF EXISTS icebarrier_update ON {cs}.iceberg_tables;
DROP POLICY IF EXISTS icebarrier_delete ON {cs}.iceberg_tables;
CREATE POLICY icebarrier_read ON {cs}.iceberg_tables FOR SELECT USING (true);
CREATE POLICY icebarrier_insert ON {cs}.iceberg_tables FOR INSERT
    WITH CHECK ({s}.check_catalog_write(catalog_name, table_namespace, table_name));
CREATE POLICY icebarrier_update ON {cs}.iceberg_tables FOR UPDATE USING (true)
    WITH CHECK ({s}.check_catalog_write(catalog_name, table_namespace, table_name));
CREATE POLICY icebarrier_delete ON {cs}.iceberg_tables FOR DELETE
    USING ({s}.may_write_catalog_table(catalog_name, table_namespace, table_name));
"""


# Every change of a pointer row is announced when its transaction commits, on the catalog's
# channel (notices.pointers_channel): a catalog server keeps pointers in memory
# (apps/catalog/load_cache.py, which checks the trigger is there). The function lives with the
# table, not in a control plane's schema: control planes may share a catalog, and dropping one
# must not silence it.
POINTER_TRIGGER = "icebarrier_pointer_moved"
_ANNOUNCE = """
LOCK TABLE {cs}.iceberg_tables IN SHARE ROW EXCLUSIVE MODE;  -- one (re)creation at a time
CREATE OR REPLACE FUNCTION {cs}.{trigger}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM pg_notify({channel}, json_build_array(OLD.catalog_name, OLD.table_namespace, OLD.table_name)::text);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify({channel}, json_build_array(NEW.catalog_name, NEW.table_namespace, NEW.table_name)::text);
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER {trigger} AFTER INSERT OR UPDATE OR DELETE ON {cs}.iceberg_tables
    FOR EACH ROW EXECUTE FUNCTION {cs}.{trigger}();
"""


# Where every table lies, for the check that no two tables' locations overlap
# (iceberg_ext/locations.py): a row a table, its normalized location indexed in byte order (C), so a
# placement probes the new location's ancestors and descendants instead of reading every table. A
# server keeps the rows: this trigger marks each pointer row inserted, deleted or renamed, or moved
# out of its ``metadata`` folder, and the next placement places the marked rows again. A commit that
# writes its metadata file beside the last leaves no mark (the pointer implies the same location),
# so a lake's commits cost nothing here. The function runs as its owner: a job role that writes
# pointers needs no grant on the marks. Rows no placement holds yet (a catalog written before) are
# marked when this is (re)created.
PLACEMENT_TRIGGER = "icebarrier_placement_changed"  # a row inserted or deleted
PLACEMENT_MOVED_TRIGGER = "icebarrier_placement_moved"  # a row renamed or moved
_PLACEMENTS = """
CREATE TABLE IF NOT EXISTS {cs}.icebarrier_placement (
    catalog_name text NOT NULL, table_namespace text NOT NULL, table_name text NOT NULL,
    location text COLLATE "C" NOT NULL,
    CONSTRAINT icebarrier_placement_pkey PRIMARY KEY (catalog_name, table_namespace, table_name));
CREATE INDEX IF NOT EXISTS icebarrier_placement_location ON {cs}.icebarrier_placement (catalog_name, location);
CREATE TABLE IF NOT EXISTS {cs}.icebarrier_placement_mark (
    catalog_name text NOT NULL, table_namespace text NOT NULL, table_name text NOT NULL,
    CONSTRAINT icebarrier_placement_mark_pkey PRIMARY KEY (catalog_name, table_namespace, table_name));
CREATE OR REPLACE FUNCTION {cs}.{marks}() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        INSERT INTO {cs}.icebarrier_placement_mark VALUES (OLD.catalog_name, OLD.table_namespace, OLD.table_name)
            ON CONFLICT DO NOTHING;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        INSERT INTO {cs}.icebarrier_placement_mark VALUES (NEW.catalog_name, NEW.table_namespace, NEW.table_name)
            ON CONFLICT DO NOTHING;
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER {marks} AFTER INSERT OR DELETE ON {cs}.iceberg_tables
    FOR EACH ROW EXECUTE FUNCTION {cs}.{marks}();
CREATE OR REPLACE TRIGGER {moved} AFTER UPDATE ON {cs}.iceberg_tables FOR EACH ROW
    WHEN ((OLD.catalog_name, OLD.table_namespace, OLD.table_name)
              IS DISTINCT FROM (NEW.catalog_name, NEW.table_namespace, NEW.table_name)
          OR NOT coalesce(NEW.metadata_location ~ './metadata/[^/]*$'
                          AND regexp_replace(OLD.metadata_location, '/[^/]*$', '')
                              = regexp_replace(NEW.metadata_location, '/[^/]*$', ''), false))
    EXECUTE FUNCTION {cs}.{marks}();
INSERT INTO {cs}.icebarrier_placement_mark
    SELECT catalog_name, table_namespace, table_name FROM {cs}.iceberg_tables t WHERE NOT EXISTS (
        SELECT 1 FROM {cs}.icebarrier_placement p WHERE (p.catalog_name, p.table_namespace, p.table_name)
            = (t.catalog_name, t.table_namespace, t.table_name))
    UNION SELECT catalog_name, table_namespace, table_name FROM {cs}.icebarrier_placement p WHERE NOT EXISTS (
        SELECT 1 FROM {cs}.iceberg_tables t WHERE (p.catalog_name, p.table_namespace, p.table_name)
            = (t.catalog_name, t.table_namespace, t.table_name))
    ON CONFLICT DO NOTHING;
"""


def watch_pointers(settings: Settings) -> None:
    """The default SQL catalog's pointer table announces its changes and marks the placements
    they move, and the placements are brought up to date (idempotent; its tables exist)."""
    from psycopg import sql

    from icebarrier.control_plane import db
    from icebarrier.control_plane.notices import pointers_channel
    from icebarrier.iceberg_ext import locations

    if not settings.is_default_catalog:
        return
    _catalog_ddl(
        settings,
        _ANNOUNCE + _PLACEMENTS,
        trigger=sql.Identifier(POINTER_TRIGGER),
        channel=sql.Literal(pointers_channel(settings.catalog_schema)),
        marks=sql.Identifier(PLACEMENT_TRIGGER),
        moved=sql.Identifier(PLACEMENT_MOVED_TRIGGER),
    )
    read = locations.reader(settings.pyiceberg_properties())
    with db.connect(settings.dsn, settings.schema) as conn:
        with conn.transaction():
            db.advisory_lock(conn, locations.LOCK, [0], what="placing the catalog's tables")
            placed = locations.refresh(conn, settings.catalog_schema, settings.catalog, read)
        if placed > 1000:  # a catalog written before: its marks' dead rows would slow each placement for a while
            conn.execute(
                sql.SQL("VACUUM {}").format(sql.Identifier(settings.catalog_schema, "icebarrier_placement_mark"))
            )


def secure_catalog(settings: Settings) -> None:
    """Guard the default SQL catalog's pointer table with row-level security (idempotent)."""
    from psycopg import sql

    _catalog_ddl(settings, _POLICIES, s=sql.Identifier(settings.schema))


def _catalog_ddl(settings: Settings, template: str, **values) -> None:
    """``template`` on the default SQL catalog's schema (``{cs}``) in one transaction; nothing
    for another catalog."""
    import psycopg
    from psycopg import sql

    if not settings.is_default_catalog:
        return
    ddl = sql.SQL(template).format(cs=sql.Identifier(settings.catalog_schema), **values)
    with psycopg.connect(settings.dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(ddl)


def grant(settings: Settings, role: str, *, job: str | None = None):
    """``db grant-job ROLE JOB`` (with ``job``) or ``db grant-reader ROLE``: the control-plane
    grants and the catalog's (a job role writes the pointer table under its row-level security,
    a reader only reads it), in one transaction, each verified. Returns the ``schema.Grant``."""
    from dataclasses import replace

    import psycopg
    from psycopg import sql

    from icebarrier.control_plane import db, schema

    with db.connect(settings.dsn, settings.schema) as conn, conn.transaction():
        done = schema.grant_job(conn, role, job) if job else schema.grant_reader(conn, role)
        if not settings.is_default_catalog:
            return done
        cs, r = settings.catalog_schema, sql.Identifier(role)
        tables, props = (sql.Identifier(cs, t) for t in ("iceberg_tables", "iceberg_namespace_properties"))
        statements = [
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(cs), r),
            sql.SQL("GRANT SELECT ON {}, {} TO {}").format(tables, props, r),
        ]
        checks = [
            (f"USAGE ON SCHEMA {cs}", "has_schema_privilege(%s, %s, 'USAGE')", (cs,)),
            (f"SELECT ON {cs}.iceberg_tables", "has_table_privilege(%s, %s, 'SELECT')", (f"{cs}.iceberg_tables",)),
        ]
        if job:
            statements += [
                sql.SQL(
                    "GRANT INSERT, DELETE, UPDATE (metadata_location, previous_metadata_location) ON {} TO {}"
                ).format(tables, r),
                sql.SQL("GRANT INSERT, UPDATE, DELETE ON {} TO {}").format(props, r),
            ]
            checks += [
                (f"INSERT ON {cs}.iceberg_tables", "has_table_privilege(%s, %s, 'INSERT')", (f"{cs}.iceberg_tables",)),
                (
                    f"UPDATE (metadata_location) ON {cs}.iceberg_tables",
                    "has_column_privilege(%s, %s, 'metadata_location', 'UPDATE')",
                    (f"{cs}.iceberg_tables",),
                ),
            ]
        try:
            for statement in statements:
                conn.execute(statement)
        except psycopg.errors.UndefinedTable:
            raise IcebarrierError(
                f"the Iceberg catalog tables in schema {cs!r} do not exist; run `icebarrier db upgrade` first"
            ) from None
        schema.require_granted(conn, role, checks)
        return replace(done, granted=(*done.granted, *(what for what, _, _ in checks)))


def stages_commits(catalog, sinks) -> bool:
    """Does this catalog stage a multi-sink job's commits until the barrier is published
    (``icebarrier serve``, reached as a REST catalog with a job token)?"""
    from pyiceberg.catalog.rest import RestCatalog

    return isinstance(catalog, RestCatalog) and len(sinks) > 1


def publish_barrier(catalog, sinks) -> None:
    """Publish the barrier a multi-sink job staged through ``icebarrier serve``: one transaction
    naming all its sinks with no changes; the server swaps every staged pointer and completes
    the barrier at once."""
    body = {
        "table-changes": [
            {"identifier": {"namespace": list(t.namespace), "name": t.name}, "requirements": [], "updates": []}
            for t in sorted(sinks)
        ]
    }
    response = catalog._session.post(catalog.url("transactions/commit"), json=body)
    if response.status_code != 204:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        raise IcebarrierError(f"publishing the barrier through the catalog failed ({response.status_code}): {message}")


def load_table(catalog, table: TableName):
    from pyiceberg.exceptions import NoSuchTableError

    pyiceberg_fixes.install()
    if table.catalog != catalog.name:
        raise CatalogMismatchError(table, catalog.name)
    try:
        return catalog.load_table(table.identifier)
    except NoSuchTableError:
        raise IcebergTableNotFoundError(table) from None


def create_table(catalog, table: TableName, schema, *, properties: dict[str, str] | None = None):
    """Create a managed table (namespace too) with icebarrier's table properties."""
    if table.catalog != catalog.name:
        raise CatalogMismatchError(table, catalog.name)
    catalog.create_namespace_if_not_exists(table.identifier[:-1])
    return catalog.create_table_if_not_exists(
        table.identifier, schema=schema, properties={**MANAGED_TABLE_PROPERTIES, **(properties or {})}
    )


def ensure_managed_properties(tbl):
    """Give a table icebarrier's commit-retry properties if it lacks them (one metadata commit)."""
    missing = {k: v for k, v in MANAGED_TABLE_PROPERTIES.items() if k not in tbl.properties}
    if missing:
        with tbl.transaction() as tx:
            tx.set_properties(missing)
    return tbl


def summary_properties(snapshot) -> dict[str, str]:
    summary = snapshot.summary
    if summary is None:
        return {}
    return dict(summary.additional_properties)


def barrier_of(snapshot) -> int | None:
    value = summary_properties(snapshot).get(SUMMARY_BARRIER)
    return int(value) if value is not None else None


def input_range_of(snapshot) -> dict | None:
    """The input range a commit carries for the control plane (:data:`SUMMARY_INPUT_RANGE`), if any."""
    text = summary_properties(snapshot).get(SUMMARY_INPUT_RANGE)
    if text is None:
        return None
    try:
        spec = json.loads(text)
    except ValueError:
        return None
    return spec if isinstance(spec, dict) else None


def coalesced_after(snapshot) -> int | None:
    """The progress a coalescing commit started from (None: an exact commit)."""
    value = summary_properties(snapshot).get(SUMMARY_COALESCED_AFTER)
    return int(value) if value is not None else None


def is_compaction(snapshot) -> bool:
    return summary_properties(snapshot).get(SUMMARY_OPERATION) == OPERATION_COMPACTION


def ancestors(table, snapshot, *, stop_at: int | None = None) -> Iterator:
    """``snapshot`` and its ancestors, newest first, up to (not including) ``stop_at``."""
    while snapshot is not None and snapshot.snapshot_id != stop_at:
        yield snapshot
        snapshot = table.snapshot_by_id(snapshot.parent_snapshot_id) if snapshot.parent_snapshot_id else None


def lineage(table) -> Iterator:
    """The current snapshot and its ancestors, newest first (rolled-back branches excluded)."""
    return ancestors(table, table.current_snapshot())


def find_barrier_commit(table, barrier: int) -> int | None:
    """The data snapshot carrying ``barrier`` in the table's current lineage, if any.

    Used before writing (exactly once per (table, barrier)): a crash between the Iceberg
    commit and the control-plane record leaves such a snapshot to adopt. Only the current
    lineage counts, so snapshots undone by a revision are never adopted.
    """
    for snapshot in lineage(table):
        b = barrier_of(snapshot)
        if b is None:
            continue
        if b == barrier and not is_compaction(snapshot):
            return snapshot.snapshot_id
        if b < barrier:
            return None
    return None


COMMIT_ATTEMPTS = 10


@functools.cache
def outages() -> tuple[type[BaseException], ...]:
    """What losing the control plane's Postgres (a restart, a failover: the primary gone, a
    standby not yet promoted) raises, through our own connections and the SQL catalog's
    (SQLAlchemy's) alike: a component that meets one waits and tries again."""
    import psycopg
    import sqlalchemy.exc

    from icebarrier.control_plane.errors import ControlPlaneUnavailableError

    return (
        psycopg.OperationalError,
        psycopg.InterfaceError,
        ControlPlaneUnavailableError,
        sqlalchemy.exc.OperationalError,
        sqlalchemy.exc.InterfaceError,
        sqlalchemy.exc.PendingRollbackError,
    )


def lost_race(exc: BaseException) -> bool:
    """Whether a commit failed because another commit won: PyIceberg's CommitFailedException, or
    Spark's and Iceberg's own (a rewrite or a MERGE validated against files another commit
    replaced)."""
    from pyiceberg.exceptions import CommitFailedException

    if isinstance(exc, CommitFailedException):
        return True
    text = str(exc)
    return any(
        marker in text
        for marker in ("ValidationException", "CommitFailedException", "Cannot commit", "missing data files")
    )


def retry_commit(fn, *, attempts: int = COMMIT_ATTEMPTS):
    """Run a commit, retrying (bounded, with backoff) when another commit won (:func:`lost_race`:
    the table's only other writer is maintenance, whose compaction a MERGE or an overwrite may
    have to be planned again over); ``fn`` must reload the table itself (a Spark write plans
    again against the table as it is). Spark retries plain conflicts on its own
    (commit.retry.*); what reaches here is a validation its retries could not pass."""
    import random
    import time

    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == attempts or not lost_race(exc):
                raise
            time.sleep(min(2.0, 0.02 * 2**attempt) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def require_snapshots(catalog, snapshots: dict[TableName, int | None], barrier: int | None = None) -> None:
    """Raise :class:`SnapshotExpiredError` if a snapshot no longer exists in its table."""
    for name, snapshot_id in snapshots.items():
        if snapshot_id is not None and load_table(catalog, name).snapshot_by_id(snapshot_id) is None:
            raise SnapshotExpiredError(str(name), snapshot_id, barrier)


def names_breaking_rule(settings) -> list[tuple[str, str, str]]:
    """(kind, name, why) of every namespace and table in the SQL catalog whose name breaks the
    names rule (:func:`icebarrier.control_plane.model.check_name`): earlier versions let some
    through. A namespace is stored dotted, its levels escaped (:func:`~icebarrier.control_plane.model.sql_namespace`):
    one that splits into a level the rule refuses (a blank one), or holds a '%' icebarrier would
    not have stored (it cannot name it), is listed."""
    from psycopg import sql

    from icebarrier.control_plane import db
    from icebarrier.control_plane.errors import InvalidNameError
    from icebarrier.control_plane.model import check_name, check_namespace, namespace_from_sql, sql_namespace

    cs = sql.Identifier(settings.catalog_schema)
    found = []
    with db.connect(settings.dsn, settings.schema) as conn:
        namespaces = conn.execute(
            sql.SQL(
                "SELECT namespace AS ns FROM {}.iceberg_namespace_properties WHERE catalog_name = %(c)s "
                "UNION SELECT table_namespace FROM {}.iceberg_tables WHERE catalog_name = %(c)s ORDER BY 1"
            ).format(cs, cs),
            {"c": settings.catalog},
        ).fetchall()
        tables = conn.execute(
            sql.SQL(
                "SELECT table_namespace AS ns, table_name AS name FROM {}.iceberg_tables WHERE catalog_name = %s "
                "ORDER BY 1, 2"
            ).format(cs),
            (settings.catalog,),
        ).fetchall()
    for row in namespaces:
        try:
            levels = check_namespace(namespace_from_sql(row["ns"]))
        except InvalidNameError as exc:
            found.append(("namespace", row["ns"], str(exc)))
            continue
        if sql_namespace(levels) != row["ns"]:
            found.append(
                (
                    "namespace",
                    row["ns"],
                    "holds a '%' that is not %25 or %2E (how '%' and '.' inside a level are stored)",
                )
            )
    for row in tables:
        try:
            check_name(row["name"])
        except InvalidNameError as exc:
            found.append(("table", f"{row['ns']}.{row['name']}", str(exc)))
    return found


def pointers(conn, settings, only=None) -> dict:
    """Every table of the SQL catalog (TableName -> its metadata location), managed or not, or
    (``only``, a TableName) that one if it exists; a table whose name icebarrier cannot spell
    (outside the names rule) is left out."""
    from psycopg import sql

    from icebarrier.control_plane.errors import IcebarrierError
    from icebarrier.control_plane.model import TableName, check_name, check_namespace

    rows = conn.execute(
        sql.SQL(
            "SELECT table_namespace AS ns, table_name AS name, metadata_location FROM {}.iceberg_tables "
            "WHERE catalog_name = %s AND metadata_location IS NOT NULL AND (iceberg_type = 'TABLE' OR iceberg_type IS NULL)"
            + (" AND table_namespace = %s AND table_name = %s" if only is not None else "")
        ).format(sql.Identifier(settings.catalog_schema)),
        (settings.catalog, *((only.sql_namespace, only.name) if only is not None else ())),
    ).fetchall()
    found = {}
    for row in rows:
        try:
            name = TableName.from_sql_catalog(settings.catalog, row["ns"], row["name"])
            check_namespace(name.namespace)
            check_name(name.name)
        except IcebarrierError:
            continue
        found[name] = row["metadata_location"]
    return found
