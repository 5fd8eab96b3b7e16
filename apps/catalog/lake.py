"""The server's view of the lake: the SQL catalog (PyIceberg) plus the control plane.

The server serves the tables of the JDBC/SQL catalog in the control-plane database, so Spark's
JDBC catalog, PyIceberg's SQL catalog and REST clients all see one lake. It keeps no state of
its own: sessions live in Postgres; what it caches in memory (metadata files, pinned metadata)
is immutable.

Writes go through ``latest`` only. A commit to a managed table must come from a token of its
writer job and carry ``icebarrier.barrier``; the pointer swap and the commit's record in the
control plane are one Postgres transaction, and a commit of all of a job's sinks carrying
barrier B also completes B for the job in that transaction. A multi-sink job committing its
sinks one by one has them staged (``catalog_pending``, seen only by its own tokens) until it
publishes the barrier; then all pointers swap and B completes in one transaction.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

from psycopg import sql

from icebarrier.apps.catalog.errors import ForbiddenError
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import db, jobs, leases, reads, tokens
from icebarrier.control_plane.errors import IcebarrierError, SnapshotExpiredError
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.control_plane.tokens import AuthenticationError, Principal
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER, coalesced_after, load_catalog
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.pinning import pinned

LEASE_RENEW_S = 300.0


class _LRU:
    """A small thread-safe LRU for immutable values (metadata files, pinned responses)."""

    def __init__(self, size: int) -> None:
        self.size, self.items, self.lock = size, OrderedDict(), threading.Lock()

    def get(self, key, make):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        value = make()
        with self.lock:
            self.items[key] = value
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return value


def _catalog_sql(catalog_schema: str, text: str) -> str:
    """SQL over the SQL catalog's tables, ``{cs}`` being its schema."""
    return sql.SQL(text).format(cs=sql.Identifier(catalog_schema)).as_string(None)


