"""Bounded request bodies (DESIGN.md, "The server on a network").

:class:`BodyLimit` is the outermost ASGI middleware: a request whose ``Content-Length`` is past
its route's limit is answered 413 at once, before a byte of it is read and before its token is
looked at (an unauthenticated client cannot make the server read or buffer it); a body sent
without a length (chunked) is counted as it arrives and answered 413 as soon as it passes the
limit. Nothing past the limit is ever held in memory.

The limits: :data:`TOKEN_BODY_BYTES` for the OAuth2 token request (a form of three fields), and
``max_body_bytes`` (``serve --max-body``, default :data:`DEFAULT_MAX_BODY_BYTES`) for every other
request: a commit's body is its updates (a schema, a snapshot's summary, properties), a few KiB
to a few hundred; a table of 10,000 columns created in one request is about 1 MiB.
"""

from __future__ import annotations

from icebarrier.apps.catalog.errors import error_response
from icebarrier.control_plane.errors import IcebarrierError

DEFAULT_MAX_BODY_BYTES = 8 << 20
TOKEN_BODY_BYTES = 64 << 10


class RequestTooLargeError(IcebarrierError):
    """A request body past the route's limit (413)."""


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    def limit(self, path: str) -> int:
        return TOKEN_BODY_BYTES if path == "/v1/oauth/tokens" else self.max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit(scope["path"])
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._refuse(scope, send, limit)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _TooLarge
            return message

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if started:
                raise
            await self._refuse(scope, send, limit)

    @staticmethod
    async def _refuse(scope, send, limit: int) -> None:
        response = error_response(
            RequestTooLargeError(
                f"the request body is over {limit:,} bytes, this server's limit for this route; send less "
                f"(the server's operator sets the limit: `serve --max-body`)"
            )
        )
        response.headers["Connection"] = "close"  # the rest of the body is not read: the connection ends
        await response(scope, None, send)
