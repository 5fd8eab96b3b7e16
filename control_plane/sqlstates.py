"""The SQLSTATEs the control-plane functions raise (class IB), mapped back to icebarrier's errors:
the functions put the ids in the error's DETAIL as JSON; each entry builds the error from (detail,
the function's own message). One registry, like ``psycopg.errors.lookup``; :mod:`.db` raises what
it gives."""

from __future__ import annotations

import json
from collections.abc import Callable

from icebarrier.control_plane.cuts import check_valid_at, latest_valid_barrier
from icebarrier.control_plane.errors import (
    BarrierError,
    BarrierNotIssuedError,
    BarrierOutOfOrderError,
    CoalesceAcrossAnchorError,
    CompletionConflictError,
    IcebarrierError,
    InvalidValueError,
    JobDefinitionError,
    JobNotFoundError,
    LeaseExpiredError,
    LeaseNotFoundError,
    LockTimeoutError,
    NotASinkError,
    PermissionDeniedError,
    RevisionError,
    RevisionInProgressError,
    SelfReadError,
    SinkAlreadyOwnedError,
    SinkHistoryMismatchError,
    SnapshotExpiredError,
    SourcesNotReadyError,
    TableNotFoundError,
    TopologyCycleError,
)
from icebarrier.control_plane.model import TableName, TableState


def _cut_not_valid(d: dict, _message: str) -> IcebarrierError:
    """Say why a cut is not valid with the pure definitions (cuts.py), from the tables' progress."""
    states = [
        TableState(
            name=TableName.parse(s["name"]),
            start_barrier=s["start"],
            watermark=s["watermark"],
            coalesced=tuple(tuple(r) for r in s.get("coalesced", ())),
        )
        for s in d["states"]
    ]
    try:
        if d["barrier"] is None:
            latest_valid_barrier(states)
        else:
            check_valid_at(states, d["barrier"], nearest=tuple(d.get("nearest") or (None, None)))
    except IcebarrierError as exc:
        return exc
    return IcebarrierError(f"{_message} (the pure definition disagrees: a bug, please report it)")


SQLSTATES: dict[str, Callable[[dict, str], IcebarrierError]] = {
    "IB001": lambda d, m: JobNotFoundError(d["job"]),
    "IB002": lambda d, m: BarrierNotIssuedError(d["barrier"]),
    "IB003": lambda d, m: RevisionInProgressError(d["table"], d["revision_id"]),
    "IB004": lambda d, m: NotASinkError(d["job"], d["tables"]),
    "IB005": lambda d, m: SinkHistoryMismatchError(d["job"], d["watermarks"]),
    "IB006": lambda d, m: CompletionConflictError(d["job"], d["barrier"], d["recorded"], d["given"]),
    "IB007": lambda d, m: BarrierOutOfOrderError(
        d["job"],
        d["barrier"],
        d["expected"],
        d["watermark"],
        changed=d.get("changed"),
        coalesced_into=d.get("coalesced_into"),
    ),
    "IB008": lambda d, m: SourcesNotReadyError(d["job"], d["barrier"], d["waiting"], d.get("coalesced")),
    "IB009": lambda d, m: TableNotFoundError(d["table"]),
    "IB010": _cut_not_valid,
    "IB011": lambda d, m: SnapshotExpiredError(d["table"], int(d["snapshot_id"]), d.get("barrier")),
    "IB012": lambda d, m: LeaseNotFoundError(d["lease_id"]),
    "IB013": lambda d, m: LeaseExpiredError(d["lease_id"], d["state"]),
    "IB014": lambda d, m: InvalidValueError(m),
    "IB015": lambda d, m: JobDefinitionError(m),
    "IB016": lambda d, m: SelfReadError(d["job"], d["table"]),
    "IB017": lambda d, m: SinkAlreadyOwnedError(d["table"], d["owner"], d["job"]),
    "IB018": lambda d, m: TopologyCycleError(d["job"], d["path"]),
    "IB020": lambda d, m: RevisionError(m),
    "IB021": lambda d, m: BarrierError(m),
    "IB022": lambda d, m: CoalesceAcrossAnchorError(d["job"], d["barrier"], d["watermark"], d["anchor"]),
    "IB030": lambda d, m: PermissionDeniedError(d["role"], d["action"], d["job"], m),
    "IB040": lambda d, m: LockTimeoutError(d["what"], d["timeout"], d["holders"]),
}


def from_sqlstate(sqlstate: str | None, message: str, detail: str | None) -> IcebarrierError | None:
    """The error a control-plane function meant by raising ``sqlstate``, or None if not ours."""
    factory = SQLSTATES.get(sqlstate or "")
    if factory is None:
        return None
    return factory(json.loads(detail) if detail else {}, message)
