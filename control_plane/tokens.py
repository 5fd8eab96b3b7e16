"""Catalog clients: tokens (a reader, or one job) and the sessions they open.

``icebarrier token create`` prints ``CLIENT_ID:SECRET`` once; only the secret's SHA-256 is
stored (a secret is 256 random bits, so a plain hash is as strong as a slow one). A client
exchanges its credentials for an access token (OAuth2 client credentials, see
``icebarrier serve``); each access token is a session, kept in Postgres so that any number of
servers answer alike.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import parse_job_name

SESSION_TTL_S = 3600


class TokenNotFoundError(IcebarrierError):
    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        super().__init__(f"token {client_id} does not exist; see `icebarrier token list`")


class AuthenticationError(IcebarrierError):
    """Credentials or an access token that are unknown, revoked or expired."""


def unknown_token() -> AuthenticationError:
    return AuthenticationError("the access token is unknown, expired or revoked; authenticate again")


def token_required() -> AuthenticationError:
    """A request without a token where the catalog needs one."""
    return AuthenticationError(
        "this catalog needs a token: create one with `icebarrier token create` and pass "
        "CLIENT_ID:SECRET as the client's credential"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Principal:
    """Who a catalog request comes from: a reader, a job (it may commit to its sinks), or an
    admin (it may open any job's session)."""

    client_id: str | None  # None: anonymous
    kind: str  # reader, job or admin
    job: str | None = None

    @property
    def acting_job(self) -> str:
        """The job a job principal acts for (the server checked the kind before it asks)."""
        if self.job is None:
            raise AuthenticationError(f"{self.describe()} acts for no job; use a job's token")
        return self.job

    def describe(self) -> str:
        who = f"token {self.client_id}" if self.client_id else "an anonymous client"
        return f"{who} (job {self.job})" if self.job else f"{who} ({self.kind})"


ANONYMOUS = Principal(client_id=None, kind="reader")  # no token, where the catalog allows that


@dataclass(frozen=True, slots=True, kw_only=True)
class Token:
    client_id: str
    kind: str
    job: str | None
    name: str | None
    created_at: datetime
    revoked_at: datetime | None

    def to_json(self) -> dict:
        return {
            "client_id": self.client_id,
            "role": self.kind,
            "job": self.job,
            "name": self.name,
            "created_at": self.created_at.isoformat(),
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
        }


def token_hash(secret: str) -> str:
    """What the database keeps of a secret or an access token."""
    return hashlib.sha256(secret.encode()).hexdigest()


def create(conn: Conn, *, job: str | None = None, name: str | None = None, admin: bool = False) -> tuple[str, str]:
    """A new token for a reader (``job`` None), for ``job``, or (``admin``) for any job's session;
    returns (client id, secret)."""
    if job is not None:
        parse_job_name(job)
    if admin and job is not None:
        raise IcebarrierError("a token is for one job or an admin, not both")
    kind = "admin" if admin else "job" if job else "reader"
    client_id = f"ib-{secrets.token_hex(8)}"
    secret = secrets.token_urlsafe(32)
    with conn.transaction():
        conn.execute(
            "INSERT INTO catalog_token (client_id, secret_hash, kind, job_name, name) VALUES (%s, %s, %s, %s, %s)",
            (client_id, token_hash(secret), kind, job, name),
        )
    return client_id, secret


def list_tokens(conn: Conn) -> list[Token]:
    rows = conn.execute(
        "SELECT client_id, kind, job_name AS job, name, created_at, revoked_at FROM catalog_token ORDER BY created_at"
    ).fetchall()
    return [Token(**r) for r in rows]


def revoke(conn: Conn, client_id: str) -> Token:
    """Revoke a token and end its sessions (at once, on every server)."""
    with conn.transaction():
        row = conn.execute(
            "UPDATE catalog_token SET revoked_at = coalesce(revoked_at, now()) WHERE client_id = %s "
            "RETURNING client_id, kind, job_name AS job, name, created_at, revoked_at",
            (client_id,),
        ).fetchone()
        if row is None:
            raise TokenNotFoundError(client_id)
        conn.execute("DELETE FROM catalog_session WHERE client_id = %s", (client_id,))
    return Token(**row)


def open_session(conn: Conn, client_id: str, secret: str, *, ttl_s: int = SESSION_TTL_S) -> str:
    """Check a client's credentials and open a session; returns its access token."""
    if "\x00" in client_id:  # no such client (and Postgres text cannot hold NUL)
        raise AuthenticationError(f"client {client_id!r} is unknown; create a token with `icebarrier token create`")
    row = conn.execute(
        "SELECT secret_hash, revoked_at FROM catalog_token WHERE client_id = %s", (client_id,)
    ).fetchone()
    if (
        row is None
        or row["revoked_at"] is not None
        or not secrets.compare_digest(row["secret_hash"], token_hash(secret))
    ):
        raise AuthenticationError(
            f"client {client_id!r} is unknown, revoked, or its secret is wrong; "
            f"create a token with `icebarrier token create`"
        )
    return _new_session(conn, client_id, ttl_s)


def reopen_session(conn: Conn, access_token: str, *, ttl_s: int = SESSION_TTL_S) -> str:
    """A fresh access token for the client of a live one (OAuth2 token exchange, a refresh)."""
    principal = session(conn, access_token)
    if principal.client_id is None:
        raise AuthenticationError("an anonymous client has no session to refresh")
    return _new_session(conn, principal.client_id, ttl_s)


def _new_session(conn: Conn, client_id: str, ttl_s: int) -> str:
    access_token = secrets.token_urlsafe(32)
    with conn.transaction():
        conn.execute("DELETE FROM catalog_session WHERE client_id = %s AND expires_at < now()", (client_id,))
        conn.execute(
            "INSERT INTO catalog_session (token_hash, client_id, expires_at) "
            "VALUES (%s, %s, now() + make_interval(secs => %s))",
            (token_hash(access_token), client_id, ttl_s),
        )
    return access_token


def session(conn: Conn, access_token: str) -> Principal:
    """The principal behind a live access token."""
    row = conn.execute(
        """SELECT t.client_id, t.kind, t.job_name FROM catalog_session s JOIN catalog_token t USING (client_id)
           WHERE s.token_hash = %s AND s.expires_at > now() AND t.revoked_at IS NULL""",
        (token_hash(access_token),),
    ).fetchone()
    if row is None:
        raise unknown_token()
    return Principal(client_id=row["client_id"], kind=row["kind"], job=row["job_name"])
