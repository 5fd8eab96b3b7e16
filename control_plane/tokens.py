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
from dataclasses import dataclass, field
from datetime import datetime

from icebarrier.control_plane import audit
from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import TableName, parse_job_name, quote_name

SESSION_TTL_S = 3600  # an access token's life (`serve --token-ttl`, within the bounds below)
MIN_SESSION_TTL_S, MAX_SESSION_TTL_S = 60, 86400


class TokenNotFoundError(IcebarrierError):
    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        super().__init__(f"token {client_id} does not exist; see `icebarrier token list`")


class AuthenticationError(IcebarrierError):
    """Credentials or an access token that are unknown, revoked or expired."""


class NotGrantedError(IcebarrierError):
    """A table or namespace outside what the token was granted (403)."""


def unknown_token() -> AuthenticationError:
    return AuthenticationError("the access token is unknown, expired or revoked; authenticate again")


def token_required() -> AuthenticationError:
    """A request without a token where the catalog needs one."""
    return AuthenticationError(
        "this catalog needs a token: create one with `icebarrier token create` and pass "
        "CLIENT_ID:SECRET as the client's credential"
    )


@dataclass(frozen=True, slots=True)
class Reach:
    """What a token reaches short of an admin's everything: tables and namespaces (a namespace
    covers the namespaces under it) to read, and to write where they are not managed; a job's
    sinks (written under the catalog's own rules) and sources; a whole-lake token reads every
    table (a job's also writes every unmanaged one). Built from ``token_reach`` (migration 0024)."""

    read_tables: frozenset[str] = frozenset()
    write_tables: frozenset[str] = frozenset()
    read_namespaces: tuple[str, ...] = ()
    write_namespaces: tuple[str, ...] = ()
    sinks: frozenset[str] = frozenset()
    read_all: bool = False
    write_all: bool = False

    @classmethod
    def parse(cls, entries: list[str]) -> Reach:
        found: dict[tuple[str, str], set[str]] = {}
        for entry in entries:
            privilege, kind, obj = entry.split(":", 2)
            found.setdefault((privilege, kind), set()).add(obj)
        sinks = found.get(("write", "sink"), set())
        write_tables = found.get(("write", "table"), set())
        write_namespaces = found.get(("write", "namespace"), set())
        return cls(  # a write grant reads too; a job reads its sources and sinks
            read_tables=frozenset(found.get(("read", "table"), set()) | found.get(("read", "source"), set()))
            | write_tables
            | sinks,
            write_tables=frozenset(write_tables),
            read_namespaces=tuple(sorted(found.get(("read", "namespace"), set()) | write_namespaces)),
            write_namespaces=tuple(sorted(write_namespaces)),
            sinks=frozenset(sinks),
            read_all=("read", "lake") in found,
            write_all=("write", "lake") in found,
        )

    def reads(self, table: TableName) -> bool:
        return self.reads_namespace(table.namespace) or str(table) in self.read_tables

    def reads_namespace(self, namespace: tuple[str, ...]) -> bool:
        """Whether it reads every table of ``namespace``: it is granted, or under a grant."""
        return self.read_all or _under(namespace, self.read_namespaces)

    def writes(self, table: TableName) -> bool:
        """May write ``table`` if it is not managed (a managed one: only its writer job)."""
        return self.write_all or str(table) in self.write_tables or _under(table.namespace, self.write_namespaces)

    def sees_namespace(self, catalog: str, namespace: tuple[str, ...]) -> bool:
        """Whether a list shows ``namespace``: it is granted, under a grant, or above something granted."""
        if self.reads_namespace(namespace):
            return True
        name = quote_name(namespace)
        if any(n.startswith(name + ".") for n in self.read_namespaces):
            return True
        prefix = f"{catalog}.{name}."
        return any(t.startswith(prefix) for t in self.read_tables)


def _under(namespace: tuple[str, ...], granted: tuple[str, ...]) -> bool:
    """Whether ``namespace`` is a granted one or under one (grants name namespaces as
    :func:`~icebarrier.control_plane.model.quote_name` writes them: a prefix is a parent)."""
    name = quote_name(namespace)
    return any(name == g or name.startswith(g + ".") for g in granted)


