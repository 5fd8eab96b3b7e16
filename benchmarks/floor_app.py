"""The floor under a catalog load on this machine: an app served like ``icebarrier serve`` (the
same uvicorn, HTTP protocol and worker count) that answers every GET with the bytes of a real
load response, read once from ``FLOOR_BODY`` — no token check, no database, no metadata.
``benchmarks/catalog.py`` measures loads/s against it in the same run."""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

BODY = Path(os.environ["FLOOR_BODY"]).read_bytes()
app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@app.get("/{path:path}")
def answer(path: str) -> Response:
    return Response(BODY, media_type="application/json")
