"""``icebarrier serve``: the Iceberg REST catalog protocol over the lake, with consistency.

Every engine that speaks the REST catalog (Spark, PyIceberg, DuckDB, Trino…) reads consistent
cuts by naming a warehouse (see :mod:`.warehouses`); what is read and written is the lake's
(:mod:`.lake`). The routes follow the spec's resources: configuration and OAuth2
(:mod:`.oauth`), namespaces (:mod:`.namespaces`), tables and transactions (:mod:`.tables`), scan
planning (:mod:`.planning`), views (:mod:`.views`);
job sessions (:mod:`.sessions`, icebarrier's own, for ``icebarrier job exec``); the status
page (:mod:`.ui`, ``/ui``), Prometheus metrics (:mod:`.metrics`, ``/metrics``) and health
(:mod:`.health`, ``/healthz`` and ``/readyz``, without a token).
``GET /v1/config`` lists exactly the endpoints registered here.
"""

from __future__ import annotations

import gc
import json
import os
import socket

from fastapi import FastAPI
from fastapi.routing import APIRoute

from icebarrier.apps.catalog import (
    access_log,
    errors,
    health,
    limits,
    metrics,
    namespaces,
    oauth,
    planning,
    sessions,
    tables,
    ui,
    views,
)
from icebarrier.apps.catalog.lake import Lake
from icebarrier.apps.catalog.notices import Hub
from icebarrier.control_plane import job_sessions, tokens
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.scan_planning import PLAN_SUBMIT_ABOVE

WORKER_ENV = "ICEBARRIER_SERVE_WORKER"  # `serve --workers N`: what each worker process builds its app from

ROUTERS = (
    health.router,
    oauth.router,
    namespaces.router,
    tables.router,
    planning.router,
    views.router,
    sessions.router,
    ui.router,
)


def openapi_document() -> dict:
    """The server's OpenAPI document (its routes, not served: the docs site renders it). A table's
    load is a plain Starlette route (the hottest, without FastAPI's dependency solving), so it is
    described here as the spec's ``loadTable``."""
    app = FastAPI(title="icebarrier consistent catalog", version=_version())
    for router in ROUTERS:
        app.include_router(router)
    document = app.openapi()
    document["paths"].setdefault(tables.router.prefix + tables.TABLE, {})["get"] = {
        "operationId": "loadTable",
        "summary": "Load a table at the warehouse's cut",
        "description": (
            "The spec's LoadTableResult: the metadata served through the warehouse (latest, read-committed, "
            "read-committed:<ns>, barrier-<B>, lease-<ID>, a job's session), the storage config and credentials "
            "of the caller's grants, an ETag (304 to If-None-Match with it)."
        ),
        "parameters": [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in ("prefix", "namespace", "table")
        ],
        "responses": {"200": {"description": "LoadTableResult"}, "304": {"description": "Not modified"}},
    }
    return document


def _version() -> str:
    from importlib.metadata import version

    return version("icebarrier")


def served_endpoints(routes: list[APIRoute]) -> list[str]:
    """``"<VERB> <path>"`` of every catalog route under ``/v1/{prefix}`` (the spec's format)."""
    found = {f"{method} {r.path}" for r in routes if r.path.startswith("/v1/{prefix}/") for method in r.methods or ()}
    return sorted(found, key=lambda e: (e.split(" ", 1)[1], e))


