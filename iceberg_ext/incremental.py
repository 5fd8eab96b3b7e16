"""An SqlJob's query maintained incrementally (DESIGN.md, "Incremental SQL").

The sink at barrier B stays exactly the query Q over the sources at B; from the barrier P the
job last computed, with append-only changes ΔS since P, it is reached more cheaply:

- **rows**: projections, filters, inner joins and ``UNION ALL`` map appends to appends. For a
  join of table occurrences t1 … tn, ΔQ is the union over i of Q with t1 … t(i-1) at P, ti's
  increment and t(i+1) … tn at B (``ΔL⋈R(B) ∪ L(P)⋈ΔR`` for two). The sink takes ΔQ as an append.
- **groups**: ``GROUP BY`` (or none) with ``COUNT(*)``, ``COUNT(x)``, ``SUM``, ``MIN``, ``MAX``,
  ``AVG`` over such rows. Each aggregate has partials that combine (counts and sums add, with
  SQL's NULLs; minima and maxima take the least and greatest; an average is a sum and a
  count): the partials of ΔQ's groups are combined with the stored partials of the same
  groups at P, and the sink is rewritten with those groups replaced. A sink's own
  columns are its partials unless an ``AVG`` needs a sum and a count: then a state table of
  the job (``<sink>__icebarrier_state``) holds every partial, written in the same barrier.

The query is analysed with sqlglot (Spark dialect); tables are resolved the way Spark's parser
resolves them (:mod:`icebarrier.iceberg_ext.spark_sql`). Anything outside the class is named
(:attr:`Analysis.reason`) and the job recomputes fully; so does a computation whose inputs
are not append-only since P (the runtime's checks, :class:`Computation`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

from icebarrier.control_plane.model import TableName, barrier_label
from icebarrier.iceberg_ext.catalog import ancestors, barrier_of, is_compaction, load_table, summary_properties

if TYPE_CHECKING:
    from icebarrier.iceberg_ext.barrier_context import BarrierContext

DIALECT = "spark"
# Part of every fingerprint: partials written by a different planner are not continued from.
PLANNER_VERSION = "1"
SUMMARY_PLAN = "icebarrier.sql-plan"  # the snapshot summary property carrying the fingerprint
STATE_SUFFIX = "__icebarrier_state"

# Functions whose value depends on when the query runs: two runs of the same query differ,
# so the result of earlier barriers cannot be kept (Spark's analyser calls them deterministic).
_CLOCK_FUNCTIONS = frozenset(
    {
        "current_timestamp",
        "current_date",
        "current_time",
        "now",
        "curdate",
        "localtimestamp",
        "current_timezone",
        "unix_timestamp",
        "current_user",
        "user",
        "session_user",
        "current_catalog",
        "current_database",
        "current_schema",
    }
)
_AGGREGATES: dict[type, str] = {exp.Count: "count", exp.Sum: "sum", exp.Min: "min", exp.Max: "max", exp.Avg: "avg"}
_OCCURRENCE = "icebarrier_occurrence"  # a table node's index among the query's table occurrences


class _Outside(Exception):
    """The construct that puts the query outside the incremental class (the message)."""


@dataclass(frozen=True)
class Partial:
    column: str
    expression: exp.Expression  # over the input rows of a group
    combine: str  # SUM, MIN or MAX: how two partials of the same group combine


@dataclass(frozen=True)
class Aggregate:
    position: int  # in the query's output
    func: str  # count, sum, min, max, avg
    argument: exp.Expression | None  # None: COUNT(*)

    def partials(self) -> tuple[Partial, ...]:
        p = f"__ib_p{self.position}"
        arg = self.argument.copy() if self.argument is not None else None
        if self.func == "avg":
            return (Partial(f"{p}_sum", exp.Sum(this=arg), "SUM"), Partial(f"{p}_count", exp.Count(this=arg), "SUM"))
        if self.func == "count":
            return (Partial(p, exp.Count(this=arg if arg is not None else exp.Star()), "SUM"),)
        if self.func == "sum":
            return (Partial(p, exp.Sum(this=arg), "SUM"),)
        return (Partial(p, exp.Min(this=arg) if self.func == "min" else exp.Max(this=arg), self.func.upper()),)


@dataclass(frozen=True)
class Query:
    """A query in the incremental class. ``tree`` is the parsed query with each table
    occurrence marked; ``tables[i]`` is occurrence i's table."""

    tree: exp.Expression
    tables: tuple[TableName, ...]
    keys: tuple[int, ...]  # output positions of the GROUP BY keys (grouped queries)
    aggregates: tuple[Aggregate, ...]  # none: the query maps appended rows to appended rows
    fingerprint: str

    @property
    def grouped(self) -> bool:
        return bool(self.aggregates)

    @property
    def needs_state(self) -> bool:
        """An AVG keeps a sum and a count beyond the sink's columns."""
        return any(a.func == "avg" for a in self.aggregates)

    def key_column(self, j: int) -> str:
        return f"__ib_k{j}"

    def partials(self) -> tuple[Partial, ...]:
        return tuple(p for a in self.aggregates for p in a.partials())

    # -- the SQL it runs ------------------------------------------------------------------------------

    def full(self, view: Callable[[TableName, str], str]) -> str:
        """Q over every table at B."""
        return _render(self.tree, self.tables, lambda i: "new", view)

    def delta(self, view: Callable[[TableName, str], str]) -> str:
        """ΔQ for a rows query; for a grouped one, the partials of ΔQ's groups (several rows
        per group: one per delta term; they combine)."""
        tree = self._partials_select() if self.grouped else self.tree
        return " UNION ALL ".join(_delta_terms(tree, self.tables, view))

    def full_partials(self, view: Callable[[TableName, str], str]) -> str:
        """The partials of every group over the tables at B (what a state table holds)."""
        return _render(self._partials_select(), self.tables, lambda i: "new", view)

    def _partials_select(self) -> exp.Select:
        select = self.tree.copy()
        assert isinstance(select, exp.Select)
        items = select.expressions
        keyed = [exp.alias_(items[pos].unalias().copy(), self.key_column(j)) for j, pos in enumerate(self.keys)]
        partials = [exp.alias_(p.expression, p.column) for p in self.partials()]
        select.set("expressions", keyed + partials)
        return select


