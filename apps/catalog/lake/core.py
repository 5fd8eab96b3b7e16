"""The lake's storage primitives: the SQL catalog (PyIceberg) and its pointer rows in the
control-plane database, metadata files (cached: they are immutable), names and writers. A job's
staged (unpublished) commits are :mod:`.staging`'s.
"""

from __future__ import annotations

import contextvars
import functools
import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import quote

import psycopg
from psycopg import sql
from pyiceberg.exceptions import ViewAlreadyExistsError
from pyiceberg.utils.config import Config

from icebarrier.apps.catalog.delegation import (
    REFRESH_ENDPOINT,
    Delegation,
    ScopedVendor,
    SessionVendor,
    storage_credential,
)
from icebarrier.apps.catalog.errors import ForbiddenError
from icebarrier.apps.catalog.load_cache import Listed, LoadCache
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import audit, db, jobs
from icebarrier.control_plane.errors import ConfigurationError, IcebarrierError
from icebarrier.control_plane.model import TableName, sql_namespace
from icebarrier.control_plane.tokens import Principal
from icebarrier.iceberg_ext import locations
from icebarrier.iceberg_ext import storage as s3
from icebarrier.iceberg_ext.catalog import catalog_properties, load_catalog
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.scan_planning import PLAN_SUBMIT_ABOVE, ManifestCache

LATEST = Warehouse("latest")


_MEMORY_ONLY = contextvars.ContextVar("icebarrier_memory_only", default=False)


class NeedsStorage(Exception):
    """Work under :func:`memory_only` needed a file (a metadata file not cached yet, a pinned
    response to write): do it where blocking is fine."""


@contextmanager
def memory_only() -> Iterator[None]:
    """Within: a cache miss raises :class:`NeedsStorage` instead of reading or writing a file
    (the catalog serves a load on its event loop only while Postgres and memory suffice)."""
    token = _MEMORY_ONLY.set(True)
    try:
        yield
    finally:
        _MEMORY_ONLY.reset(token)


class _LRU:
    """A small thread-safe LRU for immutable values (metadata files, their JSON, pinned files)."""

    def __init__(self, size: int) -> None:
        self.size, self.lock = size, threading.Lock()
        self.items: OrderedDict[object, object] = OrderedDict()

    def get(self, key, make, *, storage: bool = True):
        """The value of ``key``, made by ``make`` if it is not here (``storage``: making it reads
        or writes a file, which :func:`memory_only` refuses)."""
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        if storage and _MEMORY_ONLY.get():
            raise NeedsStorage(key)
        value = make()
        with self.lock:
            self.items[key] = value
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return value


def around_metadata(location: str, metadata_json: bytes, *fields: bytes) -> bytes:
    """A response's JSON that carries a table's metadata (a load's, a commit's) spliced around the
    metadata's cached bytes: ``metadata-location``, ``metadata``, then ``fields`` (each
    ``,"name":value``)."""
    return b"".join(
        (b'{"metadata-location":', json.dumps(location).encode(), b',"metadata":', metadata_json, *fields, b"}")
    )


VIEW = "VIEW"  # iceberg_tables.iceberg_type of a view (tables and views share one name space)


def java_name(table: TableName) -> str:
    """A name as Iceberg's reference messages print it (``ns.table``), which clients match (the
    REST Compatibility Kit asserts how such messages start)."""
    return ".".join(table.levels)


def _catalog_sql(catalog_schema: str, text: str) -> str:
    """SQL over the SQL catalog's tables, ``{cs}`` being its schema."""
    return sql.SQL(text).format(cs=sql.Identifier(catalog_schema)).as_string(None)


@dataclass(frozen=True, slots=True)
class TableState:
    managed: bool
    writer: str | None  # the job writing it (a managed table may have none)
    location: str | None  # its metadata's (None: no such table, or not asked)


