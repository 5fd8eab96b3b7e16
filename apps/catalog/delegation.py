"""Storage access for catalog clients (the REST spec's access delegation).

A client needs only the catalog URI and its token: a table on object storage is loaded with the
storage settings it needs in the LoadTableResult's ``config``, the way the spec defines it. A
client that sends ``X-Iceberg-Access-Delegation: vended-credentials`` (PyIceberg does by default,
DuckDB with ``ACCESS_DELEGATION_MODE 'vended_credentials'``, Spark and Trino when configured)
gets keys:

- a job token (or an admin token in a job's session) gets the server's keys (``[storage]``);
- a reader token gets ``[storage.readers]``, keys the operator makes read-only on the bucket,
  so a reader's credentials never allow a write the catalog would refuse; without them a
  reader gets the endpoint and no keys (it must bring its own).

With ``[storage.sessions]`` the keys never leave the server: a client gets temporary credentials
that STS's GetSessionToken made from them (``s3.session-token`` and its expiry,
``s3.session-token-expires-at-ms``), with the same rights and a lifetime of ``duration-s``. Trino
uses vended credentials only with a session token. One set per key is shared by every load until
a quarter of its lifetime is left (:class:`SessionVendor`).

Every client gets the endpoint, region and path style (no secret). ``remote-signing`` is not
offered: a client asking only for it gets the same answer as one asking for nothing, as the
spec allows.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header

from icebarrier.apps.catalog.errors import MalformedRequestError
from icebarrier.iceberg_ext import storage as s3
from icebarrier.iceberg_ext.storage import Storage, is_object_storage

HEADER = "X-Iceberg-Access-Delegation"
VENDED_CREDENTIALS = "vended-credentials"
REMOTE_SIGNING = "remote-signing"
MODES = (VENDED_CREDENTIALS, REMOTE_SIGNING)


@dataclass(frozen=True, slots=True)
class Delegation:
    """The access a client asked for with the header."""

    modes: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, header: str | None) -> Delegation:
        if not header:
            return cls()
        modes = frozenset(m.strip() for m in header.split(",") if m.strip())
        unknown = sorted(modes - set(MODES))
        if unknown:
            raise MalformedRequestError(
                f"header {HEADER} names {', '.join(unknown)}; use {' or '.join(MODES)} (comma-separated)"
            )
        return cls(modes)

    def config(
        self, storage: Storage, location: str, *, reader: bool, sessions: SessionVendor | None = None
    ) -> dict[str, str]:
        """The ``config`` of a LoadTableResult for a table at ``location`` (``sessions``: where
        ``[storage.sessions]`` is set, temporary credentials instead of the keys)."""
        if not is_object_storage(location):
            return {}
        if VENDED_CREDENTIALS not in self.modes:
            return storage.public()
        vended = storage.vended(reader=reader)
        if sessions is not None and s3.ACCESS_KEY_ID in vended:
            vended.update(sessions.credentials(vended))
        return vended


class SessionVendor:
    """Temporary credentials from STS GetSessionToken for a pair of keys, made once per key and
    shared until a quarter of their lifetime is left."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, dict[str, str]]] = {}

    def credentials(self, keys: dict[str, str]) -> dict[str, str]:
        """``s3.access-key-id``, ``s3.secret-access-key``, ``s3.session-token`` and its expiry for
        ``keys``. Raises StorageUnavailableError when STS refuses or cannot be reached."""
        key_id, duration_s = keys[s3.ACCESS_KEY_ID], self.storage.session_duration_s
        assert duration_s is not None  # a vendor is made only for [storage.sessions]
        with self._lock:
            renew_at, cached = self._cache.get(key_id, (0.0, {}))
            if time.monotonic() < renew_at:
                return cached
            made = self._session(keys, duration_s)
            self._cache[key_id] = (time.monotonic() + 0.75 * duration_s, made)
            return made

    def _session(self, keys: dict[str, str], duration_s: int) -> dict[str, str]:
        import boto3
        import botocore.exceptions

        from icebarrier.apps.catalog.errors import StorageUnavailableError

        sts = boto3.client(
            "sts",
            endpoint_url=self.storage.sts_endpoint,
            region_name=self.storage.properties.get(s3.REGION),
            aws_access_key_id=keys[s3.ACCESS_KEY_ID],
            aws_secret_access_key=keys[s3.SECRET_ACCESS_KEY],
            aws_session_token=keys.get(s3.SESSION_TOKEN),
        )
        try:
            made = sts.get_session_token(DurationSeconds=duration_s)["Credentials"]
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise StorageUnavailableError(
                f"STS at {self.storage.sts_endpoint or 'AWS'} made no session credentials ({exc}); "
                f"fix [storage.sessions] or remove it to vend the keys"
            ) from None
        return {
            s3.ACCESS_KEY_ID: made["AccessKeyId"],
            s3.SECRET_ACCESS_KEY: made["SecretAccessKey"],
            s3.SESSION_TOKEN: made["SessionToken"],
            s3.SESSION_TOKEN_EXPIRES_AT_MS: str(int(made["Expiration"].timestamp() * 1000)),
        }


async def delegation(x_iceberg_access_delegation: Annotated[str | None, Header()] = None) -> Delegation:
    return Delegation.parse(x_iceberg_access_delegation)


Access = Annotated[Delegation, Depends(delegation)]
