"""Revision: roll a table and everything downstream of it back to barrier R.

``revise T --to-barrier R`` sets the watermark of T and of every table downstream of it
that is past R back to R (or to "not started" for a table that started after R), revokes
their commits after R (kept for audit, marked with the revision), and so resets their jobs'
progress: the jobs recompute the barriers after R. The Iceberg side rolls each table back
to S(·, R) between :func:`begin` and :func:`finish`; while a revision is applying, the
tables' writers cannot complete barriers. Rerunning an interrupted revision resumes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import psycopg

from icebarrier.control_plane import jobs, topology
from icebarrier.control_plane.db import advisory_lock
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
            "table": str(self.table), "writer_job": self.writer_job,
            "from_watermark": self.from_watermark, "to_watermark": self.to_watermark,
            "from_snapshot": self.from_snapshot, "to_snapshot": self.to_snapshot,
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
            "revision_id": self.revision_id, "root": str(self.root), "to_barrier": self.to_barrier,
            "tables": [t.to_json() for t in self.tables], "jobs_reset": self.jobs_reset,
        }

    @classmethod
    def from_json(cls, data: dict, revision_id: int) -> RevisionPlan:
        return cls(
            root=TableName.parse(data["root"]), to_barrier=data["to_barrier"], revision_id=revision_id,
            tables=tuple(
                TableRevision(**{**t, "table": TableName.parse(t["table"])}) for t in data["tables"]
            ),
        )


_TABLE_AT = """
SELECT t.table_id, t.start_barrier, t.watermark, t.revision_id,
       (SELECT c.snapshot_id FROM table_commit c WHERE c.table_id = t.table_id AND c.revoked_by IS NULL
         ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1) AS current,
       (SELECT c.snapshot_id FROM table_commit c
         WHERE c.table_id = t.table_id AND c.revoked_by IS NULL AND c.barrier <= %(r)s
         ORDER BY c.barrier DESC, c.commit_id DESC LIMIT 1) AS at_r
FROM managed_table t WHERE t.name = %(name)s
"""


def plan(conn: psycopg.Connection, table: TableName, to_barrier: int) -> RevisionPlan:
    """What revising ``table`` to ``to_barrier`` would change (no writes)."""
    if conn.execute("SELECT 1 FROM barrier WHERE barrier = %s", (to_barrier,)).fetchone() is None:
        raise BarrierNotIssuedError(to_barrier)
    definitions = jobs.load_definitions(conn)
    writers = topology.writer_by_table(definitions.values())
    names = [table, *(s.table for s in topology.downstream(definitions.values(), table))]
    items = []
    for name in names:
        row = conn.execute(_TABLE_AT, {"name": str(name), "r": to_barrier}).fetchone()
        if row is None:
            raise RevisionError(f"table {name} is not managed by icebarrier; nothing to revise")
        start, mark = row["start_barrier"], row["watermark"]
        if name == table and not (start is not None and start <= to_barrier <= mark):
            raise RevisionError(
                f"table {name} has not completed barrier {to_barrier} (it completed {start}..{mark}); "
                f"revise to a barrier it completed"
            )
        if mark is None or mark <= to_barrier:
            target, to_snapshot = mark, row["current"]
        elif start <= to_barrier:
            target, to_snapshot = to_barrier, row["at_r"]
        else:
            target, to_snapshot = None, None
        items.append(
            TableRevision(
                table=name, writer_job=writers.get(name), from_watermark=mark, to_watermark=target,
                from_snapshot=row["current"], to_snapshot=to_snapshot,
            )
        )
    return RevisionPlan(root=table, to_barrier=to_barrier, tables=tuple(items))


def begin(conn: psycopg.Connection, table: TableName, to_barrier: int) -> RevisionPlan:
    """Apply the control-plane half of a revision in one transaction; returns the plan with its id.

    If an unfinished revision of the same table to the same barrier exists, it is returned
    to be resumed instead.
    """
    with conn.transaction():
        advisory_lock(conn, "topology", [0], what="a revision")
        pending = conn.execute(
            "SELECT revision_id, plan, root_table, to_barrier FROM revision WHERE state = 'applying' "
            "ORDER BY revision_id LIMIT 1"
        ).fetchone()
        if pending:
            if pending["root_table"] == str(table) and pending["to_barrier"] == to_barrier:
                return RevisionPlan.from_json(pending["plan"], pending["revision_id"])
            raise RevisionError(
                f"revision {pending['revision_id']} of {pending['root_table']} to barrier {pending['to_barrier']} "
                f"is unfinished; rerun that revise to finish it first"
            )
        p = plan(conn, table, to_barrier)
        row = conn.execute(
            "INSERT INTO revision (root_table, to_barrier, plan) VALUES (%s, %s, %s) RETURNING revision_id",
            (str(table), to_barrier, json.dumps(p.to_json())),
        ).fetchone()
        rid = row["revision_id"]
        for t in p.tables:
            if not t.changes:
                continue
            moved = conn.execute(
                """
                UPDATE managed_table
                SET watermark = %(to)s, start_barrier = CASE WHEN %(to)s::bigint IS NULL THEN NULL ELSE start_barrier END,
                    revision_id = %(rid)s
                WHERE name = %(name)s AND watermark IS NOT DISTINCT FROM %(from)s
                RETURNING table_id
                """,
                {"to": t.to_watermark, "from": t.from_watermark, "rid": rid, "name": str(t.table)},
            ).fetchone()
            if moved is None:
                raise RevisionError(f"table {t.table} moved while planning the revision; run revise again")
            bound = t.to_watermark if t.to_watermark is not None else -1
            conn.execute(
                "UPDATE table_commit SET revoked_by = %s WHERE table_id = %s AND barrier > %s AND revoked_by IS NULL",
                (rid, moved["table_id"], bound),
            )
            conn.execute("DELETE FROM table_completion WHERE table_id = %s AND barrier > %s", (moved["table_id"], bound))
    return RevisionPlan(root=p.root, to_barrier=p.to_barrier, tables=p.tables, revision_id=rid)


def record_revision_snapshot(conn: psycopg.Connection, plan_: RevisionPlan, table: TableName, snapshot_id: int) -> None:
    """Record the snapshot that emptied a table during a revision as its state at R."""
    t = next(x for x in plan_.tables if x.table == table)
    with conn.transaction():
        conn.execute(
            """
            INSERT INTO table_commit (table_id, barrier, snapshot_id, operation, job_name)
            SELECT table_id, %s, %s, 'revision', 'icebarrier-revise' FROM managed_table WHERE name = %s
            """,
            (t.to_watermark if t.to_watermark is not None else plan_.to_barrier, snapshot_id, str(table)),
        )


def finish(conn: psycopg.Connection, revision_id: int) -> None:
    with conn.transaction():
        conn.execute("UPDATE managed_table SET revision_id = NULL WHERE revision_id = %s", (revision_id,))
        conn.execute(
            "UPDATE revision SET state = 'done', finished_at = now() WHERE revision_id = %s", (revision_id,)
        )
