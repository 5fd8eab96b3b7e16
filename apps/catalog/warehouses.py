"""What a catalog client's warehouse means (DESIGN.md, "The consistent catalog").

| warehouse                   | every managed table loaded through it is at                      |
|-----------------------------|------------------------------------------------------------------|
| ``latest``                  | its current snapshot; the only warehouse that accepts writes     |
| ``read-committed``          | the newest cut over all managed tables, stable per session       |
| ``read-committed:<ns>``     | the same over the managed tables of namespace ``<ns>`` only      |
| ``barrier-<B>``             | ``S(T, B)``                                                      |
| ``lease-<ID>``              | the lease's cut; each load renews the lease                      |
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from icebarrier.control_plane.errors import InvalidValueError

_NAMESPACE = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*")


@dataclass(frozen=True, slots=True)
class Warehouse:
    kind: str  # latest, read-committed, barrier or lease
    namespace: str | None = None  # read-committed:<namespace>
    barrier: int | None = None
    lease_id: str | None = None

    @property
    def writable(self) -> bool:
        return self.kind == "latest"

    @classmethod
    def parse(cls, text: str) -> Warehouse:
        if text == "latest":
            return cls("latest")
        if text == "read-committed":
            return cls("read-committed")
        if text.startswith("read-committed:") and _NAMESPACE.fullmatch(text.removeprefix("read-committed:")):
            return cls("read-committed", namespace=text.removeprefix("read-committed:"))
        if text.startswith("barrier-") and text.removeprefix("barrier-").isdigit():
            barrier = int(text.removeprefix("barrier-"))
            if 0 < barrier < 2**63:
                return cls("barrier", barrier=barrier)
        if text.startswith("lease-"):
            try:
                return cls("lease", lease_id=str(uuid.UUID(text.removeprefix("lease-"))))
            except ValueError:
                pass
        raise InvalidValueError(
            f"warehouse {text!r} is unknown; use latest, read-committed, read-committed:<namespace>, "
            f"barrier-<B> or lease-<ID>")

    def __str__(self) -> str:
        if self.kind == "read-committed" and self.namespace:
            return f"read-committed:{self.namespace}"
        if self.kind == "barrier":
            return f"barrier-{self.barrier}"
        if self.kind == "lease":
            return f"lease-{self.lease_id}"
        return self.kind