class LakeCore:
    """The server's view of the lake: the SQL catalog (PyIceberg) plus the control plane."""

    def __init__(
        self,
        settings: Settings,
        *,
        quiet_ms: int,
        pool_size: int = 8,
        allowed_locations: Iterable[str] = (),
        scan_planning: str = "client",
        plan_submit_above: int = PLAN_SUBMIT_ABOVE,
    ) -> None:
        if not settings.is_default_catalog:
            raise IcebarrierError(
                "icebarrier serve serves the default SQL catalog in the control-plane database; "
                "remove [catalog_properties] from the configuration"
            )
        settings.check_storage()
        s3.make_local(settings.warehouse)  # a local warehouse's folder, if nothing made it yet
        self.settings = settings
        self.scan_planning = scan_planning  # where clients plan scans by default (`serve --scan-planning`)
        self.manifest_cache = ManifestCache()  # every plan's manifests, read once (scan_planning)
        self.plan_submit_above = plan_submit_above  # data manifests past which a plan is answered submitted
        self.sessions = SessionVendor(settings.storage) if settings.storage.session_duration_s else None
        self.scoped = ScopedVendor(settings.storage) if settings.storage.session_role_arn else None
        if self.scoped is not None:
            self.scoped.check(settings.warehouse)
        settings.require_catalog_schema()
        self.properties = catalog_properties(settings)  # the catalog's, its FileIO's
        self.pool = db.pool(settings.dsn, settings.schema, max_size=pool_size)
        with self.pool.connection() as conn:
            placements = sql.Identifier(settings.catalog_schema, "icebarrier_placement").as_string(conn)
            if conn.execute("SELECT to_regclass(%s) IS NULL AS missing", (placements,)).fetchone()["missing"]:
                self.pool.close()
                raise ConfigurationError(
                    f"the SQL catalog has no table placements ({placements}), which the location checks read; "
                    f"run `icebarrier db upgrade`"
                )
        self.async_pool = db.async_pool(settings.dsn, settings.schema)  # loads; opened on the server's loop
        self.quiet_ms = quiet_ms
        self.load_cache = LoadCache(settings.dsn, settings.schema, settings.catalog_schema, quiet_ms=quiet_ms)
        self.confinement = locations.Confinement.of(settings.warehouse, allowed_locations)
        self.metadata_cache = _LRU(4096)  # location: (metadata, io)
        self.metadata_json_cache = _LRU(4096)  # location: (its JSON, the table's location)
        self.pinned_cache = _LRU(8192)  # (table uuid, snapshot): (pinned location, its JSON, the table's location)
        self._legacy_metadata = bool(Config().get_bool("legacy-current-snapshot-id"))
        in_catalog = functools.partial(_catalog_sql, settings.catalog_schema)
        self._pointer_sql = in_catalog(
            "SELECT metadata_location FROM {cs}.iceberg_tables WHERE catalog_name = %s AND table_namespace = %s "
            "AND table_name = %s AND coalesce(iceberg_type, 'TABLE') = 'TABLE'"
        )
        self._state_sql = in_catalog(
            "SELECT m.table_id IS NOT NULL AS managed, j.name AS writer, CASE WHEN %(pointer)s THEN "
            "(SELECT metadata_location FROM {cs}.iceberg_tables WHERE catalog_name = %(catalog)s "
            "AND table_namespace = %(namespace)s AND table_name = %(table)s "
            "AND coalesce(iceberg_type, 'TABLE') = 'TABLE') END AS location "
            "FROM (SELECT 1) x LEFT JOIN managed_table m ON m.name = %(name)s "
            "LEFT JOIN job_sink k ON k.table_id = m.table_id LEFT JOIN job j ON j.job_id = k.job_id AND j.active"
        )
        self._names_sql = in_catalog(
            "SELECT table_name, coalesce(iceberg_type, 'TABLE') = 'VIEW' AS view FROM {cs}.iceberg_tables "
            "WHERE catalog_name = %s AND table_namespace = %s ORDER BY table_name"
        )
        self._swap_sql = in_catalog(
            "UPDATE {cs}.iceberg_tables SET metadata_location = %s, previous_metadata_location = %s "
            "WHERE catalog_name = %s AND table_namespace = %s AND table_name = %s AND metadata_location = %s"
        )
        self._kind_sql = in_catalog(
            "SELECT coalesce(iceberg_type, 'TABLE') AS kind, metadata_location FROM {cs}.iceberg_tables "
            "WHERE catalog_name = %s AND table_namespace = %s AND table_name = %s"
        )
        # whether a namespace exists, as PyIceberg's SQL catalog decides it (a table in it or under
        # it, or a property), and its location property
        self._namespace_sql = in_catalog(
            # in this order, each asked only if those before found nothing: the exact ones by index,
            # the prefix ones (a namespace that only holds namespaces) by scanning
            "SELECT EXISTS (SELECT 1 FROM {cs}.iceberg_namespace_properties WHERE catalog_name = %(catalog)s "
            "AND namespace = %(namespace)s) "
            "OR EXISTS (SELECT 1 FROM {cs}.iceberg_tables WHERE catalog_name = %(catalog)s "
            "AND table_namespace = %(namespace)s) "
            "OR EXISTS (SELECT 1 FROM {cs}.iceberg_namespace_properties WHERE catalog_name = %(catalog)s "
            "AND namespace LIKE %(under)s ESCAPE '!') "
            "OR EXISTS (SELECT 1 FROM {cs}.iceberg_tables WHERE catalog_name = %(catalog)s "
            "AND table_namespace LIKE %(under)s ESCAPE '!') AS found, "
            "(SELECT property_value FROM {cs}.iceberg_namespace_properties WHERE catalog_name = %(catalog)s "
            "AND namespace = %(namespace)s AND property_key = 'location') AS location"
        )
        self._insert_sql = in_catalog(
            "INSERT INTO {cs}.iceberg_tables (catalog_name, table_namespace, table_name, metadata_location, "
            "previous_metadata_location, iceberg_type) VALUES (%s, %s, %s, %s, NULL, 'TABLE')"
        )

    async def open(self) -> None:
        await self.async_pool.open()
        await self.load_cache.start(self.async_pool)

    async def aclose(self) -> None:
        await self.load_cache.stop()
        await self.async_pool.close()

    def close(self) -> None:
        self.pool.close()

    async def check_connections(self) -> None:
        """Drop every pooled connection an outage killed (both pools)."""
        from starlette.concurrency import run_in_threadpool

        await run_in_threadpool(self.pool.check)
        await self.async_pool.check()

    def response(self, table: TableName, location: str, metadata, principal: Principal, access: Delegation, **where):
        """The LoadTableResult of ``metadata`` at ``location``, with the storage access the
        caller gets (:mod:`icebarrier.apps.catalog.delegation`; ``where``: as for :meth:`storage_access`)."""
        from pyiceberg.catalog.rest import TableResponse

        config, credentials = self.storage_access(table, metadata.location, principal, access, **where)
        response = TableResponse(metadata_location=location, metadata=metadata, config=config)
        return response.model_copy(update={"storage_credentials": credentials}) if credentials else response

    def storage_access(
        self,
        table: TableName,
        table_location: str,
        principal: Principal,
        access: Delegation,
        *,
        managed: bool,
        warehouse: str = "latest",
    ) -> tuple[dict[str, str], list[dict]]:
        """A LoadTableResult's ``config`` and ``storage-credentials``: the storage access the
        caller gets for ``table`` (at ``table_location``; ``managed``: whether it is, which decides
        whether a job's grant may write it; ``warehouse``: where it was loaded, for the refresh
        endpoint)."""
        storage = self.settings.storage
        scoped = None
        if self.scoped is not None:
            write = self.writes_files(principal, table, managed)
            scoped = functools.partial(self.scoped_credentials, table, table_location, principal, write, warehouse)
        config = access.config(
            storage, table_location, reader=principal.kind == "reader", sessions=self.sessions, scoped=scoped
        )
        if scoped is None or s3.SESSION_TOKEN not in config:
            return config, []
        keys = (*s3.SECRETS, s3.SESSION_TOKEN_EXPIRES_AT_MS, REFRESH_ENDPOINT)
        return config, [storage_credential(table_location, config, keys)]

    def writes_files(self, principal: Principal, table: TableName, managed: bool) -> bool:
        """Whether the caller's credentials for ``table`` may write: the job writing it (its
        sink), or a job granted to write an unmanaged table. An admin acting for a job (in its
        session) writes that job's sinks."""
        if principal.kind != "job":
            return False
        if principal.reach is None:
            with self.pool.connection() as conn:
                job = jobs.load_definitions(conn, only=principal.acting_job).get(principal.acting_job)
            return not managed or (job is not None and table in job.sinks)
        return str(table) in principal.reach.sinks or (not managed and principal.reach.writes(table))

    def scoped_credentials(
        self, table: TableName, table_location: str, principal: Principal, write: bool, warehouse: str
    ) -> dict[str, str]:
        """The table's own credentials (cached); one newly made is recorded in the audit trail."""
        assert self.scoped is not None
        if _MEMORY_ONLY.get() and self.scoped.cached(table_location, write=write) is None:
            raise NeedsStorage(table_location)  # STS and the audit trail: not on the event loop
        made = self.scoped.credentials(table_location, write=write)
        if made.made:
            with self.pool.connection() as conn, conn.transaction():
                audit.append(
                    conn,
                    "storage credentials",
                    job=principal.job,
                    table=str(table),
                    object=principal.client_id,
                    detail={"access": "write" if write else "read", "expires_at_ms": made.expires_at_ms},
                )
        namespace = quote("\x1f".join(table.namespace), safe="")
        endpoint = (
            f"v1/{quote(warehouse, safe='')}/namespaces/{namespace}/tables/{quote(table.name, safe='')}/credentials"
        )
        return {**made.config, REFRESH_ENDPOINT: endpoint}

    def table_name(self, namespace: tuple[str, ...], name: str) -> TableName:
        """The identifier as the client spelled it (the catalog is case-sensitive and allows
        any characters); only a name in icebarrier's canonical form can be managed."""
        return TableName(catalog=self.settings.catalog, namespace=tuple(namespace), name=name)

    @staticmethod
    def managed_key(table: TableName) -> str:
        """The table's name in the control plane (``str``: it reads back as the same table)."""
        return str(table)

    def writer_of(self, conn, table: TableName) -> tuple[bool, str | None]:
        """(is the table managed, its writer job)."""
        state = self.table_state(conn, table, pointer=False)
        return state.managed, state.writer

    def table_state(self, conn, table: TableName, *, pointer: bool = True) -> TableState:
        """Is the table managed, its writer job and (``pointer``) its metadata location, in one
        statement."""
        row = db.one(
            conn.execute(
                self._state_sql,
                {
                    "name": self.managed_key(table),
                    "pointer": pointer,
                    "catalog": table.catalog,
                    "namespace": table.sql_namespace,
                    "table": table.name,
                },
            )
        )
        return TableState(managed=row["managed"], writer=row["writer"], location=row["location"])

    @staticmethod
    def require_writer(principal: Principal, table: TableName, managed: bool, writer: str | None) -> None:
        """A managed table is written only by its writer job; another only with a write grant (or
        a whole-lake token). (Every route that writes takes a job principal: :func:`.deps.job_caller`
        refuses readers.)"""
        if managed and writer != principal.job:
            owner = f"job {writer}" if writer else "no job (it has no writer)"
            raise ForbiddenError(
                f"{principal.describe()} may not write {table}: it is written by {owner}; "
                f"commit with a token of {owner}"
            )
        if not managed:
            principal.require_write_unmanaged(table)

    async def names(self, namespace: tuple[str, ...]) -> Listed:
        """The namespace's tables' and views' names, each sorted (as PyIceberg's SQL catalog lists
        them), on the event loop: from the process's memory (:mod:`..load_cache`), else in one
        statement on the async pool, then kept; NoSuchNamespaceError if the namespace does not
        exist (an empty one is not kept: whether it still exists is not announced)."""
        from pyiceberg.exceptions import NoSuchNamespaceError

        cache, catalog, levels = self.load_cache, self.settings.catalog, sql_namespace(namespace)
        if (listed := await cache.listed(catalog, levels)) is not None:
            return listed
        generation = cache.generation
        async with self.async_pool.connection() as conn:
            rows = await (await conn.execute(self._names_sql, (catalog, levels))).fetchall()
            if not rows and not (await (await conn.execute(*self._namespace_query(levels))).fetchone())["found"]:
                raise NoSuchNamespaceError(f"Namespace does not exist: {'.'.join(namespace)}")
        listed = Listed(
            tables=tuple(r["table_name"] for r in rows if not r["view"]),
            views=tuple(r["table_name"] for r in rows if r["view"]),
        )
        if rows:
            cache.keep_listed(generation, catalog, levels, listed)
        return listed

    def namespace_location(self, conn, namespace: tuple[str, ...]) -> str | None:
        """The namespace's ``location`` property (None: it has none), in one statement;
        NoSuchNamespaceError if it does not exist (as PyIceberg's SQL catalog decides)."""
        from pyiceberg.exceptions import NoSuchNamespaceError

        row = conn.execute(*self._namespace_query(sql_namespace(namespace))).fetchone()
        if not row["found"]:
            raise NoSuchNamespaceError(f"Namespace does not exist: {'.'.join(namespace)}")
        return row["location"]

    def _namespace_query(self, levels: str) -> tuple[str, dict]:
        """Whether the namespace of SQL name ``levels`` exists, and its location: the statement and
        its parameters."""
        under = levels.replace("!", "!!").replace("_", "!_").replace("%", "!%") + ".%"
        return self._namespace_sql, {"catalog": self.settings.catalog, "namespace": levels, "under": under}

    def current(self, conn, table: TableName):
        """(metadata location, metadata, io) of the table's current version."""
        row = conn.execute(self._pointer_sql, (table.catalog, table.sql_namespace, table.name)).fetchone()
        if row is None:
            from pyiceberg.exceptions import NoSuchTableError

            raise NoSuchTableError(f"Table does not exist: {java_name(table)}")
        return (row["metadata_location"], *self.metadata(row["metadata_location"]))

    def placing(self, conn) -> locations.Near:
        """The tables whose locations may overlap a normalized location, for
        :class:`~icebarrier.iceberg_ext.locations.Confinement`'s checks: the catalog's placements
        brought up to date, under the lock that keeps two placements from passing the check at
        once (held to the transaction's end). The transaction then holds the marks it placed: a
        pointer it writes goes through ``conn`` (another connection's insert would wait for it)."""
        db.advisory_lock(conn, locations.LOCK, [0], what="placing a table")
        cs, catalog = self.settings.catalog_schema, self.settings.catalog
        locations.refresh(conn, cs, catalog, self._read_location)
        return functools.partial(locations.near, conn, cs, catalog, read_location=self._read_location)

    def _read_location(self, pointer: str) -> str:
        return self.metadata(pointer)[0].location

    def confine(
        self,
        conn,
        table: TableName,
        location: str | None,
        properties: Mapping[str, str],
        *,
        near: locations.Near | None = None,
    ) -> None:
        """Refuse a location (and path properties) of ``table`` outside the allowed prefixes or
        overlapping another table's (:mod:`icebarrier.iceberg_ext.locations`); ``near``: the
        caller's :meth:`placing`, if it has it."""
        paths = {k: v for k, v in properties.items() if k in locations.PATH_PROPERTIES}
        if location is None and not paths:
            return
        near = self.placing(conn) if near is None else near
        if location is not None:
            self.confinement.check(str(table), location, near)
        for key, path in paths.items():
            self.confinement.check(str(table), path, near, what=f"property {key}")

    def new_table(self, conn, table: TableName, request):
        """``table`` as a :class:`~.models.CreateTableRequest` makes it: its first metadata (a
        StagedTable, nothing written yet) at its location (given, or under its namespace's or
        the warehouse's), confined first. (PyIceberg's own takes one namespace level only, and
        asks the SQL catalog on connections of its own.)"""
        from pyiceberg.io import load_file_io
        from pyiceberg.partitioning import UNPARTITIONED_PARTITION_SPEC
        from pyiceberg.table import StagedTable, TableProperties
        from pyiceberg.table.locations import load_location_provider
        from pyiceberg.table.metadata import new_table_metadata
        from pyiceberg.table.sorting import UNSORTED_SORT_ORDER

        properties = request.properties or {}
        near = self.placing(conn)
        location = request.location.rstrip("/") if request.location else self.default_location(conn, table, near)
        self.confine(conn, table, location, properties, near=near)
        version = int(properties.get(TableProperties.FORMAT_VERSION, TableProperties.DEFAULT_FORMAT_VERSION))
        metadata = new_table_metadata(
            location=location,
            schema=self.catalog._convert_schema_if_needed(request.table_schema, version),
            partition_spec=request.partition_spec or UNPARTITIONED_PARTITION_SPEC,
            sort_order=request.write_order or UNSORTED_SORT_ORDER,
            properties=properties,
        )
        metadata_location = load_location_provider(location, properties).new_table_metadata_file_location()
        return StagedTable(
            identifier=table.identifier,
            metadata=metadata,
            metadata_location=metadata_location,
            io=load_file_io({**self.properties, **properties}, metadata_location),
            catalog=self.catalog,
        )

    @functools.cached_property
    def catalog(self):
        """PyIceberg's SQL catalog, made on first use: creating, committing, dropping and renaming
        tables and the namespace routes go through it, loads never (a server that only serves
        loads never imports it and SQLAlchemy: 0.8 CPU-s of a start)."""
        return load_catalog(self.settings)

    def default_location(self, conn, table: TableName, near: locations.Near | None = None) -> str:
        """Where ``table`` lives when its creation names no location: under its namespace's
        location, else the warehouse's (PyIceberg's SQL catalog's convention). With ``near`` (the
        catalog's placements), a folder another table holds already (a table renamed keeps its
        folder) gets a suffix of its own: the new table never shares a location."""
        if namespace_location := self.namespace_location(conn, table.namespace):
            location = f"{namespace_location.rstrip('/')}/{table.name}"
        else:
            location = f"{self.properties['warehouse'].rstrip('/')}/{table.sql_namespace}/{table.name}"
        spot = locations.normalized(location)
        if near is not None and any(o.table != str(table) and locations.overlap(spot, o.location) for o in near(spot)):
            return f"{location}-{uuid.uuid4().hex[:8]}"
        return location

    def metadata(self, location: str):
        def read():
            from pyiceberg.io import load_file_io
            from pyiceberg.serializers import FromInputFile

            io = load_file_io(self.properties, location)
            return FromInputFile.table_metadata(io.new_input(location)), io

        return self.metadata_cache.get(location, read)

    def metadata_json(self, location: str) -> tuple[bytes, str]:
        """The JSON of the metadata at ``location`` as the REST protocol carries it (serialized
        once), and the table's location."""

        def serialized() -> tuple[bytes, str]:
            metadata, _ = self.metadata(location)
            return metadata.model_dump_json().encode(), metadata.location

        return self.metadata_json_cache.get(location, serialized, storage=False)

    def committed_json(self, location: str) -> bytes:
        """A CommitTableResponse's JSON (``pyiceberg.table.CommitTableResponse``) around the
        metadata's JSON as written."""
        return around_metadata(location, self.metadata_json(location)[0])

    def write_metadata(self, new) -> None:
        """Write a new metadata file (a staged table: its metadata, io and location), serialized
        once: the file's bytes are what loads and the commit's answer carry. PyIceberg's writer
        only where its ``legacy-current-snapshot-id`` asks for a file unlike the protocol's JSON."""
        from pyiceberg.serializers import Compressor

        metadata, location = new.metadata, new.metadata_location
        if self._legacy_metadata:
            self.catalog._write_metadata(metadata, new.io, location)
        else:
            serialized = metadata.model_dump_json().encode()
            with new.io.new_output(location).create(overwrite=False) as out:
                out.write(Compressor.get_compressor(location).bytes_compressor()(serialized))
            self.metadata_json_cache.get(location, lambda: (serialized, metadata.location), storage=False)
        self.metadata_cache.get(location, lambda: (metadata, new.io), storage=False)

    def point(
        self,
        conn,
        table: TableName,
        location: str,
        expected: str | None,
        lost: str = "was changed by another commit; retry",
    ) -> None:
        """Move ``table``'s catalog pointer from ``expected`` (None: the table has no row yet) to
        ``location``; a lost race is a :class:`CommitFailedException` (``lost`` says why)."""
        from pyiceberg.exceptions import CommitFailedException

        key = (table.catalog, table.sql_namespace, table.name)
        if expected is None:
            try:
                with conn.transaction():
                    moved = conn.execute(self._insert_sql, (*key, location)).rowcount
            except psycopg.errors.UniqueViolation:
                self.require_not_a_view(conn, table)
                moved = 0  # created meanwhile by someone else
        else:
            moved = conn.execute(self._swap_sql, (location, expected, *key, expected)).rowcount
        if moved != 1:
            raise CommitFailedException(f"table {table} {lost}")

    def kind_of(self, conn, name: TableName) -> tuple[str | None, str | None]:
        """(``VIEW`` or ``TABLE``, its metadata location) of the catalog's row named ``name``, or
        (None, None): tables and views share one name space."""
        row = conn.execute(self._kind_sql, (name.catalog, name.sql_namespace, name.name)).fetchone()
        return (row["kind"], row["metadata_location"]) if row else (None, None)

    def require_not_a_view(self, conn, name: TableName) -> None:
        """A table may not take a view's name (creating, registering or renaming onto it)."""
        if self.kind_of(conn, name)[0] == VIEW:
            raise ViewAlreadyExistsError(f"View with same name already exists: {java_name(name)}")
