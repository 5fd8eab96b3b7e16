"""A server process's memory of what loads read, so that most loads ask Postgres nothing
themselves: who holds an access token, where a table's pointer is, whether the table is managed,
S(T, B) of a plain cut, a read-committed session's moment, and the names of a namespace's tables
and views (a list's answer, dropped at a notice of any of its rows). It answers loads through
``latest``, ``read-committed`` and ``barrier-<B>``; the database announces every change that
could make a remembered answer wrong (migration 0022).

Why an answer from memory is the database's answer at the time the load came:

- A pointer row inserted, swapped, renamed or deleted (by this server, another, or an engine
  writing the SQL catalog directly), a token revoked or an access token's session ended, a
  table managed or not any more, a cut undone by a revision: each is announced when its
  transaction commits. One connection a process listens, on the server's event loop.
- Before memory answers a load it catches up: a Sync on the listening connection (in pipeline
  mode), sent after the load came, whose answer (ReadyForQuery) Postgres sends after the notices
  of every transaction committed before the Sync reached it. Every change committed before the
  load came is then applied, so a client reads its own writes and everyone else's, through any
  process, and a two-table commit is never seen half. The loads that come in one turn of the
  event loop share a catch-up, sent at the end of the turn; catch-ups are pipelined, so a load
  never waits for one sent before it came (it costs Postgres a Sync, not a statement).
- S(T, B) is kept only for a plain cut (B issued, completed by T, not expired): it stays S(T, B)
  until a revision, which is announced. An expiry changes the pointer, whose metadata then lacks
  the snapshot: that load asks the database (``Loading.load_on_loop``).
- A read-committed session's moment is kept until it is a tenth of the quiet interval old, when
  the database would write its time again: no process moves it before the quiet interval, so
  every process gives the session the same moment, as without memory. Every twentieth of the
  quiet interval memory tells the database, in one statement (``session_touch``, migration
  0037), when each session it answered last used its moment; the database confirms the moments
  still the sessions' and memory keeps them another tenth of the interval from when it asked.
  A client loading without pause never waits for the database (before, it went there ten
  times a second), and the database still knows its last load within a twentieth of the quiet
  interval (plus the statement's time). Touches start a twentieth apart whatever each took; a
  load whose moment's time ran out while a touch carrying it is out waits for that touch's
  answer instead of asking the database (which would answer no sooner: a slow touch otherwise
  sent every session's next load to write its session at once, up to half a second each under
  16 clients). A moment's time is judged as when its load came, not after the catch-up.
- A load's answer is kept only if no notice came while its statement ran: a notice that
  overtook the answer would otherwise be undone by it (one generation counter).
- Without a listening connection nothing is kept or answered from memory; when one connects
  (again), memory starts empty: notices were missed. A load waits at most ``CATCH_UP_S`` for a
  catch-up, then asks the database; a connection cut without a word is found by TCP keepalives
  within about 15 s.
- A token is kept for the life its session has left, never longer; who holds it answers every
  route's caller (:func:`~icebarrier.apps.catalog.deps.caller`). A job's loads are not answered
  from memory: a job also sees its own staged commits, which no notice announces.
- Before ``icebarrier db upgrade`` created the trigger that announces the SQL catalog's
  pointers, every load asks the database.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from contextlib import suppress
from typing import NamedTuple

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from icebarrier.control_plane import db
from icebarrier.control_plane.catalog_loads import LoadQuery, LoadState
from icebarrier.control_plane.model import TableName
from icebarrier.control_plane.notices import loads_channel, pointers_channel
from icebarrier.control_plane.tokens import ANONYMOUS, Principal
from icebarrier.iceberg_ext.catalog import POINTER_TRIGGER

RECONNECT_S = 1.0
CATCH_UP_S = 1.0  # a load waits this long at most for memory to catch up, then asks the database
MAX_POINTERS = 100_000  # about 30 MB of keys and locations at most
MAX_TOKENS = 10_000
MAX_LISTS = 1_000  # namespaces whose names are kept (a namespace's list: its tables' and views' names)
TOUCH_MIN_S = 0.01  # moments are touched no more often (a quiet interval under 0.2 s: less than every twentieth)
MODES = ("latest", "read-committed", "barrier")  # the loads memory answers
# A cut connection is found in 5 + 2 * 5 s; connect_timeout bounds a reconnection's wait.
_LISTENER = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 5,
    "connect_timeout": 10,
}
_TOUCH = "SELECT token_hash, scope FROM session_touch(%s, %s, %s, %s)"
_ANNOUNCED = "SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = %s AND tgrelid = to_regclass(%s))"

_Key = tuple[str, str, str]  # the SQL catalog's (catalog_name, table_namespace, table_name)
_Session = tuple[str, str | None]  # a read-committed session: (token hash, scope)


class Listed(NamedTuple):
    """A namespace's names in the SQL catalog, each sorted."""

    tables: tuple[str, ...]
    views: tuple[str, ...]


