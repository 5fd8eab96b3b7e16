"""Connections to the control-plane database.

Entry points (CLI, job runtime) own connections; library functions take a
``psycopg.Connection`` and do one unit of work inside ``with conn.transaction():``.
The control plane lives in one Postgres schema (default ``icebarrier``); a connection
opened here has its ``search_path`` set to it, so SQL names its objects unqualified.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import DictRow, dict_row

from icebarrier.control_plane.errors import (
    ConfigurationError,
    ControlPlaneUnavailableError,
    IcebarrierError,
    LockTimeoutError,
    PermissionDeniedError,
)
from icebarrier.control_plane.model import parse_duration_s, parse_schema_name
from icebarrier.control_plane.schema_version import require_current
from icebarrier.control_plane.sqlstates import from_sqlstate

DEFAULT_SCHEMA = "icebarrier"
DSN_ENV = "ICEBARRIER_DSN"
SCHEMA_ENV = "ICEBARRIER_SCHEMA"
LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT = "ICEBARRIER_LOCK_TIMEOUT", "10s"
STATEMENT_TIMEOUT_ENV, DEFAULT_STATEMENT_TIMEOUT = "ICEBARRIER_STATEMENT_TIMEOUT", "60s"
# A pooled connection idle longer than this is pinged before use.
POOL_CHECK_ENV, DEFAULT_POOL_CHECK = "ICEBARRIER_POOL_CHECK_IDLE", "1s"
RETRY_ATTEMPTS = 5

T = TypeVar("T")
Conn = psycopg.Connection[DictRow]  # every control-plane connection: dict rows (connection_kwargs)


def one(cursor: psycopg.Cursor[DictRow]) -> DictRow:
    """The row of a query that always returns exactly one (an aggregate, ``RETURNING``, ``SELECT
    … FROM function()``, a row the schema guarantees): typed as present, checked once here."""
    row = cursor.fetchone()
    if row is None:
        raise IcebarrierError("the control plane answered no row where it always answers one; this is a bug")
    return row


def resolve_dsn(dsn: str | None) -> str:
    dsn = dsn or os.environ.get(DSN_ENV)
    if not dsn:
        raise ConfigurationError(
            f"no control-plane database given; pass --dsn or set {DSN_ENV}, "
            f"e.g. postgresql://postgres@127.0.0.1:5432/postgres"
        )
    try:
        info = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(
            f"--dsn / {DSN_ENV} {_redact(dsn)!r} is not a connection string ({str(exc).strip().splitlines()[0]}); "
            f"use e.g. postgresql://postgres@127.0.0.1:5432/postgres"
        ) from None
    hosts = hosts_of(info)
    if len(hosts) > 1 and info.get("target_session_attrs") not in PRIMARY_ONLY:
        given = info.get("target_session_attrs")
        raise ConfigurationError(
            f"--dsn / {DSN_ENV} names {len(hosts)} hosts ({', '.join(f'{h}:{p}' for h, p in hosts)}) "
            + (
                f"with target_session_attrs={given}, which may pick a standby"
                if given
                else "without target_session_attrs"
            )
            + "; add target_session_attrs=read-write so that every component connects to the primary"
        )
    return dsn


def unreachable(dsn: str, exc: BaseException) -> str:
    """Why no connection to the control plane could be had, in one line. With several hosts,
    each one's answer; when none of them is a writable primary (all standbys, or the primary gone
    and no standby promoted yet), that is said first."""
    import re

    text = str(exc).strip()
    attempts = re.findall(r"^- host: '([^']*)', port: '([^']*)'.*?failed: (?:.*failed: )?(.*)$", text, re.MULTILINE)
    if not attempts:
        reason = "; ".join(line.strip() for line in text.splitlines() if line.strip()) or type(exc).__name__
        if "session is read-only" in reason:
            return (
                f"cannot connect to the control plane at {_redact(dsn)}: it is a standby (read-only); "
                f"point --dsn / {DSN_ENV} at the primary, or promote the standby"
            )
        return (
            f"cannot connect to the control plane at {_redact(dsn)}: {reason}; "
            f"check that Postgres is running and --dsn / {DSN_ENV} is right"
        )
    answers = ", ".join(
        f"{h}:{p} is a standby (read-only)" if "read-only" in why else f"{h}:{p}: {why.strip()}"
        for h, p, why in attempts
    )
    return (
        f"cannot connect to the control plane at {_redact(dsn)}: no host is a writable primary ({answers}); "
        f"check that a primary runs (promote a standby if it is gone) and that --dsn / {DSN_ENV} names it"
    )


PRIMARY_ONLY = ("read-write", "primary")  # target_session_attrs that never land on a standby


def hosts_of(info: dict) -> list[tuple[str, int]]:
    """The (host, port) pairs a parsed DSN names, in the order libpq tries them (one port may
    serve every host)."""
    hosts = (info.get("host") or info.get("hostaddr") or "127.0.0.1").split(",")
    ports = str(info.get("port") or "5432").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)
    return [(h or "127.0.0.1", int(p or 5432)) for h, p in zip(hosts, ports, strict=False)]


def resolve_schema(schema: str | None) -> str:
    if schema is None:
        schema = os.environ.get(SCHEMA_ENV) or DEFAULT_SCHEMA
    return parse_schema_name(schema)


def connect(
    dsn: str | None = None, schema: str | None = None, *, check_schema: bool = True, actor: str | None = None
) -> Conn:
    """Open a connection to the control plane (autocommit; units of work use transactions).

    With ``check_schema`` it refuses a database whose schema is not at the migrations' head.
    ``actor``: who acts through the connection, as the audit trail names them beside the role
    (an admin command's OS user).
    """
    dsn = resolve_dsn(dsn)
    schema = resolve_schema(schema)
    try:
        conn = psycopg.connect(dsn, **connection_kwargs(schema, actor=actor))
    except psycopg.OperationalError as exc:
        raise ControlPlaneUnavailableError(unreachable(dsn, exc)) from exc
    conn.info_schema = schema  # type: ignore[attr-defined]
    if check_schema:
        try:
            require_current(conn, schema)
        except BaseException:
            conn.close()
            raise
    return conn


ACTOR_SETTING = "icebarrier.actor"  # who acts, for the audit trail (migration 0014)


def connection_kwargs(schema: str, *, actor: str | None = None) -> dict:
    """How every control-plane connection is opened (autocommit, dict rows, the schema first on
    the search_path, bounded lock and statement waits, the actor, no JIT); pools use the same.

    JIT off: the control plane's statements are short, but a few over views (the status page's,
    whose set-returning functions the planner guesses at 1,000 rows) cost past ``jit_above_cost``
    and paid ~1 s compiling for a 30-ms query."""
    options = (
        f"-c search_path={schema} -c lock_timeout={_timeout_ms(LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT)} "
        f"-c statement_timeout={_timeout_ms(STATEMENT_TIMEOUT_ENV, DEFAULT_STATEMENT_TIMEOUT)} -c jit=off"
    )
    if actor:
        escaped = actor.replace("\\", "\\\\").replace(" ", "\\ ")
        options += f" -c {ACTOR_SETTING}={escaped}"
    return {
        "autocommit": True,
        "row_factory": dict_row,
        "options": options,
        "application_name": "icebarrier",
        "connect_timeout": 10,
    }


def pool(dsn: str | None, schema: str | None, *, max_size: int = 8):
    """A connection pool (psycopg_pool) for a long-running server, connections as :func:`connect`'s."""
    from psycopg_pool import ConnectionPool

    dsn, schema = resolve_dsn(dsn), resolve_schema(schema)
    connect(dsn, schema).close()  # refuse an unreachable server or an old schema now, with our message
    ping_after_s = _timeout_ms(POOL_CHECK_ENV, DEFAULT_POOL_CHECK) / 1000

    def configure(conn: Conn) -> None:
        conn.info_schema = schema  # type: ignore[attr-defined]
        conn.idle_since = time.monotonic()  # type: ignore[attr-defined]  # just opened: no ping for its first use

    def returned(conn: Conn) -> None:
        conn.idle_since = time.monotonic()  # type: ignore[attr-defined]

    def check(conn: Conn) -> None:
        if _ping_due(conn, ping_after_s):
            ConnectionPool.check_connection(conn)

    return ConnectionPool(
        dsn,
        kwargs=connection_kwargs(schema),
        configure=configure,
        reset=returned,
        check=check,
        min_size=1,
        max_size=max_size,
        open=True,
        name="icebarrier",
    )


