"""Cut resolution and protected sets. Pure: values in, values out, no I/O.

A table T has completed barrier B iff ``start(T) <= B <= W(T)`` and B is not coalesced in T
(DESIGN.md, "Cost follows change"). A cut at B over tables X is valid iff every table in X
has completed B. Without coalescing the valid barriers form ``[max start, min W]``; with it,
the latest valid cut is at ``min W`` or below, at the start of a coalesced range (and never
below the newest anchor every table has passed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from icebarrier.control_plane.errors import BarrierNotValidError, NoValidCutError
from icebarrier.control_plane.model import ProtectedSnapshot, TableState


def latest_valid_barrier(states: Sequence[TableState], bound: int | None = None, *, check_starts: bool = True) -> int:
    """The newest barrier at or below ``bound`` (default: the lowest watermark) that every table in
    ``states`` has completed. Each step moves below what keeps the candidate from being valid:
    a table's watermark, or the start of the coalesced range holding it. ``check_starts``
    False: tables count as started since ever (the floor of a read-committed cut over any of
    them, which the read-committed window protects)."""
    if not check_starts:
        states = [replace(s, start_barrier=-1) if s.start_barrier is not None else s for s in states]
    names = [str(s.name) for s in states]
    if not states:
        raise NoValidCutError(names, "no tables given")
    not_started = [str(s.name) for s in states if s.watermark is None]
    if not_started:
        raise NoValidCutError(
            names,
            f"{', '.join(not_started)} completed no barrier yet; wait for its job",
            holding={t: "has completed no barrier yet" for t in not_started},
        )
    spans = [(s, *s.span) for s in states]  # (state, start, watermark): each has completed a barrier
    lowest = min(watermark for _, _, watermark in spans)
    barrier = lowest if bound is None else bound
    while True:
        late = [s for s, start, _ in spans if start > barrier]
        if late:
            early = [str(s.name) for s in states if s.watermark == lowest]
            newest = (
                f"the newest completed by {', '.join(early)}"
                if barrier == lowest
                else "the newest the others completed together (coalesced ranges hold the ones after it)"
            )
            raise NoValidCutError(
                names,
                f"{', '.join(str(s.name) for s in late)} started after barrier {barrier}, {newest}; "
                f"wait until those catch up",
                holding={str(s.name): f"started at barrier {s.start_barrier}, after barrier {barrier}" for s in late},
            )
        lower = [
            watermark if barrier > watermark else s.holding(barrier)[0]
            for s, _, watermark in spans
            if not s.has_completed(barrier)
        ]
        if not lower:
            return barrier
        barrier = min(lower)


def earliest_valid_barrier(states: Sequence[TableState], bound: int) -> int | None:
    """The oldest barrier at or above ``bound`` that every table has completed (None: none yet)."""
    if any(s.watermark is None for s in states):
        return None
    spans = [(s, *s.span) for s in states]  # (state, start, watermark)
    barrier = bound
    while True:
        if any(barrier > watermark for _, _, watermark in spans):
            return None
        higher = [
            start if barrier < start else s.holding(barrier)[1] for s, start, _ in spans if not s.has_completed(barrier)
        ]
        if not higher:
            return barrier
        barrier = max(higher)


def check_valid_at(
    states: Sequence[TableState],
    barrier: int,
    nearest: tuple[int | None, int | None] | None = None,
) -> None:
    """Raise :class:`BarrierNotValidError` naming each table that has not completed ``barrier``
    and the nearest valid cuts (``nearest``, else computed from ``states``)."""
    reasons = {}
    for s in states:
        if s.has_completed(barrier):
            continue
        coalesced = s.coalesced_at(barrier)
        if s.watermark is None:
            reasons[str(s.name)] = "has completed no barrier yet"
        elif barrier > s.watermark:
            reasons[str(s.name)] = f"has only completed up to {s.watermark}"
        elif coalesced is not None:
            reasons[str(s.name)] = (
                f"coalesced it into barrier {coalesced[1]} (its state between barriers "
                f"{coalesced[0]} and {coalesced[1]} is not kept)"
            )
        else:
            reasons[str(s.name)] = f"started at barrier {s.start_barrier}"
    if reasons:
        if nearest is None:
            try:
                before = latest_valid_barrier(states, barrier)
            except NoValidCutError:
                before = None
            nearest = (before, earliest_valid_barrier(states, barrier))
        raise BarrierNotValidError(barrier, reasons, nearest=nearest)


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
        sid: ProtectedSnapshot(snapshot_id=sid, reasons=tuple(dict.fromkeys(rs))) for sid, rs in sorted(reasons.items())
    }


def removable(candidates: Iterable[int], protected: Iterable[int]) -> list[int]:
    """The candidates expiry may remove: those outside the protected set."""
    keep = set(protected)
    return sorted({c for c in candidates if c not in keep})
