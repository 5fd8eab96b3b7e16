"""Namespaces: list, create, load, exists, drop, update properties. Reads go through any
warehouse; changes through ``latest`` with a job token. A level may hold a '.': the SQL catalog
is given each level escaped (:func:`~icebarrier.control_plane.model.sql_levels`), so ["a.b"] and
["a", "b"] stay two namespaces."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from icebarrier.apps.catalog.deps import Caller, LakeDep, NamespacePath, PageSize, Reading, Writing, parse_namespace
from icebarrier.apps.catalog.errors import UnprocessableError
from icebarrier.apps.catalog.idempotency import Writes
from icebarrier.apps.catalog.models import CreateNamespaceRequest, UpdateNamespacePropertiesRequest
from icebarrier.control_plane.model import namespace_from_sql, sql_levels, sql_namespace

router = APIRouter(prefix="/v1/{prefix}/namespaces")


@router.get("")
def list_namespaces(
    warehouse: Reading,
    who: Caller,
    lake: LakeDep,
    parent: str | None = None,
    pageToken: str | None = None,
    pageSize: PageSize = None,
):
    """The namespaces the caller may see: granted, under a grant, or above something granted."""
    found = lake.catalog.list_namespaces(sql_levels(parse_namespace(parent)) if parent else ())
    catalog = lake.settings.catalog
    levels = [namespace_from_sql(".".join(n)) for n in found]
    return {"namespaces": [list(n) for n in levels if who[0].sees_namespace(catalog, n)]}


@router.post("")
def create_namespace(to: Writing, lake: LakeDep, once: Writes, body: dict):
    request = CreateNamespaceRequest.parse(body)
    to.principal.require_namespace(lake.settings.catalog, tuple(request.namespace), write=True)

    def create(conn):
        lake.catalog.create_namespace(sql_levels(request.namespace), request.properties)
        return JSONResponse({"namespace": list(request.namespace), "properties": request.properties})

    return once.run(create)


@router.get("/{namespace}")
def load_namespace(warehouse: Reading, who: Caller, namespace: NamespacePath, lake: LakeDep):
    """The namespace's properties; ``location`` always (where its tables go by default): Trino
    places a new table itself under it (``<location>/<table>-<uuid>`` with
    ``iceberg.unique-table-location``) and otherwise creates it eagerly and then refuses the
    location the create just wrote to."""
    who[0].require_namespace(lake.settings.catalog, namespace)
    properties = lake.catalog.load_namespace_properties(sql_levels(namespace))
    properties.setdefault("location", f"{lake.settings.warehouse.rstrip('/')}/{sql_namespace(namespace)}")
    return {"namespace": list(namespace), "properties": properties}


@router.head("/{namespace}")
def namespace_exists(warehouse: Reading, who: Caller, namespace: NamespacePath, lake: LakeDep):
    who[0].require_namespace(lake.settings.catalog, namespace)
    lake.catalog.load_namespace_properties(sql_levels(namespace))  # NoSuchNamespaceError: 404
    return Response(status_code=204)


@router.delete("/{namespace}")
def drop_namespace(to: Writing, namespace: NamespacePath, lake: LakeDep, once: Writes):
    to.principal.require_namespace(lake.settings.catalog, namespace, write=True)

    def drop(conn):
        lake.require_no_views(conn, namespace)
        lake.catalog.drop_namespace(sql_levels(namespace))
        return Response(status_code=204)

    return once.run(drop)


@router.post("/{namespace}/properties")
def update_properties(to: Writing, namespace: NamespacePath, lake: LakeDep, once: Writes, body: dict):
    to.principal.require_namespace(lake.settings.catalog, namespace, write=True)
    request = UpdateNamespacePropertiesRequest.parse(body)
    both = sorted(set(request.removals) & set(request.updates))
    if both:
        raise UnprocessableError(
            f"namespace properties {', '.join(both)} are both updated and removed; send each key once"
        )

    def update(conn):
        summary = lake.catalog.update_namespace_properties(
            sql_levels(namespace), set(request.removals), request.updates
        )
        return JSONResponse({"updated": summary.updated, "removed": summary.removed, "missing": summary.missing})

    return once.run(update)