@dataclass(frozen=True, slots=True, kw_only=True)
class Principal:
    """Who a catalog request comes from: a reader, a job (it may commit to its sinks), or an
    admin (it may open any job's session); ``reach``: what it may read (None: the whole lake)."""

    client_id: str | None  # None: anonymous
    kind: str  # reader, job or admin
    job: str | None = None
    reach: Reach | None = None

    @classmethod
    def of(cls, client_id: str, kind: str, job: str | None, reach: list[str] | None) -> Principal:
        """A token's principal as the database has it (``reach``: ``token_reach``'s entries)."""
        return cls(client_id=client_id, kind=kind, job=job, reach=None if reach is None else Reach.parse(reach))

    @property
    def acting_job(self) -> str:
        """The job a job principal acts for (the server checked the kind before it asks)."""
        if self.job is None:
            raise AuthenticationError(f"{self.describe()} acts for no job; use a job's token")
        return self.job

    def describe(self) -> str:
        who = f"token {self.client_id}" if self.client_id else "an anonymous client"
        return f"{who} (job {self.job})" if self.job else f"{who} ({self.kind})"

    def reads(self, table: TableName) -> bool:
        return self.reach is None or self.reach.reads(table)

    def require_read(self, table: TableName) -> None:
        """Refuse (403) a table this principal was not granted, whether or not it exists."""
        if not self.reads(table):
            raise NotGrantedError(
                f"{self.describe()} may not read {table}: it has no grant on the table or its namespace; "
                f"an admin grants it with `icebarrier token grant {self.client_id or 'CLIENT_ID'} --table {table}` "
                f"(or --namespace {quote_name(table.namespace)})"
            )

    def sees_namespace(self, catalog: str, namespace: tuple[str, ...]) -> bool:
        return self.reach is None or self.reach.sees_namespace(catalog, namespace)

    def reads_namespace(self, namespace: tuple[str, ...]) -> bool:
        """Whether it reads every table of ``namespace`` (a list of it needs no look at each)."""
        return self.reach is None or self.reach.reads_namespace(namespace)

    def require_namespace(self, catalog: str, namespace: tuple[str, ...], *, write: bool = False) -> None:
        """Refuse (403) a namespace outside the grants: to see (load, exists, list its tables), or
        (``write``) to create, drop or change it (a write grant on it or above it)."""
        name = quote_name(namespace)
        if (
            write
            and self.reach is not None
            and not (self.reach.write_all or _under(namespace, self.reach.write_namespaces))
        ):
            raise NotGrantedError(
                f"{self.describe()} may not change namespace {name}: it needs a write grant on it or a namespace "
                f"above it; an admin creates a namespace with `icebarrier namespace create {name}`, and grants it "
                f"with `icebarrier token grant {self.client_id or 'CLIENT_ID'} --write --namespace {name}`"
            )
        if not self.sees_namespace(catalog, namespace):
            raise NotGrantedError(
                f"{self.describe()} may not see namespace {name}: it has no grant in it; an admin grants it with "
                f"`icebarrier token grant {self.client_id or 'CLIENT_ID'} --namespace {name}`"
            )

    def require_write_unmanaged(self, table: TableName) -> None:
        if self.reach is not None and not self.reach.writes(table):
            raise NotGrantedError(
                f"{self.describe()} may not write {table}: a job writes its sinks, and other tables only with a "
                f"write grant; an admin grants it with `icebarrier token grant {self.client_id or 'CLIENT_ID'} "
                f"--write --table {table}` (or --namespace {quote_name(table.namespace)})"
            )


ANONYMOUS = Principal(client_id=None, kind="reader")  # no token, where the catalog allows that


@dataclass(frozen=True, slots=True, kw_only=True)
class Token:
    client_id: str
    kind: str
    job: str | None
    name: str | None
    created_at: datetime
    revoked_at: datetime | None
    whole_lake: bool = False
    grants: list[str] = field(default_factory=list)  # "read namespace a.b", "write table lake.a.t"

    def to_json(self) -> dict:
        return {
            "client_id": self.client_id,
            "role": self.kind,
            "job": self.job,
            "name": self.name,
            "created_at": self.created_at.isoformat(),
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
            "whole_lake": self.whole_lake,
            "grants": self.grants,
        }


def token_hash(secret: str) -> str:
    """What the database keeps of a secret or an access token."""
    return hashlib.sha256(secret.encode()).hexdigest()


def create(
    conn: Conn, *, job: str | None = None, name: str | None = None, admin: bool = False, whole_lake: bool = False
) -> tuple[str, str]:
    """A new token for a reader (``job`` None), for ``job``, or (``admin``) for any job's session;
    returns (client id, secret). A reader or a job reaches only what it is granted (a job: its
    sources and sinks too), unless ``whole_lake``."""
    if job is not None:
        parse_job_name(job)
    if admin and job is not None:
        raise IcebarrierError("a token is for one job or an admin, not both")
    kind = "admin" if admin else "job" if job else "reader"
    client_id = f"ib-{secrets.token_hex(8)}"
    secret = secrets.token_urlsafe(32)
    with conn.transaction():
        conn.execute(
            "INSERT INTO catalog_token (client_id, secret_hash, kind, job_name, name, whole_lake) "
            "VALUES (%s, %s, %s, %s, %s, %s)",
            (client_id, token_hash(secret), kind, job, name, whole_lake or admin),
        )
    return client_id, secret


