"""What a catalog client's warehouse means (DESIGN.md, "The consistent catalog").

| warehouse                   | every managed table loaded through it is at                      |
|-----------------------------|------------------------------------------------------------------|
| ``latest``                  | its current snapshot; the only warehouse that accepts writes     |
| ``read-committed``          | the newest cut over all managed tables, stable per session       |
| ``read-committed:<ns>``     | the same over the managed tables of namespace ``<ns>``           |
| ``barrier-<B>``             | ``S(T, B)``                                                      |
| ``lease-<ID>``              | the lease's cut; each load renews the lease                      |
| ``job``, ``job:<JOB>``      | the job session of the token's job (an admin token names JOB):   |
|                             | sources at ``S(T, B)`` of the session's barrier B, sinks with    |
|                             | what the session staged; writes to the sinks are staged for B    |
| ``job:<JOB>@<RUN>``         | the same, for as long as run RUN (``job exec``) holds the session |

``<ns>`` is written as icebarrier writes names: ``a.b`` is two levels, ```a.b``` one.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from icebarrier.control_plane.errors import InvalidNameError, InvalidValueError
from icebarrier.control_plane.model import check_namespace, parse_job_name, quote_name, split_name

_RUN = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class Warehouse:
    kind: str  # latest, read-committed, barrier, lease or job
    namespace: str | None = None  # read-committed:<namespace>
    barrier: int | None = None
    lease_id: str | None = None
    job: str | None = None  # job:<JOB>
    run_id: str | None = None  # job:<JOB>@<RUN>: the run of `icebarrier job exec` that holds the session

    @property
    def lease(self) -> str:
        """The lease of a ``lease-<ID>`` warehouse."""
        if self.lease_id is None:
            raise ValueError(f"warehouse {self} names no lease")
        return self.lease_id

    @property
    def writable(self) -> bool:
        return self.kind in ("latest", "job")

    @classmethod
    def parse(cls, text: str) -> Warehouse:
        if text == "latest":
            return cls("latest")
        if text == "read-committed":
            return cls("read-committed")
        if text.startswith("read-committed:") and (levels := split_name(text.removeprefix("read-committed:"))):
            try:
                return cls("read-committed", namespace=quote_name(check_namespace(levels)))
            except InvalidNameError:
                pass
        if text.startswith("barrier-") and text.removeprefix("barrier-").isdigit():
            barrier = int(text.removeprefix("barrier-"))
            if 0 < barrier < 2**63:
                return cls("barrier", barrier=barrier)
        if text == "job":
            return cls("job")
        if text.startswith("job:"):
            job, at, run_id = text.removeprefix("job:").partition("@")
            try:
                if not at or _RUN.fullmatch(run_id):
                    return cls("job", job=parse_job_name(job), run_id=run_id or None)
            except InvalidValueError:
                pass
        if text.startswith("lease-"):
            try:
                return cls("lease", lease_id=str(uuid.UUID(text.removeprefix("lease-"))))
            except ValueError:
                pass
        raise InvalidValueError(
            f"warehouse {text!r} is unknown; use latest, read-committed, read-committed:<namespace>, "
            f"barrier-<B>, lease-<ID>, or job (job:<JOB>) for a job's session"
        )

    def __str__(self) -> str:
        if self.kind == "read-committed" and self.namespace:
            return f"read-committed:{self.namespace}"
        if self.kind == "barrier":
            return f"barrier-{self.barrier}"
        if self.kind == "lease":
            return f"lease-{self.lease_id}"
        if self.kind == "job" and self.job:
            return f"job:{self.job}" + (f"@{self.run_id}" if self.run_id else "")
        return self.kind
