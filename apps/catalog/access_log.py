"""A request id on every answer, and an access log an operator can use (DESIGN.md, "The server on
a network").

:class:`RequestLog` (ASGI middleware) gives each request an id: the client's ``X-Request-Id``
when it is a plain token (letters, digits, ``._-``, up to 64), else a new one; the answer carries
it back in ``X-Request-Id``. With ``serve --log-format json`` it writes one JSON line per request
to stderr: ``ts``, ``request_id``, ``method``, ``route`` (the route's template, e.g.
``/v1/{prefix}/namespaces/{namespace}/tables/{table}``: names of tables stay out), ``status``,
``duration_ms``, ``principal`` (``kind:client_id`` of the token, once known; never the token or
a secret) and ``client`` (the peer's address). Nothing of a query string, a header or a body is
logged, so no credential or vended key can reach the log.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")
REQUEST_ID = b"x-request-id"
_GIVEN_ID = re.compile(rb"[A-Za-z0-9._-]{1,64}")


def principal_label(principal) -> str:
    """How the log names a caller: its kind and client id (a client id is no secret)."""
    return f"{principal.kind}:{principal.client_id or 'anonymous'}"


class RequestLog:
    def __init__(self, app, log_format: str = "text", stream=None) -> None:
        self.app, self.json = app, log_format == "json"
        self.stream = stream or sys.stderr

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(REQUEST_ID)
        request_id = given.decode() if given and _GIVEN_ID.fullmatch(given) else uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id
        started, status = time.perf_counter(), 500

        async def tagged(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID]
                message = {**message, "headers": [*headers, (REQUEST_ID, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:
            if self.json:
                self._write(scope, request_id, status, time.perf_counter() - started)

    def _write(self, scope, request_id: str, status: int, took_s: float) -> None:
        route = scope.get("route")
        client = scope.get("client")
        line = {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "request_id": request_id,
            "method": scope["method"],
            "route": getattr(route, "path", None) or "(no route)",
            "status": status,
            "duration_ms": round(took_s * 1000, 2),
            "principal": scope.get("state", {}).get("principal"),
            "client": client[0] if client else None,
        }
        self.stream.write(json.dumps(line) + "\n")
        self.stream.flush()