def async_pool(dsn: str | None, schema: str | None, *, max_size: int = 4):
    """The same pool for asyncio (psycopg's AsyncConnection), not open yet: open it on the event
    loop that uses it (``await p.open()``). A server's loads wait for Postgres here without
    holding the loop."""
    from psycopg_pool import AsyncConnectionPool

    dsn, schema = resolve_dsn(dsn), resolve_schema(schema)
    ping_after_s = _timeout_ms(POOL_CHECK_ENV, DEFAULT_POOL_CHECK) / 1000

    async def configure(conn) -> None:
        conn.info_schema = schema
        conn.idle_since = time.monotonic()  # just opened: no ping for its first use

    async def returned(conn) -> None:
        conn.idle_since = time.monotonic()

    async def check(conn) -> None:
        if _ping_due(conn, ping_after_s):
            await AsyncConnectionPool.check_connection(conn)

    return AsyncConnectionPool(
        dsn,
        connection_class=psycopg.AsyncConnection,
        kwargs=connection_kwargs(schema),
        configure=configure,
        reset=returned,
        check=check,
        min_size=1,
        max_size=max_size,
        open=False,
        name="icebarrier-async",
    )


def _ping_due(conn, ping_after_s: float) -> bool:
    """A connection that sat idle may have been killed (a Postgres restart, a proxy's idle
    timeout): a pool pings it before handing it out (and replaces one that fails). One in steady
    use is not pinged: that would add a round trip to every request."""
    return time.monotonic() - getattr(conn, "idle_since", 0.0) >= ping_after_s


