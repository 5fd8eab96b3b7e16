"""A server process's memory of what loads read, so that most loads make no round trip to
Postgres: who holds an access token, where a table's pointer is, whether the table is managed,
S(T, B) of a plain cut, and a read-committed session's moment. It answers loads through
``latest``, ``read-committed`` and ``barrier-<B>``; the database announces every change that
could make a remembered answer wrong (migration 0022).

Why an answer from memory is the database's answer:

- A pointer row inserted, swapped, renamed or deleted (by this server, another, or an engine
  writing the SQL catalog directly), a token revoked or an access token's session ended, a
  table managed or not any more, a cut undone by a revision: each is announced when its
  transaction commits, and Postgres signals the listening connections before the committer hears
  back. The listening connection is on the server's event loop, which drops what a notice names
  as soon as it reads it.
- S(T, B) is kept only for a plain cut (B issued, completed by T, not expired): it stays S(T, B)
  until a revision, which is announced. An expiry changes the pointer, whose metadata then lacks
  the snapshot: that load asks the database (``Loading.load_on_loop``).
- A read-committed session's moment is kept until it is a tenth of the quiet interval old, when
  the database would write its time again: no process moves it before the quiet interval, so
  every process gives the session the same moment, as without memory.
- A load's answer is kept only if no notice came while its statement ran: a notice that
  overtook the answer would otherwise be undone by it (one generation counter).
- Memory catches up before it answers again when the database told a load something memory
  would not have answered (its notice may not have come yet: a two-table commit's first table
  from the database and its second from memory would be half of it) and after every write
  through this process (its clients read their writes): one query on the listening connection,
  whose answer Postgres sends after the notices of every transaction committed before it.
  A write through another process is seen once its notice has come.
- Without a listening connection nothing is kept or answered from memory; when one connects
  (again), memory starts empty: notices were missed. A connection cut without a word is found by
  TCP keepalives within about 15 s.
- A token is kept for the life its session has left, never longer. A job's token is not kept: a
  job also sees its own staged commits, which no notice announces.
- Before ``icebarrier db upgrade`` created the trigger that announces the SQL catalog's
  pointers, every load asks the database.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from contextlib import suppress

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from icebarrier.control_plane import db
from icebarrier.control_plane.catalog_loads import LoadQuery, LoadState
from icebarrier.control_plane.model import TableName
from icebarrier.control_plane.notices import loads_channel, pointers_channel
from icebarrier.control_plane.tokens import ANONYMOUS, Principal, token_hash

RECONNECT_S = 1.0
MAX_POINTERS = 100_000  # about 30 MB of keys and locations at most
MAX_TOKENS = 10_000
MODES = ("latest", "read-committed", "barrier")  # the loads memory answers
# A cut connection is found in 5 + 2 * 5 s; connect_timeout bounds a reconnection's wait.
_LISTENER = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 5,
    "connect_timeout": 10,
}
_ANNOUNCED = (
    "SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'icebarrier_pointer_moved' AND tgrelid = to_regclass(%s))"
)

_Key = tuple[str, str, str]  # the SQL catalog's (catalog_name, table_namespace, table_name)


def _key(table: TableName) -> _Key:
    return table.catalog, ".".join(table.namespace), table.name


class LoadCache:
    """Used on the server's event loop only (no locks). ``catalog_schema``: the SQL catalog's
    schema, where the pointers are."""

    def __init__(self, dsn: str | None, schema: str | None, catalog_schema: str) -> None:
        self._dsn, self._schema = db.resolve_dsn(dsn), db.resolve_schema(schema)
        self._catalog_schema = catalog_schema
        self._pointers: dict[_Key, str] = {}
        self._managed: dict[str, bool] = {}  # managed key: is the table managed
        self._cuts: dict[tuple[str, int], int] = {}  # (managed key, B): S(T, B), a plain cut's snapshot
        self._tokens: dict[str, tuple[Principal, float]] = {}  # token hash: who, valid until (monotonic)
        self._moments: dict[tuple[str, str | None], tuple[int, float]] = {}  # (token hash, scope): B, until
        self._generation = 0
        # Catching up: the database or this process's writes told something memory may not have
        # heard of yet (``_learned``); memory answers again once a catch-up sent after that has
        # come back (``_caught_up``). See :meth:`_catch_up`.
        self._learned = self._caught_up = 0
        self._catch_up_wanted = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self.live = False  # listening: memory may be used
        self.hits = self.misses = self.catch_ups = 0

    @property
    def generation(self) -> int:
        """Take it before a load's statement; :meth:`keep` its answer with it."""
        return self._generation

    def remembered(self, query: LoadQuery) -> LoadState | None:
        """The state of a load through latest, read-committed or barrier-<B> from memory, as the
        database would give it (None: ask the database)."""
        if query.mode not in MODES or query.job is not None:
            return None
        state = self._recall(query, time.monotonic()) if self.live and self._caught_up >= self._learned else None
        if state is None:
            self.misses += 1
        else:
            self.hits += 1
        return state

    def _recall(self, query: LoadQuery, now: float) -> LoadState | None:
        """What memory holds for ``query``, a token and a moment only until their time at ``now``."""
        location = self._pointers.get(_key(query.table))
        name = query.managed_key
        managed = False if name is None else self._managed.get(name)
        hashed = None if query.access_token is None else token_hash(query.access_token)
        held = None if hashed is None else self._tokens.get(hashed)
        if location is None or managed is None or (hashed is not None and (held is None or held[1] <= now)):
            return None
        principal = ANONYMOUS if held is None else held[0]
        if query.mode == "latest" or name is None or not managed:
            return LoadState(
                principal=principal,
                staged_location=None,
                managed=managed,
                location=location,
                snapshot_id=None,
                cut=None,
            )
        moment = self._moments.get((hashed or "", query.scope)) if query.mode == "read-committed" else None
        barrier = query.barrier if query.mode == "barrier" else (moment[0] if moment and moment[1] > now else None)
        snapshot_id = None if barrier is None else self._cuts.get((name, barrier))
        if barrier is None or snapshot_id is None:
            return None
        return LoadState(
            principal=principal,
            staged_location=None,
            managed=True,
            location=location,
            snapshot_id=snapshot_id,
            cut=barrier,
            moment=barrier,
            plain=True,
        )

    def keep(self, generation: int, query: LoadQuery, state: LoadState, *, asked_at: float) -> None:
        """Remember what the database answered (``asked_at``: ``time.monotonic()`` before the
        statement was sent), unless a notice came since ``generation`` or the answer is one
        memory must not give (a job's staged commit, no such table; a job's token is not kept).

        An answer memory would not have given may be a change whose notice has not come yet:
        memory then answers nothing until it has caught up (a multi-table commit's first table
        from the database and its second from memory would be half of it)."""
        if query.mode not in MODES or query.job is not None or state.principal.kind == "job":
            return  # a job's loads all ask the database: it never mixes them with memory
        if state.location is None:
            return  # no such table: nothing to keep, and nothing a commit could be half of
        if _differs(self._recall(query, -math.inf), state):  # a moment that only aged tells nothing new
            self._learn()
        if generation != self._generation or state.staged_location is not None:
            return
        hashed = None if query.access_token is None else token_hash(query.access_token)
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

    def wrote(self) -> None:
        """This process wrote the catalog (from any thread): memory catches up before it answers
        again, so its clients read their writes."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._learn)  # before the write's answer is sent: FIFO

    def _learn(self) -> None:
        self._learned += 1
        self._catch_up_wanted.set()

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

    def _forget_all(self, *, live: bool) -> None:
        self._generation += 1
        for kept in (self._pointers, self._managed, self._cuts, self._tokens, self._moments):
            kept.clear()
        self._caught_up = self._learned  # nothing is remembered: nothing to catch up on
        self.live = live

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._listen(), name="icebarrier-load-cache")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        self._forget_all(live=False)

    async def _listen(self) -> None:
        """Listen, and keep listening: memory is used only while a connection listens."""
        table = sql.Identifier(self._catalog_schema, "iceberg_tables").as_string(None)
        while True:
            try:
                conninfo = make_conninfo(self._dsn, application_name="icebarrier-load-cache", **_LISTENER)
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                    for channel in (loads_channel(self._schema), pointers_channel(self._catalog_schema)):
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    found = await (await conn.execute(_ANNOUNCED, (table,))).fetchone()
                    if not (found and found[0]):
                        print(
                            f"icebarrier serve: {table} does not announce its changes; every load asks the "
                            f"database. Run `icebarrier db upgrade` and restart the server to answer loads from memory",
                            file=sys.stderr,
                        )
                        return
                    self._forget_all(live=True)  # what changed before LISTEN was not announced to us
                    await self._hear(conn)
            except psycopg.Error:
                pass  # the control plane is away: loads ask it (and are refused as it is away)
            finally:
                self._forget_all(live=False)
            await asyncio.sleep(RECONNECT_S)

    async def _hear(self, conn) -> None:
        """Apply notices as they come; catch up when asked (until the connection fails)."""
        while True:
            notices = asyncio.ensure_future(self._notices(conn))
            wanted = asyncio.ensure_future(self._catch_up_wanted.wait())
            try:
                await asyncio.wait({notices, wanted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                wanted.cancel()
                notices.cancel()  # between two batches: a batch (one transaction's notices) is applied whole
                with suppress(asyncio.CancelledError):
                    await notices  # the connection's failure, if that is what ended it
            await self._catch_up(conn)

    async def _notices(self, conn) -> None:
        async for notice in conn.notifies():
            self.note(notice.payload)

    async def _catch_up(self, conn) -> None:
        """A query on the listening connection: Postgres sends the notices of every transaction
        that committed before the query reached it ahead of the query's answer, so once the
        answer is here, memory has heard of everything the database told before the catch-up
        was sent (and of every write of this process before then)."""
        self._catch_up_wanted.clear()
        covers = self._learned
        await conn.execute("SELECT 1")
        self.catch_ups += 1
        async for notice in conn.notifies(timeout=0):  # those that came with the answer
            self.note(notice.payload)
        self._caught_up = max(self._caught_up, covers)


def _differs(known: LoadState | None, told: LoadState) -> bool:
    """Did the database tell what memory would not have answered?"""
    return known is None or (known.location, known.snapshot_id, known.principal) != (
        told.location,
        told.snapshot_id,
        told.principal,
    )


def _put(kept: dict, most: int, key, value) -> None:
    """``kept[key] = value``, the oldest entry dropped to make room (a dict keeps insertion order)."""
    if key not in kept and len(kept) >= most:
        kept.pop(next(iter(kept)))
    kept[key] = value
