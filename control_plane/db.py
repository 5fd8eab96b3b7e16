"""Connections to the control-plane database.

Entry points (CLI, job runtime) own connections; library functions take a
``psycopg.Connection`` and do one unit of work inside ``with conn.transaction():``.
The control plane lives in one Postgres schema (default ``icebarrier``); a connection
opened here has its ``search_path`` set to it, so SQL names its objects unqualified.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable
from typing import TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from icebarrier.control_plane.errors import (
    ConfigurationError,
    ControlPlaneUnavailableError,
    IcebarrierError,
    LockTimeoutError,
)
from icebarrier.control_plane.model import parse_duration_s, parse_schema_name

DEFAULT_SCHEMA = "icebarrier"
DSN_ENV = "ICEBARRIER_DSN"
SCHEMA_ENV = "ICEBARRIER_SCHEMA"
LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT = "ICEBARRIER_LOCK_TIMEOUT", "10s"
STATEMENT_TIMEOUT_ENV, DEFAULT_STATEMENT_TIMEOUT = "ICEBARRIER_STATEMENT_TIMEOUT", "60s"
RETRY_ATTEMPTS = 5

T = TypeVar("T")


def resolve_dsn(dsn: str | None) -> str:
    dsn = dsn or os.environ.get(DSN_ENV)
    if not dsn:
        raise ConfigurationError(
            f"no control-plane database given; pass --dsn or set {DSN_ENV}, "
            f"e.g. postgresql://postgres@127.0.0.1:5432/postgres"
        )
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(
            f"--dsn / {DSN_ENV} {_redact(dsn)!r} is not a connection string ({str(exc).strip().splitlines()[0]}); "
            f"use e.g. postgresql://postgres@127.0.0.1:5432/postgres"
        ) from None
    return dsn


def resolve_schema(schema: str | None) -> str:
    if schema is None:
        schema = os.environ.get(SCHEMA_ENV) or DEFAULT_SCHEMA
    return parse_schema_name(schema)


def connect(dsn: str | None = None, schema: str | None = None, *, check_schema: bool = True) -> psycopg.Connection:
    """Open a connection to the control plane (autocommit; units of work use transactions).

    With ``check_schema`` it refuses a database whose schema is not at the migrations' head.
    """
    dsn = resolve_dsn(dsn)
    schema = resolve_schema(schema)
    try:
        conn = psycopg.connect(
            dsn,
            autocommit=True,
            row_factory=dict_row,
            options=f"-c search_path={schema} -c lock_timeout={_timeout_ms(LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT)} "
                    f"-c statement_timeout={_timeout_ms(STATEMENT_TIMEOUT_ENV, DEFAULT_STATEMENT_TIMEOUT)}",
            application_name="icebarrier",
            connect_timeout=10,
        )
    except psycopg.OperationalError as exc:
        reason = "; ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip()) \
            or type(exc).__name__
        raise ControlPlaneUnavailableError(
            f"cannot connect to the control plane at {_redact(dsn)}: {reason}; "
            f"check that Postgres is running and --dsn / {DSN_ENV} is right"
        ) from exc
    conn.info_schema = schema  # type: ignore[attr-defined]
    if check_schema:
        from icebarrier.control_plane.schema import require_current

        try:
            require_current(conn)
        except BaseException:
            conn.close()
            raise
    return conn


def _timeout_ms(env: str, default: str) -> int:
    text = os.environ.get(env) or default
    try:
        return max(1, round(parse_duration_s(text) * 1000))
    except IcebarrierError:
        raise ConfigurationError(f"{env}={text!r} is not a duration; use e.g. {default}") from None


def advisory_lock(conn: psycopg.Connection, purpose: str, ids: list[int], *, what: str, shared: bool = False,
                  session: bool = False) -> None:
    """Take the advisory locks (``purpose``, id) for ``ids`` in id order (transaction-scoped
    unless ``session``). A wait past ``lock_timeout`` raises :class:`LockTimeoutError` naming
    the backends that hold them (asked on a connection of its own: the transaction is aborted)."""
    fn = "pg_advisory_lock" if session else "pg_advisory_xact_lock"
    fn += "_shared" if shared else ""
    key, subs = _advisory_keys(conn, purpose, ids)
    try:
        conn.execute(f"SELECT {fn}(%s, s::int) FROM unnest(%s::bigint[]) AS s ORDER BY s", (key, subs))
    except pg_errors.LockNotAvailable:
        with reopen(conn) as other:
            holders = other.execute(
                """SELECT l.pid, a.usename, a.application_name, a.state, a.xact_start
                   FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                   WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
                     AND l.classid = ((%s::bigint + 4294967296) %% 4294967296)::oid
                     AND l.objid = ANY(%s::bigint[]::oid[])""", (key, subs)).fetchall()
        timeout = os.environ.get(LOCK_TIMEOUT_ENV) or DEFAULT_LOCK_TIMEOUT
        raise LockTimeoutError(what, timeout, [dict(h) for h in holders]) from None


def advisory_unlock(conn: psycopg.Connection, purpose: str, ids: list[int]) -> None:
    """Release session-level locks taken with ``advisory_lock(..., session=True)``."""
    key, subs = _advisory_keys(conn, purpose, ids)
    conn.execute("SELECT pg_advisory_unlock(%s, s::int) FROM unnest(%s::bigint[]) AS s", (key, subs))


def _advisory_keys(conn: psycopg.Connection, purpose: str, ids: list[int]) -> tuple[int, list[int]]:
    return lock_key(conn, purpose), sorted(i % 2147483647 for i in ids)


def reopen(conn: psycopg.Connection) -> psycopg.Connection:
    """A new connection to the same database and schema as ``conn``, for a thread of its own
    (a psycopg connection carries one transaction state: a background renewal on the caller's
    connection would become a savepoint of whatever transaction the caller has open)."""
    dsn = conn.info.dsn
    if conn.info.password:
        dsn = make_conninfo(dsn, password=conn.info.password)
    return connect(dsn, schema_of(conn), check_schema=False)


def schema_of(conn: psycopg.Connection) -> str:
    return getattr(conn, "info_schema", DEFAULT_SCHEMA)


def lock_key(conn: psycopg.Connection, purpose: str) -> int:
    """A stable int4 advisory-lock class id for ``purpose`` within this schema."""
    return zlib.crc32(f"icebarrier:{schema_of(conn)}:{purpose}".encode()) - 2**31


def retrying(fn: Callable[[], T], *, attempts: int = RETRY_ATTEMPTS) -> T:
    """Run a unit of work, retrying serialization failures, deadlocks and marked conflicts."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except (pg_errors.SerializationFailure, pg_errors.DeadlockDetected):
            if attempt == attempts:
                raise
        except IcebarrierError as exc:
            if not exc.retryable or attempt == attempts:
                raise
        time.sleep(0.005 * 2**attempt)
    raise AssertionError("unreachable")


def _redact(dsn: str) -> str:
    """Hide a password in a URL or key=value DSN before printing it (a password may hold '@')."""
    import re

    url = re.fullmatch(r"([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*:)(.*)@([^@]*)", dsn, re.DOTALL)
    if url:  # everything between "user:" and the last "@" is the password, whatever it holds
        return f"{url[1]}***@{url[3]}"
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "(unparsable)"
    if not params.get("password"):
        return dsn
    return make_conninfo(**{**params, "password": "***"})
