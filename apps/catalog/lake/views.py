"""Views (the REST spec's view endpoints), stored as Iceberg's JDBC catalog stores them: a view
metadata file in the warehouse, its pointer a row of the SQL catalog's ``iceberg_tables`` with
``iceberg_type = 'VIEW'`` (tables and views share one name space: a name is one or the other).

A view is not a sink and has no barrier: it holds SQL text, and an engine reading it loads the
tables it names through the same catalog, so through the same warehouse. Through
``read-committed`` those loads share the session's cut, through ``barrier-<B>`` they are at B:
a view over several tables reads one moment (docs/views.md).

Who may create, replace, rename or drop a view: an admin, or a job token with a write grant on
the view's name or a namespace above it (or a whole-lake job token), through ``latest``, as for
a table icebarrier does not manage. Reading a view needs a read grant, as for a table.
"""

from __future__ import annotations

import json
import uuid

import psycopg
from pyiceberg.exceptions import (
    NamespaceNotEmptyError,
    NoSuchTableError,
    NoSuchViewError,
    TableAlreadyExistsError,
    ViewAlreadyExistsError,
)

from icebarrier.apps.catalog import view_metadata
from icebarrier.apps.catalog.lake.core import VIEW, LakeCore, _catalog_sql, java_name
from icebarrier.control_plane.model import TableName, quote_name, sql_namespace
from icebarrier.control_plane.tokens import Principal

TABLE = "TABLE"