def _timeout_ms(env: str, default: str) -> int:
    return max(1, round(duration_env_s(env, default) * 1000))


def duration_env_s(env: str, default: str) -> float:
    """The duration (s) environment variable ``env`` sets (``default`` if unset), refused in one line."""
    text = os.environ.get(env) or default
    try:
        return parse_duration_s(text)
    except IcebarrierError:
        raise ConfigurationError(f"{env}={text!r} is not a duration; use e.g. {default}") from None


def call(conn: Conn, function: str, *args) -> list[dict]:
    """Call a control-plane function (``SELECT * FROM function(args)``) and return its rows.

    The functions check who may do what and their rules, and raise their own SQLSTATEs; those
    come back as the matching :class:`IcebarrierError` (:func:`.sqlstates.from_sqlstate`)."""
    with translated(conn, function):
        return conn.execute(_call_query(function, len(args)), args).fetchall()


@contextmanager
def translated(conn: Conn, what: str) -> Iterator[None]:
    """Raise what a control-plane function raised as our error (a missing privilege and a lock
    wait past lock_timeout too); ``what`` names the operation."""
    try:
        yield
    except pg_errors.InsufficientPrivilege as exc:
        raise PermissionDeniedError(
            conn.info.user, what, None, f"role {conn.info.user} may not call {what} ({exc.diag.message_primary})"
        ) from None
    except pg_errors.LockNotAvailable:
        timeout = os.environ.get(LOCK_TIMEOUT_ENV) or DEFAULT_LOCK_TIMEOUT
        raise LockTimeoutError(what.replace("_", " "), timeout, []) from None
    except psycopg.Error as exc:
        ours = from_sqlstate(exc.sqlstate, exc.diag.message_primary or str(exc), exc.diag.message_detail)
        if ours is None:
            raise
        raise ours from None


@functools.lru_cache(maxsize=64)
def _call_query(function: str, n_args: int) -> str:
    """``SELECT * FROM function(%s, …)``, composed once (psycopg then prepares it server-side)."""
    return (
        sql.SQL("SELECT * FROM {}({})")
        .format(sql.Identifier(function), sql.SQL(", ").join(sql.Placeholder() * n_args))
        .as_string(None)
    )


