"""What the maintenance service keeps, what it did and what it saw (DESIGN.md, "The lake
maintains itself"; migration 0019).

A table's :class:`Policy` is its own settings over the defaults (the view
``maintenance_policies`` holds the defaults, once); setting it is the admin's and audited.
Each action the service takes is recorded per table (:func:`record`: the last run, counts per
result, and an audit event), and after each look at a table what it saw and what it will do
next (:func:`observe`). Readers see all three in the view ``table_maintenance``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from icebarrier.control_plane.db import Conn, call, one
from icebarrier.control_plane.errors import InvalidValueError
from icebarrier.control_plane.model import TableName

ACTIONS = ("expire", "compact", "rewrite-manifests", "remove-orphans")
RESULTS = ("done", "gave-way", "failed")
# what `set_policy` takes: the policy's field, and its least value
SETTINGS = {
    "enabled": None,
    "retain_s": 0,
    "retain_last": 1,
    "target_file_size": 1 << 20,
    "compact_min_files": 2,
    "max_manifests": 2,
    "orphan_grace_s": 60,
    # a commit writes its manifests first and may retry for up to COMMIT_RETRY_S keeping them
    "metadata_grace_s": 120,
}
# How long a commit to a managed table may retry (its ``commit.retry.total-timeout-ms``): the
# least metadata grace, so that no commit in flight loses a manifest it wrote.
COMMIT_RETRY_S = 120


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """A table's effective maintenance policy (``own``: the settings it sets itself; the rest
    are defaults)."""

    table: TableName
    enabled: bool
    retain_s: float  # snapshots older than this expire, outside the protected set
    retain_last: int  # the newest this many snapshots stay whatever their age
    target_file_size: int  # bytes: compaction writes files of this size
    compact_min_files: int  # compact when the current snapshot has this many small data files
    max_manifests: int  # rewrite manifests when the current snapshot has more than this many
    orphan_grace_s: float  # an unreferenced data file is removed after this long
    metadata_grace_s: float  # an unreferenced metadata file is removed after this long
    own: tuple[str, ...] = ()

    def small(self, size_bytes: int) -> bool:
        """Whether a data file of ``size_bytes`` is small (compaction rewrites it)."""
        return size_bytes < self.target_file_size * 3 // 4

    def to_json(self) -> dict:
        return {
            "table": str(self.table),
            "enabled": self.enabled,
            "retain_s": self.retain_s,
            "retain_last": self.retain_last,
            "target_file_size": self.target_file_size,
            "compact_min_files": self.compact_min_files,
            "max_manifests": self.max_manifests,
            "orphan_grace_s": self.orphan_grace_s,
            "metadata_grace_s": self.metadata_grace_s,
            "own": list(self.own),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Status:
    """A table's policy, what the service saw at its last look and its actions' last runs."""

    policy: Policy
    managed: bool = True  # False: a table of the catalog no job writes (maintained all the same)
    checked_at: datetime | None = None
    seen: dict = field(default_factory=dict)  # snapshots, data_files, small_files, manifests, metadata_bytes
    next: str | None = None
    actions: dict = field(default_factory=dict)  # action -> {at, result, detail, done, gave_way, failed}
    files: Files | None = None  # the files under the table, at its last orphan removal

    def to_json(self) -> dict:
        return {
            "policy": self.policy.to_json(),
            "managed": self.managed,
            "checked_at": self.checked_at.isoformat() if self.checked_at else None,
            "seen": self.seen,
            "next": self.next,
            "actions": self.actions,
            "files": self.files.to_json() if self.files is not None else None,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Files:
    """The files under a table's location, as an orphan removal counted them after it removed
    what it removed: under the metadata folder, and the rest (data files)."""

    metadata: int
    data: int | None  # None: not listed at this pass (one over the metadata folder only)
    counted_at: datetime | None = None

    def to_json(self) -> dict:
        return {
            "metadata": self.metadata,
            "data": self.data,
            "counted_at": self.counted_at.isoformat() if self.counted_at else None,
        }


_POLICY = (
    "SELECT table_name, enabled, retain_s, retain_last, target_file_size, compact_min_files, max_manifests, "
    "orphan_grace_s, metadata_grace_s, own, checked_at, snapshots, data_files, small_files, manifests, "
    "metadata_bytes, next, actions, managed, metadata_files, data_files_under, orphans_checked_at "
    "FROM table_maintenance"
)
_SEEN = ("snapshots", "data_files", "small_files", "manifests", "metadata_bytes")


def _status(row: dict) -> Status:
    policy = Policy(
        table=TableName.parse(row["table_name"]),
        enabled=row["enabled"],
        retain_s=float(row["retain_s"]),
        retain_last=row["retain_last"],
        target_file_size=row["target_file_size"],
        compact_min_files=row["compact_min_files"],
        max_manifests=row["max_manifests"],
        orphan_grace_s=float(row["orphan_grace_s"]),
        metadata_grace_s=float(row["metadata_grace_s"]),
        own=tuple(row["own"]),
    )
    seen = {k: row[k] for k in _SEEN} if row["checked_at"] is not None else {}
    return Status(
        policy=policy,
        managed=row["managed"],
        checked_at=row["checked_at"],
        seen=seen,
        next=row["next"],
        actions=row["actions"],
        files=Files(metadata=row["metadata_files"], data=row["data_files_under"], counted_at=row["orphans_checked_at"])
        if row["orphans_checked_at"] is not None
        else None,
    )


class Marks(NamedTuple):
    """What changes when any table's policy changes (``policies``), and when a table becomes
    managed or stops being managed (``managed``): the service reads every status, or the
    catalog's managed names, only when its marks moved."""

    policies: str
    managed: str