@dataclass(frozen=True)
class Analysis:
    query: Query | None
    reason: str | None = None  # the construct outside the class, when query is None


def analyse(text: str, resolve: Callable[[tuple[str, ...]], TableName | None], *, salt: str = "") -> Analysis:
    """Is the query ``text`` (the SELECT of an SqlJob) in the incremental class? ``resolve``
    maps a table identifier as written to the table Spark reads (None: not a managed table)."""
    try:
        tree = sqlglot.parse_one(text, dialect=DIALECT)
    except SqlglotError as exc:
        return Analysis(None, f"sqlglot cannot parse it ({str(exc).splitlines()[0]})")
    try:
        if not isinstance(tree, exp.Select | exp.Union):
            raise _Outside(f"{type(tree).__name__.upper()} (only SELECT and UNION ALL)")
        tables = _mark_tables(tree, resolve)
        keys: tuple[int, ...] = ()
        aggregates: tuple[Aggregate, ...] = ()
        if isinstance(tree, exp.Select) and _is_grouped(tree):
            _check_rows(tree, allow_grouping=True)
            keys, aggregates = _check_groups(tree)
        else:
            _check_union_of_rows(tree)
    except _Outside as exc:
        return Analysis(None, str(exc))
    canonical = tree.sql(dialect=DIALECT)
    fingerprint = hashlib.sha256(f"{PLANNER_VERSION}\n{salt}\n{canonical}".encode()).hexdigest()[:16]
    return Analysis(Query(tree, tables, keys, aggregates, fingerprint))


