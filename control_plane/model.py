"""Values of the control plane: names, barriers, cuts, leases.

Parsing and formatting live on the types. Names are validated here, once, so that nothing
that reaches SQL or a file path can carry quotes, dots in the wrong place or path parts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum

from icebarrier.control_plane.errors import InvalidNameError, InvalidValueError

_JOB = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
_EXTERNAL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/@=+-]{0,511}")
_HOLDER = re.compile(r"[^\x00-\x1f\x7f]{1,200}")


# -- names: one rule for a namespace level and a table name, at every entry ----------------------

NAME_MAX = 128  # characters in a namespace level or a table name
NAMESPACE_MAX = 255  # characters in a namespace as the SQL catalog stores it (its varchar(255))
_NOT_IN_NAME = re.compile(r"[\x00-\x1f\x7f/]")


def check_name(value: str, what: str = "table name") -> str:
    """The rule for a namespace level or a table name (``what``), whoever creates it (the REST
    catalog, the CLI, job registration): 1 to :data:`NAME_MAX` characters, not blank, not ``.``
    or ``..`` (a path that walks), no '/' (a segment of REST paths and of the table's location),
    no control character (NUL, the 0x1F that separates levels in paths, newlines). A '.' inside
    a name is allowed, as the spec has it: the SQL catalog stores it escaped
    (:func:`sql_namespace`) and icebarrier quotes it (:meth:`TableName.__str__`). Raises
    :class:`InvalidNameError` naming the rule."""
    if (
        not isinstance(value, str)
        or not value.strip()
        or len(value) > NAME_MAX
        or _NOT_IN_NAME.search(value)
        or value in (".", "..")
    ):
        shown = value if not isinstance(value, str) or len(value) <= 40 else f"{value[:40]}…"
        raise InvalidNameError(
            f"{what} {shown!r} is invalid: a name is 1 to {NAME_MAX} characters, not blank, not '.' or '..', "
            f"without '/' or control characters"
        )
    return value


def check_namespace(levels) -> tuple[str, ...]:
    """A namespace: at least one level, each by :func:`check_name`, at most
    :data:`NAMESPACE_MAX` characters as the SQL catalog stores it."""
    levels = tuple(levels)
    if not levels:
        raise InvalidNameError("a namespace has at least one level")
    for level in levels:
        check_name(level, "namespace level")
    if len(sql_namespace(levels)) > NAMESPACE_MAX:
        raise InvalidNameError(
            f"namespace {quote_name(levels)[:40]!r}… is invalid: at most {NAMESPACE_MAX} characters with its levels "
            f"joined by '.' (a '.' or '%' inside a level counts 3)"
        )
    return levels


# The SQL catalog (PyIceberg's and Iceberg's JDBC catalog) keeps a namespace in one column, its
# levels joined by '.': a '.' inside a level is stored as %2E (and '%' as %25), so that ["a.b"]
# and ["a", "b"] stay two namespaces, with two locations.
_ESCAPED = re.compile(r"%(2E|25)")


def sql_namespace(levels) -> str:
    """A namespace as the SQL catalog's ``table_namespace`` column holds it."""
    return ".".join(level.replace("%", "%25").replace(".", "%2E") for level in levels)


def sql_levels(levels) -> tuple[str, ...]:
    """A namespace's levels as PyIceberg's SQL catalog takes them (each escaped: it joins them by '.')."""
    return tuple(sql_namespace((level,)) for level in levels)


def namespace_from_sql(text: str) -> tuple[str, ...]:
    """The levels of a namespace as the SQL catalog holds it (:func:`sql_namespace`, inverted)."""
    return tuple(_ESCAPED.sub(lambda m: "." if m[1] == "2E" else "%", level) for level in text.split("."))


# A name's parts as people write them (the CLI, logs, views, Spark SQL): `a.b`.c is the level
# "a.b", then c. A part of lower-case letters, digits and '_' is written as is; any other is
# quoted in backticks, verbatim, a backtick in it doubled, as Spark SQL quotes them. Unquoted, a
# part of letters, digits and '_' is read lower-cased: a name reads back as it was written.
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LOWER = re.compile(r"[a-z_][a-z0-9_]*")
_PART = re.compile(r"`((?:[^`]|``)*)`|([^.`]*)")


def quote_part(part: str) -> str:
    return part if _LOWER.fullmatch(part) else "`" + part.replace("`", "``") + "`"


def quote_name(parts) -> str:
    """Parts joined by '.', each quoted when it must be (:func:`split_name` reads it back)."""
    return ".".join(map(quote_part, parts))


def split_name(text: str) -> list[str] | None:
    """The parts of a name written as :func:`quote_name` writes it; None if it is not one."""
    parts, at = [], 0
    while True:
        match = _PART.match(text, at)
        assert match is not None  # one alternative matches the empty string
        quoted, plain = match[1], match[2]
        if quoted is not None:
            parts.append(quoted.replace("``", "`"))
        elif _PLAIN.fullmatch(plain):
            parts.append(plain.lower())
        else:
            return None
        at = match.end()
        if at == len(text):
            return parts
        if text[at] != ".":
            return None
        at += 1


@dataclass(frozen=True, slots=True, order=True)
class TableName:
    """An Iceberg table identifier ``catalog.namespace[.namespace…].table``; written with parts
    other than lower-case identifiers quoted in backticks (`` lake.`new.db`.`ta.ble` ``)."""

    catalog: str
    namespace: tuple[str, ...]
    name: str

    @classmethod
    def parse(cls, text: str) -> TableName:
        parts = split_name(text.strip())
        if parts is None or len(parts) < 3 or not _PLAIN.fullmatch(parts[0]):
            raise InvalidNameError(
                f"table name {text!r} is invalid; use catalog.namespace.table, each part letters, digits and "
                f"underscores or quoted in backticks (`a.b`, a backtick doubled), e.g. lake.db.orders"
            )
        try:
            check_name(parts[-1])
            return cls(catalog=parts[0], namespace=check_namespace(parts[1:-1]), name=parts[-1])
        except InvalidNameError as exc:
            raise InvalidNameError(f"table name {text!r} is invalid: {str(exc).split(' is invalid: ')[-1]}") from None

    @classmethod
    def from_sql_catalog(cls, catalog: str, namespace: str, name: str) -> TableName:
        """The table of a row of the SQL catalog (its namespace column as stored)."""
        return cls(catalog=catalog, namespace=namespace_from_sql(namespace), name=name)

    def __str__(self) -> str:
        return quote_name((self.catalog, *self.namespace, self.name))

    @property
    def identifier(self) -> tuple[str, ...]:
        """The identifier inside its catalog as PyIceberg's SQL catalog takes it (a '.' in a
        namespace level escaped, :func:`sql_namespace`; its table name as is)."""
        return (*sql_levels(self.namespace), self.name)

    @property
    def levels(self) -> tuple[str, ...]:
        """The identifier inside its catalog as the REST protocol and its clients take it."""
        return (*self.namespace, self.name)

    @property
    def sql_namespace(self) -> str:
        """Its namespace as the SQL catalog's ``table_namespace`` column holds it."""
        return sql_namespace(self.namespace)


def parse_job_name(text: str) -> str:
    if not _JOB.fullmatch(text):
        raise InvalidNameError(
            f"job name {text!r} is invalid; start with a letter or underscore, then letters, "
            f"digits, '_', '-' or '.', at most 128 characters"
        )
    return text


def parse_external_input(text: str) -> str:
    if not _EXTERNAL.fullmatch(text):
        raise InvalidNameError(
            f"external input {text!r} is invalid; use letters, digits and _.:/@=+- only "
            f"(e.g. kafka:orders or file:/data/in), at most 512 characters"
        )
    return text


_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def parse_schema_name(text: str) -> str:
    """A Postgres schema for the control plane or the catalog: lower case (Postgres folds
    unquoted names, e.g. in search_path), not a system schema."""
    if not _SCHEMA.fullmatch(text) or text.startswith("pg_") or text == "information_schema":
        raise InvalidNameError(
            f"schema name {text!r} is invalid; use lower-case letters, digits and underscores (at most 63), "
            f"not starting with pg_ and not information_schema, e.g. icebarrier"
        )
    return text


def parse_holder(text: str) -> str:
    if not _HOLDER.fullmatch(text):
        raise InvalidNameError(f"lease holder {text!r} is invalid; use 1-200 printable characters")
    return text


_DURATION = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d)?")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration_s(text: str, *, allow_zero: bool = False) -> float:
    """``"500ms"``, ``"10s"``, ``"10m"``, ``"1.5h"``, ``"2d"`` or plain seconds → seconds
    (``allow_zero``: ``"0s"`` is accepted, e.g. "older than 0s" = any age)."""
    match = _DURATION.fullmatch(str(text).strip())
    if not match or float(match["n"]) < 0 or (float(match["n"]) == 0 and not allow_zero):
        least = "zero or more" if allow_zero else "a positive number"
        raise InvalidValueError(f"duration {text!r} is invalid; use {least} with ms, s, m, h or d, e.g. 10m")
    return float(match["n"]) * _UNIT_S[match["unit"]]


