"""Cut resolution and protected sets. Pure: values in, values out, no I/O.

A table T has completed barrier B iff ``start(T) <= B <= W(T)``. A cut at B over tables X is
valid iff every table in X has completed B, so the valid barriers over X form the interval
``[max start, min W]`` and the latest valid cut is at ``min W``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from icebarrier.control_plane.errors import BarrierNotValidError, NoValidCutError
from icebarrier.control_plane.model import ProtectedSnapshot, TableState


def latest_valid_barrier(states: Sequence[TableState]) -> int:
    """The newest barrier every table in ``states`` has completed."""
    names = [str(s.name) for s in states]
    if not states:
        raise NoValidCutError(names, "no tables given")
    not_started = [str(s.name) for s in states if s.watermark is None]
    if not_started:
        raise NoValidCutError(names, f"{', '.join(not_started)} completed no barrier yet; wait for its job",
                              holding={t: "has completed no barrier yet" for t in not_started})
    lowest = min(s.watermark for s in states)
    newest_start = max(s.start_barrier for s in states)
    if newest_start > lowest:
        late = [s for s in states if s.start_barrier > lowest]
        early = [str(s.name) for s in states if s.watermark == lowest]
        raise NoValidCutError(
            names,
            f"{', '.join(str(s.name) for s in late)} started after barrier {lowest}, the newest completed by "
            f"{', '.join(early)}; wait until those catch up",
            holding={str(s.name): f"started at barrier {s.start_barrier}, after barrier {lowest}" for s in late},
        )
    return lowest


def check_valid_at(states: Sequence[TableState], barrier: int) -> None:
    """Raise :class:`BarrierNotValidError` naming each table that has not completed ``barrier``."""
    reasons = {}
    for s in states:
        if s.has_completed(barrier):
            continue
        if s.watermark is None:
            reasons[str(s.name)] = "has completed no barrier yet"
        elif barrier > s.watermark:
            reasons[str(s.name)] = f"has only completed up to {s.watermark}"
        else:
            reasons[str(s.name)] = f"started at barrier {s.start_barrier}"
    if reasons:
        raise BarrierNotValidError(barrier, reasons)


def protected_set(
    *,
    current: int | None,
    leases: Iterable[tuple[str, int | None]] = (),
    job_progress: Iterable[tuple[str, int | None]] = (),
    read_window: Iterable[int | None] = (),
    retained: Iterable[int] = (),
    tagged: Iterable[tuple[str, int]] = (),
) -> dict[int, ProtectedSnapshot]:
    """Snapshot id -> why it must not be expired (DESIGN.md, "Leases and snapshot retention").

    ``leases`` are (lease id, snapshot) of live leases, ``job_progress`` (downstream job,
    snapshot at its last completed barrier), ``read_window`` the snapshots a read-committed
    reader may resolve right now, ``retained`` what the retention policy keeps and ``tagged``
    (ref name, snapshot) of Iceberg tags and branches.
    """
    reasons: dict[int, list[str]] = {}

    def add(snapshot_id: int | None, reason: str) -> None:
        if snapshot_id is not None:
            reasons.setdefault(snapshot_id, []).append(reason)

    add(current, "current")
    for lease_id, snapshot_id in leases:
        add(snapshot_id, f"lease:{lease_id}")
    for job, snapshot_id in job_progress:
        add(snapshot_id, f"job:{job}")
    for snapshot_id in read_window:
        add(snapshot_id, "read-committed")
    for snapshot_id in retained:
        add(snapshot_id, "retention")
    for ref, snapshot_id in tagged:
        add(snapshot_id, f"ref:{ref}")
    return {
        sid: ProtectedSnapshot(snapshot_id=sid, reasons=tuple(dict.fromkeys(rs)))
        for sid, rs in sorted(reasons.items())
    }


def removable(candidates: Iterable[int], protected: Iterable[int]) -> list[int]:
    """The candidates expiry may remove: those outside the protected set."""
    keep = set(protected)
    return sorted({c for c in candidates if c not in keep})
