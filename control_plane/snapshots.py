"""The barrier -> snapshot map outside completion: compaction records, adoption, listing."""

from __future__ import annotations

from dataclasses import dataclass

from icebarrier.control_plane.db import Conn, call
from icebarrier.control_plane.model import TableName
from icebarrier.control_plane.tables import require


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordedCommit:
    barrier: int
    snapshot_id: int
    operation: str
    job_name: str
    run_id: str | None
    revoked: bool


def recorded(conn: Conn, table: TableName) -> dict[int, RecordedCommit]:
    """Every snapshot of ``table`` in the map (revoked ones too), by snapshot id."""
    rows = conn.execute(
        """
        SELECT c.barrier, c.snapshot_id, c.operation, c.job_name, c.run_id, c.revoked_by IS NOT NULL AS revoked
        FROM table_commits c WHERE c.table_id = %s ORDER BY c.commit_id
        """,
        (require(conn, table),),
    ).fetchall()
    return {r["snapshot_id"]: RecordedCommit(**r) for r in rows}


def known_writers(conn: Conn, table: TableName) -> set[str]:
    """Jobs that ever completed barriers of ``table`` (current and former writers)."""
    rows = conn.execute(
        """
        SELECT DISTINCT job_name FROM table_completions WHERE table_id = %(t)s
        UNION SELECT DISTINCT job_name FROM table_commits WHERE table_id = %(t)s
        UNION SELECT j.name FROM job_sink_tables k JOIN jobs j USING (job_id) WHERE k.table_id = %(t)s
        """,
        {"t": require(conn, table)},
    ).fetchall()
    return {r["job_name"] for r in rows}


def record(
    conn: Conn,
    table: TableName,
    *,
    barrier: int,
    snapshot_id: int,
    operation: str,
    job_name: str,
    run_id: str | None = None,
) -> bool:
    """Add a snapshot the table has completed ``barrier`` with (compaction, or adoption by
    reconcile; the admin or the table's writer). Returns False if it was already recorded.
    Refused for a barrier the table has not completed: its job adopts such a commit when it
    completes the barrier."""
    with conn.transaction():
        return call(conn, "record_commit", str(table), barrier, snapshot_id, operation, job_name, run_id)[0][
            "record_commit"
        ]
