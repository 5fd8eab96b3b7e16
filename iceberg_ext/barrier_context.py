"""What a job sees at a barrier and what it returns: :class:`BarrierContext` (its sources at the
barrier and at its previous one: full reads, increments, changes, a delta join) and
:class:`Output` (append, overwrite or merge), with :class:`Computation` saying how an SqlJob
computed the barrier. The jobs themselves are in :mod:`.job`; the runtime makes the context."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from icebarrier.control_plane import reads
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import TableName, quote_name
from icebarrier.iceberg_ext.catalog import ancestors, is_compaction, load_table, summary_properties
from icebarrier.iceberg_ext.reads import ConsistentRead


class IncrementUnavailableError(IcebarrierError):
    def __init__(self, table: TableName, snapshot_id: int, what: str, *, changelog_possible: bool = True) -> None:
        way = f"read its changelog with ctx.changes({str(table)!r}) or " if changelog_possible else ""
        super().__init__(
            f"source {table} has snapshot {snapshot_id} ({what}) since the previous barrier, which "
            f"incremental reads skip silently; {way}do a full recompute from ctx.table({str(table)!r})"
        )


# -- what a transform returns ------------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    df: object
    mode: str = "append"  # append, overwrite or merge
    keys: tuple[str, ...] = ()
    properties: Mapping[str, str] = field(default_factory=dict)  # more snapshot summary properties


@dataclass(frozen=True)
class Computation:
    """How a job computed a barrier, when it says (an SqlJob): from the changes since its
    previous barrier, or in full and why."""

    incremental: bool
    reason: str | None = None  # why in full

    def describe(self) -> str:
        return "incremental" if self.incremental else f"full ({self.reason})"


def append(df) -> Output:
    return Output(df, "append")


def overwrite(df) -> Output:
    return Output(df, "overwrite")


def merge(df, keys: list[str]) -> Output:
    return Output(df, "merge", tuple(keys))


# -- the per-barrier context -----------------------------------------------------------------------------


class BarrierContext:
    """A job's view of barrier B: its sources at B and at its previous barrier P (the job's
    progress). When the job coalesces, P is older than the barrier before B: increments and
    changes cover every barrier after P up to B."""

    def __init__(
        self,
        spark,
        reader: ConsistentRead,
        catalog,
        *,
        barrier: int,
        previous: int | None,
        previous_snapshots: dict[TableName, int | None],
    ) -> None:
        self.spark, self.barrier, self.previous, self.catalog = spark, barrier, previous, catalog
        self._reader = reader
        self._cut = reader.cut()
        self._previous_snapshots = dict(previous_snapshots)
        self.computation: Computation | None = None  # set by a job that says how it computed B

    @property
    def bootstrap(self) -> bool:
        """True for the job's first barrier: inputs are read in full."""
        return self.previous is None

    def snapshot(self, table: str | TableName) -> int | None:
        return self._cut.snapshots[table_name(table)]

    def table(self, table: str | TableName):
        """The source as of barrier B (full snapshot)."""
        from icebarrier.iceberg_ext.spark_io import table_at

        return table_at(self.spark, table_name(table), self.snapshot(table))

    def previous_snapshot(self, table: str | TableName) -> int | None:
        """A source's or one of the job's sinks' snapshot at the previous barrier (None: none)."""
        name = table_name(table)
        if name not in self._previous_snapshots:
            snapshot = None
            if self.previous is not None:
                try:
                    snapshot = reads.resolve(self._reader.conn, [name], barrier=self.previous).snapshots[name]
                except IcebarrierError:  # a sink added to the job after its previous barrier
                    pass
            self._previous_snapshots[name] = snapshot
        return self._previous_snapshots[name]

    def previous_table(self, table: str | TableName):
        """A source (or sink of the job) as of the job's previous barrier (empty at bootstrap)."""
        from icebarrier.iceberg_ext.spark_io import table_at

        name = table_name(table)
        return table_at(self.spark, name, self.previous_snapshot(name))

    def _since_previous(self, name: TableName, start: int, end: int):
        """The source's snapshots after the previous barrier's, up to B's, newest first."""
        tbl = load_table(self.catalog, name)
        return ancestors(tbl, tbl.snapshot_by_id(end), stop_at=start)

    def not_appended(self, table: str | TableName) -> tuple[int, str] | None:
        """The first snapshot of the source since the previous barrier that is not an append
        (a compaction adds nothing and counts as one), as (snapshot id, what it is); None if
        the source only had rows appended since then."""
        name = table_name(table)
        start, end = self._previous_snapshots.get(name), self.snapshot(name)
        if end is None or start is None or start == end:  # unchanged, or everything is new
            return None
        oldest = None
        for snapshot in self._since_previous(name, start, end):
            operation = snapshot.summary.operation.value if snapshot.summary else "unknown"
            if operation != "append" and not (operation == "replace" and is_compaction(snapshot)):
                return snapshot.snapshot_id, f"operation {operation}"
            oldest = snapshot
        if oldest is None or oldest.parent_snapshot_id != start:
            return end, f"not a descendant of snapshot {start} at the previous barrier: a rollback or revision"
        return None

    def increment(self, table: str | TableName):
        """Rows appended to the source since the previous barrier (all rows at bootstrap).

        Only for append-only history: an overwrite or delete snapshot in between raises
        :class:`IncrementUnavailableError` (incremental reads would silently skip it).
        Compaction snapshots add nothing and are skipped.
        """
        name = table_name(table)
        start, end = self._previous_snapshots.get(name), self.snapshot(name)
        if end is None or start == end:
            return self.table(name).limit(0)
        if start is None:  # bootstrap, or the source was empty at the previous barrier
            return self.table(name)
        found = self.not_appended(name)
        if found is not None:
            raise IncrementUnavailableError(name, *found)
        return (
            self.spark.read.format("iceberg")
            .option("start-snapshot-id", str(start))
            .option("end-snapshot-id", str(end))
            .load(str(name))
        )

    def changes(self, table: str | TableName):
        """The source's changelog since the previous barrier: its rows plus ``_change_type``
        (INSERT / DELETE / UPDATE_BEFORE / UPDATE_AFTER), for sources written copy-on-write
        (overwrites, MERGE, DELETE included). At bootstrap: every row as an INSERT. A
        merge-on-read history (delete files) raises :class:`IncrementUnavailableError`."""
        from pyspark.sql import functions as F

        name = table_name(table)
        start, end = self._previous_snapshots.get(name), self.snapshot(name)
        if end is None or start == end:
            return self.table(name).limit(0).withColumn("_change_type", F.lit("INSERT"))
        if start is None:
            return self.table(name).withColumn("_change_type", F.lit("INSERT"))
        for snapshot in self._since_previous(name, start, end):
            if int(summary_properties(snapshot).get("added-delete-files", "0")) > 0:
                raise IncrementUnavailableError(
                    name, snapshot.snapshot_id, "operation merge-on-read delete", changelog_possible=False
                )
        view = f"__icebarrier_changes_{abs(hash((str(name), start, end)))}"
        ident = quote_name(name.identifier)  # as Spark's SQL catalog (JDBC) stores it
        self.spark.sql(
            f"CALL {name.catalog}.system.create_changelog_view(table => '{ident}', changelog_view => '{view}', "
            f"options => map('start-snapshot-id', '{start}', 'end-snapshot-id', '{end}'))"
        )
        return self.spark.table(view).drop("_change_ordinal", "_commit_snapshot_id")


def delta_join(ctx: BarrierContext, left: str | TableName, right: str | TableName, on: list[str], how: str = "inner"):
    """The increment of ``left ⋈ right`` at B for append-only inputs, from the tables
    themselves (no copy of either kept in job state):  ΔL ⋈ R(B)  ∪  L(prev) ⋈ ΔR."""
    if ctx.bootstrap:
        return ctx.table(left).join(ctx.table(right), on, how)
    new_left = ctx.increment(left).join(ctx.table(right), on, how)
    new_right = ctx.previous_table(left).join(ctx.increment(right), on, how)
    return new_left.unionByName(new_right)


def table_name(table: str | TableName) -> TableName:
    """A table as a job names it (a string, or a TableName)."""
    return table if isinstance(table, TableName) else TableName.parse(table)