class Tail:
    """Statements a :func:`transaction` sends with its COMMIT, in the same round trip."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, dict | tuple | None]] = []

    def then(self, query: str, params: dict | tuple | None = None) -> None:
        """Run ``query`` last, with the COMMIT. Its result is not read; an error in it rolls the
        whole transaction back and is raised at the end of the block."""
        self.statements.append((query, params))


def atomic(conn: Conn) -> AbstractContextManager:
    """A transaction around a block, or nothing more where the connection is in one already: the
    block is then part of that transaction, and a savepoint (two round trips) would buy only a
    partial rollback nobody here uses (an error in the block rolls the whole transaction back)."""
    if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
        return nullcontext()
    return conn.transaction()


@contextmanager
def transaction(conn: Conn) -> Iterator[Tail]:
    """``conn.transaction()`` whose last statements ride with its COMMIT: what the block adds to
    the :class:`Tail` goes out in pipeline mode with the COMMIT and one Sync, so a write whose
    result nobody reads (a record kept beside an action) costs no round trip of its own. It is
    the connection's outermost transaction (a failed tail rolls it back whole)."""
    if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise psycopg.ProgrammingError("db.transaction() opens a transaction; this connection is already in one")
    tail = Tail()
    pipeline: AbstractContextManager | None = None  # entered: the tail and COMMIT not yet sent
    try:
        with conn.transaction():
            yield tail
            if tail.statements:
                pipeline = conn.pipeline()
                pipeline.__enter__()  # left after the COMMIT is queued (psycopg syncs before it otherwise)
                for query, params in tail.statements:
                    conn.execute(query, params)
        if pipeline is not None:
            sending, pipeline = pipeline, None
            sending.__exit__(None, None, None)  # sends the tail, COMMIT and Sync; raises the tail's error
    except BaseException as exc:
        if pipeline is not None:
            try:
                pipeline.__exit__(type(exc), exc, exc.__traceback__)
            except Exception:  # noqa: BLE001 - the first error is the one to raise
                pass
        if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            conn.rollback()  # the tail failed: the COMMIT was skipped, the transaction is aborted
        failed = _first_failure(exc)
        if failed is not exc:
            raise failed from None
        raise


def _first_failure(exc: BaseException) -> BaseException:
    """The statement that failed a pipeline: psycopg may raise PipelineAborted for a statement
    after it (the COMMIT), with the failure as its context, depending on when results arrive."""
    while isinstance(exc, psycopg.errors.PipelineAborted) and exc.__context__ is not None:
        exc = exc.__context__
    return exc


def advisory_lock(
    conn: Conn, purpose: str, ids: list[int], *, what: str, shared: bool = False, session: bool = False
) -> None:
    """Take the advisory locks (``purpose``, id) for ``ids`` in id order (transaction-scoped
    unless ``session``). A wait past ``lock_timeout`` raises :class:`LockTimeoutError` naming
    the backends that hold them. Any role that can connect can take advisory locks: see the
    README, "Locks and timeouts"."""
    call(conn, "take_lock", purpose, list(ids), shared, what, session)


def advisory_unlock(conn: Conn, purpose: str, ids: list[int]) -> None:
    """Release session-level locks taken with ``advisory_lock(..., session=True)``."""
    call(conn, "unlock", purpose, list(ids))


def reopen(conn: Conn) -> Conn:
    """A new connection to the same database and schema as ``conn``, for a thread of its own
    (a psycopg connection carries one transaction state: a background renewal on the caller's
    connection would become a savepoint of whatever transaction the caller has open)."""
    dsn = conn.info.dsn
    if conn.info.password:
        dsn = make_conninfo(dsn, password=conn.info.password)
    return connect(dsn, schema_of(conn), check_schema=False)


def schema_of(conn: Conn) -> str:
    return getattr(conn, "info_schema", DEFAULT_SCHEMA)


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
    return make_conninfo("", **{**params, "password": "***"})