def marks(conn: Conn) -> Marks:
    row = one(
        conn.execute(
            "SELECT (SELECT count(*) || '/' || coalesce(max(updated_at)::text, '') FROM maintenance_policy) AS policies, "
            "(SELECT count(*) || '/' || coalesce(max(table_id), 0) FROM managed_table) AS managed"
        )
    )
    return Marks(row["policies"], row["managed"])


def enroll_unmanaged(conn: Conn, names: list[TableName]) -> None:
    """The catalog's tables no job writes are exactly ``names``: each is maintained like a managed
    one (its policy, actions and looks kept by id), those gone from the catalog are forgotten."""
    with conn.transaction():
        call(conn, "enroll_unmanaged_tables", [str(n) for n in names])


def enroll(conn: Conn, name: TableName) -> None:
    """Maintain ``name``, a table of the catalog no job writes, from now on (a managed table
    already is)."""
    with conn.transaction():
        call(conn, "enroll_unmanaged_table", str(name))


def statuses(conn: Conn, names: list[TableName] | None = None) -> list[Status]:
    """Every maintained table's maintenance, managed or not (or the named ones, in name order)."""
    if names is None:
        rows = conn.execute(f"{_POLICY} ORDER BY table_name").fetchall()
    else:
        rows = conn.execute(
            f"{_POLICY} WHERE table_name = ANY(%s) ORDER BY table_name", ([str(n) for n in names],)
        ).fetchall()
    return [_status(r) for r in rows]


def counts(actions: dict) -> list[tuple[str, str, int]]:
    """(action, result, how many so far) from a table's ``actions`` (as ``table_maintenance``
    and :attr:`Status.actions` hold them: a result's count is under its name with ``_``)."""
    return [(action, result, last[result.replace("-", "_")]) for action, last in actions.items() for result in RESULTS]


def set_policy(conn: Conn, table: TableName, settings: dict) -> Policy:
    """Set some of ``table``'s policy (keys of :data:`SETTINGS`; a value of None returns that
    setting to the default). Audited when it changes anything. The admin's."""
    for key, value in settings.items():
        if key not in SETTINGS:
            raise InvalidValueError(f"maintenance setting {key!r} is unknown; use one of {', '.join(SETTINGS)}")
        least = SETTINGS[key]
        if value is not None and least is not None and value < least:
            raise InvalidValueError(f"maintenance setting {key} of {table} must be at least {least} (got {value:g})")
    with conn.transaction():
        call(conn, "set_maintenance_policy", str(table), json.dumps(settings))
    return statuses(conn, [table])[0].policy


def record(conn: Conn, table: TableName, action: str, result: str, detail: dict) -> None:
    """One action on ``table``: its last run and counts, and an audit event (the admin's)."""
    assert action in ACTIONS and result in RESULTS, (action, result)
    with conn.transaction():
        call(conn, "record_maintenance", str(table), action, result, json.dumps(detail))


def observe(conn: Conn, table: TableName, seen: dict, next_: str, files: Files | None = None) -> None:
    """What the service saw of ``table`` at this look, and what it will do next; ``files``: what
    an orphan removal at this look counted (kept from an earlier one if None)."""
    conn.execute(
        "INSERT INTO maintenance_table (table_id, checked_at, snapshots, data_files, small_files, manifests, "
        "metadata_bytes, next, metadata_files, data_files_under, orphans_checked_at) "
        "SELECT table_id, now(), %(snapshots)s, %(data_files)s, %(small_files)s, %(manifests)s, %(metadata_bytes)s, "
        "%(next)s, %(metadata_files)s, %(data_files_under)s, CASE WHEN %(counted)s THEN now() END "
        "FROM (SELECT maintained_table_id(%(table)s) AS table_id) t WHERE table_id IS NOT NULL "
        "ON CONFLICT (table_id) DO UPDATE SET checked_at = EXCLUDED.checked_at, snapshots = EXCLUDED.snapshots, "
        "data_files = EXCLUDED.data_files, small_files = EXCLUDED.small_files, manifests = EXCLUDED.manifests, "
        "metadata_bytes = EXCLUDED.metadata_bytes, next = EXCLUDED.next, "
        "metadata_files = coalesce(EXCLUDED.metadata_files, maintenance_table.metadata_files), "
        "data_files_under = coalesce(EXCLUDED.data_files_under, maintenance_table.data_files_under), "
        "orphans_checked_at = coalesce(EXCLUDED.orphans_checked_at, maintenance_table.orphans_checked_at)",
        {
            **{k: seen[k] for k in _SEEN},
            "next": next_,
            "table": str(table),
            "metadata_files": files.metadata if files is not None else None,
            "data_files_under": files.data if files is not None else None,
            "counted": files is not None,
        },
    )
