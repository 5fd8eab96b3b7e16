"""Consistent reads at a consistency level, for PyIceberg (Arrow) and Spark.

    with ConsistentRead(conn, catalog, [orders, payments], level=Level.REPEATABLE_READ) as r:
        r.arrow(orders)                       # PyIceberg, no JVM
        r.sql(spark, "SELECT … FROM lake.db.orders JOIN lake.db.payments …")   # Spark
        r.create_views(spark)                 # temp views `orders`, `payments` for spark.sql

- read-committed: the latest valid cut, resolved anew for each statement (each ``sql``,
  ``arrow``, ``read`` call, or ``create_views``);
- repeatable-read: one cut resolved at entry and pinned by a lease, renewed in the
  background while the block runs and released at exit (optionally mirrored as Iceberg
  tags with a maximum age, so engines that know nothing of leases keep the snapshots);
- read-uncommitted: each table's latest recorded snapshot;
- ``barrier=B``: the cut at B, or a clear error if B is not valid or its snapshots are gone.
"""

from __future__ import annotations

import threading

import psycopg

from control_plane import leases, reads
from control_plane.model import Cut, Level, TableName
from iceberg_ext.catalog import load_table, require_snapshots

LEASE_TAG_PREFIX = "icebarrier-lease-"


class ConsistentRead:
    def __init__(
        self,
        conn: psycopg.Connection,
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
    ) -> None:
        self.conn, self.catalog, self.tables = conn, catalog, list(dict.fromkeys(tables))
        self.level, self.barrier, self.ttl_s, self.holder = Level(level), barrier, ttl_s, holder
        self.mirror_tags, self.verify_snapshots, self.bootstrap_job = mirror_tags, verify_snapshots, bootstrap_job
        self._pinned: Cut | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------------

    def __enter__(self) -> ConsistentRead:
        if self.level is Level.REPEATABLE_READ:
            cut = leases.acquire(self.conn, self.tables, ttl_s=self.ttl_s, holder=self.holder, barrier=self.barrier,
                                 bootstrap_job=self.bootstrap_job)
            try:
                # Written first, re-checked after: the snapshots must still exist in Iceberg.
                require_snapshots(self.catalog, cut.snapshots, cut.barrier)
                if self.mirror_tags:
                    self._tag(cut)
            except BaseException:
                leases.release(self.conn, cut.lease_id)
                raise
            self._pinned = cut
            self._renewer = threading.Thread(target=self._renew, name="icebarrier-lease-renewal", daemon=True)
            self._renewer.start()
        elif self.barrier is not None:
            self._pinned = self._resolve()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=10)
        if self._pinned is not None and self._pinned.lease_id:
            if self.mirror_tags:
                self._untag(self._pinned)
            leases.release(self.conn, self._pinned.lease_id)

    def _renew(self) -> None:
        while not self._stop.wait(max(self.ttl_s / 3, 0.5)):
            leases.renew(self.conn, self._pinned.lease_id, ttl_s=self.ttl_s)

    def _resolve(self) -> Cut:
        cut = reads.resolve(self.conn, self.tables, level=self.level, barrier=self.barrier)
        if self.verify_snapshots:
            require_snapshots(self.catalog, cut.snapshots, cut.barrier)
        return cut

    def cut(self) -> Cut:
        """The cut the next statement reads: pinned, or resolved now (read-committed/uncommitted)."""
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

    # -- PyIceberg (Arrow) -------------------------------------------------------------------------------

    def read(self) -> tuple[Cut, dict[TableName, object]]:
        """One statement: every table as a PyArrow table, all from one cut."""
        cut = self.cut()
        return cut, {t: _arrow_at(self.catalog, t, s) for t, s in cut.snapshots.items()}

    def arrow(self, table: TableName):
        """One table as a PyArrow table at the (current) cut."""
        return _arrow_at(self.catalog, table, self.cut().snapshots[table])

    # -- Spark --------------------------------------------------------------------------------------------

    def df(self, spark, table: TableName):
        from iceberg_ext.spark_io import table_at

        return table_at(spark, table, self.cut().snapshots[table])

    def sql(self, spark, query: str):
        """Run a Spark SQL query with every managed table it names pinned to one cut."""
        from iceberg_ext.spark_io import pin_sql

        return spark.sql(pin_sql(spark, query, self.cut().snapshots))

    def create_views(self, spark, names: dict[TableName, str] | None = None) -> Cut:
        """Temp views (default: the table's short name) pinned to one cut, for plain spark.sql."""
        from iceberg_ext.spark_io import table_at

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
