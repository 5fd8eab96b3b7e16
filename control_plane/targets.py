"""Declared freshness (DESIGN.md, "Declared freshness"): each table's target lag, how a job runs
itself, and what the schedule did.

A table's target lag L: at any moment its watermark was issued at most L ago. A table without
its own target inherits the tightest target of the tables that read it (view
``table_targets``); ``target_misses`` lists the stretches in which a table was staler than its
target. Setting a target or a job's runner is the admin's, and audited.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

from icebarrier.control_plane.db import Conn, call
from icebarrier.control_plane.errors import InvalidValueError
from icebarrier.control_plane.model import TableName

RUNNER_KINDS = ("command", "file")


@dataclass(frozen=True, slots=True, kw_only=True)
class Runner:
    """How a job runs itself: ``command`` (a shell command, under ``icebarrier job exec``) or
    ``file`` (a PySpark job file, under the runtime: ``icebarrier run FILE --once``), with the
    environment it needs on top of the schedule's own."""

    kind: str
    spec: str
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in RUNNER_KINDS:
            raise InvalidValueError(f"runner kind {self.kind!r} is none of {', '.join(RUNNER_KINDS)}")
        if not self.spec.strip():
            raise InvalidValueError(f"the job's {self.kind} is empty; give the {self.kind} to run")

    def to_json(self) -> dict:
        return {"kind": self.kind, "spec": self.spec, "env": sorted(self.env)}  # values may be secrets


@dataclass(frozen=True, slots=True, kw_only=True)
class TableTarget:
    """A table's freshness against its target (a row of ``table_versions`` and ``table_targets``)."""

    name: TableName
    writer_job: str | None
    target_lag_s: float | None  # its own
    effective_s: float | None  # its own, or the tightest of the tables that read it
    target_from: str | None  # the table the effective target is set on
    watermark: int | None
    watermark_issued_at: datetime | None
    freshness_s: float | None

    @property
    def met(self) -> bool | None:
        if self.effective_s is None:
            return None
        return self.freshness_s is not None and self.freshness_s <= self.effective_s

    def to_json(self) -> dict:
        return {
            "table": str(self.name),
            "writer_job": self.writer_job,
            "target_lag_s": self.target_lag_s,
            "effective_target_lag_s": self.effective_s,
            "target_from": self.target_from,
            "freshness_s": self.freshness_s,
            "target_met": self.met,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Miss:
    """A stretch in which a table was staler than its target (``until`` None: still is)."""

    table: TableName
    target_lag_s: float
    since: datetime
    until: datetime | None
    overdue_s: float
    recovered_by: int | None

    def to_json(self) -> dict:
        return {
            "table": str(self.table),
            "target_lag_s": self.target_lag_s,
            "missed_from": self.since.isoformat(),
            "missed_until": self.until.isoformat() if self.until else None,
            "overdue_s": self.overdue_s,
            "recovered_by": self.recovered_by,
        }


def set_target_lag(conn: Conn, table: TableName, seconds: float | None) -> float | None:
    """Set (None: clear) ``table``'s own target lag; returns it as stored."""
    with conn.transaction():
        call(conn, "set_target_lag", str(table), None if seconds is None else f"{seconds} seconds")
    return seconds


def set_runner(conn: Conn, job: str, runner: Runner | None) -> None:
    """Set (None: clear) how ``job`` runs itself."""
    with conn.transaction():
        call(
            conn,
            "set_job_runner",
            job,
            runner.kind if runner else None,
            runner.spec if runner else None,
            json.dumps(runner.env) if runner else None,
        )


def runners(conn: Conn) -> dict[str, Runner]:
    """Every active job's runner, by job name."""
    rows = conn.execute(
        "SELECT j.name, r.kind, r.spec, r.env FROM job_runner r JOIN job j USING (job_id) WHERE j.active"
    ).fetchall()
    return {r["name"]: Runner(kind=r["kind"], spec=r["spec"], env=dict(r["env"])) for r in rows}


AT_RISK = 0.8  # a table whose freshness passed this share of its target lag is at risk of missing it


def target_state_sql(freshness: str, target: str) -> str:
    """The SQL of a table's state against its target lag, from SQL expressions of its freshness and
    its (effective) target lag: ``met``, ``at_risk`` (fresher than its target, but past
    :data:`AT_RISK` of it), ``missed`` (staler, or nothing completed yet), or ``none`` (no target)."""
    return (
        f"CASE WHEN {target} IS NULL THEN 'none' WHEN {freshness} IS NULL OR {freshness} > {target} THEN 'missed' "
        f"WHEN {freshness} > {target} * {AT_RISK} THEN 'at_risk' ELSE 'met' END"
    )


_TARGETS = """
SELECT v.table_name, v.writer_job, extract(epoch FROM v.target_lag) AS target_lag_s,
       extract(epoch FROM v.effective_target_lag) AS effective_s, v.target_from, v.watermark_barrier,
       v.watermark_issued_at, extract(epoch FROM v.freshness) AS freshness_s
FROM table_versions v WHERE %(after)s::text IS NULL OR v.table_name > %(after)s
ORDER BY v.table_name LIMIT %(limit)s
"""


def targets(conn: Conn, *, after: str | None = None, limit: int | None = None) -> list[TableTarget]:
    """Every managed table's target and freshness, by name (``after``, ``limit``: a page)."""
    return [
        TableTarget(
            name=TableName.parse(r["table_name"]),
            writer_job=r["writer_job"],
            target_lag_s=_float(r["target_lag_s"]),
            effective_s=_float(r["effective_s"]),
            target_from=r["target_from"],
            watermark=r["watermark_barrier"],
            watermark_issued_at=r["watermark_issued_at"],
            freshness_s=_float(r["freshness_s"]),
        )
        for r in conn.execute(_TARGETS, {"after": after, "limit": limit}).fetchall()
    ]


def misses(conn: Conn, *, table: TableName | None = None, limit: int = 50) -> list[Miss]:
    """The newest stretches in which tables were staler than their targets, newest first."""
    rows = conn.execute(
        "SELECT table_name, extract(epoch FROM target_lag) AS target_lag_s, missed_from, missed_until, "
        "       extract(epoch FROM overdue) AS overdue_s, recovered_by "
        "FROM target_misses WHERE %(table)s::text IS NULL OR table_name = %(table)s "
        "ORDER BY missed_from DESC LIMIT %(limit)s",
        {"table": str(table) if table else None, "limit": limit},
    ).fetchall()
    return [
        Miss(
            table=TableName.parse(r["table_name"]),
            target_lag_s=float(r["target_lag_s"]),
            since=r["missed_from"],
            until=r["missed_until"],
            overdue_s=float(r["overdue_s"]),
            recovered_by=r["recovered_by"],
        )
        for r in rows
    ]


def _float(value) -> float | None:
    return None if value is None else float(value)
