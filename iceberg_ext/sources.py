"""Inputs of root jobs. A source plans the input range of a barrier (recorded in the control
plane before anything is written), says when it may close a barrier, and re-reads a recorded
range exactly (deterministic replay after a crash).

- :class:`FileSource` — a directory of files; the range is the list of files taken in since
  the previous barrier (system-time). Files must appear atomically (write, then rename).
- :class:`PostgresSource` — a table read by a monotone key (system-time: the key interval),
  or by event time (event-time: exactly the rows with event time <= B, once the source
  watermark — the start of the oldest open transaction — has passed B). With an event-time
  column that defaults to ``now()`` (a transaction's start time), a source transaction
  never straddles two barriers.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from datetime import datetime, timezone

import psycopg
from psycopg import sql

from control_plane import runs
from control_plane.errors import IcebarrierError
from control_plane.model import barrier_time

SYSTEM_TIME = "system-time"
EVENT_TIME = "event-time"


class SourceError(IcebarrierError):
    """A root job's source is misconfigured or cannot be read."""


class Source:
    strategy = SYSTEM_TIME

    def plan(self, conn: psycopg.Connection, job: str, barrier: int) -> dict:
        raise NotImplementedError

    def ready(self, barrier: int) -> bool:
        """May the job close ``barrier`` now? (event-time sources wait for their watermark)"""
        return True

    def read(self, spark, spec: dict):
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass
class FileSource(Source):
    """New files in ``path`` matching ``pattern``, read with Spark's ``fmt`` reader and ``schema`` (DDL)."""

    path: str
    schema: str
    fmt: str = "json"
    pattern: str = "*"

    def plan(self, conn, job, barrier):
        consumed = {f for r in runs.ranges(conn, job, up_to_barrier=barrier) for f in r.get("files", [])}
        present = sorted(p for p in glob.glob(os.path.join(self.path, self.pattern)) if os.path.isfile(p))
        return {"source": self.describe(), "files": [p for p in present if p not in consumed]}

    def read(self, spark, spec):
        files = spec["files"]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise SourceError(
                f"input files {missing[:3]} of a recorded barrier are gone; restore them to replay the barrier"
            )
        if not files:
            return spark.createDataFrame([], self.schema)
        return spark.read.format(self.fmt).schema(self.schema).load(files)

    def describe(self) -> str:
        return f"files:{os.path.join(self.path, self.pattern)}"


@dataclass
class PostgresSource(Source):
    """Rows of ``table`` in a Postgres database, by ``key`` (system-time) or ``event_time`` (event-time)."""

    dsn: str
    table: str
    columns: list[str]
    key: str | None = None
    event_time: str | None = None
    allowed_lateness_s: float = 0.0

    def __post_init__(self) -> None:
        if (self.key is None) == (self.event_time is None):
            raise SourceError(f"source {self.table}: give exactly one of key (system-time) or event_time (event-time)")
        self.strategy = EVENT_TIME if self.event_time else SYSTEM_TIME
        self._conn: psycopg.Connection | None = None

    def _db(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, autocommit=True)
        return self._conn

    def _ident(self, name: str) -> sql.Composable:
        return sql.Identifier(*name.split("."))

    def plan(self, conn, job, barrier):
        if self.strategy == EVENT_TIME:
            previous = runs.ranges(conn, job, up_to_barrier=barrier)
            after = max((r["event_time_le"] for r in previous if r["barrier"] < barrier), default=None)
            return {"source": self.describe(), "event_time_gt": after,
                    "event_time_le": barrier_time(barrier).isoformat()}
        previous = [r for r in runs.ranges(conn, job, up_to_barrier=barrier) if r["barrier"] < barrier]
        low = previous[-1]["key_le"] if previous else None
        high = self._db().execute(sql.SQL("SELECT max({}) FROM {}").format(
            sql.Identifier(self.key), self._ident(self.table))).fetchone()[0]
        if low is not None and (high is None or high < low):
            high = low
        return {"source": self.describe(), "key_gt": low, "key_le": high}

    def watermark(self) -> datetime:
        """No transaction still open started before this; rows stamped earlier are all visible."""
        row = self._db().execute(
            """
            SELECT least(now(), coalesce(min(xact_start) FILTER (
                       WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()), now()))
            FROM pg_stat_activity
            """
        ).fetchone()
        return row[0]

    def ready(self, barrier: int) -> bool:
        if self.strategy != EVENT_TIME:
            return True
        lateness = self.allowed_lateness_s
        return (self.watermark() - barrier_time(barrier)).total_seconds() > lateness

    def read(self, spark, spec):
        cols = sql.SQL(", ").join(sql.Identifier(c) for c in self.columns)
        if self.strategy == EVENT_TIME:
            column = sql.Identifier(self.event_time)
            where = sql.SQL("{c} <= %(hi)s AND (%(lo)s::timestamptz IS NULL OR {c} > %(lo)s::timestamptz)").format(c=column)
            params = {"lo": spec["event_time_gt"], "hi": spec["event_time_le"]}
        else:
            column = sql.Identifier(self.key)
            where = sql.SQL("(%(hi)s::bigint IS NOT NULL AND {c} <= %(hi)s) AND (%(lo)s::bigint IS NULL OR {c} > %(lo)s)").format(c=column)
            params = {"lo": spec["key_gt"], "hi": spec["key_le"]}
        query = sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {}").format(cols, self._ident(self.table), where, column)
        cur = self._db().execute(query, params)
        rows = [tuple(_spark_value(v) for v in r) for r in cur.fetchall()]
        schema = ", ".join(f"`{d.name}` {_spark_type(d.type_code)}" for d in cur.description)
        return spark.createDataFrame(rows, schema)

    def describe(self) -> str:
        return f"postgres:{self.table}:{self.event_time or self.key}"


_PG_TO_SPARK = {16: "boolean", 20: "bigint", 21: "int", 23: "int", 25: "string", 1043: "string", 700: "float",
                701: "double", 1700: "decimal(38,9)", 1082: "date", 1114: "timestamp", 1184: "timestamp"}


def _spark_type(oid: int) -> str:
    try:
        return _PG_TO_SPARK[oid]
    except KeyError:
        raise SourceError(f"Postgres type oid {oid} is not supported by PostgresSource; cast the column") from None


def _spark_value(value):
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(timezone.utc).replace(tzinfo=None)
    return value