class Lake:
    """The server's view of the lake: the SQL catalog (PyIceberg) plus the control plane."""

    def __init__(self, settings: Settings, *, quiet_ms: int, pool_size: int = 8) -> None:
        if not settings.is_default_catalog:
            raise IcebarrierError("icebarrier serve serves the default SQL catalog in the control-plane database; "
                                  "remove [catalog_properties] from the configuration")
        self.settings = settings
        self.catalog = load_catalog(settings)
        self.pool = db.pool(settings.dsn, settings.schema, max_size=pool_size)
        self.quiet_ms = quiet_ms
        self.metadata_cache = _LRU(4096)
        self.pinned_cache = _LRU(8192)
        in_catalog = functools.partial(_catalog_sql, settings.catalog_schema)
        self._pointer_sql = in_catalog(
            "SELECT metadata_location FROM {cs}.iceberg_tables WHERE catalog_name = %s AND table_namespace = %s "
            "AND table_name = %s")
        # One statement for a load: is the table managed, its pointer, and (through barrier-<B>)
        # S(T, B), all from one snapshot of the database.
        self._load_sql = in_catalog(
            "SELECT m.managed, (SELECT metadata_location FROM {cs}.iceberg_tables WHERE catalog_name = %(catalog)s "
            "AND table_namespace = %(namespace)s AND table_name = %(table)s) AS location, "
            "CASE WHEN m.managed AND %(barrier)s::bigint IS NOT NULL THEN (SELECT r.snapshot_ids[1] "
            "FROM resolve_cut(ARRAY[%(name)s], %(barrier)s, true) r) END AS snapshot_id "
            "FROM (SELECT EXISTS (SELECT 1 FROM managed_table WHERE name = %(name)s) AS managed) m")
        self._swap_sql = in_catalog(
            "UPDATE {cs}.iceberg_tables SET metadata_location = %s, previous_metadata_location = %s "
            "WHERE catalog_name = %s AND table_namespace = %s AND table_name = %s AND metadata_location = %s")
        self._insert_sql = in_catalog(
            "INSERT INTO {cs}.iceberg_tables (catalog_name, table_namespace, table_name, metadata_location, "
            "previous_metadata_location, iceberg_type) VALUES (%s, %s, %s, %s, NULL, 'TABLE')")

    def close(self) -> None:
        self.pool.close()

    # -- names --------------------------------------------------------------------------------

    def table_name(self, namespace: tuple[str, ...], name: str) -> TableName:
        """The identifier as the client spelled it (the catalog is case-sensitive and allows
        any characters); only a name in icebarrier's canonical form can be managed."""
        return TableName(catalog=self.settings.catalog, namespace=tuple(namespace), name=name)

    @staticmethod
    def managed_key(table: TableName) -> str | None:
        """``str(table)`` if the table could be managed (canonical: lower-case identifiers, no
        dots inside a part), else None: such a table is never managed, whatever its spelling."""
        try:
            return str(table) if TableName.parse(str(table)) == table else None
        except IcebarrierError:
            return None

    def writer_of(self, conn, table: TableName) -> tuple[bool, str | None]:
        """(is the table managed, its writer job)."""
        key = self.managed_key(table)
        if key is None:
            return False, None
        row = conn.execute(
            "SELECT j.name FROM managed_table m LEFT JOIN job_sink k USING (table_id) "
            "LEFT JOIN job j ON j.job_id = k.job_id AND j.active WHERE m.name = %s", (key,)).fetchone()
        return (row is not None, row["name"] if row else None)

    # -- metadata -------------------------------------------------------------------------------

    def current(self, conn, table: TableName):
        """(metadata location, metadata, io) of the table's current version."""
        row = conn.execute(self._pointer_sql, (table.catalog, ".".join(table.namespace), table.name)).fetchone()
        if row is None:
            from pyiceberg.exceptions import NoSuchTableError

            raise NoSuchTableError(f"table {table} does not exist")
        return (row["metadata_location"], *self.metadata(row["metadata_location"]))

    def metadata(self, location: str):
        def read():
            from pyiceberg.io import load_file_io
            from pyiceberg.serializers import FromInputFile

            io = load_file_io(self.catalog.properties, location)
            return FromInputFile.table_metadata(io.new_input(location)), io

        return self.metadata_cache.get(location, read)

    def load(self, conn, warehouse: Warehouse, table: TableName, principal: Principal,
             access_token: str | None) -> bytes:
        """The LoadTableResult for ``table`` through ``warehouse``, as JSON bytes."""
        from pyiceberg.catalog.rest import TableResponse
        from pyiceberg.exceptions import NoSuchTableError

        staged = self.staged(conn, principal, table) if warehouse.kind == "latest" else None
        if staged is not None:  # the job's own commits of a barrier it has not published yet
            metadata, _ = self.metadata(staged["metadata_location"])
            return TableResponse(metadata_location=staged["metadata_location"], metadata=metadata,
                                 config={}).model_dump_json().encode()
        with db.translated(conn, "load_table"):
            state = conn.execute(self._load_sql, {
                "catalog": table.catalog, "namespace": ".".join(table.namespace), "table": table.name,
                "name": self.managed_key(table), "barrier": warehouse.barrier}).fetchone()
        if state["location"] is None:
            raise NoSuchTableError(f"table {table} does not exist")
        if warehouse.kind == "latest" or not state["managed"]:
            metadata, _ = self.metadata(state["location"])
            return TableResponse(metadata_location=state["location"], metadata=metadata,
                                 config={}).model_dump_json().encode()
        if warehouse.kind == "barrier":
            snapshot_id, (metadata, io) = state["snapshot_id"], self.metadata(state["location"])
        else:
            # The cut first, then the pointer: a commit's metadata lands before its record, so
            # the current metadata holds S(T, B) unless it was expired.
            snapshot_id = self.pinned_snapshot(conn, warehouse, table, access_token)
            _, metadata, io = self.current(conn, table)
        if snapshot_id is not None and metadata.snapshot_by_id(snapshot_id) is None:
            raise SnapshotExpiredError(str(table), snapshot_id)

        def pin() -> bytes:
            result = pinned(io, metadata, snapshot_id)
            return TableResponse(metadata_location=result.metadata_location, metadata=result.metadata,
                                 config={}).model_dump_json().encode()

        return self.pinned_cache.get((str(metadata.table_uuid), snapshot_id), pin)

    def pinned_snapshot(self, conn, warehouse: Warehouse, table: TableName, access_token: str | None) -> int | None:
        if warehouse.kind == "lease":  # each load renews it (never shortening it)
            lease = leases.get(conn, warehouse.lease_id)
            remaining_s = (lease.expires_at - conn.execute("SELECT now() AS t").fetchone()["t"]).total_seconds()
            if lease.state != "active" or remaining_s < LEASE_RENEW_S:
                lease = leases.renew(conn, warehouse.lease_id, ttl_s=LEASE_RENEW_S)
            if table not in lease.snapshots:
                raise ForbiddenError(f"lease {lease.lease_id} does not pin {table} (it pins "
                                     f"{', '.join(sorted(map(str, lease.snapshots)))}); read it through another "
                                     f"warehouse or take a lease that covers it")
            return lease.snapshots[table]
        scope = None
        if warehouse.namespace is not None:
            scope = f"{self.settings.catalog}.{warehouse.namespace}"
            if ".".join(table.namespace) != warehouse.namespace:
                raise ForbiddenError(f"warehouse {warehouse} reads only namespace {warehouse.namespace}, not {table}; "
                                     f"use warehouse read-committed for the whole lake")
        if access_token is None:
            raise AuthenticationError("read-committed is stable per client session and needs a token; create one "
                                      "with `icebarrier token create --reader` and pass it as credential")
        barrier, snapshot_id = tokens.session_cut(conn, access_token, str(table), scope=scope, quiet_ms=self.quiet_ms)
        if barrier is None:  # no cut over the scope yet: the table's own, or why there is none
            return reads.resolve(conn, [table]).snapshots[table]
        return snapshot_id

    # -- writes -----------------------------------------------------------------------------------

    def may_write(self, principal: Principal, table: TableName) -> bool:
        """Check that ``principal`` may change ``table``; returns whether it is managed."""
        with self.pool.connection() as conn:
            managed, writer = self.writer_of(conn, table)
        self.require_writer(principal, table, managed, writer)
        return managed

    def create(self, principal: Principal, table: TableName, request):
        """Create (or stage-create) a table from a :class:`~.models.CreateTableRequest`; the
        LoadTableResult."""
        from pyiceberg.catalog.rest import TableResponse
        from pyiceberg.partitioning import UNPARTITIONED_PARTITION_SPEC
        from pyiceberg.table.sorting import UNSORTED_SORT_ORDER

        self.may_write(principal, table)
        args = dict(schema=request.table_schema, location=request.location,
                    partition_spec=request.partition_spec or UNPARTITIONED_PARTITION_SPEC,
                    sort_order=request.write_order or UNSORTED_SORT_ORDER, properties=request.properties)
        make = self.catalog._create_staged_table if request.stage_create else self.catalog.create_table
        made = make(table.identifier, **args)
        return TableResponse(metadata_location=made.metadata_location, metadata=made.metadata, config={})

    def register(self, principal: Principal, table: TableName, metadata_location: str, *, overwrite: bool):
        """Register an existing metadata file as ``table``; the LoadTableResult. Overwriting is
        refused for a managed table: its history is the control plane's record."""
        from pyiceberg.catalog.rest import TableResponse
        from pyiceberg.exceptions import NoSuchTableError

        managed = self.may_write(principal, table)
        try:
            metadata, _ = self.metadata(metadata_location)
        except (OSError, ValueError) as exc:
            raise IcebarrierError(f"metadata-location {metadata_location!r} cannot be read as table metadata "
                                  f"({type(exc).__name__}); give the location of a metadata.json file") from None
        if not overwrite:
            self.catalog.register_table(table.identifier, metadata_location)
        elif managed:
            raise ForbiddenError(f"table {table} is managed by icebarrier; registering over it would replace its "
                                 f"barrier history. Revise it with `icebarrier revise` instead")
        else:
            with self.pool.connection() as conn, conn.transaction():
                try:
                    current, _, _ = self.current(conn, table)
                except NoSuchTableError:
                    current = None
                self.point(conn, table, metadata_location, current)
        return TableResponse(metadata_location=metadata_location, metadata=metadata, config={})

    def drop(self, principal: Principal, table: TableName, *, purge: bool) -> None:
        self.may_write(principal, table)
        (self.catalog.purge_table if purge else self.catalog.drop_table)(table.identifier)

    def rename(self, principal: Principal, source: TableName, destination: TableName) -> None:
        """Rename an unmanaged table. A managed table (or a name a job declares as its sink) is
        never renamed through the catalog: jobs, barrier records and leases name it."""
        with self.pool.connection() as conn:
            for table in (source, destination):
                managed, writer = self.writer_of(conn, table)
                if managed:
                    owner = f"job {writer}" if writer else "the control plane"
                    raise ForbiddenError(
                        f"table {table} is managed by icebarrier (written by {owner}); it is not renamed through the "
                        f"catalog. Register the job with the new sink name and let it write the new table instead")
        self.catalog.rename_table(source.identifier, destination.identifier)

    def point(self, conn, table: TableName, location: str, expected: str | None,
              lost: str = "was changed by another commit; retry") -> None:
        """Move ``table``'s catalog pointer from ``expected`` (None: the table has no row yet) to
        ``location``; a lost race is a :class:`CommitFailedException` (``lost`` says why)."""
        from pyiceberg.exceptions import CommitFailedException

        key = (table.catalog, ".".join(table.namespace), table.name)
        if expected is None:
            moved = conn.execute(self._insert_sql, (*key, location)).rowcount
        else:
            moved = conn.execute(self._swap_sql, (location, expected, *key, expected)).rowcount
        if moved != 1:
            raise CommitFailedException(f"table {table} {lost}")

    def staged(self, conn, principal: Principal, table: TableName) -> dict | None:
        """The job's staged (unpublished) commit of ``table``, if any."""
        if principal.job is None or self.managed_key(table) is None:
            return None
        return conn.execute("SELECT barrier, base_location, metadata_location FROM catalog_pending "
                            "WHERE job_name = %s AND table_name = %s", (principal.job, str(table))).fetchone()

    def commit(self, conn, principal: Principal, changes: list) -> list:
        """Apply ``changes`` (:class:`~.models.CommitTableRequest`, each with its identifier)
        atomically; returns the (table, staged table) pairs. See the module docstring for who may
        commit what.

        A multi-sink job's commits to its sinks are staged (only its own tokens see them) until
        it publishes the barrier: a transaction naming all its sinks with no changes."""
        from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
        from pyiceberg.table import Table
        from pyiceberg.table.update import AddSnapshotUpdate, AssertCreate

        definition = jobs.load_definitions(conn).get(principal.job) if principal.job else None
        multi_sink = definition is not None and len(definition.sinks) > 1
        names = [self.table_name(c.identifier.namespace, c.identifier.name) for c in changes]
        whole = multi_sink and set(names) == set(definition.sinks)  # all the job's sinks at once
        if whole and not any(c.updates or c.requirements for c in changes):
            self.publish(conn, principal.job)
            return []
        staged, managed_barriers = [], {}
        for table, change in zip(names, changes):
            managed, writer = self.writer_of(conn, table)
            self.require_writer(principal, table, managed, writer)
            pending = self.staged(conn, principal, table) if managed else None
            if pending is not None:
                metadata, io = self.metadata(pending["metadata_location"])
                current = Table(table.identifier, metadata, pending["metadata_location"], io, self.catalog)
            else:
                try:
                    current = self.catalog.load_table(table.identifier)
                except NoSuchTableError:
                    if not any(isinstance(r, AssertCreate) for r in change.requirements):
                        raise
                    current = None
            new = self.catalog._update_and_stage_table(current, table.identifier, tuple(change.requirements),
                                                       tuple(change.updates))
            added = [u.snapshot for u in change.updates if isinstance(u, AddSnapshotUpdate)]
            barrier = pending["barrier"] if pending else None
            if managed and added:
                marks = {(s.summary.additional_properties.get(SUMMARY_BARRIER) if s.summary else None) for s in added}
                if None in marks or len(marks) != 1:
                    raise ForbiddenError(f"a commit to managed table {table} must carry snapshot property "
                                         f"{SUMMARY_BARRIER} (one barrier per commit); write through the icebarrier "
                                         f"job runtime or set snapshot-property.{SUMMARY_BARRIER}")
                barrier = int(marks.pop())
                managed_barriers[table] = (barrier, added[-1].snapshot_id, coalesced_after(added[-1]))
            stage = multi_sink and not whole and managed and barrier is not None
            staged.append((table, current, new, pending, barrier if stage else None))
        for _, current, new, _, _ in staged:
            if current is None or new.metadata != current.metadata:
                self.catalog._write_metadata(new.metadata, new.io, new.metadata_location)
        with conn.transaction():
            for table, current, new, pending, barrier in staged:
                if barrier is not None:  # staged until the job publishes the barrier
                    managed_barriers.pop(table, None)
                    moved = conn.execute(
                        "INSERT INTO catalog_pending (job_name, table_name, barrier, base_location, metadata_location) "
                        "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (job_name, table_name) DO UPDATE "
                        "SET barrier = excluded.barrier, metadata_location = excluded.metadata_location, "
                        "staged_at = now() WHERE catalog_pending.metadata_location = %s",
                        (principal.job, str(table), barrier, current.metadata_location, new.metadata_location,
                         current.metadata_location)).rowcount
                    if moved != 1:
                        raise CommitFailedException(f"table {table} was changed by another commit; retry")
                elif current is None:
                    self.point(conn, table, new.metadata_location, None)
                elif pending is not None:  # built on the job's staged commit: the pointer is at its base
                    self.point(conn, table, new.metadata_location, pending["base_location"])
                    conn.execute("DELETE FROM catalog_pending WHERE job_name = %s AND table_name = %s",
                                 (principal.job, str(table)))
                elif new.metadata != current.metadata:
                    self.point(conn, table, new.metadata_location, current.metadata_location)
            faults.point(faults.IN_CATALOG_COMMIT)
            if definition is not None:
                self.complete_if_whole(conn, definition, managed_barriers)
        return [(t, new) for t, _, new, _, _ in staged]

    def publish(self, conn, job: str) -> None:
        """Swap the pointers of every commit the job staged, and complete their barrier B with
        the snapshots carrying B, in one transaction."""
        from icebarrier.iceberg_ext.catalog import barrier_of, is_compaction

        with conn.transaction():
            rows = conn.execute("SELECT table_name, barrier, base_location, metadata_location FROM catalog_pending "
                                "WHERE job_name = %s ORDER BY table_name FOR UPDATE", (job,)).fetchall()
            marks = {r["barrier"] for r in rows}
            if len(marks) != 1:
                raise IcebarrierError(f"job {job} has {'nothing' if not rows else 'several barriers'} staged to "
                                      f"publish; write its sinks through this catalog first")
            barrier, commits, coalesce = marks.pop(), {}, False
            for r in rows:
                table = TableName.parse(r["table_name"])
                self.point(conn, table, r["metadata_location"], r["base_location"],
                           lost=f"was changed outside job {job}'s barrier; retry it")
                main = self.metadata(r["metadata_location"])[0].current_snapshot()
                if main is not None and barrier_of(main) == barrier and not is_compaction(main):
                    commits[table] = main.snapshot_id
                    coalesce = coalesce or coalesced_after(main) is not None
            conn.execute("DELETE FROM catalog_pending WHERE job_name = %s", (job,))
            faults.point(faults.IN_CATALOG_COMMIT)
            with conn.transaction():
                jobs.complete(conn, job, barrier, commits, run_id="rest-catalog", coalesce=coalesce)

    @staticmethod
    def complete_if_whole(conn, job: JobDefinition, commits: dict[TableName, tuple[int, int, int | None]]) -> None:
        """A commit of all of the job's sinks carrying one barrier B completes B for the job
        (coalescing when the snapshots say they coalesced)."""
        marks = {b for b, _, _ in commits.values()}
        if not commits or set(commits) != set(job.sinks) or len(marks) != 1:
            return  # part of the job's sinks: the job completes B itself (adopting these commits)
        with conn.transaction():
            jobs.complete(conn, job.name, marks.pop(), {t: s for t, (_, s, _) in commits.items()},
                          run_id="rest-catalog", coalesce=any(c is not None for _, _, c in commits.values()))

    @staticmethod
    def require_writer(principal: Principal, table: TableName, managed: bool, writer: str | None) -> None:
        """A managed table is written only by its writer job. (Every route that writes takes a
        job principal: :func:`.deps.job_caller` refuses readers.)"""
        if managed and writer != principal.job:
            owner = f"job {writer}" if writer else "no job (it has no writer)"
            raise ForbiddenError(f"{principal.describe()} may not write {table}: it is written by {owner}; "
                                 f"commit with a token of {owner}")
