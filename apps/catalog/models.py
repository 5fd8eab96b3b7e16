"""Request bodies as the REST spec defines them (``open-api/rest-catalog-open-api.yaml``).

PyIceberg's models are a *client's*: its ``CreateTableRequest`` requires ``location``,
``partition-spec`` and ``write-order``, which the spec makes optional. These follow the spec:
required fields required, optional ones optional with the spec's defaults, unknown fields
ignored. The parts a client builds (schema, partition spec, sort order, table updates and
requirements) are PyIceberg's types, which follow the spec's component schemas.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, RootModel, field_validator
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table.sorting import SortOrder
from pyiceberg.table.update import TableRequirement, TableUpdate
from pyiceberg.view.metadata import ViewVersion

from icebarrier.apps.catalog import view_metadata
from icebarrier.apps.catalog.errors import MalformedRequestError, describe_validation
from icebarrier.control_plane import model
from icebarrier.control_plane.errors import InvalidNameError


class _Request(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)

    @classmethod
    def parse(cls, body: object):
        """The request, or :class:`MalformedRequestError` naming the first bad field."""
        from pydantic import ValidationError

        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise MalformedRequestError(describe_validation(exc.errors(), cls.__name__)) from None
        except Exception as exc:  # noqa: BLE001 - PyIceberg's validators raise assorted errors on odd input
            why = (
                f"{exc.args[0]} is missing"
                if isinstance(exc, KeyError) and exc.args
                else (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            )
            raise MalformedRequestError(f"malformed {cls.__name__}: {why}") from None


FORMAT_VERSION = "format-version"


def check_name(value: str, what: str) -> str:
    """The names rule (:func:`icebarrier.control_plane.model.check_name`) as a validator's
    ValueError (a 400 naming the rule)."""
    try:
        return model.check_name(value, what)
    except InvalidNameError as exc:
        raise ValueError(str(exc)) from None


def check_namespace(levels) -> tuple[str, ...]:
    try:
        return model.check_namespace(levels)
    except InvalidNameError as exc:
        raise ValueError(str(exc)) from None


def _properties(value: dict[str, str]) -> dict[str, str]:
    if any("\x00" in k or "\x00" in v for k, v in value.items()):
        raise ValueError("property keys and values must not contain NUL")
    return value


class TableIdentifier(_Request):
    namespace: tuple[str, ...]
    name: str

    @field_validator("namespace")
    @classmethod
    def _levels(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_namespace(value)

    @field_validator("name")
    @classmethod
    def _table(cls, value: str) -> str:
        return check_name(value, "table name")


class CreateNamespaceRequest(_Request):
    namespace: tuple[str, ...]
    properties: dict[str, str] = Field(default_factory=dict)

    _levels = field_validator("namespace")(TableIdentifier._levels.__func__)  # type: ignore[attr-defined]  # the classmethod's function, reused
    _props = field_validator("properties")(_properties)


class UpdateNamespacePropertiesRequest(_Request):
    removals: tuple[str, ...] = ()
    updates: dict[str, str] = Field(default_factory=dict)

    _props = field_validator("updates")(_properties)

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

    _table = field_validator("name")(TableIdentifier._table.__func__)  # type: ignore[attr-defined]  # the classmethod's function, reused
    _props = field_validator("properties")(_properties)

    @field_validator("properties")
    @classmethod
    def _format_version(cls, value: dict[str, str]) -> dict[str, str]:
        if value.get(FORMAT_VERSION, "2") not in ("1", "2"):
            raise ValueError(
                f"{FORMAT_VERSION} {value[FORMAT_VERSION]} is not served: the catalog writes table metadata with "
                f"PyIceberg, which writes format versions 1 and 2; create the table with {FORMAT_VERSION} 2"
            )
        return value


class RegisterTableRequest(_Request):
    name: str
    metadata_location: str = Field(alias="metadata-location")
    overwrite: bool = False

    _table = field_validator("name")(TableIdentifier._table.__func__)  # type: ignore[attr-defined]  # the classmethod's function, reused


class ExistingIdentifier(_Request):
    """A table that exists, named as it is: a rename's source may carry a name an earlier version
    let through (``icebarrier doctor`` lists them), so that it can be renamed to one the rule allows."""

    namespace: tuple[str, ...]
    name: str

    @field_validator("namespace")
    @classmethod
    def _some(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("a namespace has at least one level")
        return value

    @field_validator("name")
    @classmethod
    def _named(cls, value: str) -> str:
        return value or check_name(value, "table name")  # an empty name names nothing: the rule says so


def _json(model_: BaseModel) -> dict:
    """A model as the JSON the spec shows (lists, not tuples: stored metadata compares equal)."""
    return json.loads(model_.model_dump_json(by_alias=True, exclude_none=True))


class CreateViewRequest(_Request):
    name: str
    view_schema: Schema = Field(alias="schema")
    view_version: ViewVersion = Field(alias="view-version")
    location: str | None = None
    properties: dict[str, str] = Field(default_factory=dict)

    _name = field_validator("name")(TableIdentifier._table.__func__)  # type: ignore[attr-defined]  # the classmethod's function, reused
    _props = field_validator("properties")(_properties)

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "schema": _json(self.view_schema),
            "view-version": _json(self.view_version),
            "location": self.location,
            "properties": self.properties,
        }


_VIEW_MODELS: dict[str, type[BaseModel]] = {
    "add-schema": Schema,
    "add-view-version": ViewVersion,
}  # a model of the spec


def _view_update(update: dict) -> dict:
    """A view update with its fields checked (and its schema or version as the spec shows them)."""
    if not isinstance(update, dict) or update.get("action") not in view_metadata.UPDATES:
        action = update.get("action") if isinstance(update, dict) else update
        raise ValueError(f"unknown view update {action!r}; use one of {', '.join(view_metadata.UPDATES)}")
    key, _ = view_metadata.UPDATES[update["action"]]
    if key not in update:
        raise ValueError(f"{update['action']} needs {key}")
    kind = _VIEW_MODELS.get(update["action"])
    return {**update, key: _json(kind.model_validate(update[key]))} if kind is not None else update


def _view_requirement(requirement: dict) -> dict:
    if not isinstance(requirement, dict) or requirement.get("type") != "assert-view-uuid" or "uuid" not in requirement:
        raise ValueError("a view's only requirement is assert-view-uuid, with its uuid")
    return requirement


class CommitViewRequest(_Request):
    identifier: TableIdentifier | None = None
    requirements: list[Annotated[dict, AfterValidator(_view_requirement)]] = Field(default_factory=list)
    updates: list[Annotated[dict, AfterValidator(_view_update)]]


class RenameTableRequest(_Request):
    source: ExistingIdentifier
    destination: TableIdentifier


class CommitTableRequest(_Request):
    identifier: TableIdentifier | None = None
    requirements: tuple[TableRequirement, ...]
    updates: tuple[TableUpdate, ...]


class CommitTransactionRequest(_Request):
    table_changes: tuple[CommitTableRequest, ...] = Field(alias="table-changes")

    @field_validator("table_changes")
    @classmethod
    def _identified(cls, value: tuple[CommitTableRequest, ...]) -> tuple[CommitTableRequest, ...]:
        if any(c.identifier is None for c in value):
            raise ValueError("each table change must carry its identifier")
        return value


def _not_bool(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError("a boolean is not an integer")
    return value


Int64 = Annotated[int, BeforeValidator(_not_bool), Field(ge=-(2**63), lt=2**63)]  # 1.0 is one (JSON Schema)


class CounterResult(_Request):
    unit: str
    value: Int64


class TimerResult(_Request):
    time_unit: str = Field(alias="time-unit")
    count: Int64
    total_duration: Int64 = Field(alias="total-duration")


class TransformTerm(_Request):
    type: Literal["transform"]
    transform: str
    term: str


Term = str | TransformTerm


class TrueExpression(_Request):
    type: Literal["true"]


class FalseExpression(_Request):
    type: Literal["false"]


class AndOrExpression(_Request):
    type: Literal["and", "or"]
    left: Expression
    right: Expression


class NotExpression(_Request):
    type: Literal["not"]
    child: Expression


# The operands: spec 1.10 names them term/value, later specs child or left/right (a value
# expression: literal, reference or function). Reports are dropped: operands are not parsed.
class SetExpression(_Request):
    type: Literal["in", "not-in"]
    term: Term | None = None
    child: object = None
    values: object


class LiteralExpression(_Request):
    type: Literal["lt", "lt-eq", "gt", "gt-eq", "eq", "not-eq", "starts-with", "not-starts-with"]
    term: Term | None = None
    value: object = None
    left: object = None
    right: object = None


class UnaryExpression(_Request):
    type: Literal["is-null", "not-null", "is-nan", "not-nan"]
    term: Term | None = None
    child: object = None
    value: object = None


# A predicate: a bare boolean (later specs; Java's client writes `true` for alwaysTrue) or an object.
Expression = (
    Annotated[bool, Field(strict=True)]
    | Annotated[
        TrueExpression
        | FalseExpression
        | AndOrExpression
        | NotExpression
        | SetExpression
        | LiteralExpression
        | UnaryExpression,
        Field(discriminator="type"),
    ]
)
AndOrExpression.model_rebuild()
NotExpression.model_rebuild()


class _Report(_Request):
    report_type: str = Field(alias="report-type")
    table_name: str = Field(alias="table-name")
    snapshot_id: Int64 = Field(alias="snapshot-id")
    metrics: dict[str, CounterResult | TimerResult]
    metadata: dict[str, str] = Field(default_factory=dict)


class ScanReport(_Report):
    filter: Expression
    schema_id: int = Field(alias="schema-id")
    projected_field_ids: tuple[int, ...] = Field(alias="projected-field-ids")
    projected_field_names: tuple[str, ...] = Field(alias="projected-field-names")


class CommitReport(_Report):
    sequence_number: Int64 = Field(alias="sequence-number")
    operation: str


class ReportMetricsRequest(RootModel[ScanReport | CommitReport]):
    """A scan or commit report (accepted and dropped)."""

    parse = classmethod(_Request.parse.__func__)  # type: ignore[attr-defined,var-annotated,pydantic-field]
