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

Every client gets the endpoint, region and path style (no secret). ``remote-signing`` is not
offered: a client asking only for it gets the same answer as one asking for nothing, as the
spec allows. What a server with STS would do instead is in docs/storage.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header

from icebarrier.apps.catalog.errors import MalformedRequestError
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

    def config(self, storage: Storage, location: str, *, reader: bool) -> dict[str, str]:
        """The ``config`` of a LoadTableResult for a table at ``location``."""
        if not is_object_storage(location):
            return {}
        if VENDED_CREDENTIALS in self.modes:
            return storage.vended(reader=reader)
        return storage.public()


async def delegation(x_iceberg_access_delegation: Annotated[str | None, Header()] = None) -> Delegation:
    return Delegation.parse(x_iceberg_access_delegation)


Access = Annotated[Delegation, Depends(delegation)]
