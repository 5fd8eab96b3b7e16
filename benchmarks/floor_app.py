"""The floor under a catalog load on this machine: an app served like ``icebarrier serve`` (the
same uvicorn, HTTP protocol, worker count and hand-off of connections to the workers) that
answers every GET with the bytes of a real load response, read once from ``FLOOR_BODY`` — no
token check, no database, no metadata. ``benchmarks/catalog.py`` measures loads/s against it in
the same run: ``python floor_app.py PORT WORKERS``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

BODY = Path(os.environ["FLOOR_BODY"]).read_bytes()
app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@app.get("/{path:path}")
def answer(path: str) -> Response:
    return Response(BODY, media_type="application/json")


if __name__ == "__main__":
    import uvicorn

    from icebarrier.apps.catalog import workers
    from icebarrier.apps.catalog.server import HTTP_PROTOCOL

    port, count = map(int, sys.argv[1:3])
    config = uvicorn.Config("floor_app:app", port=port, log_level="warning", http=HTTP_PROTOCOL)
    if count == 1:
        uvicorn.Server(config).run()
    else:
        workers.serve(config, count)
