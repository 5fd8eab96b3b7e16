"""Views: list, create, load, exists, replace (a commit of new versions), drop, rename and
register, as the REST spec has them (:mod:`.lake.views` keeps them). Changes go through
``latest``, by an admin or a job token that may write the view's name (a write grant on it or a
namespace above it, or a whole-lake job token); reads through any warehouse with a read grant.
A view's SQL is read by the engine, which loads the tables it names through the same warehouse:
at that warehouse's cut (docs/views.md)."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Response

from icebarrier.apps.catalog.deps import (
    Caller,
    LakeDep,
    NamespacePath,
    PageSize,
    Reading,
    acting,
    check_table,
    writable,
)
from icebarrier.apps.catalog.errors import ForbiddenError
from icebarrier.apps.catalog.etags import cached_json
from icebarrier.apps.catalog.idempotency import Writes
from icebarrier.apps.catalog.models import (
    CommitViewRequest,
    CreateViewRequest,
    RegisterTableRequest,
    RenameTableRequest,
)
from icebarrier.apps.catalog.tables import listing
from icebarrier.control_plane.tokens import Principal

router = APIRouter(prefix="/v1/{prefix}")
VIEW = "/namespaces/{namespace}/views/{view}"


def _body(location: str, metadata: dict) -> bytes:
    """A LoadViewResult's JSON."""
    body = {"metadata-location": location, "metadata": metadata, "config": {}}
    return json.dumps(body, separators=(",", ":")).encode()


def _result(location: str, metadata: dict) -> Response:
    return Response(_body(location, metadata), media_type="application/json")


async def view_writer(who: Caller, prefix: str) -> Principal:
    """Who changes views: an admin or a job token, through ``latest`` (a job session stages data
    for its sinks only; a reader writes nothing)."""
    warehouse = writable(prefix)
    principal = who[0]
    if warehouse.kind != "latest":
        raise ForbiddenError("a job session writes only data to its sinks; change views through warehouse latest")
    if principal.kind not in ("admin", "job"):
        raise ForbiddenError(
            f"{principal.describe()} may not change the catalog: a reader token writes nothing; "
            f"create a job token with `icebarrier token create --job JOB` and grant it the namespace with --write"
        )
    return principal


ViewWriter = Annotated[Principal, Depends(view_writer)]


@router.get("/namespaces/{namespace}/views")
async def list_views(
    warehouse: Reading,
    who: Caller,
    namespace: NamespacePath,
    lake: LakeDep,
    pageToken: str | None = None,
    pageSize: PageSize = None,
):
    """The namespace's views the caller may read, on the event loop (as tables are listed)."""
    principal = acting(who[0], warehouse)
    principal.require_namespace(lake.settings.catalog, namespace)
    return await listing(lake, principal, namespace, (await lake.names(namespace)).views)


@router.post("/namespaces/{namespace}/views")
def create_view(principal: ViewWriter, namespace: NamespacePath, lake: LakeDep, once: Writes, body: dict):
    request = CreateViewRequest.parse(body)
    view = lake.table_name(namespace, request.name)
    return once.run(lambda conn: _result(*lake.create_view(conn, principal, view, request.as_json())))


@router.post("/namespaces/{namespace}/register-view")
def register_view(principal: ViewWriter, namespace: NamespacePath, lake: LakeDep, once: Writes, body: dict):
    request = RegisterTableRequest.parse(body)
    view = lake.table_name(namespace, request.name)
    return once.run(lambda conn: _result(*lake.register_view(conn, principal, view, request.metadata_location)))


@router.get(VIEW)
def load_view(
    warehouse: Reading,
    who: Caller,
    namespace: NamespacePath,
    view: str,
    lake: LakeDep,
    if_none_match: Annotated[str | None, Header()] = None,
):
    """With an ETag, and 304 to a client that has the answer (:mod:`.etags`)."""
    name = lake.table_name(namespace, check_table(view))
    acting(who[0], warehouse).require_read(name)
    with lake.pool.connection() as conn:
        return cached_json(_body(*lake.load_view(conn, name)), if_none_match)


@router.head(VIEW)
def view_exists(warehouse: Reading, who: Caller, namespace: NamespacePath, view: str, lake: LakeDep):
    name = lake.table_name(namespace, check_table(view))
    acting(who[0], warehouse).require_read(name)
    with lake.pool.connection() as conn:
        lake.load_view(conn, name)  # NoSuchViewError: 404
    return Response(status_code=204)


@router.post(VIEW)
def replace_view(principal: ViewWriter, namespace: NamespacePath, view: str, lake: LakeDep, once: Writes, body: dict):
    request = CommitViewRequest.parse(body)
    name = lake.table_name(namespace, check_table(view))
    return once.run(
        lambda conn: _result(*lake.replace_view(conn, principal, name, request.requirements, request.updates))
    )


@router.delete(VIEW)
def drop_view(principal: ViewWriter, namespace: NamespacePath, view: str, lake: LakeDep, once: Writes):
    name = lake.table_name(namespace, check_table(view))

    def drop(conn):
        lake.drop_view(conn, principal, name)
        return Response(status_code=204)

    return once.run(drop)


@router.post("/views/rename")
def rename_view(principal: ViewWriter, lake: LakeDep, once: Writes, body: dict):
    request = RenameTableRequest.parse(body)
    source = lake.table_name(request.source.namespace, request.source.name)
    destination = lake.table_name(request.destination.namespace, request.destination.name)

    def rename(conn):
        lake.rename_view(conn, principal, source, destination)
        return Response(status_code=204)

    return once.run(rename)