_SIZE = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]i?B?|B)?", re.IGNORECASE)


def parse_size_bytes(text: str) -> int:
    """``"128MB"``, ``"1GiB"``, ``"512k"`` or plain bytes → bytes (K, M, G, T are powers of 1024,
    as Iceberg's ``write.target-file-size-bytes`` is usually given)."""
    match = _SIZE.fullmatch(str(text).strip())
    if not match or float(match["n"]) <= 0:
        raise InvalidValueError(f"size {text!r} is invalid; use a positive number with B, KB, MB, GB or TB, e.g. 128MB")
    unit = (match["unit"] or "B")[0].upper()
    return int(float(match["n"]) * 1024 ** "BKMGT".index(unit))


def format_size_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    if size < 1024:
        return f"{size} B"
    shown, units = size / 1024, ["KiB", "MiB", "GiB"]
    while shown >= 1024 and len(units) > 1:
        shown, units = shown / 1024, units[1:]
    return f"{shown:.1f}".removesuffix(".0") + f" {units[0]}"


_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def parse_tag_name(text: str) -> str:
    """An Iceberg tag name icebarrier creates: letters, digits, '_', '-' and '.'."""
    if not _TAG.fullmatch(text):
        raise InvalidNameError(f"tag name {text!r} is invalid; use letters, digits, '_', '-' and '.' (at most 128)")
    return text


