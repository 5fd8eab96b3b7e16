"""Delays, freshness, lag and the bottleneck (DESIGN.md, "Observability").

- table delay = completion time - barrier issue time;
- job delay = completion in its sinks - latest completion among its sources (issue time
  for a root job);
- freshness of T = now - issue time of W(T); lag = barriers issued after W(T);
- the bottleneck is the job with the largest median job delay over the recent barriers;
- how each table completed its barriers: one exact barrier a step, a skipped run, or a
  coalesced range (DESIGN.md, "Cost follows change").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from icebarrier.control_plane import jobs, tables
from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.model import TableName


@dataclass(frozen=True, slots=True, kw_only=True)
class DelayStats:
    """Delay percentiles in seconds over the recent barriers an object completed."""

    name: str
    kind: str  # "table" or "job"
    barriers: int  # how many recent barriers were completed
    p50_s: float | None
    p95_s: float | None
    max_s: float | None
    freshness_s: float | None
    barriers_behind: int
    bottleneck: bool = False

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "barriers": self.barriers,
            "p50_s": self.p50_s,
            "p95_s": self.p95_s,
            "max_s": self.max_s,
            "freshness_s": self.freshness_s,
            "barriers_behind": self.barriers_behind,
            "bottleneck": self.bottleneck,
        }


_TABLE_DELAYS = """
WITH recent AS (SELECT barrier FROM barriers ORDER BY barrier DESC LIMIT %(last)s)
SELECT v.table_name AS name,
       count(d.delay) AS barriers,
       percentile_cont(0.5)  WITHIN GROUP (ORDER BY extract(epoch FROM d.delay)) AS p50_s,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM d.delay)) AS p95_s,
       max(extract(epoch FROM d.delay))                                          AS max_s,
       extract(epoch FROM v.freshness)                                           AS freshness_s,
       v.barriers_behind
FROM table_versions v
LEFT JOIN barrier_delay d ON d.table_name = v.table_name AND d.barrier IN (SELECT barrier FROM recent)
WHERE %(table)s::text IS NULL OR v.table_name = %(table)s
GROUP BY v.table_name, v.freshness, v.barriers_behind
ORDER BY v.table_name
"""

_JOB_DELAYS = """
WITH recent AS (SELECT barrier FROM barriers ORDER BY barrier DESC LIMIT %(last)s),
progress AS (
    SELECT j.name, max(m.watermark) AS progress, j.registered_at
    FROM jobs j JOIN job_sink_tables k USING (job_id) JOIN managed_tables m USING (table_id)
    WHERE j.active GROUP BY j.name, j.registered_at)
SELECT p.name,
       count(d.delay) AS barriers,
       percentile_cont(0.5)  WITHIN GROUP (ORDER BY extract(epoch FROM d.delay)) AS p50_s,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM d.delay)) AS p95_s,
       max(extract(epoch FROM d.delay))                                          AS max_s,
       extract(epoch FROM now() - b.issued_at)                                   AS freshness_s,
       (SELECT count(*) FROM barriers x WHERE x.barrier > coalesce(p.progress,
            (extract(epoch FROM p.registered_at) * 1000000)::bigint))             AS barriers_behind
FROM progress p
LEFT JOIN barriers b ON b.barrier = p.progress
LEFT JOIN job_delay d ON d.job_name = p.name AND d.barrier IN (SELECT barrier FROM recent)
WHERE %(job)s::text IS NULL OR p.name = %(job)s
GROUP BY p.name, p.progress, p.registered_at, b.issued_at
ORDER BY p.name
"""


def table_delays(conn: Conn, *, last: int = 100, table: str | None = None) -> list[DelayStats]:
    """Per-table delays (``table``: only that one; an unknown table is refused)."""
    if table is not None:
        tables.require(conn, TableName.parse(table))
    rows = conn.execute(_TABLE_DELAYS, {"last": last, "table": table}).fetchall()
    return [DelayStats(kind="table", **_floats(r)) for r in rows]


def job_delays(conn: Conn, *, last: int = 100, job: str | None = None) -> list[DelayStats]:
    """Per-job delays; the job with the largest median delay is flagged as the bottleneck
    (``job``: only that one; an unknown job is refused)."""
    if job is not None:
        jobs.show(conn, job)
    rows = [DelayStats(kind="job", **_floats(r)) for r in conn.execute(_JOB_DELAYS, {"last": last, "job": None})]
    slowest = max((r for r in rows if r.p50_s is not None), key=lambda r: (r.p50_s, r.max_s), default=None)
    flagged = [
        DelayStats(**{**r.to_json(), "bottleneck": slowest is not None and r.name == slowest.name}) for r in rows
    ]
    return [r for r in flagged if job is None or r.name == job]


_COMPLETION_KINDS = """
SELECT d.table_name,
       CASE WHEN d.coalesced THEN 'coalesce'
            WHEN d.from_barrier IS NULL
                 OR d.from_barrier = (SELECT max(b.barrier) FROM barriers b WHERE b.barrier < d.barrier) THEN 'exact'
            ELSE 'skip' END AS kind,
       count(*) AS n
FROM barrier_delay d GROUP BY 1, 2
"""


def completion_kinds(conn: Conn) -> dict[str, Counter]:
    """Per table, how many steps completed one barrier exactly, skipped a run of unchanged
    barriers, or coalesced a range."""
    kinds: dict[str, Counter] = {}
    for r in conn.execute(_COMPLETION_KINDS).fetchall():
        kinds.setdefault(r["table_name"], Counter())[r["kind"]] = r["n"]
    return kinds


def _floats(row: dict) -> dict:
    return {k: (float(v) if k.endswith("_s") and v is not None else v) for k, v in row.items()}
