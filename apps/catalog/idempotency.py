"""Every write route runs as one :class:`Write`: the ``Idempotency-Key`` header (the REST
spec's), the actor the audit trail names, and the one transaction in which the key's look-up,
the action and its outcome commit together (see :mod:`icebarrier.control_plane.idempotency`).

A retry with the key of a finalized request gets the first response and changes nothing (2xx
and 4xx are final, as the spec says; a 5xx is not: nothing of it committed, the retry acts).
The same key with another body, route or token is refused (422). A malformed key is a 400.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Header, Request, Response

from icebarrier.apps.catalog.deps import Caller
from icebarrier.apps.catalog.errors import error_response
from icebarrier.control_plane import idempotency
from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.idempotency import Outcome

if TYPE_CHECKING:
    from icebarrier.apps.catalog.lake.core import LakeCore

HEADER = "Idempotency-Key"
LIFETIME = f"PT{idempotency.LIFETIME_S // 60}M"  # advertised in /v1/config (idempotency-key-lifetime)
REPLAYED = "Idempotent-Replayed"  # response header on an answer given again


@dataclass(frozen=True, slots=True, kw_only=True)
class Write:
    """A write request: its key (None: none sent), fingerprint and who acts."""

    lake: LakeCore
    key: uuid.UUID | None
    fingerprint: str
    client_id: str | None

    @property
    def actor(self) -> str:
        """Who acts, as the audit trail names a catalog client."""
        return f"token:{self.client_id}" if self.client_id else "anonymous"

    def run(
        self, action: Callable[[Conn], Response], *, final: Callable[[Response], bool] = lambda r: True
    ) -> Response:
        """``action(conn)`` in one transaction with the key's look-up and outcome; ``final``: whether
        an answer is final (a long poll that found nothing to do is not: the key stays free)."""
        with self.lake.pool.connection() as conn:
            return self.run_on(conn, action, final=final)

    def run_on(
        self, conn, action: Callable[[Conn], Response], *, final: Callable[[Response], bool] = lambda r: True
    ) -> Response:
        try:
            with conn.transaction():
                outcome = self._find(conn)
                if outcome is not None:
                    return replay(outcome)
                response = action(conn)
                self._record(conn, response, final)
                return response
        except idempotency.Overtaken:
            return self._replay_first(conn)
        except Exception as exc:
            response = error_response(exc)
            if self.key is None or response.status_code >= 500 or not final(response):
                raise  # not final: nothing of it committed, a retry acts
        # A final refusal (4xx): the action's writes are gone with its transaction; the answer
        # is kept in one of its own (unless another attempt's answer was kept meanwhile).
        try:
            with conn.transaction():
                outcome = self._find(conn)
                if outcome is not None:
                    return replay(outcome)
                self._record(conn, response, final)
            return response
        except idempotency.Overtaken:
            return self._replay_first(conn)

    def _find(self, conn: Conn) -> Outcome | None:
        return idempotency.find(
            conn, self.key, actor=self.actor, client_id=self.client_id, fingerprint=self.fingerprint
        )

    def _record(self, conn: Conn, response: Response, final: Callable[[Response], bool]) -> None:
        if self.key is not None and final(response):
            outcome = Outcome(status=response.status_code, media_type=response.media_type, body=bytes(response.body))
            idempotency.record(conn, self.key, outcome, client_id=self.client_id, fingerprint=self.fingerprint)

    def _replay_first(self, conn: Conn) -> Response:
        outcome = self._find(conn)
        assert outcome is not None  # record() met its row committed
        return replay(outcome)


def replay(outcome: Outcome) -> Response:
    return Response(outcome.body, status_code=outcome.status, media_type=outcome.media_type, headers={REPLAYED: "true"})


async def write(request: Request, who: Caller, key: Annotated[str | None, Header(alias=HEADER)] = None) -> Write:
    parsed = idempotency.parse_key(key) if key is not None else None
    digest = hashlib.sha256(f"{request.method} {request.url.path}?{request.url.query}\n".encode())
    if parsed is not None:
        digest.update(await request.body())
    return Write(lake=request.app.state.lake, key=parsed, fingerprint=digest.hexdigest(), client_id=who[0].client_id)


Writes = Annotated[Write, Depends(write)]
