"""Inputs of root jobs. A source plans the input range of a barrier (recorded in the control
plane before anything is written), says when it may close a barrier, and re-reads a recorded
range exactly (deterministic replay after a crash).

- :class:`FileSource` — a directory of files; the range is the list of files taken in since
  the previous barrier (system-time). Files must appear atomically (write, then rename).
- :class:`PostgresSource` — a table read by a monotone key (system-time: the key interval),
  or by event time (event-time: exactly the rows with event time <= B, once the source
  watermark — the start of the oldest open writing transaction in the source's database by
  a role that may write the table — has passed B). With an event-time column that defaults
  to ``now()`` (a transaction's start time), a source transaction never straddles two
  barriers. Transactions in other databases, or of roles that cannot write the table, do
  not hold the watermark back. The source's role must see other sessions' transactions
  (superuser or ``pg_read_all_stats``); otherwise the source refuses to close barriers.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg
from psycopg import sql

from icebarrier.control_plane import db, runs
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import barrier_time

SYSTEM_TIME = "system-time"
EVENT_TIME = "event-time"


class SourceError(IcebarrierError):
    """A root job's source is misconfigured or cannot be read."""


class Source:
    strategy = SYSTEM_TIME
    recheck_s = 1.0  # how often a job whose input is not ready yet looks again
    reads_arrow = False  # read_arrow() gives a range's rows without Spark

    def check(self) -> None:
        """Refuse (SourceError) a source that cannot be read as configured, before the job registers."""

    def plan(self, conn: db.Conn, job: str, barrier: int) -> dict:
        raise NotImplementedError

    def waiting_for(self, barrier: int) -> str | None:
        """What keeps the job from closing ``barrier`` now, in words; None when it may."""
        return None

    def ready(self, barrier: int) -> bool:
        """May the job close ``barrier`` now? (event-time sources wait for their watermark)"""
        return self.waiting_for(barrier) is None

    def ready_until(self) -> int | None:
        """The newest barrier (µs) the job may close now; None: any (system-time)."""
        return None

    def is_empty(self, spec: dict) -> bool:
        """Does a planned range hold no input (so the barriers it covers change nothing)?"""
        return False

    def read(self, spark, spec: dict):
        raise NotImplementedError

    def read_arrow(self, spec: dict, schema):
        """A recorded range's rows as a PyArrow table of ``schema`` (the sink's), where ``reads_arrow``."""
        raise NotImplementedError

    def summary(self, spec: dict) -> dict[str, str]:
        """Snapshot summary properties the commit of a recorded range carries (say, Kafka offsets)."""
        return {}

    def describe(self) -> str:
        raise NotImplementedError