def _key(table: TableName) -> _Key:
    return table.catalog, table.sql_namespace, table.name


class LoadCache:
    """Used on the server's event loop only (no locks). ``catalog_schema``: the SQL catalog's
    schema, where the pointers are."""

    def __init__(self, dsn: str | None, schema: str | None, catalog_schema: str, *, quiet_ms: int) -> None:
        self._dsn, self._schema = db.resolve_dsn(dsn), db.resolve_schema(schema)
        self._catalog_schema = catalog_schema
        self._quiet_s = quiet_ms / 1000
        self._pointers: dict[_Key, str] = {}
        self._managed: dict[str, bool] = {}  # managed key: is the table managed
        self._cuts: dict[tuple[str, int], int] = {}  # (managed key, B): S(T, B), a plain cut's snapshot
        self._tokens: dict[str, tuple[Principal, float]] = {}  # token hash: who, valid until (monotonic)
        self._moments: dict[_Session, tuple[int, float]] = {}  # B, until
        self._lists: dict[tuple[str, str], Listed] = {}  # (catalog, namespace): its names, as listed
        self._used: dict[_Session, float] = {}  # the moments given since the last touch: when last
        self._touching: tuple[dict[_Session, int], asyncio.Future] | None = None  # a touch out: its moments
        self._generation = 0
        # Catching up (:meth:`_readable`): the catch-ups sent and not answered yet, oldest first,
        # each the loads that wait for it; the loads that wait for the next one (sent at the end
        # of this turn of the event loop); the listening connection while it listens.
        self._in_flight: deque[asyncio.Future] = deque()
        self._next: asyncio.Future | None = None
        self._pgconn: psycopg.pq.abc.PGconn | None = None
        self._fd = -1
        self._lost: asyncio.Future | None = None
        self._tasks: list[asyncio.Task] = []
        self.live = False  # listening: memory may be used
        self.hits = self.misses = self.catch_ups = self.touches = 0

    @property
    def generation(self) -> int:
        """Take it before a load's statement; :meth:`keep` its answer with it."""
        return self._generation

    async def remembered(self, query: LoadQuery) -> LoadState | None:
        """The state of a load through latest, read-committed or barrier-<B> from memory, as the
        database would give it now (None: ask the database). Memory answers after it has caught
        up with every transaction committed before the load came (:meth:`_caught_up`)."""
        if query.mode not in MODES or query.job is not None:
            return None
        state = None
        came = time.monotonic()
        if self.live and self._recall(query, came) is None and self._touching_moment_of(query):
            await self._touched()  # what the database says of the moment: kept another tenth, or ended
            came = time.monotonic()
        if self.live and self._recall(query, came) is not None and await self._caught_up():
            state = self._recall(query, came)  # as it is after the catch-up, a moment's time as when it came
        if state is None:
            self.misses += 1
        else:
            self.hits += 1
            self._used_moment(query, time.monotonic())
        return state

    def _touching_moment_of(self, query: LoadQuery) -> bool:
        """Whether the touch out now carries the session's moment, which memory still holds: its
        time ran out while the touch was out (a slow database). The load waits for the touch's
        answer rather than asking the database itself: what it asks would be answered no sooner,
        and every session's loads would ask at once."""
        if self._touching is None or query.mode != "read-committed" or query.hashed_token is None:
            return False
        key = (query.hashed_token, query.scope)
        kept = self._moments.get(key)
        return kept is not None and self._touching[0].get(key) == kept[0]

    async def _touched(self) -> None:
        assert self._touching is not None
        with suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._touching[1]), CATCH_UP_S)

    def _used_moment(self, query: LoadQuery, now: float) -> None:
        """A read-committed load was given its session's moment at ``now``: the next touch says so."""
        if query.mode == "read-committed" and query.hashed_token is not None and query.job is None:
            self._used.pop(key := (query.hashed_token, query.scope), None)
            _put(self._used, MAX_TOKENS, key, now)

    def _recall(self, query: LoadQuery, now: float) -> LoadState | None:
        """What memory holds for ``query``, a token and a moment only until their time at ``now``."""
        location = self._pointers.get(_key(query.table))
        name = query.managed_key
        managed = False if name is None else self._managed.get(name)
        hashed = query.hashed_token
        held = None if hashed is None else self._tokens.get(hashed)
        if location is None or managed is None or (hashed is not None and _gone(held, now)):
            return None
        if held is not None and held[0].kind == "job":
            return None  # a job's loads see its staged commits, which no notice announces
        principal = ANONYMOUS if held is None else held[0]
        barrier = snapshot_id = None  # through latest, or an unmanaged table: nothing pinned
        if query.mode != "latest" and name is not None and managed:
            moment = self._moments.get((hashed or "", query.scope)) if query.mode == "read-committed" else None
            barrier = query.barrier if query.mode == "barrier" else (moment[0] if moment and moment[1] > now else None)
            snapshot_id = None if barrier is None else self._cuts.get((name, barrier))
            if snapshot_id is None:
                return None
        return LoadState(
            principal=principal,
            staged_location=None,
            managed=managed,
            location=location,
            snapshot_id=snapshot_id,
            cut=barrier,
            moment=barrier,
            plain=barrier is not None,
        )

    async def principal(self, hashed_token: str) -> Principal | None:
        """Who holds the access token whose hash is ``hashed_token``, from memory, as the database
        would say now (None: ask it); after a catch-up, as a load's."""
        if not self.live or _gone(self._tokens.get(hashed_token), time.monotonic()) or not await self._caught_up():
            return None
        held = self._tokens.get(hashed_token)
        return None if held is None or held[1] <= time.monotonic() else held[0]

    def keep_principal(self, generation: int, hashed_token: str, principal: Principal, *, until: float) -> None:
        """Remember who holds a token until ``until`` (``time.monotonic()``; the database's answer,
        asked at ``generation``: a notice since, and it is not kept)."""
        if generation == self._generation:
            _put(self._tokens, MAX_TOKENS, hashed_token, (principal, until))

    async def listed(self, catalog: str, namespace: str) -> Listed | None:
        """A namespace's tables' and views' names from memory, as the database would list them now
        (None: ask it); after a catch-up, as a load's. A notice of any row of the namespace (a
        table created, dropped, renamed or committed) drops them."""
        key = (catalog, namespace)
        if not self.live or key not in self._lists or not await self._caught_up():
            return None
        return self._lists.get(key)

    def keep_listed(self, generation: int, catalog: str, namespace: str, listed: Listed) -> None:
        """Remember a namespace's names as the database listed them at ``generation``."""
        if generation == self._generation:
            _put(self._lists, MAX_LISTS, (catalog, namespace), listed)

    def keep(self, generation: int, query: LoadQuery, state: LoadState, *, asked_at: float) -> None:
        """Remember what the database answered (``asked_at``: ``time.monotonic()`` before the
        statement was sent), unless a notice came since ``generation`` or the answer is one
        memory must not give (a job's staged commit, no such table; a job's token is not kept)."""
        if generation != self._generation or query.mode not in MODES or query.job is not None:
            return
        if state.staged_location is not None or state.location is None:
            return
        hashed = query.hashed_token
        if hashed is not None and state.principal.kind != "job" and state.token_ttl_s is not None:
            _put(self._tokens, MAX_TOKENS, hashed, (state.principal, asked_at + state.token_ttl_s))
        _put(self._pointers, MAX_POINTERS, _key(query.table), state.location)
        name = query.managed_key
        if name is None:
            return
        _put(self._managed, MAX_POINTERS, name, state.managed)
        if state.moment is None:
            return
        if state.plain:
            _put(self._cuts, MAX_POINTERS, (name, state.moment), state.snapshot_id)
        if hashed is not None and query.mode == "read-committed" and state.moment_age_s is not None:
            # The database writes the moment's time again when it is a tenth of the quiet interval
            # old; memory gives it until then, so the gap the database sees between a session's
            # loads is never more than it would see without memory (moves are past 1.1 quiet).
            until = asked_at - state.moment_age_s + query.quiet_ms / 10_000
            _put(self._moments, MAX_TOKENS, (hashed, query.scope), (state.moment, until))
            self._used_moment(query, asked_at)  # session_cut writes its time only a tenth of quiet apart

    async def _caught_up(self) -> bool:
        """Wait for a catch-up sent after now (the loads of one turn of the event loop share
        one); whether memory is still live then. At most CATCH_UP_S."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(self._send_catch_up)
        waiting = self._next
        try:
            await asyncio.wait_for(asyncio.shield(waiting), CATCH_UP_S)
        except TimeoutError:
            return False  # the listening connection is slow or gone: the database answers
        return self.live

    def note(self, payload: str) -> None:
        """Drop what a notice names: a pointer's key (a JSON array), every token, or every cut
        and managed table."""
        self._generation += 1
        if payload == "tokens":
            self._tokens.clear()
        elif payload == "cuts":
            self._cuts.clear()
            self._managed.clear()
        else:
            catalog, namespace, name = json.loads(payload)
            self._pointers.pop((catalog, namespace, name), None)
            self._lists.pop((catalog, namespace), None)

    def _forget_all(self, *, live: bool) -> None:
        self._generation += 1
        for kept in (self._pointers, self._managed, self._cuts, self._tokens, self._moments, self._used, self._lists):
            kept.clear()
        self.live = live
        self._release()  # loads waiting for a catch-up: memory is empty, they ask the database

    def _release(self) -> None:
        for waiting in (*self._in_flight, self._next):
            if waiting is not None and not waiting.done():
                waiting.set_result(None)
        self._in_flight.clear()
        self._next = None

    async def start(self, pool) -> None:
        """Listen, and touch the moments given (``pool``: the server's async pool)."""
        self._tasks = [
            asyncio.create_task(self._listen(), name="icebarrier-load-cache"),
            asyncio.create_task(self._touch_moments(pool), name="icebarrier-moments"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        self._forget_all(live=False)

    async def _touch_moments(self, pool) -> None:
        """Every twentieth of the quiet interval, the moments given since the last time, in one
        statement: the database writes each session's last use (never earlier than it has it)
        where the session's moment is still the one given; memory keeps those moments another
        tenth of the quiet interval from when it asked, and forgets the others (their next load
        asks the database). A statement that fails leaves the moments to end at their time. A
        load whose moment's time ends while the touch is out waits for its answer
        (:meth:`_touching_moment_of`)."""
        period_s = max(self._quiet_s / 20, TOUCH_MIN_S)
        started = time.monotonic()
        while True:  # a period from one touch's start to the next: a slow statement delays none after it
            await asyncio.sleep(max(0.0, started + period_s - time.monotonic()))
            started = time.monotonic()
            used, self._used = self._used, {}
            given = {key: self._moments[key][0] for key in used if key in self._moments}
            if not given or not self.live:
                continue
            self._touching = (given, asyncio.get_running_loop().create_future())
            try:
                await self._touch(pool, given, used)
            finally:
                touching, self._touching = self._touching, None
                touching[1].set_result(None)

    async def _touch(self, pool, given: dict[_Session, int], used: dict[_Session, float]) -> None:
        try:
            async with pool.connection() as conn:
                asked_at = time.monotonic()  # with a connection: the database's time is about now
                ago = [asked_at - used[key] for key in given]
                arrays = ([key[0] for key in given], [key[1] for key in given], list(given.values()), ago)
                confirmed = {
                    (r["token_hash"], r["scope"]) for r in await (await conn.execute(_TOUCH, arrays)).fetchall()
                }
        except psycopg.Error:
            return
        self.touches += 1
        for key, barrier in given.items():
            kept = self._moments.get(key)
            if kept is None or kept[0] != barrier:
                continue  # memory has moved on since it asked
            if key in confirmed:
                self._moments[key] = (barrier, max(kept[1], asked_at + self._quiet_s / 10))
            else:
                del self._moments[key]

    async def _listen(self) -> None:
        """Listen, and keep listening: memory is used only while a connection listens."""
        table = sql.Identifier(self._catalog_schema, "iceberg_tables").as_string(None)
        loop = asyncio.get_running_loop()
        while True:
            try:
                conninfo = make_conninfo(self._dsn, application_name="icebarrier-load-cache", **_LISTENER)
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                    for channel in (loads_channel(self._schema), pointers_channel(self._catalog_schema)):
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    found = await (await conn.execute(_ANNOUNCED, (POINTER_TRIGGER, table))).fetchone()
                    if not (found and found[0]):
                        print(
                            f"icebarrier serve: {table} does not announce its changes; every load asks the "
                            f"database. Run `icebarrier db upgrade` and restart the server to answer loads from memory",
                            file=sys.stderr,
                        )
                        return
                    conn.pgconn.enter_pipeline_mode()  # catch-ups are Syncs, several out at once
                    self._pgconn, self._fd, self._lost = conn.pgconn, conn.pgconn.socket, loop.create_future()
                    loop.add_reader(self._fd, self._readable)
                    try:
                        self._forget_all(live=True)  # what changed before LISTEN was not announced to us
                        await self._lost
                    finally:
                        self._lose(None)
            except psycopg.Error:
                pass  # the control plane is away: loads ask it (and are refused as it is away)
            finally:
                self._forget_all(live=False)
            await asyncio.sleep(RECONNECT_S)

    # The listening connection is driven through psycopg's libpq layer from loop callbacks: a
    # catch-up is one Sync and its answer, no task switch (through psycopg's async notifies and
    # execute it took a quarter of a millisecond a load).

    def _send_catch_up(self) -> None:
        """Send the catch-up the waiting loads wait for (see :meth:`_readable` for its answer). A
        Sync that cannot be sent within CATCH_UP_S leaves its loads to the database."""
        if self._pgconn is None or self._next is None:
            return
        try:
            self._pgconn.pipeline_sync()
        except psycopg.Error as exc:
            self._lose(exc)
            return
        self._in_flight.append(self._next)
        self._next = None

    def _readable(self) -> None:
        """Notices, in the order they came, and catch-ups' answers: Postgres sends the notices of
        every transaction that committed before a catch-up reached it ahead of its answer, so once
        the answer is here, memory holds what the database held when the catch-up was sent."""
        pgconn = self._pgconn
        if pgconn is None:
            return
        try:
            pgconn.consume_input()
            while True:
                self._apply_notices(pgconn)  # libpq parses up to the next answer
                if not self._in_flight or pgconn.is_busy() or (result := pgconn.get_result()) is None:
                    return
                if result.status != psycopg.pq.ExecStatus.PIPELINE_SYNC:
                    raise psycopg.OperationalError(f"catch-up failed: {result.error_message.decode(errors='replace')}")
                self.catch_ups += 1
                self._in_flight.popleft().set_result(None)
        except psycopg.Error as exc:
            self._lose(exc)

    def _apply_notices(self, pgconn) -> None:
        while (notice := pgconn.notifies()) is not None:
            self.note(notice.extra.decode())

    def _lose(self, exc: BaseException | None) -> None:
        """The listening connection failed (or the server stops): :meth:`_listen` connects again,
        memory empty. Its reader goes at once: libpq has closed the socket of a failed
        connection, and the number may soon be another socket's."""
        if self._pgconn is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._pgconn = None
        if exc is not None and self._lost is not None and not self._lost.done():
            self._lost.set_exception(exc)


def _gone(held: tuple[Principal, float] | None, now: float) -> bool:
    """A token memory does not hold, or holds past its time."""
    return held is None or held[1] <= now


def _put(kept: dict, most: int, key, value) -> None:
    """``kept[key] = value``, the oldest entry dropped to make room (a dict keeps insertion order)."""
    if key not in kept and len(kept) >= most:
        kept.pop(next(iter(kept)))
    kept[key] = value