def create_app(
    settings: Settings,
    *,
    quiet_ms: int = 1000,
    allow_anonymous_read: bool = False,
    allowed_locations: list[str] | tuple[str, ...] = (),
    max_body_bytes: int = limits.DEFAULT_MAX_BODY_BYTES,
    max_body_memory: int = limits.DEFAULT_MAX_BODY_MEMORY,
    body_timeout_s: float = limits.DEFAULT_BODY_TIMEOUT_S,
    max_per_token: int = limits.DEFAULT_MAX_PER_TOKEN,
    log_format: str = "text",
    heartbeat_s: float = job_sessions.HEARTBEAT_S,
    token_ttl_s: int = tokens.SESSION_TTL_S,
    scan_planning: str = "client",
    plan_submit_above: int = PLAN_SUBMIT_ABOVE,
) -> FastAPI:
    app = FastAPI(title="icebarrier consistent catalog", docs_url=None, redoc_url=None, openapi_url=None)
    lake = Lake(
        settings,
        quiet_ms=quiet_ms,
        allowed_locations=allowed_locations,
        scan_planning=scan_planning,
        plan_submit_above=plan_submit_above,
    )
    app.state.lake = lake
    app.state.hub = Hub(settings.dsn, settings.schema, heartbeat_s=heartbeat_s)
    app.state.allow_anonymous_read = allow_anonymous_read
    app.state.token_ttl_s = token_ttl_s  # an access token's life (`serve --token-ttl`)
    app.state.storage_probe = health.StorageProbe()
    app.router.add_event_handler("startup", lake.open)
    app.router.add_event_handler("startup", app.state.hub.start)
    app.router.add_event_handler("shutdown", app.state.hub.stop)
    app.router.add_event_handler("shutdown", lake.aclose)
    app.router.add_event_handler("shutdown", lake.close)
    errors.install(app)
    app.router.routes.insert(0, tables.LOAD_ROUTE)
    for router in ROUTERS:
        app.include_router(router)
    metrics.install(app, lake, app.state.hub)
    app.add_middleware(errors.ControlPlaneOutage, lake=lake)
    app.add_middleware(
        limits.BodyLimit,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        max_body_memory=max_body_memory,
    )
    app.add_middleware(limits.PerTokenLimit, max_per_token=max_per_token)  # before a body is read
    app.add_middleware(access_log.RequestLog, log_format=log_format)  # outermost: every answer has its id
    app.state.routes = [tables.LOAD_ROUTE, *(r for router in ROUTERS for r in router.routes)]
    app.state.endpoints = served_endpoints(app.state.routes)
    return app


def check_settings(settings: Settings) -> None:
    """What a server refuses to start on (the database, its schema, the storage), checked once
    before its workers start (each worker's lake checks it again, and makes a local warehouse's
    folder that does not exist yet)."""
    from icebarrier.control_plane import db
    from icebarrier.iceberg_ext import storage

    db.connect(settings.dsn, settings.schema).close()
    settings.check_storage()
    if settings.is_default_catalog:
        storage.make_local(settings.warehouse)


def process_app(settings: Settings, **options) -> FastAPI:
    """The app of a process that serves it and nothing else (``icebarrier serve``, each of its
    ``--workers``): :func:`create_app`, the garbage collector set for a server at start, and its
    pauses timed."""
    app = create_app(settings, **options)
    app.router.add_event_handler("startup", _collect_for_a_server)
    gc.callbacks.append(app.state.metrics.gc_pauses)  # its pauses in /metrics
    return app


def _collect_for_a_server() -> None:
    """Leave what the process built at start (modules, the app, the lake: some 230,000 objects)
    out of the garbage collector's full passes, and collect the young generation less often: each
    full pass walked them all and held the event loop 135 ms, about once a second under 16
    clients (every answer out then waited), as a load's short-lived objects, caught in young
    passes every few hundred allocations, were promoted until one was due."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def worker_app() -> FastAPI:
    """The app of one worker process of ``icebarrier serve --workers N`` (uvicorn's factory)."""
    options = json.loads(os.environ[WORKER_ENV])
    settings = Settings.load(options.pop("config"), dsn=options.pop("dsn"), schema=options.pop("schema"))
    return process_app(settings, **options)


def _http_protocol() -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11) with TCP_NODELAY set on every
    connection: a socket uvicorn binds for ``--workers`` is not marked TCP, so asyncio leaves
    Nagle's algorithm on, and a response in two writes waits out the client's delayed ACK (40 ms)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]  # the fallback

    class NoDelay(base):
        def connection_made(self, transport) -> None:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)

    return NoDelay


NoDelayHttp = _http_protocol()
HTTP_PROTOCOL = f"{__name__}:NoDelayHttp"  # uvicorn's http= (an import string reaches the workers)
