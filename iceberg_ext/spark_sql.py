"""The tables a Spark SQL statement reads, found by Spark's own parser, and pinning them.

A regular expression over query text cannot tell a table from a string literal, a column
path (``s.addr.city``) or a CTE name, and misses backticks and ``USE``. Here the statement
is parsed by the session's parser; every relation it names is resolved against the
session's current catalog and namespace exactly as Spark resolves it, and carries the
character span of its identifier in the text. Pinning inserts ``VERSION AS OF <snapshot>``
right after each managed table's identifier (or reads a pinned empty view when the table
had no snapshot at the cut), re-parses the result and checks that every managed relation is
now pinned to the cut; literals are never touched. A statement that names a managed table
in a way that cannot be pinned (already time-travelled, a metadata table, a table-valued
function, a table outside the read) is refused with :class:`StatementNotPinnableError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.errors import StatementNotPinnableError

_PLANS = "org.apache.spark.sql.catalyst.plans.logical."
_ANALYSIS = "org.apache.spark.sql.catalyst.analysis."
_SUBQUERY = "org.apache.spark.sql.catalyst.expressions.SubqueryExpression"
# Table-valued functions that only generate rows from their arguments (no table access).
_PURE_TVFS = frozenset(
    {
        "range",
        "explode",
        "explode_outer",
        "inline",
        "inline_outer",
        "posexplode",
        "posexplode_outer",
        "json_tuple",
        "stack",
    }
)
EMPTY_VIEW_PREFIX = "__icebarrier_empty_"


@dataclass(frozen=True, slots=True, kw_only=True)
class Relation:
    """One relation of a statement: an identifier as written, and what it resolves to."""

    parts: tuple[str, ...]
    kind: str  # table, cte, temp_view, function
    table: TableName | None  # for kind=table: catalog.namespace.name, lower-cased
    start: int  # span of the identifier in the text, inclusive
    stop: int
    aliased: bool = False
    time_travel: str | None = None  # the VERSION/TIMESTAMP AS OF already written, if any

    @property
    def written(self) -> str:
        return ".".join(self.parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Statement:
    text: str
    relations: tuple[Relation, ...]
    sink: TableName | None = None  # for INSERT INTO|OVERWRITE
    overwrite: bool = False
    query_start: int = 0  # where the SELECT of an INSERT starts

    @property
    def query(self) -> str:
        return self.text[self.query_start :]

    def tables(self) -> list[TableName]:
        """The tables read, once each, in order of appearance (sink excluded)."""
        return list(dict.fromkeys(r.table for r in self.relations if r.kind == "table"))


def _seq(scala_seq) -> list:
    out, it = [], scala_seq.iterator()
    while it.hasNext():
        out.append(it.next())
    return out


class _Parser:
    def __init__(self, spark) -> None:
        self.spark, self.jvm = spark, spark._jvm
        state = spark._jsparkSession.sessionState()
        self.parser, self.catalogs, self.session_catalog = state.sqlParser(), state.catalogManager(), state.catalog()
        self._classes: dict[str, Any] = {}  # java.lang.Class proxies

    def is_a(self, obj, class_name: str) -> bool:
        cls = self._classes.get(class_name)
        if cls is None:
            cls = self._classes[class_name] = self.jvm.java.lang.Class.forName(class_name)
        return cls.isInstance(obj)

    def resolve(self, parts: tuple[str, ...]) -> TableName | None:
        """catalog.namespace.name as Spark resolves a multipart identifier in this session."""
        if len(parts) > 1 and self.catalogs.isCatalogRegistered(parts[0]):
            catalog, rest = parts[0], parts[1:]
        else:
            catalog, rest = self.catalogs.currentCatalog().name(), parts
        if len(rest) == 1:
            rest = (*self.catalogs.currentNamespace(), rest[0])
        if len(rest) < 2:
            return None
        return TableName(catalog=catalog.lower(), namespace=tuple(p.lower() for p in rest[:-1]), name=rest[-1].lower())

    def relation(self, node, ctes: frozenset[str], *, aliased: bool, time_travel: str | None = None) -> Relation:
        parts = tuple(str(p) for p in _seq(node.multipartIdentifier()))
        origin = node.origin()
        start, stop = int(origin.startIndex().get()), int(origin.stopIndex().get())
        if len(parts) == 1 and parts[0].lower() in ctes:
            kind, table = "cte", None
        elif len(parts) == 1 and self.session_catalog.getTempView(parts[0]).isDefined():
            kind, table = "temp_view", None
        else:
            kind, table = "table", self.resolve(parts)
        return Relation(
            kind=kind, table=table, parts=parts, start=start, stop=stop, aliased=aliased, time_travel=time_travel
        )

    def walk(self, plan, ctes: frozenset[str], out: list[Relation], parent=None) -> None:
        name = plan.getClass().getName()
        aliased = parent is not None and self.is_a(parent, _PLANS + "SubqueryAlias")
        if name == _ANALYSIS + "UnresolvedRelation":
            out.append(self.relation(plan, ctes, aliased=aliased))
            return
        if name == _ANALYSIS + "RelationTimeTravel":
            version = plan.version()
            travel = f"VERSION AS OF {version.get()}" if version.isDefined() else "TIMESTAMP AS OF …"
            inner = plan.relation()
            if inner.getClass().getName() == _ANALYSIS + "UnresolvedRelation":
                out.append(self.relation(inner, ctes, aliased=aliased, time_travel=travel))
            return
        if name == _ANALYSIS + "UnresolvedTableValuedFunction":
            fn = tuple(str(p) for p in _seq(plan.name()))
            if fn[-1].lower() not in _PURE_TVFS:
                origin = plan.origin()
                out.append(
                    Relation(
                        parts=fn,
                        kind="function",
                        table=None,
                        start=int(origin.startIndex().get()),
                        stop=int(origin.stopIndex().get()),
                    )
                )
        if name == _PLANS + "UnresolvedWith":
            # Each CTE is visible in the later definitions and in the body.
            scope = ctes
            for pair in _seq(plan.cteRelations()):
                self.walk(pair._2(), scope, out)
                scope = scope | {str(pair._1()).lower()}
            self.walk(plan.child(), scope, out, plan)
            return
        for child in _seq(plan.children()):
            self.walk(child, ctes, out, plan)
        for inner in _seq(plan.innerChildren()):
            self.walk(inner, ctes, out, plan)
        for expression in _seq(plan.expressions()):
            self._walk_expression(expression, ctes, out)

    def _walk_expression(self, expression, ctes, out) -> None:
        if self.is_a(expression, _SUBQUERY):
            self.walk(expression.plan(), ctes, out)
        for child in _seq(expression.children()):
            self._walk_expression(child, ctes, out)


def parse(spark, text: str, *, insert: bool = False) -> Statement:
    """Parse a query (with ``insert``: an ``INSERT INTO|OVERWRITE <table> <query>``) with
    Spark's parser.

    Raises :class:`StatementNotPinnableError` for any other kind of statement."""
    p = _Parser(spark)
    plan = _parse_plan(p, text)
    relations: list[Relation] = []
    if insert and plan.getClass().getName() == _PLANS + "InsertIntoStatement":
        target = plan.table()
        if target.getClass().getName() != _ANALYSIS + "UnresolvedRelation":
            raise StatementNotPinnableError(None, "an INSERT must name its target table directly")
        if plan.partitionSpec().nonEmpty() or plan.userSpecifiedCols().nonEmpty():
            raise StatementNotPinnableError(
                None, "write INSERT INTO <table> SELECT … without a column list or PARTITION clause"
            )
        sink_relation = p.relation(target, frozenset(), aliased=False)
        p.walk(plan.query(), frozenset(), relations)
        _dedupe(relations)
        # With no column list or PARTITION clause the query follows the target's identifier
        # (the query node's own origin is its top operator, e.g. the GROUP BY).
        return Statement(
            text=text,
            relations=tuple(relations),
            sink=sink_relation.table,
            overwrite=bool(plan.overwrite()),
            query_start=sink_relation.stop + 1,
        )
    if p.is_a(plan, _PLANS + "Command") or p.is_a(plan, _PLANS + "ParsedStatement"):
        raise StatementNotPinnableError(
            None, "only queries (SELECT, WITH, VALUES, TABLE) can be read at a cut; run writes through a job"
        )
    p.walk(plan, frozenset(), relations)
    _dedupe(relations)
    return Statement(text=text, relations=tuple(relations))


def _parse_plan(p: _Parser, text: str):
    from pyspark.errors import ParseException

    try:
        return p.parser.parsePlan(text)
    except ParseException as exc:  # PySpark converts the JVM's ParseException on every py4j call
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "syntax error"
        raise StatementNotPinnableError(None, f"Spark cannot parse the statement: {first}") from None


def _dedupe(relations: list[Relation]) -> None:
    """A subquery can be reached twice (as an inner child and as an expression)."""
    seen, unique = set(), []
    for r in relations:
        if (r.start, r.stop) not in seen:
            seen.add((r.start, r.stop))
            unique.append(r)
    relations[:] = unique


def check_pinnable(
    statement: Statement, managed: set[TableName], allowed: set[TableName] | None = None
) -> list[TableName]:
    """The managed tables the statement reads; refuses any it reads in a way that cannot be pinned.

    ``allowed`` (the read's tables) refuses a managed table outside it."""
    read = []
    for r in statement.relations:
        if r.kind == "function":
            raise StatementNotPinnableError(
                None,
                f"table-valued function {r.written}(…) may read tables the cut cannot pin; "
                f"read the table by name instead",
            )
        if r.kind != "table" or r.table is None:
            continue
        if r.table not in managed:
            meta = (
                TableName(catalog=r.table.catalog, namespace=r.table.namespace[:-1], name=r.table.namespace[-1])
                if len(r.table.namespace) > 1
                else None
            )
            if meta in managed:
                raise StatementNotPinnableError(
                    str(meta),
                    f"{r.written} is a metadata table, which has no snapshot to pin; "
                    f"query it with read-uncommitted (a plain spark.sql)",
                )
            continue
        if r.time_travel:
            raise StatementNotPinnableError(
                str(r.table),
                f"{r.written} already has {r.time_travel}; a consistent read pins the snapshot "
                f"itself, so drop the clause (or read that snapshot outside the consistent read)",
            )
        if allowed is not None and r.table not in allowed:
            raise StatementNotPinnableError(
                str(r.table),
                "the query reads it but the consistent read does not include it; add it to the "
                "read's tables so it is pinned to the same cut",
            )
        read.append(r.table)
    return list(dict.fromkeys(read))


def pin(spark, statement: Statement, snapshots: dict[TableName, int | None]) -> str:
    """The statement's query text with every table in ``snapshots`` pinned to its snapshot.

    The result is parsed again and checked: each of those tables is read at its snapshot."""
    from icebarrier.iceberg_ext.spark_io import table_at

    text, offset = statement.query, statement.query_start
    for r in sorted(statement.relations, key=lambda r: -r.start):
        if r.kind != "table" or r.table not in snapshots:
            continue
        start, stop = r.start - offset, r.stop - offset + 1
        snapshot_id = snapshots[r.table]
        if snapshot_id is None:
            view = EMPTY_VIEW_PREFIX + "_".join((r.table.catalog, *r.table.namespace, r.table.name))
            table_at(spark, r.table, None).createOrReplaceTempView(view)
            replacement = view if r.aliased else f"{view} AS `{r.parts[-1]}`"
        else:
            replacement = f"{text[start:stop]} VERSION AS OF {int(snapshot_id)}"
        text = text[:start] + replacement + text[stop:]
    _verify(spark, text, snapshots)
    return text


def _verify(spark, text: str, snapshots: dict[TableName, int | None]) -> None:
    p = _Parser(spark)
    relations: list[Relation] = []
    p.walk(_parse_plan(p, text), frozenset(), relations)
    for r in relations:
        if r.kind == "table" and r.table in snapshots:
            expected = f"VERSION AS OF {snapshots[r.table]}"
            if r.time_travel != expected:
                raise StatementNotPinnableError(
                    str(r.table),
                    f"could not be pinned (found {r.time_travel or 'no time travel'}, "
                    f"expected {expected}); please report this query",
                )
