"""Storage access for catalog clients (the REST spec's access delegation).

A client needs only the catalog URI and its token: a table on object storage is loaded with the
storage settings it needs in the LoadTableResult's ``config``, the way the spec defines it. A
client that sends ``X-Iceberg-Access-Delegation: vended-credentials`` (PyIceberg does by default,
DuckDB with ``ACCESS_DELEGATION_MODE 'vended_credentials'``, Spark and Trino when configured)
gets credentials:

- With ``[storage.sessions] role-arn`` (least privilege, DESIGN.md): credentials for that one
  table, made by STS ``AssumeRole`` with a session policy (:func:`table_policy`) that opens the
  table's location only: read for a reader and a job's sources, read and write for the job
  writing it (its sinks, the unmanaged tables it was granted to write). The server's own keys
  never leave it. They come in ``config`` and in ``storage-credentials`` (with their prefix),
  with their expiry and ``client.refresh-credentials-endpoint``: the table's ``/credentials``
  (the spec's loadCredentials), where a long job gets fresh ones. One set per (access, table) is
  shared until a quarter of its lifetime is left (:class:`ScopedVendor`); each one made is
  recorded in the audit trail (token, table, read or write, expiry).
- Without a role: a job token (or an admin token in a job's session) gets the server's keys
  (``[storage]``); a reader token gets ``[storage.readers]``, keys the operator makes read-only,
  else the endpoint and no keys (it must bring its own). With ``[storage.sessions]`` the keys
  are exchanged for temporary credentials of the same rights (STS ``GetSessionToken``,
  :class:`SessionVendor`). Trino uses vended credentials only with a session token.

Every client gets the endpoint, region and path style (no secret). ``remote-signing`` is not
offered: a client asking only for it gets the same answer as one asking for nothing, as the
spec allows.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header

from icebarrier.apps.catalog.errors import MalformedRequestError
from icebarrier.control_plane.errors import ConfigurationError
from icebarrier.iceberg_ext import storage as s3
from icebarrier.iceberg_ext.storage import Storage, is_object_storage

HEADER = "X-Iceberg-Access-Delegation"
VENDED_CREDENTIALS = "vended-credentials"
REMOTE_SIGNING = "remote-signing"
MODES = (VENDED_CREDENTIALS, REMOTE_SIGNING)
REFRESH_ENDPOINT = "client.refresh-credentials-endpoint"  # Iceberg's AwsClientProperties: where to refresh


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
        self,
        storage: Storage,
        location: str,
        *,
        reader: bool,
        sessions: SessionVendor | None = None,
        scoped: Callable[[], dict[str, str]] | None = None,
    ) -> dict[str, str]:
        """The ``config`` of a LoadTableResult for a table at ``location`` (``scoped``: the
        table's own credentials, where a role is configured; else ``sessions``: where
        ``[storage.sessions]`` is set, temporary credentials instead of the keys)."""
        if not is_object_storage(location):
            return {}
        if VENDED_CREDENTIALS not in self.modes:
            return storage.public()
        if scoped is not None:
            return {**storage.public(), **scoped()}
        vended = storage.vended(reader=reader)
        if sessions is not None and s3.ACCESS_KEY_ID in vended:
            vended.update(sessions.credentials(vended))
        return vended


def table_prefix(location: str) -> tuple[str, str]:
    """(bucket, key prefix ending in ``/``) of a table's location."""
    bucket, _, path = location.split("://", 1)[-1].partition("/")  # not urlparse: '?' and '#' are a key's
    return bucket, path.strip("/") + "/"


def storage_credential(location: str, config: dict[str, str], keys: tuple[str, ...]) -> dict:
    """A ``storage-credentials`` entry: the ``keys`` of ``config`` there are, for the objects under
    the table at ``location``."""
    bucket, prefix = table_prefix(location)
    return {"prefix": f"s3://{bucket}/{prefix}", "config": {k: config[k] for k in keys if k in config}}


def _iam_literal(text: str) -> str:
    """``text`` with IAM's wildcard characters made literal (``${*}``, ``${?}``, ``${$}``)."""
    return "".join("${" + c + "}" if c in "*?$" else c for c in text)


POLICY_MAX_CHARS = 2048  # STS refuses a longer inline session policy


def table_policy(location: str, *, write: bool) -> str:
    """The session policy for one table: objects under its location (``GetObject``; with
    ``write`` also ``PutObject`` and ``DeleteObject``) and listing only under it. The prefix
    ends in ``/`` and wildcards in it are literal, so no name opens a sibling (``t`` never
    opens ``t_new``)."""
    bucket, prefix = table_prefix(location)
    under = _iam_literal(prefix) + "*"
    actions = ["s3:GetObject", *(["s3:PutObject", "s3:DeleteObject"] if write else [])]
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": actions, "Resource": [f"arn:aws:s3:::{bucket}/{under}"]},
            {
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{bucket}"],
                "Condition": {"StringLike": {"s3:prefix": [under]}},
            },
            {"Effect": "Allow", "Action": ["s3:GetBucketLocation"], "Resource": [f"arn:aws:s3:::{bucket}"]},
        ],
    }
    text = json.dumps(policy, separators=(",", ":"))
    if len(text) > POLICY_MAX_CHARS:
        raise MalformedRequestError(
            f"table location {location} is too long for a storage session policy ({len(text)} characters, "
            f"STS takes {POLICY_MAX_CHARS}); give the table a shorter location"
        )
    return text


