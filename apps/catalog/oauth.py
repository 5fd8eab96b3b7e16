"""``GET /v1/config`` (warehouse -> prefix, the endpoints served) and the OAuth2 token endpoint.

Clients exchange a token's ``CLIENT_ID:SECRET`` for an access token (RFC 6749 §4.4, client
credentials). The credentials may come in an HTTP Basic header (§2.3.1 recommends it; DuckDB
does it) or as form fields (PyIceberg, Spark); both at once must agree. A refresh is a token
exchange (RFC 8693) whose subject is a live access token. Errors are RFC 6749 §5.2's
``{"error", "error_description"}``, as the spec's ``OAuthError`` says.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated
from urllib.parse import unquote_plus

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from icebarrier.apps.catalog import idempotency
from icebarrier.apps.catalog.deps import Caller, LakeDep
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import tokens
from icebarrier.control_plane.tokens import AuthenticationError
from icebarrier.iceberg_ext.storage import is_object_storage

router = APIRouter()

CLIENT_CREDENTIALS = "client_credentials"
TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"


class OAuthError(Exception):
    """An RFC 6749 §5.2 error: ``error`` is one of the spec's codes."""

    def __init__(self, error: str, description: str, status: int = 400) -> None:
        super().__init__(description)
        self.error, self.description, self.status = error, description, status

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": 'Basic realm="icebarrier"'} if self.status == 401 else None
        return JSONResponse(
            {"error": self.error, "error_description": self.description}, status_code=self.status, headers=headers
        )


def basic_credentials(authorization: str | None) -> tuple[str, str] | None:
    """(client id, secret) from ``Authorization: Basic …``, each form-urlencoded (§2.3.1)."""
    if not authorization or not authorization.lower().startswith("basic "):
        return None
    try:
        decoded = base64.b64decode(authorization[6:].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise OAuthError(
            "invalid_request", "the Basic authorization header is not base64 of CLIENT_ID:SECRET"
        ) from None
    client_id, colon, secret = decoded.partition(":")
    if not colon or not client_id:
        raise OAuthError("invalid_request", "the Basic authorization header must hold CLIENT_ID:SECRET")
    return unquote_plus(client_id), unquote_plus(secret)


def client_credentials(form, authorization: str | None) -> tuple[str, str]:
    """The client's credentials from the Basic header or the form (both: they must agree)."""
    header = basic_credentials(authorization)
    client_id, secret = form.get("client_id"), form.get("client_secret")
    fields = (client_id, secret) if client_id is not None and secret is not None else None
    if fields is None and (client_id, secret) != (None, None):
        missing = "client_secret" if secret is None else "client_id"
        raise OAuthError(
            "invalid_request",
            f"{missing} is missing; send both client_id and client_secret, or "
            f"CLIENT_ID:SECRET in a Basic authorization header",
        )
    if header and fields and header != fields:
        raise OAuthError(
            "invalid_request",
            "the Basic authorization header and the form name different clients; send the credentials once",
        )
    found = header or fields
    if found is None:
        raise OAuthError(
            "invalid_client",
            "no client credentials: send CLIENT_ID:SECRET (from `icebarrier token "
            "create`) in a Basic authorization header or as client_id and "
            "client_secret form fields",
            status=401,
        )
    return found


@router.post("/v1/oauth/tokens")
async def oauth_tokens(request: Request, lake: LakeDep, authorization: Annotated[str | None, Header()] = None):
    try:
        try:
            form = await request.form()
        except Exception:  # noqa: BLE001 - any unparsable body is the client's error
            raise OAuthError("invalid_request", "the body must be application/x-www-form-urlencoded") from None
        # opening a session writes to Postgres: off the event loop
        ttl_s = request.app.state.token_ttl_s
        access = await run_in_threadpool(_grant, lake, form, authorization, ttl_s)
    except OAuthError as exc:
        return exc.response()
    answer = {
        "access_token": access,
        "token_type": "bearer",
        "expires_in": ttl_s,
        "issued_token_type": ACCESS_TOKEN_TYPE,
    }
    if form.get("scope"):
        answer["scope"] = form.get("scope")
    return answer


def _grant(lake, form, authorization: str | None, ttl_s: int) -> str:
    """The access token the form's grant earns, live ``ttl_s``; :class:`OAuthError` says why not."""
    grant_type = form.get("grant_type")
    if not grant_type:
        raise OAuthError("invalid_request", f"grant_type is missing; use {CLIENT_CREDENTIALS}")
    if grant_type not in (CLIENT_CREDENTIALS, TOKEN_EXCHANGE):
        raise OAuthError(
            "unsupported_grant_type",
            f"grant_type {grant_type!r} is not supported; use {CLIENT_CREDENTIALS} (or a token exchange to refresh)",
        )
    if grant_type == TOKEN_EXCHANGE and not form.get("subject_token"):
        raise OAuthError("invalid_request", "subject_token is missing: a token exchange refreshes a live access token")
    credentials = client_credentials(form, authorization) if grant_type == CLIENT_CREDENTIALS else None
    with lake.pool.connection() as conn:
        try:
            if credentials is not None:
                return tokens.open_session(conn, *credentials, ttl_s=ttl_s)
            return tokens.reopen_session(conn, form.get("subject_token"), ttl_s=ttl_s)
        except AuthenticationError as exc:
            raise OAuthError("invalid_client", str(exc), status=401) from None


@router.get("/v1/config")
def config(request: Request, who: Caller, lake: LakeDep, warehouse: str = ""):
    """The prefix of ``warehouse``; as defaults, where the lake's files live (endpoint, region,
    path style of object storage; never a key: those come with each load, as the caller may)."""
    parsed = Warehouse.parse(warehouse or "latest")  # no warehouse named: latest
    return {
        "defaults": {
            **(lake.settings.storage.public() if is_object_storage(lake.settings.warehouse) else {}),
            "scan-planning-mode": lake.scan_planning,  # a default: a client's own setting wins
        },
        "overrides": {"prefix": str(parsed)},
        "endpoints": request.app.state.endpoints,
        "idempotency-key-lifetime": idempotency.LIFETIME,
    }
