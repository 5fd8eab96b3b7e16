"""Health for load balancers and Kubernetes probes, without a token (DESIGN.md, "The server on a
network").

- ``GET /healthz``: the process answers (liveness). Touches nothing.
- ``GET /readyz``: it can serve (readiness): Postgres answers from the pool, the control-plane
  schema is at this version's revision, and the warehouse's storage takes a probe (written, read
  and deleted on object storage; a writable folder locally). The storage probe's answer is kept
  for :data:`STORAGE_PROBE_S`, so a probe every second costs one object round trip every few.

Both answer ``{"status": ...}`` and, when not ready, which of ``postgres``, ``schema`` or
``storage`` failed, or ``stopping`` (SIGTERM came: a balancer should send it nothing more): no
message, version, host or path (an unauthenticated client learns nothing about the deployment).
"""

from __future__ import annotations

import os
import threading
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from icebarrier.control_plane import schema_version
from icebarrier.control_plane.db import schema_of
from icebarrier.iceberg_ext import storage

router = APIRouter()
STORAGE_PROBE_S = 10.0


class StorageProbe:
    """The warehouse's last probe result, at most :data:`STORAGE_PROBE_S` old."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at, self._ok = -STORAGE_PROBE_S, False

    def ok(self, settings) -> bool:
        with self._lock:
            if time.monotonic() - self._at >= STORAGE_PROBE_S:
                self._ok, self._at = _probe(settings), time.monotonic()
            return self._ok


def _probe(settings) -> bool:
    warehouse = settings.warehouse
    try:
        if storage.is_object_storage(warehouse):
            settings.check_storage()
            return True
        path = storage.local_folder(warehouse)
        return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)
    except Exception:  # noqa: BLE001 - any failure is "not ready"; what failed is not for an anonymous client
        return False


@router.get("/healthz", include_in_schema=False)
def healthz():
    return {"status": "alive"}


@router.get("/readyz", include_in_schema=False)
def readyz(request: Request):
    lake = request.app.state.lake
    failing = ["stopping"] if request.app.state.hub.closing else []
    try:
        with lake.pool.connection(timeout=2.0) as conn:
            if schema_version.current_revision(conn, schema_of(conn)) != schema_version.head_revision():
                failing.append("schema")
    except Exception:  # noqa: BLE001 - unreachable, refused, timed out: all "postgres"
        failing.append("postgres")
    if not request.app.state.storage_probe.ok(lake.settings):
        failing.append("storage")
    if failing:
        return JSONResponse({"status": "not ready", "failing": failing}, status_code=503)
    return {"status": "ready"}
