"""Commits through ``latest`` and ``job``: who may commit what, staging of a multi-sink
job's barrier, and the one transaction that swaps every staged pointer and completes it.
"""

from __future__ import annotations

from icebarrier.apps.catalog.errors import ForbiddenError
from icebarrier.apps.catalog.lake.core import java_name
from icebarrier.apps.catalog.lake.sessions import Sessions
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import db, job_sessions, jobs
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.control_plane.tokens import Principal
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import (
    SUMMARY_BARRIER,
    barrier_of,
    coalesced_after,
)


class Commits(Sessions):
    def commit(self, conn, warehouse: Warehouse, principal: Principal, changes: list) -> list:
        """Apply ``changes`` (:class:`~.models.CommitTableRequest`, each with its identifier)
        atomically; returns the (table, staged table) pairs. See the module docstring for who may
        commit what.

        Through a job session every change is to a sink and is staged for the session's barrier.
        Through latest, a multi-sink job's commits to its sinks are staged (only its own tokens
        see them) until it publishes the barrier. Either publishes with a transaction naming all
        the job's sinks with no changes."""
        from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
        from pyiceberg.table import Table
        from pyiceberg.table.update import AddSnapshotUpdate, AssertCreate, SetLocationUpdate, SetPropertiesUpdate

        session = self.session(conn, warehouse, principal) if warehouse.kind == "job" else None
        names = [self.table_name(c.identifier.namespace, c.identifier.name) for c in changes]
        empty = not any(c.updates or c.requirements for c in changes)  # a publish, if it names all the sinks
        # Each changed table's state (managed, writer, pointer) first: the job's definition (its
        # sinks) matters only where a managed table is written (a job's sinks are managed tables)
        # or for a publish, which reads no table's state.
        states = {} if empty else {table: self.table_state(conn, table) for table in names}
        definition = (
            jobs.load_definitions(conn, only=principal.job).get(principal.job)
            if principal.job and not session and (empty or any(s.managed for s in states.values()))
            else None
        )
        sinks = session.sinks if session else definition.sinks if definition else frozenset()
        whole = (session is not None or len(sinks) > 1) and set(names) == set(sinks)  # all the job's sinks at once
        if whole and empty:
            if session is not None:
                job_sessions.mark_succeeded(conn, session.job, warehouse.run_id)
                self.publish_session(conn, session.job, warehouse.run_id)
            else:
                self.publish(conn, principal.acting_job)
            return []
        staged, managed_barriers = [], {}
        for table, change in zip(names, changes):
            if session is not None:
                self.require_sink(conn, session, table)
                change = self.stamped(session, table, change)
            state = states.get(table) or self.table_state(conn, table)  # empty changes: not read yet
            managed = state.managed
            self.require_writer(principal, table, managed, state.writer)
            pending = self.staged(conn, principal.job, table) if managed else None
            if pending is not None:
                metadata, io = self.metadata(pending["metadata_location"])
                current = Table(table.identifier, metadata, pending["metadata_location"], io, self.catalog)
            elif state.location is not None:  # the pointer on this connection, the metadata from the cache
                metadata, io = self.metadata(state.location)
                current = Table(table.identifier, metadata, state.location, io, self.catalog)
            elif any(isinstance(r, AssertCreate) for r in change.requirements):
                current = None
            else:
                raise NoSuchTableError(f"Table does not exist: {java_name(table)}")
            try:
                try:
                    new = self.catalog._update_and_stage_table(
                        current, table.identifier, tuple(change.requirements), tuple(change.updates)
                    )
                except CommitFailedException:  # main moved: by maintenance alone, the commit is replayed on it
                    if (replayed := self.replayed(current, change)) is None:
                        raise
                    change = replayed
                    new = self.catalog._update_and_stage_table(
                        current, table.identifier, tuple(change.requirements), tuple(change.updates)
                    )
            except ValueError as exc:  # PyIceberg: an update that does not apply to the table as it is
                raise CommitFailedException(
                    f"the changes to {table} do not apply to its current metadata ({' '.join(str(exc).split())}); "
                    f"load the table again and retry"
                ) from None
            if current is not None and new.metadata == current.metadata:
                # nothing changed: nothing to write, and the answer is the table as it is (as PyIceberg's)
                new = current
            moved = any(isinstance(u, SetLocationUpdate) for u in change.updates)
            paths = {k: v for u in change.updates if isinstance(u, SetPropertiesUpdate) for k, v in u.updates.items()}
            self.confine(conn, table, new.metadata.location if moved else None, paths)
            added = [u.snapshot for u in change.updates if isinstance(u, AddSnapshotUpdate)]
            barrier = session.barrier if session else pending["barrier"] if pending else None
            if managed and added and session is None:
                marks = {b for s in added if (b := barrier_of(s)) is not None}
                if len(marks) != 1 or any(barrier_of(s) is None for s in added):
                    raise ForbiddenError(
                        f"a commit to managed table {table} must carry snapshot property "
                        f"{SUMMARY_BARRIER} (one barrier per commit); write through the icebarrier "
                        f"job runtime or set snapshot-property.{SUMMARY_BARRIER}"
                    )
                barrier = marks.pop()
                managed_barriers[table] = (barrier, added[-1].snapshot_id, coalesced_after(added[-1]))
            stage = session is not None or (len(sinks) > 1 and not whole and managed and barrier is not None)
            staged.append((table, current, new, pending, barrier if stage else None))
        for _, current, new, _, _ in staged:
            if new is not current:
                self.write_metadata(new)
        with db.atomic(conn):
            for table, current, new, pending, barrier in staged:
                location = current.metadata_location if current is not None else None
                if barrier is not None:  # staged until the job publishes the barrier
                    managed_barriers.pop(table, None)
                    base = pending["base_location"] if pending else location
                    self.stage(conn, principal.acting_job, table, barrier, base, new.metadata_location, location)
                elif current is None:
                    self.point(conn, table, new.metadata_location, None)
                elif pending is not None:  # built on the job's staged commit: the pointer is at its base
                    self.point(conn, table, new.metadata_location, pending["base_location"])
                    conn.execute(
                        "DELETE FROM catalog_pending WHERE job_name = %s AND table_name = %s",
                        (principal.job, str(table)),
                    )
                elif new is not current:
                    self.point(conn, table, new.metadata_location, location)
            faults.point(faults.IN_CATALOG_COMMIT)
            if definition is not None:
                self.complete_if_whole(conn, definition, managed_barriers)
        return [(t, new) for t, _, new, _, _ in staged]

    def publish(self, conn, job: str) -> None:
        """Swap the pointers of every commit the job staged through latest, and complete their
        barrier B with the snapshots carrying B, in one transaction."""
        with conn.transaction():
            barrier, commits, coalesce = self.swap_staged(conn, job)
            faults.point(faults.IN_CATALOG_COMMIT)
            with conn.transaction():
                jobs.complete(conn, job, barrier, commits, run_id="rest-catalog", coalesce=coalesce)

    @staticmethod
    def complete_if_whole(conn, job: JobDefinition, commits: dict[TableName, tuple[int, int, int | None]]) -> None:
        """A commit of all of the job's sinks carrying one barrier B completes B for the job
        (coalescing when the snapshots say they coalesced)."""
        marks = {b for b, _, _ in commits.values()}
        if not commits or set(commits) != set(job.sinks) or len(marks) != 1:
            return  # part of the job's sinks: the job completes B itself (adopting these commits)
        with conn.transaction():
            jobs.complete(
                conn,
                job.name,
                marks.pop(),
                {t: s for t, (_, s, _) in commits.items()},
                run_id="rest-catalog",
                coalesce=any(c is not None for _, _, c in commits.values()),
            )
