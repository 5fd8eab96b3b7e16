"""Request bodies as the REST spec defines them (``open-api/rest-catalog-open-api.yaml``).

PyIceberg's models are a *client's*: its ``CreateTableRequest`` requires ``location``,
``partition-spec`` and ``write-order``, which the spec makes optional. These follow the spec:
required fields required, optional ones optional with the spec's defaults, unknown fields
ignored. The parts a client builds (schema, partition spec, sort order, table updates and
requirements) are PyIceberg's types, which follow the spec's component schemas.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table.sorting import SortOrder
from pyiceberg.table.update import TableRequirement, TableUpdate

from icebarrier.apps.catalog.errors import MalformedRequestError, describe_validation


class _Request(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)

    @classmethod
    def parse(cls, body: object):
        """The request, or :class:`MalformedRequestError` naming the first bad field."""
        from pydantic import ValidationError

        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise MalformedRequestError(describe_validation(exc.errors(), f"{cls.__name__}")) from None


def _name(value: str, what: str) -> str:
    if not value or "\x1f" in value:
        raise ValueError(f"a {what} must be a non-empty string without the unit separator (0x1F)")
    return value


class TableIdentifier(_Request):
    namespace: tuple[str, ...]
    name: str

    @field_validator("namespace")
    @classmethod
    def _levels(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("a namespace has at least one level")
        return tuple(_name(v, "namespace level") for v in value)

    @field_validator("name")
    @classmethod
    def _table(cls, value: str) -> str:
        return _name(value, "table name")


class CreateNamespaceRequest(_Request):
    namespace: tuple[str, ...]
    properties: dict[str, str] = Field(default_factory=dict)

    _levels = field_validator("namespace")(TableIdentifier._levels.__func__)


class UpdateNamespacePropertiesRequest(_Request):
    removals: tuple[str, ...] = ()
    updates: dict[str, str] = Field(default_factory=dict)

    @field_validator("removals")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError("removals must not repeat a key")
        return value


class CreateTableRequest(_Request):
    name: str
    table_schema: Schema = Field(alias="schema")
    location: str | None = None
    partition_spec: PartitionSpec | None = Field(default=None, alias="partition-spec")
    write_order: SortOrder | None = Field(default=None, alias="write-order")
    stage_create: bool = Field(default=False, alias="stage-create")
    properties: dict[str, str] = Field(default_factory=dict)

    _table = field_validator("name")(TableIdentifier._table.__func__)


class RegisterTableRequest(_Request):
    name: str
    metadata_location: str = Field(alias="metadata-location")
    overwrite: bool = False

    _table = field_validator("name")(TableIdentifier._table.__func__)


class RenameTableRequest(_Request):
    source: TableIdentifier
    destination: TableIdentifier


class CommitTableRequest(_Request):
    identifier: TableIdentifier | None = None
    requirements: tuple[TableRequirement, ...]
    updates: tuple[TableUpdate, ...]


class CommitTransactionRequest(_Request):
    table_changes: tuple[CommitTableRequest, ...] = Field(alias="table-changes", min_length=1)

    @field_validator("table_changes")
    @classmethod
    def _identified(cls, value: tuple[CommitTableRequest, ...]) -> tuple[CommitTableRequest, ...]:
        if any(c.identifier is None for c in value):
            raise ValueError("each table change must carry its identifier")
        return value


class ReportMetricsRequest(_Request):
    """A scan or commit report: accepted and dropped (the fields both kinds require)."""

    report_type: str = Field(alias="report-type")
    table_name: str = Field(alias="table-name")
    snapshot_id: int = Field(alias="snapshot-id")
    metrics: dict[str, object]