@dataclass(frozen=True, slots=True)
class Scoped:
    """Credentials for one table: the ``config`` keys and when they expire."""

    config: dict[str, str]
    expires_at_ms: int
    made: bool  # made by this call (not from the cache): to be recorded


class ScopedVendor:
    """Credentials for one table (:func:`table_policy`) from STS ``AssumeRole`` with the
    configured role, made once per (table location, read or write) and shared until a quarter of
    their lifetime is left."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, bool], tuple[float, Scoped]] = {}
        self.calls = 0  # AssumeRole calls made (for /metrics and the benchmark)

    def cached(self, location: str, *, write: bool) -> Scoped | None:
        """The table's credentials if they are cached and fresh (None: they must be made)."""
        with self._lock:
            renew_at, cached = self._cache.get((location, write), (0.0, None))
            if cached is not None and time.monotonic() < renew_at:
                return Scoped(cached.config, cached.expires_at_ms, made=False)
        return None

    def credentials(self, location: str, *, write: bool) -> Scoped:
        key = (location, write)
        cached = self.cached(location, write=write)
        if cached is not None:
            return cached
        made = self._assume(location, write)  # outside the lock: other tables' loads go on meanwhile
        lifetime_s = (made.expires_at_ms / 1000) - time.time()  # as STS gave it (it may shorten what was asked)
        with self._lock:
            self._cache[key] = (time.monotonic() + 0.75 * lifetime_s, made)
            if len(self._cache) > 100_000:  # bounded: the oldest half goes
                for old in list(self._cache)[: len(self._cache) // 2]:
                    del self._cache[old]
        return made

    def check(self, warehouse: str) -> None:
        """At start: a role STS refuses is a configuration error (one line, the server does not
        start); an STS out of reach is not (loads get a 503 until it answers)."""
        import botocore.exceptions

        from icebarrier.apps.catalog.errors import StorageUnavailableError

        try:
            self._assume(warehouse, False, raising=True)
        except botocore.exceptions.ClientError as exc:
            raise ConfigurationError(
                f"[storage.sessions] role-arn {self.storage.session_role_arn}: STS at "
                f"{self.storage.sts_endpoint or 'AWS'} refused to assume it ({exc.response['Error'].get('Message') or exc}); "
                f"fix role-arn, or let the role trust the server's keys"
            ) from None
        except (botocore.exceptions.BotoCoreError, StorageUnavailableError):
            pass

    def _assume(self, location: str, write: bool, *, raising: bool = False) -> Scoped:
        import boto3
        import botocore.exceptions
        from botocore.config import Config

        from icebarrier.apps.catalog.errors import StorageUnavailableError

        storage = self.storage
        sts = boto3.client(
            "sts",
            endpoint_url=storage.sts_endpoint,
            region_name=storage.properties.get(s3.REGION) or "us-east-1",
            aws_access_key_id=storage.properties.get(s3.ACCESS_KEY_ID),
            aws_secret_access_key=storage.properties.get(s3.SECRET_ACCESS_KEY),
            aws_session_token=storage.properties.get(s3.SESSION_TOKEN),
            # a load waits on it: an STS out of reach is a 503 within seconds, not after minutes of retries
            config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 2, "mode": "standard"}),
        )
        self.calls += 1
        try:
            made = sts.assume_role(
                RoleArn=storage.session_role_arn,
                RoleSessionName=f"icebarrier-{'write' if write else 'read'}",
                Policy=table_policy(location, write=write),
                **({"DurationSeconds": storage.session_duration_s} if storage.session_duration_asked else {}),
            )["Credentials"]
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            if raising:
                raise
            raise StorageUnavailableError(
                f"STS at {storage.sts_endpoint or 'AWS'} refused to assume role {storage.session_role_arn} "
                f"({exc}); fix [storage.sessions] role-arn (the role must trust the server's keys)"
            ) from None
        expires_at_ms = int(made["Expiration"].timestamp() * 1000)
        config = {
            s3.ACCESS_KEY_ID: made["AccessKeyId"],
            s3.SECRET_ACCESS_KEY: made["SecretAccessKey"],
            s3.SESSION_TOKEN: made["SessionToken"],
            s3.SESSION_TOKEN_EXPIRES_AT_MS: str(expires_at_ms),
        }
        return Scoped(config, expires_at_ms, made=True)


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
