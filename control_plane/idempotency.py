"""Idempotency keys: a mutating request's key, its fingerprint and its final outcome, kept in
the control plane so that any server process answers a retry (DESIGN.md, "Retries are safe").

The caller claims the key inside the transaction that performs the action and records the
outcome in that same transaction: a retry either finds the outcome (and changes nothing) or,
if the first attempt never committed, performs the action itself. A retry that arrives while
the first attempt is still in flight waits for it (the key's row is locked until then).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import IcebarrierError

LIFETIME_S = 30 * 60  # advertised: a client may retry with a key for this long
GRACE_S = 5 * 60  # kept a little longer, for clocks and slow retries
EXPIRED_PER_CLAIM = 100  # expired keys deleted by each claim (their index finds them)


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


_CLAIM = f"""
WITH expired AS (
    DELETE FROM idempotency_key WHERE key IN (
        SELECT key FROM idempotency_key WHERE expires_at < now() ORDER BY expires_at
        LIMIT {EXPIRED_PER_CLAIM} FOR UPDATE SKIP LOCKED))
INSERT INTO idempotency_key (key, client_id, fingerprint, status, body, expires_at)
VALUES (%(key)s, %(client)s, %(fingerprint)s, 0, '', now() + make_interval(secs => %(keep_s)s))
ON CONFLICT (key) DO NOTHING
RETURNING key
"""


def claim(conn: Conn, key: uuid.UUID, *, client_id: str | None, fingerprint: str) -> Outcome | None:
    """Inside the caller's transaction: reserve ``key`` for this request (None: go ahead, then
    :func:`record`), or the outcome of the request that finalized it. Raises
    :class:`IdempotencyKeyReusedError` for a key first used with another request."""
    params = {"key": key, "client": client_id, "fingerprint": fingerprint, "keep_s": LIFETIME_S + GRACE_S}
    if conn.execute(_CLAIM, params).fetchone() is not None:
        return None
    row = conn.execute(
        "SELECT client_id, fingerprint, status, media_type, body FROM idempotency_key WHERE key = %s", (key,)
    ).fetchone()
    if row is None:  # the first attempt rolled back meanwhile: this one is the first
        return claim(conn, key, client_id=client_id, fingerprint=fingerprint)
    if row["fingerprint"] != fingerprint or row["client_id"] != client_id:
        raise IdempotencyKeyReusedError(str(key))
    return Outcome(status=row["status"], media_type=row["media_type"], body=bytes(row["body"]))


def record(conn: Conn, key: uuid.UUID, outcome: Outcome) -> None:
    """The claimed key's final outcome (in the transaction that claimed it)."""
    conn.execute(
        "UPDATE idempotency_key SET status = %s, media_type = %s, body = %s WHERE key = %s",
        (outcome.status, outcome.media_type, outcome.body, key),
    )
