"""Every refusal of the catalog, in the REST spec's error model with our one-line message.

``{"error": {"message": <one line>, "type": <Iceberg exception name>, "code": <HTTP status>}}``
for every non-2xx answer of every route, including routes the server does not serve and
methods a route does not allow (never FastAPI's ``{"detail": …}``). The OAuth2 token
endpoint answers in RFC 6749's own error model instead (see :mod:`.oauth`).
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import namespace_from_sql


class ForbiddenError(IcebarrierError):
    """The token may not do this (403)."""


class MalformedRequestError(IcebarrierError):
    """A request body or parameter that the spec does not allow (400); names the field."""


class UnprocessableError(IcebarrierError):
    """A well-formed request that contradicts itself (422)."""


class StorageUnavailableError(IcebarrierError):
    """The object store's credential service refused or did not answer (503)."""


class NotServedError(IcebarrierError):
    """A route of the spec (or none) that this server does not serve (404 / 405)."""

    def __init__(self, method: str, path: str, status: int) -> None:
        self.method, self.path, self.status = method, path, status
        what = "does not allow this method" if status == 405 else "is not served here"
        super().__init__(f"{method} {path} {what}; GET /v1/config lists the endpoints this catalog serves")


_STATUS = [  # (exception class name, HTTP status, REST error type), most specific first
    ("AuthenticationError", 401, "NotAuthorizedException"),
    ("ForbiddenError", 403, "ForbiddenException"),
    ("LocationRefusedError", 403, "ForbiddenException"),
    ("SessionGoneError", 403, "ForbiddenException"),
    ("StaleSessionError", 403, "ForbiddenException"),
    ("SessionHeldError", 409, "ConflictException"),
    ("PermissionDeniedError", 403, "ForbiddenException"),
    ("NotGrantedError", 403, "ForbiddenException"),
    ("NoSuchTableError", 404, "NoSuchTableException"),
    ("TableNotFoundError", 404, "NoSuchTableException"),
    ("NoSuchNamespaceError", 404, "NoSuchNamespaceException"),
    ("NoSuchViewError", 404, "NoSuchViewException"),
    ("NoSuchPlanTaskError", 404, "NoSuchPlanTaskException"),
    ("NoSuchPlanIdError", 404, "NoSuchPlanIdException"),
    ("TableAlreadyExistsError", 409, "AlreadyExistsException"),
    ("NamespaceAlreadyExistsError", 409, "AlreadyExistsException"),
    ("ViewAlreadyExistsError", 409, "AlreadyExistsException"),
    ("NamespaceNotEmptyError", 409, "NamespaceNotEmptyException"),
    ("CommitFailedException", 409, "CommitFailedException"),
    ("UnprocessableError", 422, "UnprocessableEntityException"),
    ("IdempotencyKeyReusedError", 422, "UnprocessableEntityException"),
    ("RequestTooLargeError", 413, "RequestEntityTooLargeException"),
    ("RequestTimeoutError", 408, "RequestTimeoutException"),
    ("TooManyRequestsError", 429, "TooManyRequestsException"),
    ("ServerBusyError", 503, "ServiceUnavailableException"),
    ("ControlPlaneInterruptedError", 503, "ServiceUnavailableException"),
    ("StorageUnavailableError", 503, "ServiceUnavailableException"),
    ("ControlPlaneUnavailableError", 503, "ServiceUnavailableException"),
    ("ViewMetadataError", 400, "IllegalArgumentException"),  # Java clients raise IllegalArgumentException
    ("ValidationError", 400, "BadRequestException"),
    ("IcebarrierError", 400, "BadRequestException"),
]


def _levels(text: str) -> str:
    """A namespace as PyIceberg's SQL catalog prints it (a tuple's repr, or dotted; its levels as
    stored) as the reference prints it: levels joined by '.'."""
    try:
        levels = ast.literal_eval(text) if text.startswith("(") else (text,)
    except (ValueError, SyntaxError):
        return text
    return ".".join(namespace_from_sql(".".join(levels)))


def _changed(what: str) -> Callable[[re.Match], str]:
    return lambda m: f"Requirement failed: {what} changed: expected id {m[1]} != {m[2]}"


# PyIceberg's wording (its SQL catalog and its requirement checks) -> the reference catalog's, which
# clients assert (the REST Compatibility Kit: how a message starts). The spec defines no wording.
REFERENCE_WORDING: list[tuple[re.Pattern, Callable[[re.Match], str]]] = [
    (re.compile(r"^Namespace (.+?) does not exists?$"), lambda m: f"Namespace does not exist: {_levels(m[1])}"),
    (re.compile(r"^Namespace does not exist: (\(.*\))$"), lambda m: f"Namespace does not exist: {_levels(m[1])}"),
    (re.compile(r"^Namespace (.+) already exists$"), lambda m: f"Namespace already exists: {_levels(m[1])}"),
    (re.compile(r"^Table (\S+) already exists$"), lambda m: f"Table already exists: {m[1]}"),
    (re.compile(r"^Table already exists$"), lambda m: "Requirement failed: table already exists"),
    (
        re.compile(r"^Table UUID does not match: (\S+) != (\S+)$"),
        lambda m: f"Requirement failed: UUID does not match: expected {m[2]} != {m[1]}",
    ),
    (
        re.compile(r"^Requirement failed: current schema id has changed: expected (\S+), found (\S+)$"),
        _changed("current schema"),
    ),
    (
        re.compile(r"^Requirement failed: last assigned field id has changed: expected (\S+), found (\S+)$"),
        _changed("last assigned field id"),
    ),
    (
        re.compile(r"^Requirement failed: last assigned partition id has changed: expected (\S+), found (\S+)$"),
        _changed("last assigned partition id"),
    ),
    (
        re.compile(r"^Requirement failed: default spec id has changed: expected (\S+), found (\S+)$"),
        _changed("default partition spec"),
    ),
    (
        re.compile(r"^Requirement failed: default sort order id has changed: expected (\S+), found (\S+)$"),
        _changed("default sort order"),
    ),
]