class Views(LakeCore):
    """The views of the SQL catalog."""

    def _catalog(self, text: str) -> str:
        return _catalog_sql(self.settings.catalog_schema, text)

    def view_names(self, conn, namespace: tuple[str, ...]) -> list[str]:
        rows = conn.execute(
            self._catalog(
                "SELECT table_name FROM {cs}.iceberg_tables WHERE catalog_name = %s AND table_namespace = %s "
                "AND iceberg_type = 'VIEW' ORDER BY table_name"
            ),
            (self.settings.catalog, sql_namespace(namespace)),
        ).fetchall()
        if not rows:
            self.namespace_location(conn, namespace)
        return [r["table_name"] for r in rows]

    def load_view(self, conn, name: TableName) -> tuple[str, dict]:
        """(metadata location, metadata JSON) of view ``name``; NoSuchViewError if there is none."""
        kind, location = self.kind_of(conn, name)
        if kind != VIEW or location is None:
            raise NoSuchViewError(f"View does not exist: {java_name(name)}")
        return location, self._read(location)

    def _read(self, location: str) -> dict:
        from pyiceberg.io import load_file_io

        with load_file_io(self.properties, location).new_input(location).open() as f:
            return json.loads(f.read())

    def _write(self, metadata: dict, version: int) -> str:
        """A new metadata file of ``metadata`` (``<location>/metadata/NNNNN-<uuid>.metadata.json``,
        or under ``write.metadata.path``); its location."""
        from pyiceberg.io import load_file_io

        folder = (
            metadata["properties"].get(view_metadata.METADATA_PATH) or f"{metadata['location'].rstrip('/')}/metadata"
        )
        location = f"{folder.rstrip('/')}/{version:05d}-{uuid.uuid4()}.metadata.json"
        with load_file_io(self.properties, location).new_output(location).create(overwrite=False) as f:
            f.write(json.dumps(metadata, separators=(",", ":")).encode())
        return location

    @staticmethod
    def _version_of(location: str) -> int:
        try:
            return int(location.rsplit("/", 1)[-1].split("-", 1)[0])
        except ValueError:
            return 0

    def _require_free(self, conn, principal: Principal, name: TableName) -> None:
        """May ``principal`` put a view at ``name``: its namespace exists, no table or view has it."""
        principal.require_write_unmanaged(name)
        self.namespace_location(conn, name.namespace)
        kind, _ = self.kind_of(conn, name)
        if kind == VIEW:
            raise ViewAlreadyExistsError(f"View already exists: {java_name(name)}")
        if kind == TABLE:
            raise TableAlreadyExistsError(f"Table with same name already exists: {java_name(name)}")

    def _insert(self, conn, name: TableName, location: str) -> None:
        try:
            with conn.transaction():
                conn.execute(
                    self._catalog(
                        "INSERT INTO {cs}.iceberg_tables (catalog_name, table_namespace, table_name, "
                        "metadata_location, previous_metadata_location, iceberg_type) VALUES (%s, %s, %s, %s, NULL, 'VIEW')"
                    ),
                    (name.catalog, name.sql_namespace, name.name, location),
                )
        except psycopg.errors.UniqueViolation:  # created meanwhile
            raise ViewAlreadyExistsError(f"View already exists: {java_name(name)}") from None

    def create_view(self, conn, principal: Principal, name: TableName, request: dict) -> tuple[str, dict]:
        self._require_free(conn, principal, name)
        metadata = view_metadata.create(request, self.default_location(conn, name))
        self.confine(conn, name, metadata["location"], metadata["properties"])
        location = self._write(metadata, 0)
        self._insert(conn, name, location)
        return location, metadata

    def register_view(self, conn, principal: Principal, name: TableName, metadata_location: str) -> tuple[str, dict]:
        self._require_free(conn, principal, name)
        near = self.placing(conn)
        self.confinement.check_file(str(name), metadata_location, near)
        try:
            metadata = self._read(metadata_location)
            location = metadata["location"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise view_metadata.ViewMetadataError(
                f"metadata-location {metadata_location!r} cannot be read as view metadata ({type(exc).__name__}); "
                f"give the location of a view's metadata.json file"
            ) from None
        self.confine(conn, name, location, metadata.get("properties") or {}, near=near)
        self._insert(conn, name, metadata_location)
        return metadata_location, metadata

    def replace_view(
        self, conn, principal: Principal, name: TableName, requirements: list[dict], updates: list[dict]
    ) -> tuple[str, dict]:
        """A CommitViewRequest: the row locked while the new metadata is built from the current
        one and written, so concurrent replaces apply one after the other."""
        principal.require_write_unmanaged(name)
        with conn.transaction():
            row = conn.execute(
                self._catalog(
                    "SELECT metadata_location FROM {cs}.iceberg_tables WHERE catalog_name = %s "
                    "AND table_namespace = %s AND table_name = %s AND iceberg_type = 'VIEW' FOR UPDATE"
                ),
                (name.catalog, name.sql_namespace, name.name),
            ).fetchone()
            if row is None:
                raise NoSuchViewError(f"View does not exist: {java_name(name)}")
            current = row["metadata_location"]
            metadata = view_metadata.commit(self._read(current), requirements, updates)
            if any(u["action"] in ("set-properties", "set-location") for u in updates):  # where it writes
                self.confine(conn, name, metadata["location"], metadata["properties"])
            location = self._write(metadata, self._version_of(current) + 1)
            conn.execute(
                self._catalog(
                    "UPDATE {cs}.iceberg_tables SET metadata_location = %s, previous_metadata_location = %s "
                    "WHERE catalog_name = %s AND table_namespace = %s AND table_name = %s"
                ),
                (location, current, name.catalog, name.sql_namespace, name.name),
            )
        return location, metadata

    def drop_view(self, conn, principal: Principal, name: TableName) -> None:
        principal.require_write_unmanaged(name)
        with conn.transaction():
            dropped = conn.execute(
                self._catalog(
                    "DELETE FROM {cs}.iceberg_tables WHERE catalog_name = %s AND table_namespace = %s "
                    "AND table_name = %s AND iceberg_type = 'VIEW'"
                ),
                (name.catalog, name.sql_namespace, name.name),
            ).rowcount
        if not dropped:
            raise NoSuchViewError(f"View does not exist: {java_name(name)}")

    def rename_view(self, conn, principal: Principal, source: TableName, destination: TableName) -> None:
        for name in (source, destination):
            principal.require_write_unmanaged(name)
        if self.kind_of(conn, source)[0] != VIEW:
            raise NoSuchViewError(f"View does not exist: {java_name(source)}")
        self.namespace_location(conn, destination.namespace)
        kind, _ = self.kind_of(conn, destination)
        if kind is not None:
            raise (ViewAlreadyExistsError if kind == VIEW else TableAlreadyExistsError)(
                f"Cannot rename {java_name(source)} to {java_name(destination)}. "
                f"{'View' if kind == VIEW else 'Table'} already exists"
            )
        try:
            with conn.transaction():
                moved = conn.execute(
                    self._catalog(
                        "UPDATE {cs}.iceberg_tables SET table_namespace = %s, table_name = %s WHERE catalog_name = %s "
                        "AND table_namespace = %s AND table_name = %s AND iceberg_type = 'VIEW'"
                    ),
                    (destination.sql_namespace, destination.name, source.catalog, source.sql_namespace, source.name),
                ).rowcount
        except psycopg.errors.UniqueViolation:
            raise ViewAlreadyExistsError(
                f"Cannot rename {java_name(source)} to {java_name(destination)}. View already exists"
            ) from None
        if not moved:
            raise NoSuchViewError(f"View does not exist: {java_name(source)}")

    def require_no_views(self, conn, namespace: tuple[str, ...]) -> None:
        """A namespace holding views is not empty (PyIceberg's SQL catalog counts only tables)."""
        if self.view_names(conn, namespace):
            raise NamespaceNotEmptyError(f"Namespace {quote_name(namespace)} is not empty: it holds views")

    def table_is_a_view(self, conn, name: TableName) -> None:
        """A table operation on a view's name: the table does not exist."""
        if self.kind_of(conn, name)[0] == VIEW:
            raise NoSuchTableError(f"Table does not exist: {java_name(name)}")
