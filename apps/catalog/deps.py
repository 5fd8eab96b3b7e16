"""What every route needs, as FastAPI dependencies: the lake, the caller, the warehouse (a
prefix to read through, or one that accepts writes), the namespace and table path parameters.

They are ``async``: none blocks, and FastAPI would run a plain ``def`` dependency in its thread
pool, one hop each."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Query, Request

from icebarrier.apps.catalog.access_log import principal_label
from icebarrier.apps.catalog.errors import ForbiddenError, MalformedRequestError
from icebarrier.apps.catalog.lake import Lake, NeedsStorage, memory_only
from icebarrier.apps.catalog.lake.core import LakeCore
from icebarrier.apps.catalog.models import check_name, check_namespace
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import catalog_loads, tokens
from icebarrier.control_plane.errors import SnapshotExpiredError
from icebarrier.control_plane.model import TableName
from icebarrier.control_plane.tokens import ANONYMOUS, Principal, token_required

SEP = "\x1f"  # the REST spec's namespace level separator


async def get_lake(request: Request) -> Lake:
    return request.app.state.lake


LakeDep = Annotated[Lake, Depends(get_lake)]


async def bearer(request: Request, authorization: Annotated[str | None, Header()] = None) -> str | None:
    """The caller's access token from the Authorization header, not yet checked (None: an
    anonymous reader, where the server allows them)."""
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    if request.app.state.allow_anonymous_read:
        return None
    raise token_required()


Bearer = Annotated["str | None", Depends(bearer)]


def principal_of(conn, access_token: str | None) -> Principal:
    """Who holds ``access_token`` (AuthenticationError if nobody does now)."""
    return ANONYMOUS if access_token is None else tokens.session(conn, access_token)


async def caller(request: Request, token: Bearer) -> tuple[Principal, str | None]:
    """Who calls, and their access token (the session): from the process's memory of tokens,
    as the database would answer now (:meth:`LoadCache.principal`), else from the database, on
    the event loop, on the async pool. (One indexed lookup costs less than a hop to the thread
    pool; on the thread pool's connections it held the loop whenever requests in the thread
    pool held all of them, waiting for locks: at 2,000 jobs, their long polls' lines and notices
    with it. A job's renewed long poll, every ten minutes, spent a third of its CPU on it.)"""
    if token is None:
        request.state.principal = principal_label(ANONYMOUS)
        return ANONYMOUS, None
    principal = await token_holder(request.app.state.lake, token)
    request.state.principal = principal_label(principal)  # for the access log
    return principal, token


async def token_holder(lake: LakeCore, token: str) -> Principal:
    """Who holds ``token`` now (AuthenticationError if nobody does): from the process's memory of
    tokens, as the database would answer now, else from the database."""
    hashed = tokens.token_hash(token)
    if (principal := await lake.load_cache.principal(hashed)) is None:
        generation, asked_at = lake.load_cache.generation, time.monotonic()
        async with lake.async_pool.connection() as conn:
            principal, ttl_s = await tokens.session_async(conn, token)
        lake.load_cache.keep_principal(generation, hashed, principal, until=asked_at + ttl_s)
    return principal


Caller = Annotated[tuple[Principal, "str | None"], Depends(caller)]


def acting(principal: Principal, warehouse: Warehouse) -> Principal:
    """Who acts through ``warehouse``: through ``job`` (``job:<JOB>``), the job whose session it
    is (a job token of that job, or an admin token naming it); elsewhere the caller."""
    if warehouse.kind != "job":
        return principal
    if principal.kind == "admin" and warehouse.job:
        return Principal(client_id=principal.client_id, kind="job", job=warehouse.job)
    if principal.kind == "job" and warehouse.job in (None, principal.job):
        return principal
    if principal.kind == "admin":
        raise ForbiddenError(f"{principal.describe()} acts for no job of its own: name the job, warehouse job:<JOB>")
    job = warehouse.job or "JOB"
    if principal.kind == "job":
        raise ForbiddenError(
            f"{principal.describe()} may not run job {job}: use a token of job {job} (or warehouse "
            f"job, its own job's session)"
        )
    raise ForbiddenError(
        f"{principal.describe()} may not run job {job}: a reader token writes nothing; use a token "
        f"of the job (`icebarrier token create --job {job}`)"
    )


def require_job(principal: Principal) -> Principal:
    """A principal that may change the catalog: a job (a reader token writes nothing)."""
    if principal.kind == "admin":
        raise ForbiddenError(
            f"{principal.describe()} may not change the catalog except in a job's session: use "
            f"warehouse job:<JOB>, or a job token"
        )
    if principal.kind != "job":
        raise ForbiddenError(
            f"{principal.describe()} may not change the catalog: a reader token writes nothing; "
            f"create a job token with `icebarrier token create --job JOB`"
        )
    return principal


async def reading(who: Caller, prefix: str) -> Warehouse:
    return Warehouse.parse(prefix)


def writable(prefix: str) -> Warehouse:
    warehouse = Warehouse.parse(prefix)
    if not warehouse.writable:
        raise ForbiddenError(
            f"warehouse {warehouse} is read-only (it pins snapshots); write through warehouse latest "
            f"(or a job's session, warehouse job)"
        )
    return warehouse


@dataclass(frozen=True, slots=True)
class Writer:
    """A writable warehouse and the job acting through it."""

    warehouse: Warehouse
    principal: Principal


async def writer(who: Caller, prefix: str) -> Writer:
    warehouse = writable(prefix)
    return Writer(warehouse, require_job(acting(who[0], warehouse)))


Reading = Annotated[Warehouse, Depends(reading)]
Writing = Annotated[Writer, Depends(writer)]


def parse_namespace(text: str) -> tuple[str, ...]:
    """A namespace path or query parameter: levels separated by 0x1F (``%1F``)."""
    try:
        return check_namespace(text.split(SEP))
    except ValueError as exc:
        raise MalformedRequestError(f"{exc} (levels are separated by %1F)") from None


async def namespace_path(namespace: str) -> tuple[str, ...]:
    return parse_namespace(namespace)


def check_table(table: str) -> str:
    try:
        return check_name(table, "table name")
    except ValueError as exc:
        raise MalformedRequestError(str(exc)) from None


NamespacePath = Annotated[tuple[str, ...], Depends(namespace_path)]
PageSize = Annotated[int | None, Query(ge=1)]  # accepted; every list is answered in one page


# -- one table: the hot path (a pinned load) resolves all it needs in one dependency; each
# FastAPI dependency costs ~50 us a request (measured in-process).


@dataclass(frozen=True, slots=True, kw_only=True)
class TableAt:
    """What a route on ``/v1/{prefix}/namespaces/{namespace}/tables/{table}`` works on."""

    lake: Lake
    warehouse: Warehouse
    table: TableName  # as the client spelled it
    principal: Principal
    access_token: str | None


def _table_at(
    request: Request, warehouse: Warehouse, namespace: str, table: str, principal: Principal, access_token: str | None
) -> TableAt:
    lake = request.app.state.lake
    name = lake.table_name(parse_namespace(namespace), check_table(table))
    return TableAt(lake=lake, warehouse=warehouse, table=name, principal=principal, access_token=access_token)


async def reading_table(request: Request, who: Caller, prefix: str, namespace: str, table: str) -> TableAt:
    warehouse = Warehouse.parse(prefix)
    at = _table_at(request, warehouse, namespace, table, acting(who[0], warehouse), who[1])
    at.principal.require_read(at.table)
    return at


@dataclass(frozen=True, slots=True, kw_only=True)
class Loading:
    """A load's request, parsed (no database yet): the route checks the token on the connection
    it loads with."""

    lake: Lake
    warehouse: Warehouse
    table: TableName
    access_token: str | None

    def at(self, conn) -> TableAt:
        principal = acting(principal_of(conn, self.access_token), self.warehouse)
        return TableAt(
            lake=self.lake,
            warehouse=self.warehouse,
            table=self.table,
            principal=principal,
            access_token=self.access_token,
        )

    async def load_on_loop(self, access) -> bytes:
        """The LoadTableResult of a load through latest, barrier-<B> or read-committed, on the event
        loop: from the process's memory of loads where it has what the load reads, else its one
        statement on the async pool (the loop serves other requests meanwhile); the response
        from memory, in the thread pool only where a file must be read or written."""
        plan = self.lake.plan(self.warehouse, self.table, self.access_token)
        cache = self.lake.load_cache
        state = await cache.remembered(plan.query)
        if state is not None:
            try:
                return await self._respond(plan, state, access)
            except SnapshotExpiredError:
                pass  # memory's pointer predates the cut's commit (its notice not read yet), or an expiry: ask
        generation, asked_at = cache.generation, time.monotonic()
        async with self.lake.async_pool.connection() as conn:
            state = await catalog_loads.load_state_async(conn, plan.query)
        cache.keep(generation, plan.query, state, asked_at=asked_at)
        return await self._respond(plan, state, access)

    async def _respond(self, plan, state: catalog_loads.LoadState, access) -> bytes:
        from starlette.concurrency import run_in_threadpool

        try:
            with memory_only():
                return self.lake.respond(None, plan, state, access)
        except NeedsStorage:
            return await run_in_threadpool(self.lake.respond, None, plan, state, access)

    def load(self, access) -> bytes:
        """The LoadTableResult, on one pooled connection (the token checked in the load's own
        statement; in a job's session first, to know the job acting)."""
        with self.lake.pool.connection() as conn:
            acting = self.at(conn).principal if self.warehouse.kind == "job" else None
            return self.lake.load(
                conn, self.warehouse, self.table, access, access_token=self.access_token, acting=acting
            )


async def loading_table(request: Request, token: Bearer, prefix: str, namespace: str, table: str) -> Loading:
    lake = request.app.state.lake
    return Loading(
        lake=lake,
        warehouse=Warehouse.parse(prefix),
        access_token=token,
        table=lake.table_name(parse_namespace(namespace), check_table(table)),
    )


async def writing_table(request: Request, who: Caller, to: Writing, namespace: str, table: str) -> TableAt:
    return _table_at(request, to.warehouse, namespace, table, to.principal, who[1])


ReadTable = Annotated[TableAt, Depends(reading_table)]
WriteTable = Annotated[TableAt, Depends(writing_table)]
