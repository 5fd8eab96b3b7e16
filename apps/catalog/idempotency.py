"""Every write route runs as one :class:`Write`: the ``Idempotency-Key`` header (the REST
spec's), the actor the audit trail names, and the one transaction in which the key's look-up,
the action and its outcome commit together (see :mod:`icebarrier.control_plane.idempotency`).

A retry with the key of a finalized request gets the first response and changes nothing (2xx
and 4xx are final, as the spec says; a 5xx is not: nothing of it committed, the retry acts).
The same key with another body, route or token is refused (422). A malformed key is a 400.
A commit answers :class:`Committed`: its body is kept by reference to the metadata file the
commit wrote, and a retry's answer is read back from it (``reread``).
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
from icebarrier.control_plane.db import Conn, Tail
from icebarrier.control_plane.idempotency import Outcome

if TYPE_CHECKING:
    from icebarrier.apps.catalog.lake.core import LakeCore

HEADER = "Idempotency-Key"
LIFETIME = f"PT{idempotency.LIFETIME_S // 60}M"  # advertised in /v1/config (idempotency-key-lifetime)
REPLAYED = "Idempotent-Replayed"  # response header on an answer given again


class Committed(Response):
    """A commit's answer: the table's metadata as written at ``metadata_location`` (a keyed
    commit keeps the location, not the body: see :mod:`icebarrier.control_plane.idempotency`)."""

    def __init__(self, body: bytes, metadata_location: str) -> None:
        super().__init__(body, media_type="application/json")
        self.metadata_location = metadata_location


Reread = Callable[[Conn, str], Response]  # a Committed answer again, from its metadata file


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
        self,
        action: Callable[[Conn], Response],
        *,
        final: Callable[[Response], bool] = lambda r: True,
        reread: Reread | None = None,
    ) -> Response:
        """``action(conn)`` in one transaction with the key's look-up and outcome; ``final``: whether
        an answer is final (a long poll that found nothing to do is not: the key stays free);
        ``reread``: how a :class:`Committed` answer of the action is read again."""
        with self.lake.pool.connection() as conn:
            return self.run_on(conn, action, final=final, reread=reread)

    def run_on(
        self,
        conn,
        action: Callable[[Conn], Response],
        *,
        final: Callable[[Response], bool] = lambda r: True,
        reread: Reread | None = None,
    ) -> Response:
        try:
            with idempotency.transaction(conn) as tail:
                outcome = self._find(conn)
                if outcome is not None:
                    return replay(conn, outcome, reread)
                response = action(conn)
                self._record(tail, response, final)
                return response
        except idempotency.Overtaken:
            return self._replay_first(conn, reread)
        except Exception as exc:
            response = error_response(exc)
            if self.key is None or response.status_code >= 500 or not final(response):
                raise  # not final: nothing of it committed, a retry acts
        # A final refusal (4xx): the action's writes are gone with its transaction; the answer
        # is kept in one of its own (unless another attempt's answer was kept meanwhile).
        try:
            with idempotency.transaction(conn) as tail:
                outcome = self._find(conn)
                if outcome is not None:
                    return replay(conn, outcome, reread)
                self._record(tail, response, final)
            return response
        except idempotency.Overtaken:
            return self._replay_first(conn, reread)

    def _find(self, conn: Conn) -> Outcome | None:
        return idempotency.find(
            conn, self.key, actor=self.actor, client_id=self.client_id, fingerprint=self.fingerprint
        )

    def _record(self, tail: Tail, response: Response, final: Callable[[Response], bool]) -> None:
        if self.key is not None and final(response):
            status, media_type = response.status_code, response.media_type
            if isinstance(response, Committed):
                outcome = Outcome(status=status, media_type=media_type, metadata_location=response.metadata_location)
            else:
                outcome = Outcome(status=status, media_type=media_type, body=bytes(response.body))
            idempotency.record(tail, self.key, outcome, client_id=self.client_id, fingerprint=self.fingerprint)

    def _replay_first(self, conn: Conn, reread: Reread | None) -> Response:
        outcome = self._find(conn)
        assert outcome is not None  # record() met its row committed
        return replay(conn, outcome, reread)


def replay(conn: Conn, outcome: Outcome, reread: Reread | None) -> Response:
    if outcome.metadata_location is not None:
        assert reread is not None  # the route that answered Committed passes it
        response = reread(conn, outcome.metadata_location)
        response.headers[REPLAYED] = "true"
        return response
    return Response(outcome.body, status_code=outcome.status, media_type=outcome.media_type, headers={REPLAYED: "true"})


async def write(request: Request, who: Caller, key: Annotated[str | None, Header(alias=HEADER)] = None) -> Write:
    parsed = idempotency.parse_key(key) if key is not None else None
    digest = hashlib.sha256(f"{request.method} {request.url.path}?{request.url.query}\n".encode())
    if parsed is not None:
        digest.update(await request.body())
    return Write(lake=request.app.state.lake, key=parsed, fingerprint=digest.hexdigest(), client_id=who[0].client_id)


Writes = Annotated[Write, Depends(write)]