def reference_wording(message: str) -> str:
    for pattern, reworded in REFERENCE_WORDING:
        if match := pattern.match(message):
            return reworded(match)
    return message


def error_response(exc: Exception) -> JSONResponse:
    """The spec's error model; the message is our one line."""
    if isinstance(exc, NotServedError):
        status, kind = exc.status, "UnsupportedOperationException" if exc.status == 405 else "NotFoundException"
    else:
        names = {cls.__name__ for cls in type(exc).__mro__}
        status, kind = next(((s, k) for n, s, k in _STATUS if n in names), (500, "InternalServerError"))
    text = str(exc).strip()
    message = reference_wording(text.splitlines()[0]) if text else type(exc).__name__
    if status == 500:  # a bug: say so, and keep internals in the server's log
        message = f"internal error ({type(exc).__name__}); the server's log has the details"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def describe_validation(errors: Sequence[Any], what: str) -> str:
    """One line naming the first offending field of a pydantic/FastAPI validation and why."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    # pydantic names the member of a union it tried ("AddSnapshotUpdate"); keep field names only
    loc = [p for p in loc if not p[:1].isupper() and not p.startswith("function-")]
    field = ".".join(loc) or "the body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"malformed {what}: {field}: {first.get('msg', 'invalid')}{more}"


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette names only the first route's)."""
    from starlette.routing import Match

    found = set()
    for route in request.app.state.routes:
        if route.matches({**request.scope, "method": next(iter(route.methods))})[0] == Match.FULL:
            found.update(route.methods)
    return sorted(found)


def install(app: FastAPI) -> None:
    """Route every expected failure to the error model; anything else is a bug (a 500 in the
    error model, logged with its traceback)."""
    from pydantic import ValidationError
    from pyiceberg import exceptions as iceberg_errors

    expected = (
        IcebarrierError,
        ValidationError,
        iceberg_errors.NoSuchTableError,
        iceberg_errors.NoSuchNamespaceError,
        iceberg_errors.TableAlreadyExistsError,
        iceberg_errors.NamespaceAlreadyExistsError,
        iceberg_errors.NamespaceNotEmptyError,
        iceberg_errors.NoSuchViewError,
        iceberg_errors.ViewAlreadyExistsError,
        iceberg_errors.CommitFailedException,
    )
    for kind in expected:
        app.add_exception_handler(kind, lambda request, exc: error_response(exc))

    def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(MalformedRequestError(describe_validation(exc.errors(), "request")))

    def http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        if exc.status_code in (404, 405):
            response = error_response(NotServedError(request.method, request.url.path, exc.status_code))
        else:
            response = error_response(IcebarrierError(str(exc.detail)))
        if exc.status_code == 405:
            response.headers["Allow"] = ", ".join(allowed_methods(request))
        return response

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http)
    app.add_exception_handler(Exception, lambda request, exc: error_response(exc))


class ControlPlaneInterruptedError(IcebarrierError):
    """A request met a dead control-plane connection (a Postgres restart, failover) twice (503)."""


RETRY_AFTER_S = 1  # what a 503 asks the client to wait


class ControlPlaneOutage:
    """ASGI middleware: a request that meets a dead control-plane connection (Postgres restarted
    under the server) is retried once on fresh connections where that is safe (reads, the token
    grant, and writes carrying an ``Idempotency-Key``: their action and key commit together, so
    a retry replays what committed or does what did not); else, or if it fails again, a 503 with
    ``Retry-After`` in the error model. Never a 500. The pool pings idle connections before use
    (:func:`icebarrier.control_plane.db.pool`); this covers the ones killed mid-request."""

    def __init__(self, app, lake) -> None:
        self.app, self.lake = app, lake

    @staticmethod
    def _outages() -> tuple[type[BaseException], ...]:
        """The errors of a dead connection: psycopg's, and SQLAlchemy's once the SQL catalog (made
        on the first write, :attr:`~icebarrier.apps.catalog.lake.core.LakeCore.catalog`) has
        imported it; before, none of its errors can be raised (importing it here cost each start
        0.2 CPU-s)."""
        import psycopg

        sqlalchemy = sys.modules.get("sqlalchemy.exc")
        return (psycopg.OperationalError,) + ((sqlalchemy.OperationalError,) if sqlalchemy else ())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        headers = dict(scope.get("headers") or ())
        safe = (
            scope["method"] in ("GET", "HEAD") or scope["path"] == "/v1/oauth/tokens" or b"idempotency-key" in headers
        )
        started = False

        delivered = False

        async def replay():  # the buffered body once per attempt, then the client's own messages
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        for attempt in (1, 2):
            delivered = False
            try:
                return await self.app(scope, replay, tracked)
            except self._outages() as exc:
                if started:
                    raise
                await self.lake.check_connections()
                if attempt == 1 and safe:
                    continue
                response = error_response(
                    ControlPlaneInterruptedError(
                        f"the control-plane database was interrupted ({type(exc).__name__}); retry in {RETRY_AFTER_S} s"
                    )
                )
                response.headers["Retry-After"] = str(RETRY_AFTER_S)
                return await response(scope, receive, send)


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body"):
            return b"".join(chunks)
