"""Consistent reads at a consistency level, for PyIceberg (Arrow) and Spark.

    with ConsistentRead(conn, catalog, [orders, payments], level=Level.REPEATABLE_READ) as r:
        r.arrow(orders)                       # PyIceberg, no JVM
        r.sql(spark, "SELECT … FROM lake.db.orders JOIN lake.db.payments …")   # Spark
        r.create_views(spark)                 # temp views `orders`, `payments` for spark.sql

- read-committed: the latest valid cut, resolved anew for each statement (each ``sql``,
  ``arrow``, ``read`` call, or ``create_views``); an eager statement (``read``, ``arrow``)
  holds a lease on its cut while it reads, so expiry cannot pull files from under it;
- repeatable-read: one cut resolved at entry and pinned by a lease, renewed in the
  background while the block runs and released at exit (optionally mirrored as Iceberg
  tags with a maximum age, so engines that know nothing of leases keep the snapshots).
  The lease lives on a connection of its own, so the caller's transactions cannot roll it
  back; if it cannot be renewed in time, the next statement raises
  :class:`~icebarrier.iceberg_ext.errors.LeaseLostError` instead of reading unprotected;
- read-uncommitted: each table's latest recorded snapshot;
- ``barrier=B``: the cut at B, or a clear error if B is not valid or its snapshots are gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from icebarrier.control_plane import db, leases, reads
from icebarrier.control_plane.errors import IcebarrierError, LeaseExpiredError, LeaseNotFoundError
from icebarrier.control_plane.model import Cut, Level, TableName
from icebarrier.iceberg_ext.catalog import load_table, require_snapshots
from icebarrier.iceberg_ext.errors import LeaseLostError

LEASE_TAG_PREFIX = "icebarrier-lease-"
STATEMENT_LEASE_TTL_S = 30.0  # renewed while an eager read-committed statement runs


class _LeaseKeeper:
    """Holds a lease on a connection of its own and renews it from a thread.

    A renewal that fails is retried until the lease would lapse; then the keeper is *lost*
    and :meth:`check` raises. ``check`` also trusts only its own clock: past the last
    renewal's TTL it raises even if the thread never ran."""

    def __init__(self, conn: db.Conn, ttl_s: float) -> None:
        self._origin = conn  # the caller's connection: where to reconnect to
        self.conn, self.ttl_s = db.reopen(conn), ttl_s
        self.lease_id: str | None = None
        self.lost: str | None = None
        self.renewals = 0
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, tables, *, barrier, holder, bootstrap_job) -> Cut:
        started = time.monotonic()
        cut = leases.acquire(
            self.conn, tables, ttl_s=self.ttl_s, holder=holder, barrier=barrier, bootstrap_job=bootstrap_job
        )
        self.lease_id, self._valid_until = cut.lease_id, started + self.ttl_s
        return cut

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"icebarrier-lease-{self.lease_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(self.ttl_s / 3, 0.1)
        while not self._stop.wait(interval):
            started = time.monotonic()
            try:
                leases.renew(self.conn, self.lease_id, ttl_s=self.ttl_s)
            except Exception as exc:  # noqa: BLE001 - any failure is retried until the lease lapses
                if isinstance(exc, (LeaseExpiredError, LeaseNotFoundError)):  # gone for good
                    self.lost = str(exc)
                    return
                if time.monotonic() >= self._valid_until:
                    self.lost = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                    return
                self._reconnect()
                interval = max(self.ttl_s / 10, 0.05)
                continue
            self._valid_until, self.renewals, interval = (
                started + self.ttl_s,
                self.renewals + 1,
                max(self.ttl_s / 3, 0.1),
            )

    def _reconnect(self) -> None:
        if self.conn.closed or self.conn.broken:
            try:
                self.conn = db.reopen(self._origin)
            except IcebarrierError:
                pass  # still unreachable: the next round tries again, until the lease would lapse

    def check(self) -> None:
        if self.lost is None and time.monotonic() >= self._valid_until:
            self.lost = f"no renewal within its TTL of {self.ttl_s:g}s"
        if self.lost is not None:
            raise LeaseLostError(self.lease_id, self.lost)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            if self.lease_id is not None:
                self._release()
        finally:
            self.conn.close()

    def _release(self) -> None:
        """Release the lease, on a new connection if its own broke (the primary failed over
        since its last renewal); one that cannot be released lapses at its TTL."""
        for again in (False, True):
            try:
                leases.release(self.conn, self.lease_id)
                return
            except psycopg.OperationalError:
                if again:
                    return
                self._reconnect()