def state_table(sink: TableName) -> TableName:
    return TableName(catalog=sink.catalog, namespace=sink.namespace, name=sink.name + STATE_SUFFIX)


# -- analysis -------------------------------------------------------------------------------------------


def _mark_tables(tree: exp.Expression, resolve) -> tuple[TableName, ...]:
    if tree.find(exp.CTE) is not None:
        raise _Outside("a WITH clause (common table expression)")
    tables = []
    for i, node in enumerate(tree.find_all(exp.Table)):
        parts = tuple(p for p in (node.catalog, node.db, node.name) if p)
        if not isinstance(node.this, exp.Identifier) or not parts:
            raise _Outside(f"a table expression ({node.sql(dialect=DIALECT)})")
        table = resolve(parts)
        if table is None:
            raise _Outside(f"{'.'.join(parts)}, which is not a managed table")
        node.meta[_OCCURRENCE] = i
        tables.append(table)
    if not tables:
        raise _Outside("a query that reads no table")
    return tuple(tables)


def _is_grouped(select: exp.Select) -> bool:
    return select.args.get("group") is not None or any(
        isinstance(node, exp.AggFunc) for item in select.expressions for node in item.walk()
    )


def _check_union_of_rows(tree: exp.Expression) -> None:
    if isinstance(tree, exp.Union):
        if tree.args.get("distinct"):
            raise _Outside("UNION (without ALL: it removes duplicates)")
        _check_union_of_rows(tree.this)
        _check_union_of_rows(tree.expression)
    elif isinstance(tree, exp.Select):
        if _is_grouped(tree):
            raise _Outside("an aggregate inside UNION ALL (aggregate over the union instead)")
        _check_rows(tree, allow_grouping=False)
    else:
        raise _Outside(f"{type(tree).__name__.upper()} (set operations other than UNION ALL)")


_CLAUSES = {
    "distinct": "SELECT DISTINCT",
    "having": "HAVING",
    "order": "ORDER BY",
    "limit": "LIMIT",
    "offset": "OFFSET",
    "qualify": "QUALIFY",
    "laterals": "LATERAL VIEW",
    "windows": "WINDOW",
    "sort": "SORT BY",
    "cluster": "CLUSTER BY",
    "distribute": "DISTRIBUTE BY",
}


def _check_rows(select: exp.Select, *, allow_grouping: bool) -> None:
    """A select of tables (FROM, inner joins), filters and deterministic expressions."""
    for clause, name in _CLAUSES.items():
        if select.args.get(clause):
            raise _Outside(name)
    if select.args.get("group") is not None and not allow_grouping:
        raise _Outside("GROUP BY")
    source = select.args.get("from_")
    if source is None or not isinstance(source.this, exp.Table):
        raise _Outside("a subquery in FROM" if source is not None else "a SELECT without FROM")
    for join in select.args.get("joins") or []:
        if not isinstance(join.this, exp.Table):
            raise _Outside("a subquery in a JOIN")
        side, kind = (join.args.get("side") or "").upper(), (join.args.get("kind") or "").upper()
        if side or kind not in ("", "INNER", "CROSS"):
            raise _Outside(f"{' '.join(x for x in (side, kind) if x)} JOIN (only inner joins are incremental)")
    for node in select.walk():
        if node is not select and isinstance(node, exp.Select):
            raise _Outside("a subquery")
        if isinstance(node, exp.Window):
            raise _Outside(f"a window function ({node.sql(dialect=DIALECT)})")
        if isinstance(node, exp.Column) and (node.args.get("db") or node.args.get("catalog")):
            raise _Outside(f"column {node.sql(dialect=DIALECT)} (qualify columns by table or alias only)")
        if isinstance(node, exp.Func):
            name = node.name if isinstance(node, exp.Anonymous) else node.sql_name()
            if name.lower() in _CLOCK_FUNCTIONS or isinstance(node, exp.CurrentTimestamp | exp.CurrentDate):
                raise _Outside(f"{name.lower()}(), whose value depends on when the query runs")