@dataclass
class FileSource(Source):
    """New files in ``path`` matching ``pattern``, read with Spark's ``fmt`` reader and ``schema`` (DDL).

    Which files are new follows a consumed-input watermark, not the whole history: each range
    records when its listing started (``arrived_le``); the next takes the files that arrived
    (were renamed into place: their ctime) after the previous watermark less ``margin_s``, except
    those the ranges of that last stretch took. So a plan reads a few recent ranges, however
    many barriers came before. ``margin_s`` covers a file system's coarse clock (its ctime may
    lag the rename by a tick)."""

    path: str
    schema: str
    fmt: str = "json"
    pattern: str = "*"
    margin_s: float = 1.0

    def plan(self, conn, job, barrier):
        listed_at = time.time()  # before the listing: whatever arrived by then is in it
        present = sorted(p for p in glob.glob(os.path.join(self.path, self.pattern)) if os.path.isfile(p))
        recent = runs.recent_ranges(conn, job, before_barrier=barrier)
        first = next(recent, None)
        if first is None:
            new = present
        elif "arrived_le" not in first:  # recorded before the watermark existed: every range is needed
            consumed = {f for r in runs.ranges(conn, job, up_to_barrier=barrier) for f in r.get("files", [])}
            new = [p for p in present if p not in consumed]
        else:
            after = first["arrived_le"] - self.margin_s
            taken = set(first["files"])
            for earlier in recent:  # the ranges that may have taken a file that arrived after `after`
                if earlier.get("arrived_le", float("-inf")) < after - self.margin_s:
                    break
                taken.update(earlier["files"])
            new = [p for p in present if _arrived(p) > after and p not in taken]
        return {"source": self.describe(), "files": new, "arrived_le": listed_at}

    def is_empty(self, spec):
        return not spec["files"]

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
        self._conn: psycopg.Connection | None = None  # its own, tuple rows
        self._sees_all_sessions = False  # checked once, on first use

    def _db(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, autocommit=True)
        return self._conn

    def _ident(self, name: str) -> sql.Composable:
        return sql.Identifier(*name.split("."))

    def plan(self, conn, job, barrier):
        previous = runs.last_range(conn, job, before_barrier=barrier)  # ranges are contiguous: the last is enough
        if self.strategy == EVENT_TIME:
            return {
                "source": self.describe(),
                "event_time_gt": previous["event_time_le"] if previous else None,
                "event_time_le": barrier_time(barrier).isoformat(),
            }
        low = previous["key_le"] if previous else None
        high = (
            self._db()
            .execute(sql.SQL("SELECT max({}) FROM {}").format(sql.Identifier(self.key), self._ident(self.table)))
            .fetchone()[0]
        )
        if low is not None and (high is None or high < low):
            high = low
        return {"source": self.describe(), "key_gt": low, "key_le": high}

    def _oldest_writer(self) -> dict | None:
        """The oldest open transaction that has written and whose role may write the table,
        in the source's database (None if there is none)."""
        conn = self._db()
        if not self._sees_all_sessions:
            sees_all = conn.execute(
                "SELECT pg_has_role('pg_read_all_stats', 'USAGE') "
                "OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
            ).fetchone()[0]
            if not sees_all:
                raise SourceError(
                    f"source {self.table}: role cannot see other sessions' transactions, so its event-time watermark "
                    f"would be wrong; GRANT pg_read_all_stats TO the source's role"
                )
            self._sees_all_sessions = True
        row = conn.execute(
            """
            SELECT a.pid, a.xact_start, a.usename, a.application_name
            FROM pg_stat_activity a
            WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
              AND a.backend_xid IS NOT NULL AND a.xact_start IS NOT NULL AND a.usesysid IS NOT NULL
              AND has_table_privilege(a.usesysid, to_regclass(%s), 'INSERT, UPDATE')
            ORDER BY a.xact_start LIMIT 1
            """,
            (self._ident(self.table).as_string(conn),),
        ).fetchone()
        return None if row is None else dict(zip(("pid", "xact_start", "user", "application"), row))

    def watermark(self) -> datetime:
        """No transaction that may write the table is still open from before this; rows
        stamped earlier are all visible."""
        return self._watermark()[0]

    def _watermark(self) -> tuple[datetime, dict | None]:
        now = self._db().execute("SELECT now()").fetchone()[0]
        oldest = self._oldest_writer()
        return (now if oldest is None else min(now, oldest["xact_start"])), oldest

    def ready_until(self) -> int | None:
        if self.strategy != EVENT_TIME:
            return None
        watermark = self._watermark()[0].timestamp() - self.allowed_lateness_s
        return int(watermark * 1_000_000) - 1

    def is_empty(self, spec):
        _, where, params = self._where(spec)
        query = sql.SQL("SELECT NOT EXISTS (SELECT 1 FROM {} WHERE {})").format(self._ident(self.table), where)
        return self._db().execute(query, params).fetchone()[0]

    def waiting_for(self, barrier: int) -> str | None:
        if self.strategy != EVENT_TIME:
            return None
        watermark, oldest = self._watermark()
        if (watermark - barrier_time(barrier)).total_seconds() > self.allowed_lateness_s:
            return None
        if oldest is not None and oldest["xact_start"] <= barrier_time(barrier):
            return (
                f"event-time watermark of {self.describe()}: transaction pid {oldest['pid']} "
                f"(user {oldest['user']}, application {oldest['application']!r}) open since "
                f"{oldest['xact_start'].isoformat()}"
            )
        return f"event-time watermark of {self.describe()}: allowed lateness {self.allowed_lateness_s:g}s"

    def _where(self, spec) -> tuple[sql.Composable, sql.Composable, dict]:
        """The column a recorded range is on, its condition and parameters."""
        if self.strategy == EVENT_TIME:
            column = sql.Identifier(self.event_time)
            where = sql.SQL("{c} <= %(hi)s AND (%(lo)s::timestamptz IS NULL OR {c} > %(lo)s::timestamptz)").format(
                c=column
            )
            return column, where, {"lo": spec["event_time_gt"], "hi": spec["event_time_le"]}
        column = sql.Identifier(self.key)
        where = sql.SQL(
            "(%(hi)s::bigint IS NOT NULL AND {c} <= %(hi)s) AND (%(lo)s::bigint IS NULL OR {c} > %(lo)s)"
        ).format(c=column)
        return column, where, {"lo": spec["key_gt"], "hi": spec["key_le"]}

    def read(self, spark, spec):
        cols = sql.SQL(", ").join(sql.Identifier(c) for c in self.columns)
        column, where, params = self._where(spec)
        query = sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {}").format(cols, self._ident(self.table), where, column)
        cur = self._db().execute(query, params)
        rows = [tuple(_spark_value(v) for v in r) for r in cur.fetchall()]
        schema = ", ".join(f"`{d.name}` {_spark_type(d.type_code)}" for d in cur.description)
        return spark.createDataFrame(rows, schema)

    def describe(self) -> str:
        return f"postgres:{self.table}:{self.event_time or self.key}"


_PG_TO_SPARK = {
    16: "boolean",
    20: "bigint",
    21: "int",
    23: "int",
    25: "string",
    1043: "string",
    700: "float",
    701: "double",
    1700: "decimal(38,9)",
    1082: "date",
    1114: "timestamp",
    1184: "timestamp",
}


def _arrived(path: str) -> float:
    """When a file arrived: its ctime, which a rename into place sets (0 if it is gone)."""
    try:
        return os.stat(path).st_ctime
    except FileNotFoundError:
        return 0.0


def _spark_type(oid: int) -> str:
    try:
        return _PG_TO_SPARK[oid]
    except KeyError:
        raise SourceError(f"Postgres type oid {oid} is not supported by PostgresSource; cast the column") from None


def _spark_value(value):
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC).replace(tzinfo=None)
    return value
