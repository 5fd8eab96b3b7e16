"""Barrier-tagged commits: exactly once per (table, barrier).

A :class:`BarrierCommit` gathers one job's writes for one barrier. Each write carries
``icebarrier.barrier``, ``icebarrier.job`` and ``icebarrier.run`` in its snapshot summary.
Before writing a table it checks the control plane (barrier already completed: nothing to
do), then the table's lineage for a snapshot carrying the barrier (a crash after the
Iceberg commit and before the control-plane record) and adopts it instead of writing
again. On success it completes the barrier for all the job's sinks in one control-plane
transaction; tables that were not written keep their snapshot.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from icebarrier.control_plane import db, jobs
from icebarrier.control_plane.errors import IcebarrierError, NotASinkError
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import (
    SUMMARY_BARRIER,
    SUMMARY_COALESCED_AFTER,
    SUMMARY_JOB,
    SUMMARY_RUN,
    ensure_managed_properties,
    find_barrier_commit,
    load_table,
    publish_barrier,
    retry_commit,
    stages_commits,
    summary_properties,
)

if TYPE_CHECKING:
    from pyiceberg.table import Table

_CHANGE_COUNTERS = ("added-data-files", "deleted-data-files", "added-delete-files", "removed-delete-files")


def _changes_nothing(snapshot) -> bool:
    """An append/overwrite snapshot that added and removed no file (and has a parent to return to)."""
    if snapshot is None or snapshot.parent_snapshot_id is None or snapshot.summary is None:
        return False
    props = summary_properties(snapshot)
    return snapshot.summary.operation.value in ("append", "overwrite") and all(
        int(props.get(k, "0")) == 0 for k in _CHANGE_COUNTERS
    )


class DuplicateWriteError(IcebarrierError):
    def __init__(self, job: str, table: TableName, barrier: int) -> None:
        super().__init__(
            f"job {job} already wrote {table} for barrier {barrier}; a (table, barrier) has one commit. "
            f"Combine the writes into one (e.g. a single overwrite or MERGE)"
        )


class BarrierCommit:
    """One job's writes for one barrier; use as a context manager. With ``coalesce_after`` (the
    job's progress P) the writes cover every barrier after P up to this one, which the
    completion coalesces; each snapshot says so (``icebarrier.coalesced-after``)."""

    def __init__(
        self,
        conn: db.Conn,
        catalog,
        *,
        job: str,
        barrier: int,
        run_id: str | None = None,
        job_info: jobs.JobInfo | None = None,
        coalesce_after: int | None = None,
    ):
        self.conn, self.catalog, self.job, self.barrier = conn, catalog, job, barrier
        self.coalesce_after = coalesce_after
        self.run_id = run_id or uuid.uuid4().hex
        self.commits: dict[TableName, int] = {}
        self.adopted: set[TableName] = set()
        self._loaded: dict[TableName, Table] = {}
        info = job_info or jobs.show(conn, job)
        self.sinks = frozenset(info.definition.sinks)
        # Already completed (a replay of a finished barrier): every write is skipped.
        self.already_completed = info.progress is not None and info.start_barrier <= barrier <= info.progress
        self.completion: jobs.Completion | None = None
        # Through `icebarrier serve`, a multi-sink job's commits are staged until it publishes
        # the barrier: all sinks' pointers and the completion then land in one transaction.
        self.staging = stages_commits(catalog, self.sinks)
        self.staged = False

    @property
    def properties(self) -> dict[str, str]:
        """The snapshot summary properties every write of this barrier carries."""
        coalesced = {} if self.coalesce_after is None else {SUMMARY_COALESCED_AFTER: str(self.coalesce_after)}
        return {SUMMARY_BARRIER: str(self.barrier), SUMMARY_JOB: self.job, SUMMARY_RUN: self.run_id, **coalesced}

    def write(
        self,
        table: TableName,
        do_write: Callable[[dict[str, str]], Table | None],
        extra: Mapping[str, str] | None = None,
    ) -> int | None:
        """Write ``table`` once for this barrier with ``do_write(properties)`` (``extra``: more
        summary properties for this write); returns the snapshot id. ``do_write`` returns the
        PyIceberg table it committed through (its metadata is then the commit's), or None
        (an engine wrote it: the table is loaded again).

        Skips the write if the barrier is already completed or if the table already holds a
        snapshot for it (adopted). Returns None when the write produced no snapshot.
        """
        if table not in self.sinks:
            raise NotASinkError(self.job, [str(table)])
        if table in self.commits or table in self.adopted:
            raise DuplicateWriteError(self.job, table, self.barrier)
        if self.already_completed:
            self.adopted.add(table)
            return None
        tbl = ensure_managed_properties(load_table(self.catalog, table))
        existing = find_barrier_commit(tbl, self.barrier)
        if existing is not None:
            self.staged = self.staged or self.staging
            self.adopted.add(table)
            self.commits[table] = existing
            return existing
        self._loaded[table] = tbl  # the first attempt writes on it; a retry loads again
        try:
            committed = retry_commit(lambda: do_write({**(extra or {}), **self.properties}))
        finally:
            self._loaded.pop(table, None)
        faults.point(faults.AFTER_ICEBERG_COMMIT)
        tbl = committed if committed is not None and not self.staging else load_table(self.catalog, table)
        written = find_barrier_commit(tbl, self.barrier)
        self.staged = self.staged or (self.staging and written is not None)
        if written is not None and _changes_nothing(tbl.snapshot_by_id(written)):
            # Engines commit a snapshot even for an empty write; a barrier that changes nothing
            # writes no snapshot, so step back to the parent (cheaper than probing the data first).
            parent = tbl.snapshot_by_id(written).parent_snapshot_id
            retry_commit(
                lambda: (
                    load_table(self.catalog, table).manage_snapshots().set_current_snapshot(snapshot_id=parent).commit()
                )
            )
            written = None
        if written is not None:
            self.commits[table] = written
        return written

    def _table(self, table: TableName) -> Table:
        """The table for a PyIceberg write's attempt: as :meth:`write` loaded it, then reloaded."""
        return self._loaded.pop(table, None) or load_table(self.catalog, table)

    def complete(self) -> jobs.Completion:
        """Record the barrier for all the job's sinks (idempotent for a replayed barrier)."""
        if self.already_completed:
            self.completion = jobs.Completion(
                job=self.job, barrier=self.barrier, commits={}, sinks=tuple(sorted(self.sinks)), noop=True
            )
        else:
            if self.staged:
                publish_barrier(self.catalog, self.sinks)  # completes the barrier with the pointer swaps
            self.completion = jobs.complete(
                self.conn,
                self.job,
                self.barrier,
                self.commits,
                run_id=self.run_id,
                coalesce=self.coalesce_after is not None,
            )
        faults.point(faults.AFTER_CONTROL_PLANE)
        return self.completion

    def __enter__(self) -> BarrierCommit:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.complete()

    # -- PyIceberg writes (no JVM) ----------------------------------------------------------------

    def append_arrow(self, table: TableName, data, properties: Mapping[str, str] | None = None) -> int | None:
        """Append a PyArrow table (an empty one writes no snapshot; ``properties``: more summary properties)."""
        if data.num_rows == 0:
            return self.write(table, lambda props: None)

        def append(props: dict[str, str]) -> Table:
            tbl = self._table(table)
            tbl.append(data, snapshot_properties=props)
            return tbl

        return self.write(table, append, properties)

    def overwrite_arrow(self, table: TableName, data, overwrite_filter=None) -> int | None:
        """Replace the table's rows (or those matching ``overwrite_filter``) with ``data``."""
        from pyiceberg.expressions import AlwaysTrue

        def overwrite(props: dict[str, str]) -> Table:
            tbl = self._table(table)
            tbl.overwrite(data, overwrite_filter=overwrite_filter or AlwaysTrue(), snapshot_properties=props)
            return tbl

        return self.write(table, overwrite)
