"""A catalog load's state in one statement: ``catalog_load`` (migrations 0021, 0022).

Who asks (the access token checked), the job's staged commit of the table, whether the table is
managed, the snapshot the warehouse pins (S(T, B) through ``barrier-<B>``, the session's moment
through ``read-committed``) and then the table's pointer: one round trip, where it was eight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from icebarrier.control_plane.db import Conn, translated
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import TableName
from icebarrier.control_plane.tokens import ANONYMOUS, Principal, token_hash, unknown_token

# psycopg prepares it on the server after a few uses (one parse and plan per connection).
_SQL = (
    "SELECT * FROM catalog_load(%(token)s, %(job)s, %(catalog_schema)s, %(catalog)s, %(namespace)s, "
    "%(table)s, %(name)s, %(mode)s, %(barrier)s, %(scope)s, %(quiet_ms)s)"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadState:
    principal: Principal  # who holds the token (ANONYMOUS without one)
    staged_location: str | None  # the acting job's unpublished commit of the table
    managed: bool
    location: str | None  # the table's pointer (None: no such table)
    snapshot_id: int | None  # the snapshot the warehouse pins (barrier, read-committed)
    cut: int | None  # the barrier of that snapshot
    # What a server needs to keep the answer (``apps/catalog/load_cache.py``):
    token_ttl_s: float | None = None  # how long the token is valid from now (None: no token)
    moment: int | None = None  # the barrier asked: the read-committed session's moment, or B
    moment_age_s: float | None = None  # since the session's moment was last confirmed
    plain: bool = False  # the cut is S(T, moment) of a valid, unexpired barrier


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadQuery:
    """What a load through ``mode`` asks: ``latest``; ``barrier``: S(T, ``barrier``);
    ``read-committed``: the session's moment over ``scope``, kept while its loads come less than
    ``quiet_ms`` apart; any other mode pins nothing. ``job``: the job acting, if the caller knows
    it (an admin in a job's session); else the token's job. ``managed_key``: the table's name if
    it could be managed (None: never managed). ``catalog_schema``: the SQL catalog's schema,
    where the pointer is read (None: the state without it)."""

    catalog_schema: str | None
    table: TableName
    managed_key: str | None
    mode: str
    access_token: str | None
    job: str | None = None
    barrier: int | None = None
    scope: str | None = None
    quiet_ms: int = 0
    hashed_token: str | None = field(init=False)  # what the database keeps of the token (once a load)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hashed_token", None if self.access_token is None else token_hash(self.access_token))

    def params(self) -> dict:
        return {
            "token": self.hashed_token,
            "job": self.job,
            "catalog_schema": self.catalog_schema,
            "catalog": self.table.catalog,
            "namespace": self.table.sql_namespace,
            "table": self.table.name,
            "name": self.managed_key,
            "mode": self.mode,
            "barrier": self.barrier,
            "scope": self.scope,
            "quiet_ms": self.quiet_ms,
        }

    def state(self, row: dict | None) -> LoadState:
        """The state in ``catalog_load``'s row. Raises AuthenticationError (:func:`unknown_token`)
        when the token is unknown, expired or revoked."""
        if row is None:  # catalog_load returns a row every time
            raise IcebarrierError("catalog_load answered no row; this is a bug")
        if self.access_token is None:
            principal = ANONYMOUS
        elif row["who_client"] is None:
            raise unknown_token()
        else:
            principal = Principal.of(row["who_client"], row["who_kind"], row["who_job"], row["who_reach"])
        return LoadState(
            principal=principal,
            staged_location=row["staged_location"],
            managed=bool(row["managed"]),
            location=row["location"],
            snapshot_id=row["snapshot_id"],
            cut=row["cut"],
            token_ttl_s=row["token_ttl_s"],
            moment=row["moment"],
            moment_age_s=row["moment_age_s"],
            plain=bool(row["plain"]),
        )


def load_state(conn: Conn, query: LoadQuery) -> LoadState:
    """The state a load needs, in one statement."""
    with translated(conn, "load_table"):
        row = conn.execute(_SQL, query.params()).fetchone()
    return query.state(row)


async def load_state_async(conn, query: LoadQuery) -> LoadState:
    """:func:`load_state` on an ``AsyncConnection`` (the server's event loop)."""
    with translated(conn, "load_table"):
        row = await (await conn.execute(_SQL, query.params())).fetchone()
    return query.state(row)