@dataclass(frozen=True, slots=True)
class Grant:
    kind: str  # namespace or table
    object: str  # a namespace ("a.b") or a table ("lake.a.t")
    privilege: str  # read, or write (the unmanaged tables there; read too)

    def __str__(self) -> str:
        return f"{self.privilege} {self.kind} {self.object}"


def grant(conn: Conn, client_id: str, grants: list[Grant]) -> Token:
    """Add ``grants`` to a token (a grant given again takes the new privilege)."""
    with conn.transaction():
        token = _token(conn, client_id, lock=True)
        if token.kind == "admin" or token.whole_lake:
            raise IcebarrierError(f"token {client_id} reaches the whole lake already; grants would change nothing")
        if token.kind == "reader" and any(g.privilege == "write" for g in grants):
            raise IcebarrierError(f"token {client_id} is a reader's: it writes nothing; grant it read (drop --write)")
        for g in grants:
            conn.execute(
                "INSERT INTO catalog_grant (client_id, kind, object, privilege) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (client_id, kind, object) DO UPDATE SET privilege = EXCLUDED.privilege, granted_at = now()",
                (client_id, g.kind, g.object, g.privilege),
            )
        audit.append(conn, "token grant", job=token.job, object=client_id, detail={"grants": [str(g) for g in grants]})
    return _token(conn, client_id)


def ungrant(conn: Conn, client_id: str, grants: list[Grant]) -> Token:
    """Take ``grants`` (kind and object; the privilege is ignored) from a token; one it does not
    hold is refused, naming it."""
    with conn.transaction():
        token = _token(conn, client_id, lock=True)
        for g in grants:
            gone = conn.execute(
                "DELETE FROM catalog_grant WHERE client_id = %s AND kind = %s AND object = %s",
                (client_id, g.kind, g.object),
            ).rowcount
            if not gone:
                raise IcebarrierError(
                    f"token {client_id} holds no grant on {g.kind} {g.object}; see `icebarrier token list`"
                )
        audit.append(
            conn,
            "token ungrant",
            job=token.job,
            object=client_id,
            detail={"grants": [f"{g.kind} {g.object}" for g in grants]},
        )
    return _token(conn, client_id)


_TOKEN_SQL = (
    "SELECT client_id, kind, job_name AS job, name, created_at, revoked_at, whole_lake, "
    "ARRAY(SELECT g.privilege || ' ' || g.kind || ' ' || g.object FROM catalog_grant g "
    "WHERE g.client_id = t.client_id ORDER BY g.kind, g.object) AS grants FROM catalog_token t"
)


def _token(conn: Conn, client_id: str, *, lock: bool = False) -> Token:
    row = conn.execute(f"{_TOKEN_SQL} WHERE client_id = %s{' FOR UPDATE' if lock else ''}", (client_id,)).fetchone()
    if row is None:
        raise TokenNotFoundError(client_id)
    return Token(**row)


def list_tokens(conn: Conn) -> list[Token]:
    return [Token(**r) for r in conn.execute(f"{_TOKEN_SQL} ORDER BY created_at").fetchall()]


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


_SESSION = """SELECT t.client_id, t.kind, t.job_name, token_reach(t.client_id) AS reach,
                      extract(epoch FROM s.expires_at - now())::float8 AS ttl_s
               FROM catalog_session s JOIN catalog_token t USING (client_id)
               WHERE s.token_hash = %s AND s.expires_at > now() AND t.revoked_at IS NULL"""


def session(conn: Conn, access_token: str) -> Principal:
    """The principal behind a live access token."""
    return _principal(conn.execute(_SESSION, (token_hash(access_token),)).fetchone())


async def session_async(conn, access_token: str) -> tuple[Principal, float]:
    """:func:`session` on an asyncio connection (a server's event loop waits for Postgres without
    holding the loop), and how long the access token stays valid from now (seconds)."""
    row = await (await conn.execute(_SESSION, (token_hash(access_token),))).fetchone()
    return _principal(row), row["ttl_s"]


def _principal(row: dict | None) -> Principal:
    if row is None:
        raise unknown_token()
    return Principal.of(row["client_id"], row["kind"], row["job_name"], row["reach"])
