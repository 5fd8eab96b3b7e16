"""Revision: roll a table and everything downstream of it back to barrier R.

``revise T --to-barrier R`` sets the watermark of T and of every table downstream of it
that is past R back to R (or to "not started" for a table that started after R), revokes
their commits after R (kept for audit, marked with the revision), and so resets their jobs'
progress: the jobs recompute the barriers after R. The Iceberg side rolls each table back
to S(·, R) between :func:`begin` and :func:`finish`; while a revision is applying, the
tables' writers cannot complete barriers. Rerunning an interrupted revision resumes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg.types.json import Jsonb

from icebarrier.control_plane import jobs, tables, topology
from icebarrier.control_plane.db import Conn, call, one
from icebarrier.control_plane.errors import BarrierNotIssuedError, RevisionError
from icebarrier.control_plane.model import TableName


@dataclass(frozen=True, slots=True, kw_only=True)
class TableRevision:
    table: TableName
    writer_job: str | None
    from_watermark: int | None
    to_watermark: int | None  # None: the table started after R and starts over
    from_snapshot: int | None
    to_snapshot: int | None  # S(T, R); None: empty at R

    @property
    def changes(self) -> bool:
        return self.from_watermark != self.to_watermark

    def to_json(self) -> dict:
        return {
            "table": str(self.table),
            "writer_job": self.writer_job,
            "from_watermark": self.from_watermark,
            "to_watermark": self.to_watermark,
            "from_snapshot": self.from_snapshot,
            "to_snapshot": self.to_snapshot,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RevisionPlan:
    root: TableName
    to_barrier: int
    tables: tuple[TableRevision, ...]
    revision_id: int | None = None  # set once begun

    @property
    def jobs_reset(self) -> list[str]:
        return sorted({t.writer_job for t in self.tables if t.changes and t.writer_job})

    def to_json(self) -> dict:
        return {
            "revision_id": self.revision_id,
            "root": str(self.root),
            "to_barrier": self.to_barrier,
            "tables": [t.to_json() for t in self.tables],
            "jobs_reset": self.jobs_reset,
        }

    @classmethod
    def from_json(cls, data: dict, revision_id: int) -> RevisionPlan:
        return cls(
            root=TableName.parse(data["root"]),
            to_barrier=data["to_barrier"],
            revision_id=revision_id,
            tables=tuple(TableRevision(**{**t, "table": TableName.parse(t["table"])}) for t in data["tables"]),
        )


# S(T, b) of the named table (no row: not managed).
_SNAPSHOT_AT = """
SELECT (SELECT snapshot_id FROM snapshot_at(t.table_id, %(b)s)) AS s FROM managed_tables t WHERE t.name = %(name)s
"""


def plan(conn: Conn, table: TableName, to_barrier: int) -> RevisionPlan:
    """What revising ``table`` to ``to_barrier`` would change (no writes)."""
    if conn.execute("SELECT 1 FROM barriers WHERE barrier = %s", (to_barrier,)).fetchone() is None:
        raise BarrierNotIssuedError(to_barrier)
    definitions = jobs.load_definitions(conn)
    writers = topology.writer_by_table(definitions.values())
    names = [table, *(s.table for s in topology.downstream(definitions.values(), table))]
    items = []
    for name in names:
        current = conn.execute(_SNAPSHOT_AT, {"name": str(name), "b": 2**63 - 1}).fetchone()
        if current is None:
            raise RevisionError(f"table {name} is not managed by icebarrier; nothing to revise")
        state = tables.states(conn, [name])[0]
        start, mark = state.start_barrier, state.watermark
        if name == table and not state.has_completed(to_barrier):
            raise RevisionError(
                f"table {name} has not completed barrier {to_barrier} (it completed {start}..{mark}"
                f"{', coalescing it' if state.coalesced_at(to_barrier) else ''}); revise to a barrier it completed"
            )
        if mark is None or mark <= to_barrier:
            target, to_snapshot = mark, current["s"]
        elif (
            start is not None and start <= to_barrier
        ):  # back to the last barrier it completed at or before R (R, unless coalesced)
            target = (state.coalesced_at(to_barrier) or (to_barrier,))[0]
            to_snapshot = one(conn.execute(_SNAPSHOT_AT, {"name": str(name), "b": target}))["s"]
        else:
            target, to_snapshot = None, None
        items.append(
            TableRevision(
                table=name,
                writer_job=writers.get(name),
                from_watermark=mark,
                to_watermark=target,
                from_snapshot=current["s"],
                to_snapshot=to_snapshot,
            )
        )
    return RevisionPlan(root=table, to_barrier=to_barrier, tables=tuple(items))


def begin(conn: Conn, table: TableName, to_barrier: int) -> RevisionPlan:
    """Apply the control-plane half of a revision in one transaction (the admin only); returns
    the plan with its id. If an unfinished revision of the same table to the same barrier
    exists, it is returned to be resumed instead."""
    with conn.transaction():
        p = plan(conn, table, to_barrier)
        row = call(conn, "begin_revision", str(table), to_barrier, Jsonb(p.to_json()))[0]
    if row["resumed"]:
        return RevisionPlan.from_json(row["plan"], row["revision_id"])
    return RevisionPlan(root=p.root, to_barrier=p.to_barrier, tables=p.tables, revision_id=row["revision_id"])


def record_revision_snapshot(conn: Conn, plan_: RevisionPlan, table: TableName, snapshot_id: int) -> None:
    """Record the snapshot that emptied a table during a revision as its state at R."""
    t = next(x for x in plan_.tables if x.table == table)
    with conn.transaction():
        call(
            conn,
            "record_revision_snapshot",
            str(table),
            t.to_watermark if t.to_watermark is not None else plan_.to_barrier,
            snapshot_id,
        )


def finish(conn: Conn, revision_id: int) -> None:
    with conn.transaction():
        call(conn, "finish_revision", revision_id)
