"""Table administration: create (or stage-create), register, drop and rename, each
refused for a managed table where the control plane's record would be lost.
"""

from __future__ import annotations

from pyiceberg.exceptions import CommitFailedException, TableAlreadyExistsError, ViewAlreadyExistsError

from icebarrier.apps.catalog.delegation import Delegation
from icebarrier.apps.catalog.errors import ForbiddenError
from icebarrier.apps.catalog.lake.core import VIEW, java_name
from icebarrier.apps.catalog.lake.sessions import Sessions
from icebarrier.apps.catalog.lake.views import Views
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import TableName
from icebarrier.control_plane.tokens import Principal


class Admin(Sessions, Views):
    def may_write(self, conn, principal: Principal, table: TableName) -> bool:
        """Check that ``principal`` may change ``table``; returns whether it is managed."""
        managed, writer = self.writer_of(conn, table)
        self.require_writer(principal, table, managed, writer)
        return managed

    def create(self, conn, warehouse: Warehouse, principal: Principal, table: TableName, request, access: Delegation):
        """Create (or stage-create) a table from a :class:`~.models.CreateTableRequest`; the
        LoadTableResult. Through a job session, a sink's creation is staged."""

        if warehouse.kind == "job":
            return self.create_staged(conn, self.session(conn, warehouse, principal), table, request, principal, access)
        managed = self.may_write(conn, principal, table)
        made = self.new_table(conn, table, request)
        if not request.stage_create:  # the metadata written once, its pointer in the request's transaction
            self.write_metadata(made)
            self._point_new(conn, table, made.metadata_location)
        return self.response(table, made.metadata_location, made.metadata, principal, access, managed=managed)

    def _point_new(self, conn, table: TableName, metadata_location: str) -> None:
        """A new table's pointer, on the request's connection (its transaction holds the marks the
        placement took, :meth:`placing`); a table of that name is a TableAlreadyExistsError (a
        view's, a ViewAlreadyExistsError)."""
        try:
            self.point(conn, table, metadata_location, None)
        except CommitFailedException:
            raise TableAlreadyExistsError(f"Table {table.sql_namespace}.{table.name} already exists") from None

    @staticmethod
    def outside_sessions(warehouse: Warehouse, what: str) -> None:
        """Refuse, through a job session, what a session cannot stage (registering, dropping, renaming)."""
        if warehouse.kind == "job":
            raise ForbiddenError(f"a job session writes only data to its sinks; {what} through warehouse latest")

    def register(
        self,
        conn,
        principal: Principal,
        table: TableName,
        metadata_location: str,
        *,
        overwrite: bool,
        access: Delegation,
    ):
        """Register an existing metadata file as ``table``; the LoadTableResult. Overwriting is
        refused for a managed table: its history is the control plane's record."""
        from pyiceberg.exceptions import NoSuchTableError

        managed = self.may_write(conn, principal, table)
        self.require_not_a_view(conn, table)
        if overwrite and managed:
            raise ForbiddenError(
                f"table {table} is managed by icebarrier; registering over it would replace its "
                f"barrier history. Revise it with `icebarrier revise` instead"
            )
        near = self.placing(conn)
        self.confinement.check_file(str(table), metadata_location, near)  # before anything is read
        try:
            metadata, _ = self.metadata(metadata_location)
        except (OSError, ValueError) as exc:
            raise IcebarrierError(
                f"metadata-location {metadata_location!r} cannot be read as table metadata "
                f"({type(exc).__name__}); give the location of a metadata.json file"
            ) from None
        self.confine(conn, table, metadata.location, metadata.properties, near=near)
        if not overwrite:
            self.namespace_location(conn, table.namespace)  # NoSuchNamespaceError
            self._point_new(conn, table, metadata_location)
        else:
            try:
                current, _, _ = self.current(conn, table)
            except NoSuchTableError:
                current = None
            self.point(conn, table, metadata_location, current)
        return self.response(table, metadata_location, metadata, principal, access, managed=managed)

    def drop(self, conn, principal: Principal, table: TableName, *, purge: bool) -> None:
        self.may_write(conn, principal, table)
        (self.catalog.purge_table if purge else self.catalog.drop_table)(table.identifier)

    def rename(self, conn, principal: Principal, source: TableName, destination: TableName) -> None:
        """Rename an unmanaged table. A managed table (or a name a job declares as its sink) is
        never renamed through the catalog: jobs, barrier records and leases name it."""
        for table in (source, destination):
            managed, writer = self.writer_of(conn, table)
            if not managed:
                principal.require_write_unmanaged(table)
            else:
                owner = f"job {writer}" if writer else "the control plane"
                raise ForbiddenError(
                    f"table {table} is managed by icebarrier (written by {owner}); it is not renamed through the "
                    f"catalog. Register the job with the new sink name and let it write the new table instead"
                )
        self.table_is_a_view(conn, source)
        if self.kind_of(conn, destination)[0] == VIEW:
            raise ViewAlreadyExistsError(
                f"Cannot rename {java_name(source)} to {java_name(destination)}. View already exists"
            )
        self.catalog.rename_table(source.identifier, destination.identifier)
