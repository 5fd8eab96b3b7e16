"""A job's staged (unpublished) commits: a commit of a multi-sink job, or of a job session, is
kept in ``catalog_pending`` (the pointer stays at its base) until the job publishes the barrier;
then every staged pointer swaps in one transaction, each rebased where maintenance alone moved
the table meanwhile (:mod:`icebarrier.iceberg_ext.rebase`).
"""

from __future__ import annotations

from icebarrier.apps.catalog.lake.core import LakeCore
from icebarrier.control_plane import runs
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext import rebase
from icebarrier.iceberg_ext.catalog import barrier_of, coalesced_after, input_range_of, is_compaction


class Staging(LakeCore):
    def staged(self, conn, job: str | None, table: TableName) -> dict | None:
        """The job's staged (unpublished) commit of ``table``, if any."""
        if job is None:
            return None
        return conn.execute(
            "SELECT barrier, base_location, metadata_location FROM catalog_pending "
            "WHERE job_name = %s AND table_name = %s",
            (job, str(table)),
        ).fetchone()

    def created(self, conn, job: str) -> list[TableName]:
        """The tables the job's staged commits create (published with its barrier)."""
        rows = conn.execute(
            "SELECT table_name FROM catalog_pending WHERE job_name = %s AND base_location IS NULL", (job,)
        ).fetchall()
        return [TableName.parse(r["table_name"]) for r in rows]

    def stage(
        self, conn, job: str, table: TableName, barrier: int, base: str | None, location: str, expected: str | None
    ) -> None:
        """Stage ``location`` as the job's commit of ``table`` for ``barrier``: the pointer stays at
        ``base`` until the job publishes; ``expected`` is the staged location it builds on (None:
        it stages the table's first commit of the barrier)."""
        from pyiceberg.exceptions import CommitFailedException

        moved = conn.execute(
            "INSERT INTO catalog_pending (job_name, table_name, barrier, base_location, metadata_location) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (job_name, table_name) DO UPDATE "
            "SET barrier = excluded.barrier, metadata_location = excluded.metadata_location, "
            "staged_at = now() WHERE catalog_pending.metadata_location = %s",
            (job, str(table), barrier, base, location, expected),
        ).rowcount
        if moved != 1:
            raise CommitFailedException(f"table {table} was changed by another commit; retry")

    def rebased(self, table: TableName, base: str, current: str, staged: str) -> str:
        """A staged commit built on ``base``, rebased onto ``current`` where maintenance alone moved
        the table meanwhile: expiry (snapshots removed; found by `icebarrier check`: an expiry while
        a session ran made its publish fail for ever) or compaction and manifest rewrites (the
        job's snapshots replayed on top, :mod:`icebarrier.iceberg_ext.rebase`). Anything else moved
        the table: refused (:class:`CommitFailedException`), the job computes the barrier again."""
        from pyiceberg.exceptions import CommitFailedException
        from pyiceberg.table import Table
        from pyiceberg.table.update import RemoveSnapshotsUpdate

        (was, _), (now, now_io), (mine, io) = self.metadata(base), self.metadata(current), self.metadata(staged)
        before, after = {s.snapshot_id for s in was.snapshots}, {s.snapshot_id for s in now.snapshots}
        if (
            not after - before
            and now.refs == was.refs
            and now.schemas == was.schemas
            and now.properties == was.properties
        ):
            gone = sorted((before - after) & {s.snapshot_id for s in mine.snapshots})
            if not gone:
                return staged
            updates: tuple = (RemoveSnapshotsUpdate(snapshot_ids=gone),)
            on, requirements = Table(table.identifier, mine, staged, io, self.catalog), ()
        else:
            try:
                if (mine.schemas, mine.properties, mine.partition_specs, mine.sort_orders) != (
                    was.schemas,
                    was.properties,
                    was.partition_specs,
                    was.sort_orders,
                ):
                    raise rebase.NotRebasableError("the job changed the table's schema, spec or properties")
                on = Table(table.identifier, now, current, now_io, self.catalog)
                snapshots = rebase.job_snapshots(mine, was.current_snapshot_id)
                requirements, updates = rebase.replay(on, was.current_snapshot_id, snapshots, io)
                if not updates:
                    return current  # the job added nothing on top of its base: the table as it is now
            except rebase.NotRebasableError as exc:
                raise CommitFailedException(
                    f"table {table} was changed outside the barrier staged for it (not by maintenance alone: "
                    f"{exc.why}); run the job again"
                ) from None
        new = self.catalog._update_and_stage_table(on, table.identifier, requirements, updates)
        self.write_metadata(new)
        return new.metadata_location

    def replayed(self, current, change):
        """``change`` (a commit's requirements and updates, refused by ``current`` because ``main``
        moved) with its snapshots replayed on ``current``, where maintenance alone moved ``main``
        since the snapshot the change asserts; None where that is not so (the refusal stands)."""
        from pyiceberg.table.update import AddSnapshotUpdate, AssertRefSnapshotId, SetSnapshotRefUpdate

        asserted = [r for r in change.requirements if isinstance(r, AssertRefSnapshotId) and r.ref == "main"]
        added = [u.snapshot for u in change.updates if isinstance(u, AddSnapshotUpdate)]
        moves = [u for u in change.updates if isinstance(u, SetSnapshotRefUpdate)]
        if (
            current is None
            or len(asserted) != 1
            or not added
            or len(moves) + len(added) != len(change.updates)
            or any(u.ref_name != "main" or u.snapshot_id != added[-1].snapshot_id for u in moves)
        ):
            return None
        try:
            requirements, updates = rebase.replay(current, asserted[0].snapshot_id, added, current.io)
        except rebase.NotRebasableError:
            return None
        rest = tuple(r for r in change.requirements if r is not asserted[0])
        return change.model_copy(update={"requirements": (*rest, *requirements), "updates": updates})

    def swap_staged(self, conn, job: str, barrier: int | None = None) -> tuple[int, dict[TableName, int], bool]:
        """Swap every pointer the job staged to its staged commit (inside the caller's
        transaction) and drop the staging. Returns the barrier (``barrier`` None: the one they
        were all staged for), the snapshot each sink committed for it, and whether a commit
        says it coalesced."""
        rows = conn.execute(
            "SELECT table_name, barrier, base_location, metadata_location FROM catalog_pending "
            "WHERE job_name = %s ORDER BY table_name FOR UPDATE",
            (job,),
        ).fetchall()
        marks = {r["barrier"] for r in rows} | ({barrier} if barrier is not None else set())
        if len(marks) != 1:
            raise IcebarrierError(
                f"job {job} has {'nothing' if not rows else 'several barriers'} staged to "
                f"publish; write its sinks through this catalog first"
            )
        barrier, commits, coalesced = marks.pop(), {}, False
        for r in rows:
            table = TableName.parse(r["table_name"])
            location, base = r["metadata_location"], r["base_location"]
            if base is not None:
                now = conn.execute(  # locked: a maintenance commit waits for this publish, then loses its swap
                    self._pointer_sql + " FOR UPDATE", (table.catalog, table.sql_namespace, table.name)
                ).fetchone()
                if now is not None and now["metadata_location"] != base:
                    location, base = (
                        self.rebased(table, base, now["metadata_location"], location),
                        now["metadata_location"],
                    )
            self.point(conn, table, location, base, lost=f"was changed outside job {job}'s barrier; run the job again")
            main = self.metadata(location)[0].current_snapshot()
            if main is not None and barrier_of(main) == barrier and not is_compaction(main):
                commits[table] = main.snapshot_id
                coalesced = coalesced or coalesced_after(main) is not None
                if (spec := input_range_of(main)) is not None:  # a root job's input (Kafka offsets): kept with B
                    runs.record_range(conn, job, barrier, spec)
        conn.execute("DELETE FROM catalog_pending WHERE job_name = %s", (job,))
        return barrier, commits, coalesced
