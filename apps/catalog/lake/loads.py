"""Loads: a table's metadata through a warehouse (latest, pinned at a barrier, a
read-committed session's cut, a lease's), as the LoadTableResult a client gets.

A load is one statement (:func:`~icebarrier.control_plane.catalog_loads.load_state`: the token,
the cut, the pointer) and a response put together from cached bytes: a metadata file's JSON is
serialized once, and only the ``config`` (the caller's storage access) is made per request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from icebarrier.apps.catalog.delegation import Delegation
from icebarrier.apps.catalog.errors import ForbiddenError
from icebarrier.apps.catalog.lake.core import around_metadata, java_name
from icebarrier.apps.catalog.lake.sessions import Sessions
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import catalog_loads, leases
from icebarrier.control_plane.errors import SnapshotExpiredError
from icebarrier.control_plane.model import TableName, quote_name
from icebarrier.control_plane.tokens import AuthenticationError, Principal
from icebarrier.iceberg_ext.pinning import pinned

LEASE_RENEW_S = 300.0
SCAN_PLANNING_MODE = "scan-planning-mode"  # in a load's config: where the client plans (Iceberg 1.11+)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadPlan:
    """A load, planned before the database: the warehouse it reads through (a job session's view
    resolved), what :func:`~icebarrier.control_plane.catalog_loads.load_state` is asked, and why
    a managed table would be refused."""

    warehouse: Warehouse
    table: TableName
    query: catalog_loads.LoadQuery
    acting: Principal | None
    refusal: Exception | None


class Loads(Sessions):
    def load(
        self,
        conn,
        warehouse: Warehouse,
        table: TableName,
        access: Delegation,
        *,
        access_token: str | None,
        acting: Principal | None = None,
    ) -> bytes:
        """The LoadTableResult for ``table`` through ``warehouse``, as JSON bytes. The token is
        checked in the load's own statement; ``acting``: who acts, where the caller knows it
        already (a job's session: the job, which may be an admin's choice)."""
        if warehouse.kind == "job":
            if acting is None:
                raise ValueError("a load in a job's session needs the job acting")
            warehouse = self.session_view(conn, self.session(conn, warehouse, acting), table)
        plan = self.plan(warehouse, table, access_token, acting)
        return self.respond(conn, plan, catalog_loads.load_state(conn, plan.query), access)

    def plan(
        self, warehouse: Warehouse, table: TableName, access_token: str | None, acting: Principal | None = None
    ) -> LoadPlan:
        refusal = self._read_committed_refusal(warehouse, table, access_token)
        query = catalog_loads.LoadQuery(
            catalog_schema=self.settings.catalog_schema,
            table=table,
            managed_key=self.managed_key(table),
            mode="refused" if refusal else warehouse.kind,
            access_token=access_token,
            job=acting.job if acting is not None and acting.kind == "job" else None,
            barrier=warehouse.barrier,
            scope=f"{self.settings.catalog}.{warehouse.namespace}" if warehouse.namespace else None,
            quiet_ms=self.quiet_ms,
        )
        return LoadPlan(warehouse=warehouse, table=table, query=query, acting=acting, refusal=refusal)

    def respond(self, conn, plan: LoadPlan, state: catalog_loads.LoadState, access: Delegation) -> bytes:
        """The LoadTableResult of a load whose state the database gave (``conn``: only a lease's
        load uses it, to renew the lease)."""
        from pyiceberg.exceptions import NoSuchTableError

        warehouse, table = plan.warehouse, plan.table
        principal = plan.acting or state.principal
        principal.require_read(table)  # before anything is told of the table, even whether it exists
        where = {"managed": state.managed or state.staged_location is not None, "warehouse": str(plan.warehouse)}
        if state.staged_location is not None:  # the job's own commits of a barrier it has not published yet
            return self.answer(table, state.staged_location, principal, access, **where)
        if state.location is None:
            raise NoSuchTableError(f"Table does not exist: {java_name(table)}")
        if warehouse.kind == "latest" or not state.managed:
            return self.answer(table, state.location, principal, access, **where)
        if plan.refusal is not None:
            raise plan.refusal
        # The cut first, then the pointer (in load_state, or a lease's fixed snapshot): a commit's
        # metadata lands before its record, so the current metadata holds S(T, B) unless it was
        # expired.
        snapshot_id = self._leased(conn, warehouse, table) if warehouse.kind == "lease" else state.snapshot_id
        metadata, io = self.metadata(state.location)
        if snapshot_id is not None and metadata.snapshot_by_id(snapshot_id) is None:
            raise SnapshotExpiredError(str(table), snapshot_id)

        def pin() -> tuple[str, bytes, str]:
            result = pinned(io, metadata, snapshot_id)
            return result.metadata_location, result.metadata.model_dump_json().encode(), metadata.location

        location, metadata_json, table_location = self.pinned_cache.get((str(metadata.table_uuid), snapshot_id), pin)
        return self._spliced(table, location, metadata_json, table_location, principal, access, **where)

    def answer(self, table: TableName, location: str, principal: Principal, access: Delegation, **where) -> bytes:
        """The LoadTableResult of the metadata file at ``location``."""

        metadata_json, table_location = self.metadata_json(location)
        return self._spliced(table, location, metadata_json, table_location, principal, access, **where)

    def _spliced(
        self,
        table: TableName,
        location: str,
        metadata_json: bytes,
        table_location: str,
        principal: Principal,
        access: Delegation,
        **where,
    ) -> bytes:
        """A TableResponse's JSON (``pyiceberg.catalog.rest.TableResponse``, as ``response``
        makes it) around the metadata's cached bytes: only the storage access is made per request
        (it depends on who asks, and session credentials are renewed)."""
        config, credentials = self.storage_access(table, table_location, principal, access, **where)
        if self.scan_planning == "server":
            config = {**config, SCAN_PLANNING_MODE: "server"}
        return around_metadata(
            location,
            metadata_json,
            b',"config":',
            json.dumps(config, separators=(",", ":")).encode(),
            b',"storage-credentials":',
            json.dumps(credentials, separators=(",", ":")).encode(),
        )

    def exists(self, conn, warehouse: Warehouse, table: TableName, principal: Principal) -> None:
        """Does ``table`` exist for the caller (a job session sees the sinks it created)? Else
        NoSuchTableError."""
        if warehouse.kind != "job" or self.staged(conn, principal.job, table) is None:
            self.current(conn, table)

    def _read_committed_refusal(
        self, warehouse: Warehouse, table: TableName, access_token: str | None
    ) -> Exception | None:
        """Why a managed table may not be read through this read-committed warehouse (None: it may,
        or the warehouse is another). Raised only if the table turns out to be managed."""
        if warehouse.kind != "read-committed":
            return None
        if warehouse.namespace is not None and quote_name(table.namespace) != warehouse.namespace:
            return ForbiddenError(
                f"warehouse {warehouse} reads only namespace {warehouse.namespace}, not {table}; "
                f"use warehouse read-committed for the whole lake"
            )
        if access_token is None:
            return AuthenticationError(
                "read-committed is stable per client session and needs a token; create one "
                "with `icebarrier token create --reader --namespace NS` and pass it as credential"
            )
        return None

    @staticmethod
    def _leased(conn, warehouse: Warehouse, table: TableName) -> int | None:
        """The snapshot of ``table`` the lease pins; each load renews the lease (never shortening it)."""
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
