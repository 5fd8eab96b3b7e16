"""Bounded requests (DESIGN.md, "The server on a network").

:class:`BodyLimit` (ASGI middleware, before anything reads a body): a request whose ``Content-Length`` is past
its route's limit is answered 413 at once, before a byte of it is read and before its token is
looked at (an unauthenticated client cannot make the server read or buffer it); a body sent
without a token (anywhere but the token request: no write is anonymous) is answered 401 at once,
unread, so a flood of bodies from clients without tokens costs no memory; a body sent
without a length (chunked) is counted as it arrives and answered 413 as soon as it passes the
limit. Nothing past the limit is ever held in memory, and all requests' bodies together hold at
most ``max_body_memory`` (``serve --max-body-memory``, 64 MB): a body that would pass it is
answered 503 with ``Retry-After`` (many large bodies at once wait their turn at the client,
not in the server's memory). A body must arrive within
``body_timeout_s`` (``serve --body-timeout``, 30 s) of the request's start, else 408: a client
sending a byte a second holds no more than that.

:class:`PerTokenLimit`: at most ``max_per_token`` requests in flight per access token (and per
address for clients without one); one more is answered 429 with ``Retry-After`` at once, before
its token is checked. A long poll (``job exec --follow``) counts as one while it waits.

The limits: :data:`TOKEN_BODY_BYTES` for the OAuth2 token request (a form of three fields), and
``max_body_bytes`` (``serve --max-body``, default :data:`DEFAULT_MAX_BODY_BYTES`) for every other
request: a commit's body is its updates (a schema, a snapshot's summary, properties), a few KiB
to a few hundred; a table of 10,000 columns created in one request is about 1 MiB.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from icebarrier.apps.catalog.errors import error_response
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.tokens import token_required

TOKEN_PATH = "/v1/oauth/tokens"
DEFAULT_MAX_BODY_BYTES = 8 << 20
TOKEN_BODY_BYTES = 64 << 10
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_BODY_MEMORY = 64 << 20
DEFAULT_MAX_PER_TOKEN = 32
RETRY_AFTER_S = 1


class RequestTooLargeError(IcebarrierError):
    """A request body past the route's limit (413)."""


class RequestTimeoutError(IcebarrierError):
    """A request body that did not arrive in time (408)."""


class TooManyRequestsError(IcebarrierError):
    """More requests in flight for one token than the server takes (429)."""


class ServerBusyError(IcebarrierError):
    """The server holds as many request bodies as it may (503, Retry-After)."""


class _TooLarge(Exception):
    pass


class _Busy(Exception):
    pass


class _TooSlow(Exception):
    pass


class BodyLimit:
    def __init__(
        self,
        app,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        max_body_memory: int = DEFAULT_MAX_BODY_MEMORY,
    ) -> None:
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self.max_body_memory, self.held = max_body_memory, 0  # bytes of bodies held now (on the event loop)

    def limit(self, path: str) -> int:
        return TOKEN_BODY_BYTES if path == TOKEN_PATH else self.max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, headers = self.limit(scope["path"]), dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _answer(scope, send, _too_large(limit), close=True)
        has_body = headers.get(b"transfer-encoding", b"").lower() == b"chunked" or (
            length is not None and length.isdigit() and int(length) > 0
        )
        if has_body and scope["path"] != TOKEN_PATH and not headers.get(b"authorization", b"").strip():
            return await _answer(scope, send, token_required(), close=True)
        seen, mine, started, complete = 0, 0, False, False
        deadline = time.monotonic() + self.body_timeout_s

        bodiless = b"transfer-encoding" not in headers and length in (None, b"0")  # by HTTP framing

        async def counted():
            nonlocal seen, mine, complete
            if complete or bodiless:  # after the body (or none): waiting for a disconnect has no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise _TooSlow from None
            size = len(message.get("body", b""))
            seen += size
            if seen > limit:
                raise _TooLarge
            if self.held + size > self.max_body_memory:
                raise _Busy
            self.held, mine = self.held + size, mine + size
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except (_TooLarge, _TooSlow, _Busy) as exc:
            if started:
                raise
            if isinstance(exc, _Busy):
                busy = ServerBusyError(
                    f"the server holds {self.max_body_memory:,} bytes of request bodies, its limit; retry "
                    f"(the server's operator sets the limit: `serve --max-body-memory`)"
                )
                return await _answer(scope, send, busy, close=True, retry_after_s=RETRY_AFTER_S)
            error = (
                _too_large(limit)
                if isinstance(exc, _TooLarge)
                else RequestTimeoutError(
                    f"the request body did not arrive within {self.body_timeout_s:g} s; send it at once "
                    f"(the server's operator sets the limit: `serve --body-timeout`)"
                )
            )
            await _answer(scope, send, error, close=True)  # the rest of the body is not read: the connection ends
        finally:
            self.held -= mine


def _too_large(limit: int) -> RequestTooLargeError:
    return RequestTooLargeError(
        f"the request body is over {limit:,} bytes, this server's limit for this route; send less "
        f"(the server's operator sets the limit: `serve --max-body`)"
    )


async def _answer(scope, send, error: IcebarrierError, *, close: bool = False, retry_after_s: int | None = None):
    response = error_response(error)
    if close:
        response.headers["Connection"] = "close"
    if retry_after_s is not None:
        response.headers["Retry-After"] = str(retry_after_s)
    await response(scope, _no_body, send)


async def _no_body() -> dict:
    """The receive of an answer given without reading the request: the client is gone, for all it knows."""
    return {"type": "http.disconnect"}


class PerTokenLimit:
    """At most ``max_per_token`` requests in flight per access token (per address without one)."""

    def __init__(self, app, max_per_token: int = DEFAULT_MAX_PER_TOKEN) -> None:
        self.app, self.max_per_token = app, max_per_token
        self.in_flight: dict[str, int] = {}  # on the event loop: no lock needed

    @staticmethod
    def key(scope) -> str:
        authorization = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if authorization:
            return "token:" + hashlib.sha256(authorization).hexdigest()[:32]  # the token itself is not kept
        client = scope.get("client")
        return f"address:{client[0] if client else '?'}"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = self.key(scope)
        if self.in_flight.get(key, 0) >= self.max_per_token:
            error = TooManyRequestsError(
                f"{self.max_per_token} requests of this token are in flight, this server's limit; retry in "
                f"{RETRY_AFTER_S} s (the server's operator sets the limit: `serve --max-per-token`)"
            )
            return await _answer(scope, send, error, retry_after_s=RETRY_AFTER_S)
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[key] -= 1
            if not self.in_flight[key]:
                del self.in_flight[key]