def _check_groups(select: exp.Select) -> tuple[tuple[int, ...], tuple[Aggregate, ...]]:
    group = select.args.get("group")
    items = select.expressions
    if group is not None and any(group.args.get(k) for k in ("rollup", "cube", "grouping_sets", "totals")):
        raise _Outside("ROLLUP, CUBE or GROUPING SETS")
    keys_by_expression: list[exp.Expression] = []
    for g in group.expressions if group is not None else []:
        if isinstance(g, exp.Rollup | exp.Cube | exp.GroupingSets):
            raise _Outside("ROLLUP, CUBE or GROUPING SETS")
        if isinstance(g, exp.Literal) and not g.is_string:  # GROUP BY 2: the select's second item
            position = int(g.this) - 1
            if not 0 <= position < len(items):
                raise _Outside(f"GROUP BY {g.this}, which names no select item")
            g = items[position].unalias()
        elif isinstance(g, exp.Column) and not g.table and any(i.alias == g.name for i in items if i.alias):
            raise _Outside(f"GROUP BY {g.name}, a select alias (group by the expression itself)")
        keys_by_expression.append(g)
    if group is not None:
        group.set("expressions", [g.copy() for g in keys_by_expression])
    keys, aggregates = [], []
    for position, item in enumerate(items):
        inner = item.unalias()
        if isinstance(inner, exp.Star):
            raise _Outside("SELECT * with GROUP BY")
        aggregate = _aggregate(position, inner)
        if aggregate is not None:
            aggregates.append(aggregate)
        elif any(inner == k for k in keys_by_expression):
            keys.append(position)
        elif any(isinstance(n, exp.AggFunc) for n in inner.walk()):
            raise _Outside(f"{inner.sql(dialect=DIALECT)} (an expression over aggregates)")
        else:
            raise _Outside(f"{inner.sql(dialect=DIALECT)}, which is neither a GROUP BY key nor an aggregate")
    missing = [k for k in keys_by_expression if not any(k == items[p].unalias() for p in keys)]
    if missing:
        raise _Outside(f"GROUP BY {missing[0].sql(dialect=DIALECT)}, which is not in the select list")
    if not aggregates:
        raise _Outside("GROUP BY without an aggregate (a DISTINCT)")
    return tuple(keys), tuple(aggregates)


def _aggregate(position: int, node: exp.Expression) -> Aggregate | None:
    func = _AGGREGATES.get(type(node))
    if func is None:
        if isinstance(node, exp.AggFunc):
            raise _Outside(f"{node.sql(dialect=DIALECT)} (aggregates: COUNT, SUM, MIN, MAX, AVG)")
        return None
    argument = node.this
    if isinstance(argument, exp.Distinct):
        raise _Outside(f"{node.sql(dialect=DIALECT)} (a DISTINCT aggregate)")
    if node.args.get("expressions") or (func == "count" and isinstance(node.this, exp.Tuple)):
        raise _Outside(f"{node.sql(dialect=DIALECT)} (an aggregate of several arguments)")
    if argument is not None and any(isinstance(n, exp.AggFunc) for n in argument.walk()):
        raise _Outside(f"{node.sql(dialect=DIALECT)} (a nested aggregate)")
    if isinstance(argument, exp.Star):
        argument = None
    if argument is None and func != "count":
        raise _Outside(f"{node.sql(dialect=DIALECT)}")
    return Aggregate(position, func, argument)


# -- rewriting -------------------------------------------------------------------------------------------


def _render(
    tree: exp.Expression,
    tables: tuple[TableName, ...],
    role: Callable[[int], str],
    view: Callable[[TableName, str], str],
) -> str:
    """``tree`` with occurrence i read from ``view(tables[i], role(i))`` (old, new or delta).

    The occurrence keeps the name its columns are qualified by: its alias, else its table name."""
    copy = tree.copy()
    for node in list(copy.find_all(exp.Table)):
        i = node.meta[_OCCURRENCE]
        alias = node.alias or node.name
        replacement = exp.to_table(view(tables[i], role(i)), dialect=DIALECT)
        replacement.set("alias", exp.TableAlias(this=exp.to_identifier(alias)))
        node.replace(replacement)
    return copy.sql(dialect=DIALECT)


