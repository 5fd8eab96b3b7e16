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

Through warehouse ``job`` a job works in its *session* (:mod:`icebarrier.control_plane.job_sessions`):
its sources load at ``S(T, B)`` of the session's barrier B, its sinks with what the session
staged, and every commit to its sinks is staged for B (stamped with the barrier, job and run
when the client did not) until the session is published: all staged pointers swap and B
completes in one transaction, sinks it did not write completing B unchanged.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import psycopg
from psycopg import sql

from icebarrier.apps.catalog.errors import ForbiddenError
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import db, job_sessions, jobs, leases, reads, tokens
from icebarrier.control_plane.errors import IcebarrierError, SnapshotExpiredError
from icebarrier.control_plane.job_sessions import JobSession
from icebarrier.control_plane.jobs import Completion, Plan
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.control_plane.tokens import AuthenticationError, Principal
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import (
    SUMMARY_BARRIER,
    SUMMARY_COALESCED_AFTER,
    SUMMARY_JOB,
    SUMMARY_RUN,
    barrier_of,
    coalesced_after,
    is_compaction,
    load_catalog,
)
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.pinning import pinned

LEASE_RENEW_S = 300.0
LATEST = Warehouse("latest")


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

        if warehouse.kind == "job":
            warehouse = self.session_view(conn, self.session(conn, warehouse, principal), table)
        staged = self.staged(conn, principal.job, table) if warehouse.kind == "latest" else None
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

    def exists(self, conn, warehouse: Warehouse, table: TableName, principal: Principal) -> None:
        """Does ``table`` exist for the caller (a job session sees the sinks it created)? Else
        NoSuchTableError."""
        if warehouse.kind != "job" or self.staged(conn, principal.job, table) is None:
            self.current(conn, table)

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

    # -- job sessions -----------------------------------------------------------------------------

    @staticmethod
    def session(conn, warehouse: Warehouse, principal: Principal) -> JobSession:
        """The session a request through warehouse ``job`` works in (opened by the job's first request)."""
        return job_sessions.current(conn, principal.job, run_id=warehouse.run_id)

    def session_view(self, conn, session: JobSession, table: TableName) -> Warehouse:
        """Where a job session reads ``table``: a source at ``S(T, B)``, a sink (with what the
        session staged) and an unmanaged table as they are; any other managed table is refused."""
        if table in session.sources:
            return Warehouse("barrier", barrier=session.barrier)
        if table in session.sinks:
            return LATEST
        if self.writer_of(conn, table)[0]:
            raise ForbiddenError(f"job {session.job} may not read {table}: it is not one of the job's sources "
                                 f"({', '.join(sorted(map(str, session.sources))) or 'none'}); declare it with "
                                 f"`icebarrier job register {session.job} --source {table} … --replace`")
        return LATEST

    def require_sink(self, conn, session: JobSession, table: TableName) -> None:
        if table not in session.sinks:
            writer = self.writer_of(conn, table)[1]
            owner = f" ({table} is written by job {writer})" if writer else ""
            raise ForbiddenError(f"job {session.job} may not write {table}: it writes only its sinks "
                                 f"({', '.join(sorted(map(str, session.sinks))) or 'none'}){owner}; nothing of this "
                                 f"run is published")

    @staticmethod
    def stamped(session: JobSession, table: TableName, change):
        """``change`` with every snapshot it adds carrying the session's barrier, job and run (and
        the coalesced range) in its summary; a snapshot naming another barrier is refused."""
        from pyiceberg.table.snapshots import Summary
        from pyiceberg.table.update import AddSnapshotUpdate

        marks = {SUMMARY_BARRIER: str(session.barrier), SUMMARY_JOB: session.job, SUMMARY_RUN: session.run_id}
        if session.coalesce_after is not None:
            marks[SUMMARY_COALESCED_AFTER] = str(session.coalesce_after)
        updates = []
        for update in change.updates:
            if isinstance(update, AddSnapshotUpdate):
                snapshot = update.snapshot
                given = barrier_of(snapshot)
                if given is not None and given != session.barrier:
                    raise ForbiddenError(f"a commit to {table} carries barrier {given}, but job {session.job}'s "
                                         f"session computes barrier {session.barrier}; drop snapshot property "
                                         f"{SUMMARY_BARRIER} (the catalog sets it)")
                summary = snapshot.summary
                operation = summary.operation if summary is not None else "append"
                properties = {**(summary.additional_properties if summary is not None else {}), **marks}
                update = AddSnapshotUpdate(snapshot=snapshot.model_copy(
                    update={"summary": Summary(operation, **properties)}))
            updates.append(update)
        return change.model_copy(update={"updates": tuple(updates)})

    def create_staged(self, conn, session: JobSession, table: TableName, request):
        """A sink the session creates: staged (nobody else sees it) until the barrier is published."""
        from pyiceberg.catalog.rest import TableResponse
        from pyiceberg.exceptions import TableAlreadyExistsError

        self.require_sink(conn, session, table)
        if self.staged(conn, session.job, table) is not None or conn.execute(
                self._pointer_sql, (table.catalog, ".".join(table.namespace), table.name)).fetchone() is not None:
            raise TableAlreadyExistsError(f"table {table} already exists")
        made = self.catalog._create_staged_table(table.identifier, **self.create_args(request))
        if not request.stage_create:  # a staged create is committed by the client (AssertCreate) like any change
            self.catalog._write_metadata(made.metadata, made.io, made.metadata_location)
            self.stage(conn, session.job, table, session.barrier, None, made.metadata_location, None)
        return TableResponse(metadata_location=made.metadata_location, metadata=made.metadata, config={})

    def stage(self, conn, job: str, table: TableName, barrier: int, base: str | None, location: str,
              expected: str | None) -> None:
        """Stage ``location`` as the job's commit of ``table`` for ``barrier``: the pointer stays at
        ``base`` until the job publishes; ``expected`` is the staged location it builds on (None:
        it stages the table's first commit of the barrier)."""
        from pyiceberg.exceptions import CommitFailedException

        moved = conn.execute(
            "INSERT INTO catalog_pending (job_name, table_name, barrier, base_location, metadata_location) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (job_name, table_name) DO UPDATE "
            "SET barrier = excluded.barrier, metadata_location = excluded.metadata_location, "
            "staged_at = now() WHERE catalog_pending.metadata_location = %s",
            (job, str(table), barrier, base, location, expected)).rowcount
        if moved != 1:
            raise CommitFailedException(f"table {table} was changed by another commit; retry")

    def publish_session(self, conn, job: str, run_id: str | None) -> Completion:
        """Publish the job's session: every commit it staged swaps in and its barrier B completes,
        in one transaction (sinks it did not write complete B unchanged). The session is marked
        succeeded first, so that a publish cut short is adopted by the job's next run."""
        job_sessions.mark_succeeded(conn, job, run_id)
        with conn.transaction():
            session = job_sessions.get(conn, job, run_id=run_id, lock=True)
            _, commits, _ = self.swap_staged(conn, job, session.barrier)
            job_sessions.close(conn, job)
            faults.point(faults.IN_CATALOG_COMMIT)
            # a root job that committed nothing skips (its barriers stay exact); else the plan says
            coalesce = session.plan is Plan.COALESCE and (bool(commits) or not session.root)
            with conn.transaction():
                return jobs.complete(conn, job, session.barrier, commits, run_id=session.run_id, coalesce=coalesce)

    # -- writes -----------------------------------------------------------------------------------

    def may_write(self, principal: Principal, table: TableName) -> bool:
        """Check that ``principal`` may change ``table``; returns whether it is managed."""
        with self.pool.connection() as conn:
            managed, writer = self.writer_of(conn, table)
        self.require_writer(principal, table, managed, writer)
        return managed

    @staticmethod
    def create_args(request) -> dict:
        from pyiceberg.partitioning import UNPARTITIONED_PARTITION_SPEC
        from pyiceberg.table.sorting import UNSORTED_SORT_ORDER

        return dict(schema=request.table_schema, location=request.location,
                    partition_spec=request.partition_spec or UNPARTITIONED_PARTITION_SPEC,
                    sort_order=request.write_order or UNSORTED_SORT_ORDER, properties=request.properties)

    def create(self, warehouse: Warehouse, principal: Principal, table: TableName, request):
        """Create (or stage-create) a table from a :class:`~.models.CreateTableRequest`; the
        LoadTableResult. Through a job session, a sink's creation is staged."""
        from pyiceberg.catalog.rest import TableResponse

        if warehouse.kind == "job":
            with self.pool.connection() as conn:
                return self.create_staged(conn, self.session(conn, warehouse, principal), table, request)
        self.may_write(principal, table)
        make = self.catalog._create_staged_table if request.stage_create else self.catalog.create_table
        made = make(table.identifier, **self.create_args(request))
        return TableResponse(metadata_location=made.metadata_location, metadata=made.metadata, config={})

    @staticmethod
    def outside_sessions(warehouse: Warehouse, what: str) -> None:
        """Refuse, through a job session, what a session cannot stage (registering, dropping, renaming)."""
        if warehouse.kind == "job":
            raise ForbiddenError(f"a job session writes only data to its sinks; {what} through warehouse latest")

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
            try:
                with conn.transaction():
                    moved = conn.execute(self._insert_sql, (*key, location)).rowcount
            except psycopg.errors.UniqueViolation:
                moved = 0  # created meanwhile by someone else
        else:
            moved = conn.execute(self._swap_sql, (location, expected, *key, expected)).rowcount
        if moved != 1:
            raise CommitFailedException(f"table {table} {lost}")

    def staged(self, conn, job: str | None, table: TableName) -> dict | None:
        """The job's staged (unpublished) commit of ``table``, if any."""
        if job is None or self.managed_key(table) is None:
            return None
        return conn.execute("SELECT barrier, base_location, metadata_location FROM catalog_pending "
                            "WHERE job_name = %s AND table_name = %s", (job, str(table))).fetchone()

    def commit(self, conn, warehouse: Warehouse, principal: Principal, changes: list) -> list:
        """Apply ``changes`` (:class:`~.models.CommitTableRequest`, each with its identifier)
        atomically; returns the (table, staged table) pairs. See the module docstring for who may
        commit what.

        Through a job session every change is to a sink and is staged for the session's barrier.
        Through latest, a multi-sink job's commits to its sinks are staged (only its own tokens
        see them) until it publishes the barrier. Either publishes with a transaction naming all
        the job's sinks with no changes."""
        from pyiceberg.exceptions import NoSuchTableError
        from pyiceberg.table import Table
        from pyiceberg.table.update import AddSnapshotUpdate, AssertCreate

        session = self.session(conn, warehouse, principal) if warehouse.kind == "job" else None
        definition = jobs.load_definitions(conn).get(principal.job) if principal.job and not session else None
        sinks = session.sinks if session else definition.sinks if definition else frozenset()
        names = [self.table_name(c.identifier.namespace, c.identifier.name) for c in changes]
        whole = (session is not None or len(sinks) > 1) and set(names) == set(sinks)  # all the job's sinks at once
        if whole and not any(c.updates or c.requirements for c in changes):
            if session is not None:
                self.publish_session(conn, session.job, warehouse.run_id)
            else:
                self.publish(conn, principal.job)
            return []
        staged, managed_barriers = [], {}
        for table, change in zip(names, changes):
            if session is not None:
                self.require_sink(conn, session, table)
                change = self.stamped(session, table, change)
            managed, writer = self.writer_of(conn, table)
            self.require_writer(principal, table, managed, writer)
            pending = self.staged(conn, principal.job, table) if managed else None
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
            barrier = session.barrier if session else pending["barrier"] if pending else None
            if managed and added and session is None:
                marks = {barrier_of(s) for s in added}
                if None in marks or len(marks) != 1:
                    raise ForbiddenError(f"a commit to managed table {table} must carry snapshot property "
                                         f"{SUMMARY_BARRIER} (one barrier per commit); write through the icebarrier "
                                         f"job runtime or set snapshot-property.{SUMMARY_BARRIER}")
                barrier = marks.pop()
                managed_barriers[table] = (barrier, added[-1].snapshot_id, coalesced_after(added[-1]))
            stage = session is not None or (len(sinks) > 1 and not whole and managed and barrier is not None)
            staged.append((table, current, new, pending, barrier if stage else None))
        for _, current, new, _, _ in staged:
            if current is None or new.metadata != current.metadata:
                self.catalog._write_metadata(new.metadata, new.io, new.metadata_location)
        with conn.transaction():
            for table, current, new, pending, barrier in staged:
                location = current.metadata_location if current is not None else None
                if barrier is not None:  # staged until the job publishes the barrier
                    managed_barriers.pop(table, None)
                    base = pending["base_location"] if pending else location
                    self.stage(conn, principal.job, table, barrier, base, new.metadata_location, location)
                elif current is None:
                    self.point(conn, table, new.metadata_location, None)
                elif pending is not None:  # built on the job's staged commit: the pointer is at its base
                    self.point(conn, table, new.metadata_location, pending["base_location"])
                    conn.execute("DELETE FROM catalog_pending WHERE job_name = %s AND table_name = %s",
                                 (principal.job, str(table)))
                elif new.metadata != current.metadata:
                    self.point(conn, table, new.metadata_location, location)
            faults.point(faults.IN_CATALOG_COMMIT)
            if definition is not None:
                self.complete_if_whole(conn, definition, managed_barriers)
        return [(t, new) for t, _, new, _, _ in staged]

    def swap_staged(self, conn, job: str, barrier: int | None = None) -> tuple[int, dict[TableName, int], bool]:
        """Swap every pointer the job staged to its staged commit (inside the caller's
        transaction) and drop the staging. Returns the barrier (``barrier`` None: the one they
        were all staged for), the snapshot each sink committed for it, and whether a commit
        says it coalesced."""
        rows = conn.execute("SELECT table_name, barrier, base_location, metadata_location FROM catalog_pending "
                            "WHERE job_name = %s ORDER BY table_name FOR UPDATE", (job,)).fetchall()
        marks = {r["barrier"] for r in rows} | ({barrier} if barrier is not None else set())
        if len(marks) != 1:
            raise IcebarrierError(f"job {job} has {'nothing' if not rows else 'several barriers'} staged to "
                                  f"publish; write its sinks through this catalog first")
        barrier, commits, coalesced = marks.pop(), {}, False
        for r in rows:
            table = TableName.parse(r["table_name"])
            self.point(conn, table, r["metadata_location"], r["base_location"],
                       lost=f"was changed outside job {job}'s barrier; run the job again")
            main = self.metadata(r["metadata_location"])[0].current_snapshot()
            if main is not None and barrier_of(main) == barrier and not is_compaction(main):
                commits[table] = main.snapshot_id
                coalesced = coalesced or coalesced_after(main) is not None
        conn.execute("DELETE FROM catalog_pending WHERE job_name = %s", (job,))
        return barrier, commits, coalesced

    def publish(self, conn, job: str) -> None:
        """Swap the pointers of every commit the job staged through latest, and complete their
        barrier B with the snapshots carrying B, in one transaction."""
        with conn.transaction():
            barrier, commits, coalesce = self.swap_staged(conn, job)
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
