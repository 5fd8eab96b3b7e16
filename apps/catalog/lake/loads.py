"""Loads: a table's metadata through a warehouse (latest, pinned at a barrier, a
read-committed session's cut, a lease's), as the LoadTableResult a client gets.
"""

from __future__ import annotations

from icebarrier.apps.catalog.delegation import Delegation
from icebarrier.apps.catalog.errors import ForbiddenError
from icebarrier.apps.catalog.lake.sessions import Sessions
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import db, leases, reads, tokens
from icebarrier.control_plane.errors import SnapshotExpiredError
from icebarrier.control_plane.model import TableName
from icebarrier.control_plane.tokens import AuthenticationError, Principal
from icebarrier.iceberg_ext.pinning import pinned

LEASE_RENEW_S = 300.0


class Loads(Sessions):
    def load(
        self,
        conn,
        warehouse: Warehouse,
        table: TableName,
        principal: Principal,
        access_token: str | None,
        access: Delegation,
    ) -> bytes:
        """The LoadTableResult for ``table`` through ``warehouse``, as JSON bytes."""
        from pyiceberg.exceptions import NoSuchTableError

        if warehouse.kind == "job":
            warehouse = self.session_view(conn, self.session(conn, warehouse, principal), table)
        staged = self.staged(conn, principal.job, table) if warehouse.kind == "latest" else None
        if staged is not None:  # the job's own commits of a barrier it has not published yet
            metadata, _ = self.metadata(staged["metadata_location"])
            return self.response(staged["metadata_location"], metadata, principal, access).model_dump_json().encode()
        with db.translated(conn, "load_table"):
            state = conn.execute(
                self._load_sql,
                {
                    "catalog": table.catalog,
                    "namespace": ".".join(table.namespace),
                    "table": table.name,
                    "name": self.managed_key(table),
                    "barrier": warehouse.barrier,
                },
            ).fetchone()
        if state["location"] is None:
            raise NoSuchTableError(f"table {table} does not exist")
        if warehouse.kind == "latest" or not state["managed"]:
            metadata, _ = self.metadata(state["location"])
            return self.response(state["location"], metadata, principal, access).model_dump_json().encode()
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
            return (
                self.response(result.metadata_location, result.metadata, principal, access).model_dump_json().encode()
            )

        reader = principal.kind == "reader"  # the response's config depends on who asks for what
        return self.pinned_cache.get((str(metadata.table_uuid), snapshot_id, reader, access.modes), pin)

    def exists(self, conn, warehouse: Warehouse, table: TableName, principal: Principal) -> None:
        """Does ``table`` exist for the caller (a job session sees the sinks it created)? Else
        NoSuchTableError."""
        if warehouse.kind != "job" or self.staged(conn, principal.job, table) is None:
            self.current(conn, table)

    def pinned_snapshot(self, conn, warehouse: Warehouse, table: TableName, access_token: str | None) -> int | None:
        if warehouse.kind == "lease":  # each load renews it (never shortening it)
            lease = leases.get(conn, warehouse.lease)
            remaining_s = (lease.expires_at - conn.execute("SELECT now() AS t").fetchone()["t"]).total_seconds()
            if lease.state != "active" or remaining_s < LEASE_RENEW_S:
                lease = leases.renew(conn, warehouse.lease, ttl_s=LEASE_RENEW_S)
            if table not in lease.snapshots:
                raise ForbiddenError(
                    f"lease {lease.lease_id} does not pin {table} (it pins "
                    f"{', '.join(sorted(map(str, lease.snapshots)))}); read it through another "
                    f"warehouse or take a lease that covers it"
                )
            return lease.snapshots[table]
        scope = None
        if warehouse.namespace is not None:
            scope = f"{self.settings.catalog}.{warehouse.namespace}"
            if ".".join(table.namespace) != warehouse.namespace:
                raise ForbiddenError(
                    f"warehouse {warehouse} reads only namespace {warehouse.namespace}, not {table}; "
                    f"use warehouse read-committed for the whole lake"
                )
        if access_token is None:
            raise AuthenticationError(
                "read-committed is stable per client session and needs a token; create one "
                "with `icebarrier token create --reader` and pass it as credential"
            )
        barrier, snapshot_id = tokens.session_cut(conn, access_token, str(table), scope=scope, quiet_ms=self.quiet_ms)
        if barrier is None:  # no cut over the scope yet: the table's own, or why there is none
            return reads.resolve(conn, [table]).snapshots[table]
        return snapshot_id
