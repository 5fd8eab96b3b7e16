"""View metadata (the Iceberg view spec, format version 1) as the REST protocol builds it: a
view created from a ``CreateViewRequest``, and a ``CommitViewRequest``'s requirements and updates
applied to it, with the rules of Iceberg's reference implementation (``ViewMetadata.Builder``)
so that every engine sees the same versions, schemas and history from us as from it:

- a view version equal to one the view has (summary, representations, default catalog and
  namespace, schema) keeps that version's id; another gets the highest id + 1;
- a schema equal to one the view has (its fields and identifier fields) keeps its id;
- ``-1`` (``LAST_ADDED``) names the schema or version added last in the same commit;
- one SQL query per dialect (case-insensitive) in a version; a replace may not drop a dialect
  unless ``replace.drop-dialect.allowed``;
- ``version.history.num-entries`` (default 10) versions are kept, the current one always, and
  the history is cut at the first entry naming a version no longer kept.

The metadata is plain JSON (dicts), validated against PyIceberg's model where it is read.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from pyiceberg.exceptions import CommitFailedException

from icebarrier.control_plane.errors import IcebarrierError

LAST_ADDED = -1
HISTORY_SIZE, HISTORY_SIZE_DEFAULT = "version.history.num-entries", 10
DROP_DIALECT_ALLOWED = "replace.drop-dialect.allowed"
METADATA_PATH = "write.metadata.path"


class ViewMetadataError(IcebarrierError):
    """An update the view spec does not allow (a 400 naming it)."""


def _same_schema(one: dict, two: dict) -> bool:
    return one.get("fields") == two.get("fields") and sorted(one.get("identifier-field-ids") or []) == sorted(
        two.get("identifier-field-ids") or []
    )


def _same_version(one: dict, two: dict) -> bool:
    """Would the two versions behave the same (their id and timestamp aside)?"""
    return (
        (one.get("summary") or {}) == (two.get("summary") or {})
        and one.get("representations") == two.get("representations")
        and one.get("default-catalog") == two.get("default-catalog")
        and one.get("default-namespace") == two.get("default-namespace")
        and one.get("schema-id") == two.get("schema-id")
    )


def _dialects(version: dict) -> set[str]:
    return {r["dialect"].lower() for r in version.get("representations", ()) if r.get("type") == "sql"}


class Builder:
    """One change of a view's metadata (``base`` None: its creation)."""

    def __init__(self, base: dict | None) -> None:
        base = base or {}
        self.uuid: str | None = base.get("view-uuid")
        self.format_version = base.get("format-version", 1)
        self.location: str | None = base.get("location")
        self.schemas: list[dict] = list(base.get("schemas", ()))
        self.versions: list[dict] = list(base.get("versions", ()))
        self.history: list[dict] = list(base.get("version-log", ()))
        self.properties: dict[str, str] = dict(base.get("properties") or {})
        self.current_version_id: int | None = base.get("current-version-id")
        self.previous = self._version(self.current_version_id) if base else None
        self.added_versions: list[int] = []
        self.last_added_version: int | None = None
        self.last_added_schema: int | None = None
        self.history_entry: dict | None = None
        self.changed = False

    def _version(self, version_id: int | None) -> dict | None:
        return next((v for v in self.versions if v["version-id"] == version_id), None)

    # -- the updates

    def assign_uuid(self, value: str) -> None:
        if self.uuid is not None and value != self.uuid:
            raise ViewMetadataError("Cannot reassign uuid")
        self.changed |= value != self.uuid
        self.uuid = value

    def upgrade_format_version(self, version: int) -> None:
        if version < self.format_version:
            raise ViewMetadataError(f"Cannot downgrade v{self.format_version} view to v{version}")
        if version > 1:
            raise ViewMetadataError(f"Cannot upgrade view to format version {version}: only version 1 exists")
        self.format_version = version

    def set_location(self, location: str | None) -> None:
        if location is None:
            raise ViewMetadataError("Invalid location: null")
        self.changed |= location != self.location
        self.location = location

    def set_properties(self, updates: dict[str, str]) -> None:
        self.properties.update(updates)
        self.changed |= bool(updates)

    def remove_properties(self, removals: Iterable[str]) -> None:
        for key in removals:
            self.properties.pop(key, None)
            self.changed = True

    def add_schema(self, schema: dict) -> int:
        new_id = 0
        for existing in self.schemas:
            if _same_schema(existing, schema):
                return existing["schema-id"]
            new_id = max(new_id, existing["schema-id"] + 1)
        self.schemas.append({**schema, "schema-id": new_id})
        self.last_added_schema, self.changed = new_id, True
        return new_id

    def add_version(self, version: dict) -> int:
        version = dict(version)
        if version.get("schema-id") == LAST_ADDED:
            if self.last_added_schema is None:
                raise ViewMetadataError("Cannot set last added schema: no schema has been added")
            version["schema-id"] = self.last_added_schema
        new_id = version["version-id"]
        for existing in self.versions:
            if _same_version(existing, version):
                self.last_added_version = (
                    existing["version-id"] if existing["version-id"] in self.added_versions else None
                )
                return existing["version-id"]
            new_id = max(new_id, existing["version-id"] + 1)
        version["version-id"] = new_id
        if not any(s["schema-id"] == version["schema-id"] for s in self.schemas):
            raise ViewMetadataError(f"Cannot add version with unknown schema: {version['schema-id']}")
        seen: set[str] = set()
        for representation in version.get("representations", ()):
            if representation.get("type") == "sql":
                dialect = representation["dialect"].lower()
                if dialect in seen:
                    raise ViewMetadataError(f"Invalid view version: Cannot add multiple queries for dialect {dialect}")
                seen.add(dialect)
        self.versions.append(version)
        self.added_versions.append(new_id)
        self.last_added_version, self.changed = new_id, True
        return new_id

    def set_current_version(self, version_id: int) -> None:
        if version_id == LAST_ADDED:
            if self.last_added_version is None:
                raise ViewMetadataError("Cannot set last version id: no current version id has been set")
            version_id = self.last_added_version
        if version_id == self.current_version_id:
            return
        version = self._version(version_id)
        if version is None:
            raise ViewMetadataError(f"Cannot set current version to unknown version: {version_id}")
        self.current_version_id, self.changed = version_id, True
        added_now = version_id in self.added_versions
        self.history_entry = {
            "timestamp-ms": version["timestamp-ms"] if added_now else int(time.time() * 1000),
            "version-id": version_id,
        }

    # -- the result

    def build(self) -> dict:
        if self.location is None:
            raise ViewMetadataError("Invalid view location: null")
        if not self.versions:
            raise ViewMetadataError("Invalid view: no versions were added")
        history = self.history + ([self.history_entry] if self.history_entry else [])
        current = self._version(self.current_version_id)
        if current is None:
            raise ViewMetadataError("Invalid view: no current version")
        if self.previous is not None and self.properties.get(DROP_DIALECT_ALLOWED, "false").lower() != "true":
            dropped = _dialects(self.previous) - _dialects(current)
            if dropped:
                raise ViewMetadataError(
                    f"Cannot replace view due to loss of view dialects ({DROP_DIALECT_ALLOWED}=false): "
                    f"previous dialects {sorted(_dialects(self.previous))}, new dialects "
                    f"{sorted(_dialects(current))}"
                )
        try:
            size = int(self.properties.get(HISTORY_SIZE, HISTORY_SIZE_DEFAULT))
        except ValueError:
            raise ViewMetadataError(f"{HISTORY_SIZE} must be an integer") from None
        if size <= 0:
            raise ViewMetadataError(f"{HISTORY_SIZE} must be positive but was {size}")
        keep = max(len({*self.added_versions, self.current_version_id}), size)
        versions = self.versions
        if len(versions) > keep:
            newest_first = sorted(versions, key=lambda v: -v["version-id"])
            kept = [current] + [v for v in newest_first[:keep] if v is not current][: keep - 1]
            kept_ids = {v["version-id"] for v in kept}
            versions = kept
            cut: list[dict] = []
            for entry in history:
                cut = [*cut, entry] if entry["version-id"] in kept_ids else []
            history = cut
        return {
            "view-uuid": self.uuid or str(uuid.uuid4()),
            "format-version": self.format_version,
            "location": self.location,
            "schemas": self.schemas,
            "current-version-id": self.current_version_id,
            "versions": versions,
            "version-log": history,
            "properties": self.properties,
        }