def _delta_terms(tree: exp.Expression, tables, view) -> list[str]:
    if isinstance(tree, exp.Union):
        return _delta_terms(tree.this, tables, view) + _delta_terms(tree.expression, tables, view)
    occurrences = [node.meta[_OCCURRENCE] for node in tree.find_all(exp.Table)]
    terms = []
    for n, i in enumerate(occurrences):
        before = set(occurrences[:n])

        def role(k: int, i: int = i, before: frozenset = frozenset(before)) -> str:
            return "delta" if k == i else "old" if k in before else "new"

        terms.append(_render(tree, tables, role, view))
    return terms


# -- running it (Spark) ----------------------------------------------------------------------------------


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


class Views:
    """Temp views of a job's tables for one barrier, made on first use: ``old`` at the previous
    barrier P, ``new`` at B, ``delta`` the increment from P to B; and of intermediate frames."""

    def __init__(self, ctx: BarrierContext, query: Query) -> None:
        self.ctx, self.prefix = ctx, f"__icebarrier_{query.fingerprint}"
        self._made: dict[tuple[TableName, str], str] = {}
        self._frames = 0

    def __call__(self, table: TableName, role: str) -> str:
        if (table, role) not in self._made:
            read = {"new": self.ctx.table, "old": self.ctx.previous_table, "delta": self.ctx.increment}[role]
            name = f"{self.prefix}_{len(self._made)}"
            read(table).createOrReplaceTempView(name)
            self._made[(table, role)] = name
        return self._made[(table, role)]

    def frame(self, df) -> str:
        self._frames += 1
        name = f"{self.prefix}_f{self._frames}"
        df.createOrReplaceTempView(name)
        return name


def why_full(ctx: BarrierContext, query: Query, sink: TableName) -> str | None:
    """Why barrier B cannot be computed from the changes since P (None: it can)."""
    if ctx.bootstrap:
        return "the job's first computation"
    since = f"barrier {barrier_label(ctx.previous)}"
    for table in dict.fromkeys(query.tables):
        found = ctx.not_appended(table)
        if found is not None:
            return f"source {table} has snapshot {found[0]} ({found[1]}) since {since}"
    for table in [sink, state_table(sink)] if query.needs_state else [sink]:
        at_previous = ctx.previous_snapshot(table)
        if at_previous is None:
            return f"{table} had no snapshot at {since}"
        tbl = load_table(ctx.catalog, table)
        snapshot = tbl.snapshot_by_id(at_previous)
        while snapshot is not None and is_compaction(snapshot) and snapshot.parent_snapshot_id is not None:
            snapshot = tbl.snapshot_by_id(snapshot.parent_snapshot_id)  # the data it compacted
        if snapshot is None or summary_properties(snapshot).get(SUMMARY_PLAN) != query.fingerprint:
            return f"{table} at {since} holds another query's result (the statement or icebarrier's planner changed)"
        # Since P: compactions (nothing changed), or this barrier's own commit (a resumed run adopts it).
        later = list(ancestors(tbl, tbl.current_snapshot(), stop_at=at_previous))
        reached = (later[-1].parent_snapshot_id if later else tbl.metadata.current_snapshot_id) == at_previous
        foreign = [x for x in later if not (is_compaction(x) or barrier_of(x) == ctx.barrier)]
        if foreign or not reached:
            found = foreign[0].snapshot_id if foreign else tbl.metadata.current_snapshot_id
            return f"{table} has snapshot {found} after {since} that the job did not write"
    return None


