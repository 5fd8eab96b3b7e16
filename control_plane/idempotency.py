"""Idempotency keys: a mutating request's key, its fingerprint and its final outcome, kept in
the control plane so that any server process answers a retry (DESIGN.md, "Retries are safe").

The caller looks the key up (:func:`find`, in the statement that names the actor: no round
trip of its own) in the transaction that performs the action and records the outcome
(:func:`record`) in that same transaction: a retry either finds the outcome (and changes
nothing) or, if the first attempt never committed, performs the action itself. Two attempts
in flight at once both act, and the second to record waits for the first's transaction on
the key's unique index: if the first committed, the second rolls back everything it did
(:class:`Overtaken`) and answers the first's outcome. (One row written per request, at the
end: claiming the key first, then updating the row with the answer, cost a commit 6 ms more.
The row rides with the COMMIT: no round trip of its own.)

A commit's answer (its table's metadata) is kept by reference to the metadata file the commit
wrote (:attr:`Outcome.metadata_location`), not as a copy: the caller reads it back to answer a
retry. Orphan-file removal keeps the files that live keys name (:func:`referenced`).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

from icebarrier.control_plane import db
from icebarrier.control_plane.db import ACTOR_SETTING, Conn, Tail
from icebarrier.control_plane.errors import IcebarrierError

LIFETIME_S = 30 * 60  # advertised: a client may retry with a key for this long
GRACE_S = 5 * 60  # kept a little longer, for clocks and slow retries
PURGE_EVERY = 64  # one record in this many also deletes expired keys (their index finds them),
EXPIRED_PER_PURGE = 100 * PURGE_EVERY  # up to this many: a commit pays nothing for it otherwise


class IdempotencyKeyReusedError(IcebarrierError):
    """A key sent with another request than the one it was first used for (422)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(
            f"Idempotency-Key {key} was used for another request (another body, route or token); "
            f"send a new key (a UUIDv7) for each operation and reuse one only to retry it"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """A finalized request's response, answered again to each retry: its body, or (a commit's
    answer) the metadata file the body is read back from."""

    status: int
    media_type: str | None
    body: bytes | None = None
    metadata_location: str | None = None


def parse_key(text: str) -> uuid.UUID:
    """A key as the spec gives it: a UUID in its 36-character form (UUIDv7 recommended)."""
    try:
        if len(text) != 36:
            raise ValueError(text)
        return uuid.UUID(text)
    except ValueError:
        raise IcebarrierError(
            f"Idempotency-Key {text[:60]!r} is not a UUID (36 characters, e.g. "
            f"017f22e2-79b0-7cc3-98c4-dc0c0c07398f); send a new UUIDv7 per operation"
        ) from None


_RECORD = """
INSERT INTO idempotency_key (key, client_id, fingerprint, status, media_type, body, metadata_location, expires_at)
VALUES (%(key)s, %(client)s, %(fingerprint)s, %(status)s, %(media_type)s, %(body)s, %(metadata_location)s,
        now() + make_interval(secs => %(keep_s)s))
"""
_PURGE = f"""
DELETE FROM idempotency_key WHERE key IN (
    SELECT key FROM idempotency_key WHERE expires_at < now() ORDER BY expires_at
    LIMIT {EXPIRED_PER_PURGE} FOR UPDATE SKIP LOCKED)
"""
_FIND = """
SELECT set_config(%(setting)s, %(actor)s, true) AS actor, k.client_id, k.fingerprint, k.status, k.media_type, k.body,
       k.metadata_location
FROM (VALUES (1)) AS one LEFT JOIN idempotency_key AS k ON k.key = %(key)s
"""


class Overtaken(Exception):
    """Another attempt with the same key committed first: this attempt's transaction was rolled
    back (nothing it did stands) and the first attempt's outcome is the answer."""


def find(conn: Conn, key: uuid.UUID | None, *, actor: str, client_id: str | None, fingerprint: str) -> Outcome | None:
    """The outcome the request that finalized ``key`` got (None: no such request committed, or
    no key). Raises :class:`IdempotencyKeyReusedError` for a key first used with another request.
    ``actor``: who acts in this transaction, for the audit trail, named in the same statement
    (a write's first: a keyed write costs no round trip more for its look-up)."""
    row = conn.execute(_FIND, {"setting": ACTOR_SETTING, "actor": actor, "key": key}).fetchone()
    if row is None or row["fingerprint"] is None:
        return None
    if row["fingerprint"] != fingerprint or row["client_id"] != client_id:
        raise IdempotencyKeyReusedError(str(key))
    body = row["body"]
    return Outcome(
        status=row["status"],
        media_type=row["media_type"],
        body=None if body is None else bytes(body),
        metadata_location=row["metadata_location"],
    )


def record(tail: Tail, key: uuid.UUID, outcome: Outcome, *, client_id: str | None, fingerprint: str) -> None:
    """Keep ``outcome`` as the answer to ``key``, in the transaction of the action: the row goes
    out with its COMMIT (``tail``, of :func:`transaction`), costing no round trip of its own."""
    params = {
        "key": key,
        "client": client_id,
        "fingerprint": fingerprint,
        "status": outcome.status,
        "media_type": outcome.media_type,
        "body": outcome.body,
        "metadata_location": outcome.metadata_location,
        "keep_s": LIFETIME_S + GRACE_S,
    }
    tail.then(_RECORD, params)
    if random.randrange(PURGE_EVERY) == 0:
        tail.then(_PURGE)


@contextmanager
def transaction(conn: Conn) -> Iterator[Tail]:
    """The transaction of an action and its :func:`record`. Raises :class:`Overtaken` at its end
    if another attempt with the key committed first (the row's insert waits for an attempt
    still in flight on the key's unique index)."""
    try:
        with db.transaction(conn) as tail:
            yield tail
    except psycopg.errors.UniqueViolation as exc:
        if exc.diag.constraint_name != "idempotency_key_pkey":
            raise
        raise Overtaken() from None


def referenced(conn: Conn, location: str) -> set[str]:
    """The metadata files under ``location`` (a table's) that live keys' answers name."""
    rows = conn.execute(
        "SELECT metadata_location FROM idempotency_key WHERE starts_with(metadata_location, %s) AND expires_at > now()",
        (location.rstrip("/") + "/",),
    )
    return {r["metadata_location"] for r in rows}


def purge(conn: Conn) -> int:
    """Delete keys past their lifetime (up to :data:`EXPIRED_PER_PURGE`); how many."""
    return conn.execute(_PURGE).rowcount