def format_duration_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


# -- barriers --------------------------------------------------------------------------------


def barrier_time(barrier: int) -> datetime:
    """A barrier is microseconds since the epoch on the control plane's clock."""
    return datetime.fromtimestamp(barrier / 1_000_000, tz=UTC)


def barrier_label(barrier: int | None) -> str:
    """A barrier with its time on the control-plane clock, e.g. ``1795346857725686 (12:04:17.7 UTC)``."""
    if barrier is None:
        return "none"
    at = barrier_time(barrier)
    return f"{barrier} ({at:%H:%M:%S}.{at.microsecond // 100000} UTC)"


@dataclass(frozen=True, slots=True, kw_only=True)
class Barrier:
    barrier: int
    issued_at: datetime
    issued_by: str
    anchor: bool = False  # the first barrier at or after a multiple of the anchor interval: never coalesced


class Level(str, Enum):
    """Consistency levels for reads (DESIGN.md)."""

    READ_UNCOMMITTED = "read-uncommitted"
    READ_COMMITTED = "read-committed"
    REPEATABLE_READ = "repeatable-read"


# -- topology ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class JobDefinition:
    """What a job reads and writes; the unit of registration."""

    name: str
    sources: frozenset[TableName] = frozenset()
    sinks: frozenset[TableName] = frozenset()
    external_inputs: frozenset[str] = frozenset()

    @property
    def is_root(self) -> bool:
        return not self.sources

    def differences(self, other: JobDefinition) -> str:
        parts = []
        for label, mine, theirs in (
            ("sources", self.sources, other.sources),
            ("sinks", self.sinks, other.sinks),
            ("external inputs", self.external_inputs, other.external_inputs),
        ):
            if mine != theirs:
                parts.append(f"{label} {sorted(map(str, mine))} -> {sorted(map(str, theirs))}")
        return "; ".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class TableState:
    """A managed table's progress: it has completed B iff start <= B <= watermark and B is not
    coalesced. ``coalesced`` holds (after, into) ranges: the barriers strictly between were
    completed once, at ``into``, and the table's state at them is undefined."""

    name: TableName
    start_barrier: int | None
    watermark: int | None
    coalesced: tuple[tuple[int, int], ...] = ()

    def coalesced_at(self, barrier: int) -> tuple[int, int] | None:
        """The coalesced range holding ``barrier`` strictly inside, if any."""
        return next(((a, i) for a, i in self.coalesced if a < barrier < i), None)

    @property
    def span(self) -> tuple[int, int]:
        """(start barrier, watermark) of a table that has completed a barrier."""
        if self.start_barrier is None or self.watermark is None:
            raise ValueError(f"{self.name} has completed no barrier")
        return self.start_barrier, self.watermark

    def holding(self, barrier: int) -> tuple[int, int]:
        """The coalesced range holding ``barrier``, of a table within whose span it lies and
        that has not completed it (the one reason it can have)."""
        found = self.coalesced_at(barrier)
        if found is None:
            raise ValueError(f"{self.name} has completed barrier {barrier}, or it lies outside its span")
        return found

    def has_completed(self, barrier: int) -> bool:
        return (
            self.start_barrier is not None
            and self.watermark is not None
            and self.start_barrier <= barrier <= self.watermark
            and self.coalesced_at(barrier) is None
        )


# -- cuts and leases ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Cut:
    """A snapshot per table at one barrier. ``snapshot_id`` None: the table was empty at B."""

    barrier: int | None
    level: Level
    snapshots: dict[TableName, int | None] = field(default_factory=dict)
    lease_id: str | None = None
    expires_at: datetime | None = None

    def to_json(self) -> dict:
        return {
            "barrier": self.barrier,
            "level": self.level.value,
            "snapshots": {str(t): s for t, s in sorted(self.snapshots.items())},
            "lease_id": self.lease_id,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    lease_id: str
    holder: str
    barrier: int | None
    acquired_at: datetime
    expires_at: datetime
    released_at: datetime | None
    snapshots: dict[TableName, int | None]

    @property
    def state(self) -> str:
        if self.released_at is not None:
            return "released"
        if self.expires_at <= datetime.now(UTC):
            return "expired"
        return "active"

    def to_json(self) -> dict:
        return {
            "lease_id": self.lease_id,
            "holder": self.holder,
            "barrier": self.barrier,
            "state": self.state,
            "acquired_at": self.acquired_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "snapshots": {str(t): s for t, s in sorted(self.snapshots.items())},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtectedSnapshot:
    """A snapshot that expiry must keep, and why (``lease:<id>``, ``job:<name>``, …)."""

    snapshot_id: int
    reasons: tuple[str, ...]
