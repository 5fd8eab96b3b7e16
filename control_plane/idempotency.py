"""Idempotency keys: a mutating request's key, its fingerprint and its final outcome, kept in
the control plane so that any server process answers a retry (DESIGN.md, "Retries are safe").

The caller looks the key up (:func:`find`) in the transaction that performs the action and
records the outcome (:func:`record`) in that same transaction: a retry either finds the
outcome (and changes nothing) or, if the first attempt never committed, performs the action
itself. Two attempts in flight at once both act, and the second to record waits for the
first's transaction on the key's unique index: if the first committed, the second rolls back
everything it did and answers the first's outcome. (One row written per request, at the end:
claiming the key first, then updating the row with the answer, cost a commit 6 ms more.)
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import IcebarrierError

LIFETIME_S = 30 * 60  # advertised: a client may retry with a key for this long
GRACE_S = 5 * 60  # kept a little longer, for clocks and slow retries
EXPIRED_PER_RECORD = 100  # expired keys deleted by each record (their index finds them)


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
    """A finalized request's response, answered again to each retry."""

    status: int
    media_type: str | None
    body: bytes


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


_RECORD = f"""
WITH expired AS (
    DELETE FROM idempotency_key WHERE key IN (
        SELECT key FROM idempotency_key WHERE expires_at < now() ORDER BY expires_at
        LIMIT {EXPIRED_PER_RECORD} FOR UPDATE SKIP LOCKED))
INSERT INTO idempotency_key (key, client_id, fingerprint, status, media_type, body, expires_at)
VALUES (%(key)s, %(client)s, %(fingerprint)s, %(status)s, %(media_type)s, %(body)s,
        now() + make_interval(secs => %(keep_s)s))
ON CONFLICT (key) DO NOTHING
RETURNING key
"""


def find(conn: Conn, key: uuid.UUID, *, client_id: str | None, fingerprint: str) -> Outcome | None:
    """The outcome the request that finalized ``key`` got (None: no such request committed).
    Raises :class:`IdempotencyKeyReusedError` for a key first used with another request."""
    row = conn.execute(
        "SELECT client_id, fingerprint, status, media_type, body FROM idempotency_key WHERE key = %s", (key,)
    ).fetchone()
    if row is None:
        return None
    if row["fingerprint"] != fingerprint or row["client_id"] != client_id:
        raise IdempotencyKeyReusedError(str(key))
    return Outcome(status=row["status"], media_type=row["media_type"], body=bytes(row["body"]))


def record(conn: Conn, key: uuid.UUID, outcome: Outcome, *, client_id: str | None, fingerprint: str) -> bool:
    """Keep ``outcome`` as the answer to ``key`` (in the transaction of the action); False if
    another attempt with the key committed first (the caller rolls back and answers
    :func:`find`'s outcome)."""
    params = {
        "key": key,
        "client": client_id,
        "fingerprint": fingerprint,
        "status": outcome.status,
        "media_type": outcome.media_type,
        "body": outcome.body,
        "keep_s": LIFETIME_S + GRACE_S,
    }
    return conn.execute(_RECORD, params).fetchone() is not None
