"""Job sessions (warehouse ``job``): where a session's tables load, what it may write, the
barrier stamped into its snapshots, its staged creations, and its publish.
"""

from __future__ import annotations

import time

from icebarrier.apps.catalog.delegation import Delegation
from icebarrier.apps.catalog.errors import ForbiddenError, UnprocessableError
from icebarrier.apps.catalog.lake.core import LATEST
from icebarrier.apps.catalog.lake.staging import Staging
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import job_sessions, jobs
from icebarrier.control_plane.fences import Fence
from icebarrier.control_plane.job_sessions import JobSession
from icebarrier.control_plane.jobs import Completion, Plan
from icebarrier.control_plane.model import TableName
from icebarrier.control_plane.tokens import Principal
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import (
    SUMMARY_BARRIER,
    SUMMARY_COALESCED_AFTER,
    SUMMARY_INPUT_RANGE,
    SUMMARY_JOB,
    SUMMARY_RUN,
    barrier_of,
)


class Sessions(Staging):
    @staticmethod
    def session(conn, warehouse: Warehouse, principal: Principal) -> JobSession:
        """The session a request through warehouse ``job`` works in (opened by the job's first request)."""
        return job_sessions.current(conn, principal.acting_job, run_id=warehouse.run_id)

    def session_view(self, conn, session: JobSession, table: TableName) -> Warehouse:
        """Where a job session reads ``table``: a source at ``S(T, B)``, a sink (with what the
        session staged) and an unmanaged table as they are; any other managed table is refused."""
        if table in session.sources:
            return Warehouse("barrier", barrier=session.barrier)
        if table in session.sinks:
            return LATEST
        if self.writer_of(conn, table)[0]:
            raise ForbiddenError(
                f"job {session.job} may not read {table}: it is not one of the job's sources "
                f"({', '.join(sorted(map(str, session.sources))) or 'none'}); declare it with "
                f"`icebarrier job register {session.job} --source {table} … --replace`"
            )
        return LATEST

    def require_sink(self, conn, session: JobSession, table: TableName) -> None:
        if table not in session.sinks:
            writer = self.writer_of(conn, table)[1]
            owner = f" ({table} is written by job {writer})" if writer else ""
            raise ForbiddenError(
                f"job {session.job} may not write {table}: it writes only its sinks "
                f"({', '.join(sorted(map(str, session.sinks))) or 'none'}){owner}; nothing of this "
                f"run is published"
            )

    @staticmethod
    def stamped(session: JobSession, table: TableName, change):
        """``change`` with every snapshot it adds carrying the session's barrier, job and run (and
        the coalesced range) in its summary; a snapshot naming another barrier is refused."""
        from pyiceberg.table.snapshots import Operation, Summary
        from pyiceberg.table.update import AddSnapshotUpdate

        marks = {SUMMARY_BARRIER: str(session.barrier), SUMMARY_JOB: session.job, SUMMARY_RUN: session.run_id}
        if session.coalesce_after is not None:
            marks[SUMMARY_COALESCED_AFTER] = str(session.coalesce_after)
        updates = []
        for update in change.updates:
            if isinstance(update, AddSnapshotUpdate):
                snapshot = update.snapshot
                given = barrier_of(snapshot)
                if given is not None and given != session.barrier:
                    raise ForbiddenError(
                        f"a commit to {table} carries barrier {given}, but job {session.job}'s "
                        f"session computes barrier {session.barrier}; drop snapshot property "
                        f"{SUMMARY_BARRIER} (the catalog sets it)"
                    )
                summary = snapshot.summary
                operation = summary.operation if summary is not None else Operation.APPEND
                properties = {**(summary.additional_properties if summary is not None else {}), **marks}
                if SUMMARY_INPUT_RANGE in properties:
                    Sessions.require_input_range(session, table, properties[SUMMARY_INPUT_RANGE])
                update = AddSnapshotUpdate(
                    snapshot=snapshot.model_copy(update={"summary": Summary(operation, **properties)})
                )
            updates.append(update)
        return change.model_copy(update={"updates": tuple(updates)})

    MAX_INPUT_RANGE = 65536  # characters: a range per partition of a large topic fits many times over

    @staticmethod
    def require_input_range(session: JobSession, table: TableName, text: str) -> None:
        """A commit's input range (recorded in the control plane at publish) comes from a root job,
        as a JSON object of bounded size; else the commit is refused, naming the property."""
        import json

        why = None
        if not session.root:
            why = f"job {session.job} reads tables, not an outside input; only a root job records an input range"
        elif len(text) > Sessions.MAX_INPUT_RANGE:
            why = f"it has {len(text)} characters, over {Sessions.MAX_INPUT_RANGE}"
        else:
            try:
                if not isinstance(json.loads(text), dict):
                    why = "it is not a JSON object"
            except ValueError:
                why = "it is not JSON"
        if why is not None:
            raise UnprocessableError(
                f"a commit to {table} carries snapshot property {SUMMARY_INPUT_RANGE}, but {why}; "
                f"drop the property or give the range as a JSON object (iceberg_ext/kafka.py's barrier_input does)"
            )

    def create_staged(
        self, conn, session: JobSession, table: TableName, request, principal: Principal, access: Delegation
    ):
        """A sink the session creates: staged (nobody else sees it) until the barrier is published."""
        from pyiceberg.exceptions import TableAlreadyExistsError

        self.require_sink(conn, session, table)
        if (
            self.staged(conn, session.job, table) is not None
            or conn.execute(self._pointer_sql, (table.catalog, table.sql_namespace, table.name)).fetchone() is not None
        ):
            raise TableAlreadyExistsError(f"table {table} already exists")
        made = self.new_table(conn, table, request)
        if not request.stage_create:  # a staged create is committed by the client (AssertCreate) like any change
            self.write_metadata(made)
            self.stage(conn, session.job, table, session.barrier, None, made.metadata_location, None)
        return self.response(
            table,
            made.metadata_location,
            made.metadata,
            principal,
            access,
            managed=True,
            warehouse=f"job:{session.job}",
        )

    def publish_session(self, conn, job: str, run_id: str | None) -> Completion:
        """Publish the job's session: every commit it staged swaps in and its barrier B completes,
        in one transaction (sinks it did not write complete B unchanged). The caller has marked
        the session succeeded first (its own transaction), so that a publish cut short is adopted
        by the job's next run."""
        if faults.mutated(faults.NONATOMIC_PUBLISH):
            return self._publish_piecemeal(conn, job, run_id)
        if faults.mutated(faults.NO_REBASE):  # the race, made certain for a checker to meet it
            self._await_rival(conn, job)
        with conn.transaction():
            session = job_sessions.require(conn, job, run_id=run_id, lock=True)
            _, commits, _ = self.swap_staged(conn, job, session.barrier)
            job_sessions.close(conn, job)
            faults.point(faults.IN_CATALOG_COMMIT)
            with conn.transaction():
                return self._complete_session(conn, session, commits)

    MUTATION_WINDOW_S = 2.0  # between the mutation's transactions: long enough for a checker to look
    _rival_met = False
    NO_REBASE_WINDOW_S = 20.0  # long enough for a rewrite that waited for the staged commit to land first

    def _await_rival(self, conn, job: str) -> None:
        """The mutation :data:`~icebarrier.iceberg_ext.faults.NO_REBASE`: hold the publish until a
        commit outside the session (maintenance's compaction, which waits for a staged commit to
        start) moved one of its sinks, or the window passed. A fixed pause lost the race to a slow
        rewrite on a loaded machine, and the checker's test of itself then proved nothing. Once the
        race was met, publishes go on at their pace (the run still has to end). With no maintenance
        service holding its lease no rival is coming: nothing is held (a checker's run before its
        service starts, a test's barriers that compact by hand)."""
        if self._rival_met or not Fence.held(conn, "maintenance_state"):
            return
        deadline = time.monotonic() + self.NO_REBASE_WINDOW_S
        while time.monotonic() < deadline:
            for r in conn.execute(
                "SELECT table_name, base_location FROM catalog_pending WHERE job_name = %s AND base_location IS NOT NULL",
                (job,),
            ).fetchall():
                table = TableName.parse(r["table_name"])
                now = conn.execute(self._pointer_sql, (table.catalog, table.sql_namespace, table.name)).fetchone()
                if now is not None and now["metadata_location"] != r["base_location"]:
                    self._rival_met = True
                    return
            time.sleep(0.1)

    def _publish_piecemeal(self, conn, job: str, run_id: str | None) -> Completion:
        """The mutation :data:`~icebarrier.iceberg_ext.faults.NONATOMIC_PUBLISH`: what a server
        that swaps a session's pointers one transaction at a time does (a bug the checker must
        catch: a crash in between leaves sinks swapped with no completion)."""
        session = job_sessions.require(conn, job, run_id=run_id)
        rows = conn.execute(
            "SELECT table_name, base_location, metadata_location FROM catalog_pending "
            "WHERE job_name = %s ORDER BY table_name",
            (job,),
        ).fetchall()
        commits = {}
        for r in rows:
            table = TableName.parse(r["table_name"])
            with self.pool.connection() as own, own.transaction():
                self.point(own, table, r["metadata_location"], r["base_location"])
                own.execute(
                    "DELETE FROM catalog_pending WHERE job_name = %s AND table_name = %s", (job, r["table_name"])
                )
            main = self.metadata(r["metadata_location"])[0].current_snapshot()
            if main is not None and barrier_of(main) == session.barrier:
                commits[table] = main.snapshot_id
            time.sleep(self.MUTATION_WINDOW_S)
        with conn.transaction():
            job_sessions.close(conn, job)
            return self._complete_session(conn, session, commits)

    @staticmethod
    def _complete_session(conn, session: JobSession, commits: dict) -> Completion:
        """Complete the session's barrier with its commits: a root job that committed nothing
        skips (its barriers stay exact); else as the plan says."""
        coalesce = session.plan is Plan.COALESCE and (bool(commits) or not session.root)
        return jobs.complete(conn, session.job, session.barrier, commits, run_id=session.run_id, coalesce=coalesce)