def delta_outputs(ctx: BarrierContext, query: Query, sink: TableName) -> dict[TableName, tuple[object, str]]:
    """What B writes, per table, as (DataFrame, mode): a rows query appends ΔQ; a grouped one
    rewrites the sink with the groups ΔQ touches replaced (their partials at P combined with
    the new rows'), and its state table alike. The groups untouched are copied, not
    recomputed: the sink's size, not the sources', is what a grouped barrier rewrites."""
    spark, view = ctx.spark, Views(ctx, query)
    if not query.grouped:
        return {sink: (spark.sql(query.delta(view)), "append")}
    schema = spark.sql(query.full(view)).schema  # analysed, not run: the result's names and types
    keys = [_q(query.key_column(j)) for j in range(len(query.keys))]
    partials = query.partials()
    columns = ", ".join(keys + [_q(p.column) for p in partials])
    delta = view.frame(spark.sql(query.delta(view)).localCheckpoint())
    if query.needs_state:
        old = view(state_table(sink), "old")
    else:  # the sink's own columns are the partials
        stored = [f"{_q(schema.names[pos])} AS {keys[j]}" for j, pos in enumerate(query.keys)]
        stored += [f"{_q(schema.names[a.position])} AS {_q(a.partials()[0].column)}" for a in query.aggregates]
        old = view.frame(spark.sql(f"SELECT {', '.join(stored)} FROM {view(sink, 'old')}"))
    same_group = " AND ".join(f"o.{k} <=> d.{k}" for k in keys) or "true"
    combine = ", ".join(keys + [f"{p.combine}({_q(p.column)}) AS {_q(p.column)}" for p in partials])
    combined = view.frame(
        spark.sql(
            f"SELECT {combine} FROM (SELECT {columns} FROM {delta} UNION ALL "
            f"SELECT {columns} FROM {old} o LEFT SEMI JOIN {delta} d ON {same_group})"
            + (f" GROUP BY {', '.join(keys)}" if keys else "")
        ).localCheckpoint()
    )
    by_position = {a.position: a for a in query.aggregates}
    final = []
    for pos, field in enumerate(schema.fields):
        if pos in query.keys:
            value = keys[query.keys.index(pos)]
        elif by_position[pos].func == "avg":
            total, count = (_q(p.column) for p in by_position[pos].partials())
            value = f"CASE WHEN {count} = 0 THEN NULL ELSE {total} / {count} END"
        else:
            value = _q(by_position[pos].partials()[0].column)
        final.append(f"CAST({value} AS {field.dataType.simpleString()}) AS {_q(field.name)}")
    sink_group = " AND ".join(f"o.{_q(schema.names[pos])} <=> d.{keys[j]}" for j, pos in enumerate(query.keys))
    untouched = spark.sql(
        f"SELECT o.* FROM {view(sink, 'old')} o LEFT ANTI JOIN {combined} d ON {sink_group or 'true'}"
    )
    outputs = {sink: (untouched.unionByName(spark.sql(f"SELECT {', '.join(final)} FROM {combined}")), "overwrite")}
    if query.needs_state:
        kept = spark.sql(f"SELECT o.* FROM {old} o LEFT ANTI JOIN {combined} d ON {same_group}")
        outputs[state_table(sink)] = (kept.unionByName(spark.table(combined)), "overwrite")
    return outputs


def create_state_table(spark, query: Query, state: TableName) -> None:
    """The job's state table: the group keys and every partial (created, or replaced when
    the query's partials changed; a replaced one is recomputed at the next barrier)."""
    schema = spark.sql(query.full_partials(lambda table, role: str(table))).schema
    wanted = [(f.name, f.dataType.simpleString()) for f in schema.fields]
    if spark.catalog.tableExists(str(state)):
        if [(f.name, f.dataType.simpleString()) for f in spark.table(str(state)).schema.fields] == wanted:
            return
        verb = "CREATE OR REPLACE TABLE"
    else:
        verb = "CREATE TABLE IF NOT EXISTS"
    spark.sql(f"{verb} {state} ({', '.join(f'{_q(n)} {t}' for n, t in wanted)}) USING iceberg")
