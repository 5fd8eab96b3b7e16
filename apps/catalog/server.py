"""``icebarrier serve``: the Iceberg REST catalog protocol over the lake, with consistency.

Every engine that speaks the REST catalog (Spark, PyIceberg, DuckDB, Trino…) reads consistent
cuts by naming a warehouse (see :mod:`.warehouses`); what is read and written is the lake's
(:mod:`.lake`). The routes follow the spec's resources: configuration and OAuth2
(:mod:`.oauth`), namespaces (:mod:`.namespaces`), tables and transactions (:mod:`.tables`);
job sessions (:mod:`.sessions`, icebarrier's own, for ``icebarrier job exec``); the status
page (:mod:`.ui`, ``/ui``) and Prometheus metrics (:mod:`.metrics`, ``/metrics``).
``GET /v1/config`` lists exactly the endpoints registered here.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.routing import APIRoute

from icebarrier.apps.catalog import errors, metrics, namespaces, oauth, sessions, tables, ui
from icebarrier.apps.catalog.lake import Lake
from icebarrier.iceberg_ext.config import Settings


ROUTERS = (oauth.router, namespaces.router, tables.router, sessions.router, ui.router)


def served_endpoints(routes: list[APIRoute]) -> list[str]:
    """``"<VERB> <path>"`` of every catalog route under ``/v1/{prefix}`` (the spec's format)."""
    found = {f"{method} {r.path}" for r in routes if r.path.startswith("/v1/{prefix}/") for method in r.methods}
    return sorted(found, key=lambda e: (e.split(" ", 1)[1], e))


def create_app(settings: Settings, *, quiet_ms: int = 1000, allow_anonymous_read: bool = False) -> FastAPI:
    app = FastAPI(title="icebarrier consistent catalog", docs_url=None, redoc_url=None, openapi_url=None)
    lake = Lake(settings, quiet_ms=quiet_ms)
    app.state.lake = lake
    app.state.allow_anonymous_read = allow_anonymous_read
    app.router.add_event_handler("shutdown", lake.close)
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    metrics.install(app, lake.pool)
    app.state.routes = [r for router in ROUTERS for r in router.routes]
    app.state.endpoints = served_endpoints(app.state.routes)
    return app