class ConsistentRead:
    def __init__(
        self,
        conn: db.Conn,
        catalog,
        tables: list[TableName],
        *,
        level: Level = Level.READ_COMMITTED,
        barrier: int | None = None,
        ttl_s: float = 600,
        holder: str = "reader",
        mirror_tags: bool = False,
        verify_snapshots: bool = True,
        bootstrap_job: str | None = None,
        wait_s: float = 0,
        progress=None,
    ) -> None:
        """``wait_s``: wait that long for the tables' first consistent cut (``progress`` gets a
        line naming the job waited for) instead of raising NoValidCutError at once."""
        self.conn, self.catalog, self.tables = conn, catalog, list(dict.fromkeys(tables))
        self.level, self.barrier, self.ttl_s, self.holder = Level(level), barrier, ttl_s, holder
        self.mirror_tags, self.verify_snapshots, self.bootstrap_job = mirror_tags, verify_snapshots, bootstrap_job
        self._pinned: Cut | None = None
        self._keeper: _LeaseKeeper | None = None
        self.wait_s, self.progress = wait_s, progress

    # -- lifecycle ------------------------------------------------------------------------------------

    def __enter__(self) -> ConsistentRead:
        if self.wait_s > 0 and self.barrier is None and self.level is not Level.READ_UNCOMMITTED:
            reads.wait_for_cut(self.conn, self.tables, timeout_s=self.wait_s, progress=self.progress)
        if self.level is Level.REPEATABLE_READ:
            cut, keeper = self._lease(
                self.ttl_s, holder=self.holder, barrier=self.barrier, bootstrap_job=self.bootstrap_job
            )
            try:
                if self.mirror_tags:
                    self._tag(cut)
            except BaseException:
                keeper.close()
                raise
            self._pinned, self._keeper = cut, keeper
        elif self.barrier is not None:
            self._pinned = self._resolve()
        return self

    def __exit__(self, *exc) -> None:
        if self._keeper is not None:
            try:
                if self.mirror_tags:
                    self._untag(self._pinned)
            finally:
                self._keeper.close()

    @property
    def lease_renewals(self) -> int:
        """How many times the lease was renewed (0 without a lease)."""
        return self._keeper.renewals if self._keeper else 0

    def _lease(
        self, ttl_s: float, *, holder: str, barrier: int | None = None, bootstrap_job: str | None = None
    ) -> tuple[Cut, _LeaseKeeper]:
        """A lease on a cut, held and renewed on its own connection. Written first, re-checked
        after: the snapshots must still exist in Iceberg."""
        keeper = _LeaseKeeper(self.conn, ttl_s)
        try:
            cut = keeper.acquire(self.tables, barrier=barrier, holder=holder, bootstrap_job=bootstrap_job)
            require_snapshots(self.catalog, cut.snapshots, cut.barrier)
        except BaseException:
            keeper.close()
            raise
        keeper.start()
        return cut, keeper

    def _resolve(self) -> Cut:
        cut = reads.resolve(self.conn, self.tables, level=self.level, barrier=self.barrier)
        if self.verify_snapshots:
            require_snapshots(self.catalog, cut.snapshots, cut.barrier)
        return cut

    def cut(self) -> Cut:
        """The cut the next statement reads: pinned, or resolved now (read-committed/uncommitted).

        Every statement goes through here; a repeatable read whose lease was not renewed
        raises :class:`LeaseLostError`."""
        if self._keeper is not None:
            self._keeper.check()
        return self._pinned if self._pinned is not None else self._resolve()

    def _tag(self, cut: Cut) -> None:
        for table, snapshot_id in cut.snapshots.items():
            if snapshot_id is not None:
                load_table(self.catalog, table).manage_snapshots().create_tag(
                    snapshot_id, LEASE_TAG_PREFIX + cut.lease_id, max_ref_age_ms=int(self.ttl_s * 1000)
                ).commit()

    def _untag(self, cut: Cut) -> None:
        for table, snapshot_id in cut.snapshots.items():
            if snapshot_id is not None:
                tbl = load_table(self.catalog, table)
                if LEASE_TAG_PREFIX + cut.lease_id in tbl.metadata.refs:
                    tbl.manage_snapshots().remove_tag(LEASE_TAG_PREFIX + cut.lease_id).commit()

    @contextmanager
    def _statement(self) -> Iterator[Cut]:
        """The cut of one eager statement. A read-committed statement pins its cut with a lease
        of its own while it reads: the cut is protected when resolved, but once the tables
        move on, expiry could otherwise remove its snapshots' files in the middle of the read."""
        if self.level is not Level.READ_COMMITTED or self._pinned is not None:
            yield self.cut()
            return
        cut, keeper = self._lease(STATEMENT_LEASE_TTL_S, holder=f"{self.holder} (statement)")
        try:
            yield Cut(barrier=cut.barrier, level=Level.READ_COMMITTED, snapshots=cut.snapshots)
        finally:
            keeper.close()

    # -- PyIceberg (Arrow) -------------------------------------------------------------------------------

    def read(self) -> tuple[Cut, dict[TableName, object]]:
        """One statement: every table as a PyArrow table, all from one cut."""
        with self._statement() as cut:
            return cut, {t: _arrow_at(self.catalog, t, s) for t, s in cut.snapshots.items()}

    def arrow(self, table: TableName):
        """One table as a PyArrow table at the (current) cut."""
        with self._statement() as cut:
            return _arrow_at(self.catalog, table, cut.snapshots[table])

    # -- Spark --------------------------------------------------------------------------------------------

    def df(self, spark, table: TableName):
        from icebarrier.iceberg_ext.spark_io import table_at

        return table_at(spark, table, self.cut().snapshots[table])

    def sql(self, spark, query: str):
        """Run a Spark SQL query with every managed table it reads pinned to one cut.

        The tables are found by Spark's parser (:mod:`icebarrier.iceberg_ext.spark_sql`),
        resolved against the session's current catalog and namespace. A query that reads a
        managed table outside this read, or one already time-travelled, a metadata table or a
        table-valued function, raises :class:`StatementNotPinnableError` instead of reading
        it unpinned."""
        from icebarrier.control_plane.tables import managed_names
        from icebarrier.iceberg_ext import spark_sql

        statement = spark_sql.parse(spark, query)
        spark_sql.check_pinnable(statement, managed_names(self.conn), set(self.tables))
        return spark.sql(spark_sql.pin(spark, statement, self.cut().snapshots))

    def create_views(self, spark, names: dict[TableName, str] | None = None) -> Cut:
        """Temp views (default: the table's short name) pinned to one cut, for plain spark.sql."""
        from icebarrier.iceberg_ext.spark_io import table_at

        cut = self.cut()
        for table, snapshot_id in cut.snapshots.items():
            view = (names or {}).get(table, table.name)
            table_at(spark, table, snapshot_id).createOrReplaceTempView(view)
        return cut


def _arrow_at(catalog, table: TableName, snapshot_id: int | None):
    from pyiceberg.expressions import AlwaysFalse

    tbl = load_table(catalog, table)
    if snapshot_id is None:
        return tbl.scan(row_filter=AlwaysFalse()).to_arrow()
    return tbl.scan(snapshot_id=snapshot_id).to_arrow()
