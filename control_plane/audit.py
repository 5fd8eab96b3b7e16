"""The audit trail: who did what, when, to which job or table, with what result.

Rows are appended by the database, in the transaction of the action (migration 0014's
triggers on jobs, revisions, catalog tokens, settings and job sessions; :func:`append` for
actions that are no row of their own, such as an admin's lease). The admin reads them
through the ``audit`` view; reader and job roles can neither read nor change them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from icebarrier.control_plane.db import Conn, call


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    event_id: int
    at: datetime
    role: str  # the Postgres role
    actor: str | None  # who the application says acts: cli:<os user>, token:<client id>
    action: str
    job: str | None
    table: str | None
    object: str | None
    result: str
    detail: dict

    def to_json(self) -> dict:
        return {
            "event_id": self.event_id,
            "at": self.at.isoformat(),
            "role": self.role,
            "actor": self.actor,
            "action": self.action,
            "job": self.job,
            "table": self.table,
            "object": self.object,
            "result": self.result,
            "detail": self.detail,
        }


def append(
    conn: Conn,
    action: str,
    *,
    job: str | None = None,
    table: str | None = None,
    object: str | None = None,
    result: str = "done",
    detail: dict | None = None,
) -> None:
    """Append an event in the caller's transaction (the admin only)."""
    call(conn, "audit_append", action, job, table, object, result, json.dumps(detail or {}))


def events(
    conn: Conn,
    *,
    since: datetime | None = None,
    job: str | None = None,
    table: str | None = None,
    limit: int = 1000,
) -> list[Event]:
    """The newest ``limit`` events (oldest first), filtered."""
    rows = conn.execute(
        "SELECT * FROM (SELECT * FROM audit WHERE (%(since)s::timestamptz IS NULL OR at >= %(since)s) "
        "AND (%(job)s::text IS NULL OR job_name = %(job)s) AND (%(table)s::text IS NULL OR table_name = %(table)s) "
        "ORDER BY event_id DESC LIMIT %(limit)s) e ORDER BY event_id",
        {"since": since, "job": job, "table": table, "limit": limit},
    ).fetchall()
    return [
        Event(
            event_id=r["event_id"],
            at=r["at"],
            role=r["role_name"],
            actor=r["actor"],
            action=r["action"],
            job=r["job_name"],
            table=r["table_name"],
            object=r["object"],
            result=r["result"],
            detail=r["detail"],
        )
        for r in rows
    ]