def create(request: dict, location: str) -> dict:
    """A new view's metadata from a ``CreateViewRequest`` (JSON): its version becomes version 1
    (``operation: create``) of its schema, stamped now, as the reference catalog does."""
    version = request["view-version"]
    for key in ("representations", "default-namespace"):
        if key not in version:
            raise ViewMetadataError(f"malformed CreateViewRequest: view-version.{key}: Field required")
    if not any(r.get("type") == "sql" for r in version["representations"]):
        raise ViewMetadataError("Cannot create view without specifying a query")
    builder = Builder(None)
    builder.set_properties(request.get("properties") or {})
    builder.set_location(request.get("location") or location)
    schema_id = builder.add_schema(request["schema"])
    builder.add_version(
        {
            "version-id": 1,
            "timestamp-ms": int(time.time() * 1000),
            "schema-id": schema_id,
            "summary": {**(version.get("summary") or {}), "operation": "create"},
            "representations": version["representations"],
            "default-namespace": version["default-namespace"],
            **({"default-catalog": version["default-catalog"]} if version.get("default-catalog") else {}),
        }
    )
    builder.set_current_version(LAST_ADDED)
    return builder.build()


def commit(base: dict, requirements: list[dict], updates: list[dict]) -> dict:
    """``base`` with a ``CommitViewRequest``'s updates applied, its requirements checked first
    (a failed one is a 409: the client loads the view again and retries)."""
    for requirement in requirements:
        if requirement.get("type") != "assert-view-uuid":
            raise ViewMetadataError(f"requirement {requirement.get('type')!r} does not apply to a view")
        if requirement.get("uuid") != base["view-uuid"]:
            raise CommitFailedException(
                f"Requirement failed: view UUID does not match: expected {base['view-uuid']} != {requirement.get('uuid')}"
            )
    builder = Builder(base)
    for update in updates:
        if update.get("action") not in UPDATES:
            raise ViewMetadataError(f"update {update.get('action')!r} does not apply to a view")
        field, step = UPDATES[update["action"]]
        step(builder, update.get(field))
    return builder.build()


# action: the field of the update it takes, and the builder's step (the spec's ViewUpdate)
UPDATES: dict[str, tuple[str, Callable[[Builder, Any], object]]] = {
    "assign-uuid": ("uuid", Builder.assign_uuid),
    "upgrade-format-version": ("format-version", Builder.upgrade_format_version),
    "add-schema": ("schema", Builder.add_schema),
    "set-location": ("location", Builder.set_location),
    "set-properties": ("updates", Builder.set_properties),
    "remove-properties": ("removals", Builder.remove_properties),
    "add-view-version": ("view-version", Builder.add_version),
    "set-current-view-version": ("view-version-id", Builder.set_current_version),
}
