"""Managed tables: their progress, versions, topology and lineage."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from icebarrier.control_plane import jobs, topology
from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import TableNotFoundError
from icebarrier.control_plane.model import TableName, TableState


@dataclass(frozen=True, slots=True, kw_only=True)
class TableVersion:
    """A row of the ``table_versions`` view."""

    name: TableName
    kind: str
    writer_job: str | None
    start_barrier: int | None
    watermark: int | None
    current_snapshot_id: int | None
    last_commit_at: datetime | None
    freshness: timedelta | None
    barriers_behind: int
    coalesced_after: int | None = None  # its newest coalesced range: the barriers between were
    coalesced_into: int | None = None  # completed once, at coalesced_into

    def to_json(self) -> dict:
        return {
            "table": str(self.name),
            "kind": self.kind,
            "writer_job": self.writer_job,
            "start_barrier": self.start_barrier,
            "watermark": self.watermark,
            "current_snapshot_id": self.current_snapshot_id,
            "last_commit_at": self.last_commit_at.isoformat() if self.last_commit_at else None,
            "freshness_s": self.freshness.total_seconds() if self.freshness is not None else None,
            "barriers_behind": self.barriers_behind,
            "coalesced_after": self.coalesced_after,
            "coalesced_into": self.coalesced_into,
        }


def states(conn: Conn, names: list[TableName]) -> list[TableState]:
    """Progress of the named tables, in the order given; unknown tables are refused."""
    rows = conn.execute(
        "SELECT t.name, t.start_barrier, t.watermark, "
        "       ARRAY(SELECT ARRAY[r.after_barrier, r.into_barrier] FROM coalesced_ranges r "
        "             WHERE r.table_id = t.table_id ORDER BY r.into_barrier) AS coalesced "
        "FROM managed_tables t WHERE t.name = ANY(%s)",
        ([str(n) for n in names],),
    ).fetchall()
    by_name = {r["name"]: r for r in rows}
    for n in names:
        if str(n) not in by_name:
            raise TableNotFoundError(str(n))
    return [
        TableState(
            name=n,
            start_barrier=by_name[str(n)]["start_barrier"],
            watermark=by_name[str(n)]["watermark"],
            coalesced=tuple(tuple(r) for r in by_name[str(n)]["coalesced"]),
        )
        for n in names
    ]


def managed_names(conn: Conn) -> set[TableName]:
    """The names of every managed table (what a consistent SQL read must pin or refuse)."""
    return {TableName.parse(r["name"]) for r in conn.execute("SELECT name FROM managed_tables").fetchall()}


def require(conn: Conn, name: TableName) -> int:
    """The table's id; unknown tables are refused."""
    row = conn.execute("SELECT table_id FROM managed_tables WHERE name = %s", (str(name),)).fetchone()
    if row is None:
        raise TableNotFoundError(str(name))
    return row["table_id"]


def maintained_id(conn: Conn, name: TableName) -> int:
    """The id of a managed table or of one of the catalog's unmanaged tables the maintenance
    service knows (:func:`icebarrier.control_plane.upkeep.enroll`); others are refused."""
    row = conn.execute("SELECT maintained_table_id(%s) AS table_id", (str(name),)).fetchone()
    if row is None or row["table_id"] is None:
        raise TableNotFoundError(str(name))
    return row["table_id"]


def is_managed(conn: Conn, name: TableName) -> bool:
    return conn.execute("SELECT 1 FROM managed_tables WHERE name = %s", (str(name),)).fetchone() is not None


def list_versions(conn: Conn, *, after: str | None = None, limit: int | None = None) -> list[TableVersion]:
    """The managed tables by name (``after``, ``limit``: a page of them, the names after that one)."""
    rows = conn.execute(
        """
        SELECT table_name, table_kind, writer_job, start_barrier, watermark_barrier, current_snapshot_id,
               last_commit_at, freshness, barriers_behind, coalesced_after, coalesced_into
        FROM table_versions WHERE %(after)s::text IS NULL OR table_name > %(after)s
        ORDER BY table_name LIMIT %(limit)s
        """,
        {"after": after, "limit": limit},
    ).fetchall()
    return [
        TableVersion(
            name=TableName.parse(r["table_name"]),
            kind=r["table_kind"],
            writer_job=r["writer_job"],
            start_barrier=r["start_barrier"],
            watermark=r["watermark_barrier"],
            current_snapshot_id=r["current_snapshot_id"],
            last_commit_at=r["last_commit_at"],
            freshness=r["freshness"],
            barriers_behind=r["barriers_behind"],
            coalesced_after=r["coalesced_after"],
            coalesced_into=r["coalesced_into"],
        )
        for r in rows
    ]


def lineage(conn: Conn, table: TableName, *, direction: str) -> list[topology.LineageStep]:
    """Tables upstream or downstream of ``table`` (``direction`` "upstream" or "downstream")."""
    require(conn, table)
    definitions = jobs.load_definitions(conn).values()
    walk = topology.upstream if direction == "upstream" else topology.downstream
    return walk(definitions, table)
