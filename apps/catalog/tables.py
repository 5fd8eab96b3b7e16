"""Tables: list, create, register, load (pinned by the warehouse), exists, drop, commit,
rename, metrics; and multi-table transactions. Changes go through ``latest``: to a managed
table only with its writer job's token (see :class:`.lake.Lake`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from starlette.routing import Route

from icebarrier.apps.catalog.delegation import (
    HEADER,
    VENDED_CREDENTIALS,
    Access,
    Delegation,
    delegation,
    storage_credential,
)
from icebarrier.apps.catalog.deps import (
    Caller,
    LakeDep,
    NamespacePath,
    PageSize,
    Reading,
    ReadTable,
    WriteTable,
    Writing,
    acting,
    bearer,
    loading_table,
)
from icebarrier.apps.catalog.etags import cached_json
from icebarrier.apps.catalog.idempotency import Committed, Writes
from icebarrier.apps.catalog.lake import Lake
from icebarrier.apps.catalog.lake.core import java_name
from icebarrier.apps.catalog.models import (
    CommitTableRequest,
    CommitTransactionRequest,
    CreateTableRequest,
    RegisterTableRequest,
    RenameTableRequest,
    ReportMetricsRequest,
    TableIdentifier,
)
from icebarrier.control_plane.tokens import Principal
from icebarrier.iceberg_ext import storage as s3

router = APIRouter(prefix="/v1/{prefix}")
TABLE = "/namespaces/{namespace}/tables/{table}"
ON_THE_LOOP = ("latest", "barrier", "read-committed")
LOOP_LIST_MAX = 2_000  # names a list answer is made of on the event loop (about 1 ms; more: in the thread pool)


def _json(model) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


@router.get("/namespaces/{namespace}/tables")
async def list_tables(
    warehouse: Reading,
    who: Caller,
    namespace: NamespacePath,
    lake: LakeDep,
    pageToken: str | None = None,
    pageSize: PageSize = None,
):
    """The catalog's tables the caller may read, on the event loop: the namespace's names from
    the process's memory, else in one statement (:meth:`.lake.LakeCore.names`), the answer's JSON
    made directly (a thousand identifiers through FastAPI's encoder took 13 ms). Through a job's
    session also the sinks it created and has not published (nobody else sees them yet)."""
    principal = acting(who[0], warehouse)
    principal.require_namespace(lake.settings.catalog, namespace)
    names = (await lake.names(namespace)).tables
    if warehouse.kind == "job":
        created = await run_in_threadpool(_created, lake, warehouse, principal, namespace)
        names = tuple({*names, *created})  # identifiers() sorts them
    return await listing(lake, principal, namespace, names)


def _created(lake: Lake, warehouse, principal: Principal, namespace: tuple[str, ...]) -> list[str]:
    """The sinks in ``namespace`` the job's session created and has not published."""
    with lake.pool.connection() as conn:
        session = lake.session(conn, warehouse, principal)
        return [t.identifier[-1] for t in lake.created(conn, session.job) if t.namespace == namespace]


async def listing(lake: Lake, principal: Principal, namespace: tuple[str, ...], names: tuple[str, ...]) -> Response:
    """:func:`identifiers`, made on the event loop for up to LOOP_LIST_MAX names (about 1 ms),
    in the thread pool for more (the loop serves loads meanwhile)."""
    if len(names) <= LOOP_LIST_MAX:
        return identifiers(lake, principal, namespace, names)
    return await run_in_threadpool(identifiers, lake, principal, namespace, names)


def identifiers(lake: Lake, principal: Principal, namespace: tuple[str, ...], names: Iterable[str]) -> Response:
    """A ListTablesResponse (of tables, or of views) naming those of ``names`` the caller may read."""
    if not principal.reads_namespace(namespace):  # only what it may read
        names = {name for name in names if principal.reads(lake.table_name(namespace, name))}
    listed = list(namespace)
    body = {"identifiers": [{"namespace": listed, "name": name} for name in sorted(names)]}
    return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")


@router.post("/namespaces/{namespace}/tables")
def create_table(to: Writing, namespace: NamespacePath, lake: LakeDep, access: Access, once: Writes, body: dict):
    request = CreateTableRequest.parse(body)
    table = lake.table_name(namespace, request.name)
    return once.run(lambda conn: _json(lake.create(conn, to.warehouse, to.principal, table, request, access)))


@router.post("/namespaces/{namespace}/register")
def register_table(to: Writing, namespace: NamespacePath, lake: LakeDep, access: Access, once: Writes, body: dict):
    request = RegisterTableRequest.parse(body)
    lake.outside_sessions(to.warehouse, "register tables")
    table = lake.table_name(namespace, request.name)
    return once.run(
        lambda conn: _json(
            lake.register(
                conn, to.principal, table, request.metadata_location, overwrite=request.overwrite, access=access
            )
        )
    )


async def load_table(request: Request) -> Response:
    """With an ETag, and 304 to a client that has the answer (:mod:`.etags`). Through latest,
    barrier-<B> and read-committed on the event loop (the load's one statement on the async pool,
    the response from memory: no hop to the thread pool, which cost a fifth of a load's CPU); a
    lease's load and a job session's, which read and write more, in the thread pool. A plain
    Starlette route, the hottest of all: FastAPI's dependency solving cost a fifth of a load's
    CPU; it reads the same path, token and header as the dependencies do."""
    started = time.perf_counter()
    request.scope["route"] = LOAD_ROUTE  # for the access log, as FastAPI's routes set it
    params = request.path_params
    token = await bearer(request, request.headers.get("authorization"))
    loading = await loading_table(request, token, params["prefix"], params["namespace"], params["table"])
    access = await delegation(request.headers.get(HEADER))
    if loading.warehouse.kind in ON_THE_LOOP:
        body = await loading.load_on_loop(access)
    else:
        body = await run_in_threadpool(loading.load, access)
    answer = cached_json(body, request.headers.get("if-none-match"))
    metrics, kind = request.app.state.metrics, loading.warehouse.kind
    if answer.status_code == 304:
        metrics.not_modified.labels(kind).inc()
    metrics.load_seconds.labels(kind).observe(time.perf_counter() - started)
    return answer


@router.head(TABLE)
def table_exists(at: ReadTable):
    with at.lake.pool.connection() as conn:
        at.lake.exists(conn, at.warehouse, at.table, at.principal)  # NoSuchTableError: 404
    return Response(status_code=204)


# The hottest route goes first in the app's (server.py): every request walks the routes in order.
# GET only: HEAD goes on to table_exists.
LOAD_ROUTE = Route(router.prefix + TABLE, load_table, methods=["GET"])
LOAD_ROUTE.methods = {"GET"}  # Starlette adds HEAD to a GET route


@router.delete(TABLE)
def drop_table(at: WriteTable, once: Writes, purgeRequested: bool = False):
    at.lake.outside_sessions(at.warehouse, "drop tables")

    def drop(conn):
        at.lake.drop(conn, at.principal, at.table, purge=purgeRequested)
        return Response(status_code=204)

    return once.run(drop)


@router.post(TABLE)
def commit_table(at: WriteTable, once: Writes, body: dict):
    request = CommitTableRequest.parse(body)
    identified = request.model_copy(
        update={"identifier": TableIdentifier(namespace=at.table.namespace, name=at.table.name)}
    )

    def commit(conn):
        [(_, new)] = at.lake.commit(conn, at.warehouse, at.principal, [identified])
        return _committed(at.lake, new.metadata_location)

    def reread(conn, location: str) -> Response:
        """The answer again, from the metadata file the commit wrote; if that file is gone (a
        client deleting old metadata after its commits, a dropped table's purge), the table as
        it is now: the commit applied."""
        try:
            return _committed(at.lake, location)
        except FileNotFoundError:
            return _committed(at.lake, at.lake.current(conn, at.table)[0])

    return once.run(commit, reread=reread)


def _committed(lake: Lake, location: str) -> Committed:
    return Committed(lake.committed_json(location), location)


@router.get(TABLE + "/credentials")
def load_credentials(at: ReadTable, planId: str | None = None):
    """The spec's loadCredentials: the storage credentials a load of the table would vend, for a
    client whose credentials near their expiry (``client.refresh-credentials-endpoint``). The same
    grants as a load; through a job's session, its staged sinks too."""
    from pyiceberg.exceptions import NoSuchTableError

    lake = at.lake
    with lake.pool.connection() as conn:
        staged = lake.staged(conn, at.principal.job, at.table) if at.warehouse.kind == "job" else None
        state = lake.table_state(conn, at.table)
    location = staged["metadata_location"] if staged else state.location
    if location is None:
        raise NoSuchTableError(f"Table does not exist: {java_name(at.table)}")
    _, table_location = lake.metadata_json(location)
    config, credentials = lake.storage_access(
        at.table,
        table_location,
        at.principal,
        Delegation(frozenset([VENDED_CREDENTIALS])),
        managed=state.managed or staged is not None,
        warehouse=str(at.warehouse),
    )
    if not credentials and any(k in config for k in s3.SECRETS):  # keys, not a table's own credentials
        credentials = [storage_credential(table_location, config, s3.SECRETS)]
    return Response(json.dumps({"storage-credentials": credentials}), media_type="application/json")


@router.post(TABLE + "/metrics")
def report_metrics(at: ReadTable, body: dict):
    ReportMetricsRequest.parse(body)  # accepted and dropped: the lake's history is the record
    return Response(status_code=204)


@router.post("/tables/rename")
def rename_table(to: Writing, lake: LakeDep, once: Writes, body: dict):
    request = RenameTableRequest.parse(body)
    lake.outside_sessions(to.warehouse, "rename tables")

    def rename(conn):
        lake.rename(
            conn,
            to.principal,
            lake.table_name(request.source.namespace, request.source.name),
            lake.table_name(request.destination.namespace, request.destination.name),
        )
        return Response(status_code=204)

    return once.run(rename)


@router.post("/transactions/commit")
def commit_transaction(to: Writing, lake: LakeDep, once: Writes, body: dict):
    request = CommitTransactionRequest.parse(body)

    def commit(conn):
        if request.table_changes:  # an empty transaction changes nothing
            lake.commit(conn, to.warehouse, to.principal, list(request.table_changes))
        return Response(status_code=204)

    return once.run(commit)
