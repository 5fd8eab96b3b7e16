"""Lease-aware maintenance: expiry, compaction, reconcile, revision and tags.

Expiry chooses its candidates from the table's metadata, then asks the control plane
(under the table's exclusive lock, after choosing) which of them are outside the protected
set; those are tombstoned before anything is deleted, so a lease racing the expiry either
pins first (and the snapshot is kept) or is refused. Deletion runs through PyIceberg and
removes the files no remaining snapshot references, nor any commit staged for the table (a job
session's, not yet published).

Orphan-file removal is :mod:`.orphans`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from icebarrier.control_plane import db, job_sessions, leases, reads, revisions, snapshots, tables
from icebarrier.control_plane.cuts import protected_set
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import Cut, Level, TableName, parse_tag_name
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import (
    OPERATION_COMPACTION,
    OPERATION_REVISION,
    SUMMARY_BARRIER,
    SUMMARY_JOB,
    SUMMARY_OPERATION,
    SUMMARY_RUN,
    ancestors,
    barrier_of,
    is_compaction,
    lineage,
    load_table,
    retry_commit,
    summary_properties,
)
from icebarrier.iceberg_ext.errors import CompactionDeferredError

MAINTENANCE_JOB = "icebarrier-maintenance"
NO_REBASE_WAIT_S = 10.0  # the no-rebase mutation: how long a compaction waits for a staged commit to race


# -- expiry ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpiryReport:
    table: TableName
    candidates: int
    expired: tuple[int, ...]
    protected: dict[int, tuple[str, ...]]
    files_deleted: int
    dry_run: bool
    planning_s: float

    def to_json(self) -> dict:
        return {
            "table": str(self.table),
            "candidates": self.candidates,
            "expired": list(self.expired),
            "protected": {str(k): list(v) for k, v in self.protected.items()},
            "files_deleted": self.files_deleted,
            "dry_run": self.dry_run,
            "planning_s": round(self.planning_s, 4),
        }


def plan_candidates(tbl, *, older_than_s: float | None, retain_last: int, now_ms: int | None = None):
    """Candidates (every non-current snapshot, older than the cut-off if given), what the
    retention policy keeps (the newest ``retain_last``), and the refs (tags, branches)."""
    now_ms = now_ms or int(time.time() * 1000)
    current = tbl.metadata.current_snapshot_id
    snaps = tbl.metadata.snapshots
    candidates = [
        s.snapshot_id
        for s in snaps
        if s.snapshot_id != current and (older_than_s is None or s.timestamp_ms < now_ms - older_than_s * 1000)
    ]
    newest = sorted(snaps, key=lambda s: (s.timestamp_ms, s.sequence_number or 0), reverse=True)[:retain_last]
    refs = [(name, ref.snapshot_id) for name, ref in tbl.metadata.refs.items()]
    return candidates, tuple(s.snapshot_id for s in newest), tuple(refs)


def expire(
    conn: db.Conn,
    catalog,
    table: TableName,
    *,
    older_than_s: float | None = None,
    retain_last: int = 1,
    dry_run: bool = False,
    manifests: MutableMapping[str, set[str]] | None = None,
) -> ExpiryReport:
    """Expire the snapshots of ``table`` outside the protected set, and their files.
    ``manifests``: each manifest's files by its path, kept by the caller across calls (the
    maintenance service's, shared with its orphan passes), so that an expiry reads only the
    manifests it has not read before.

    Expiries of one table run one at a time (a second one waits, then plans from the table
    as the first left it)."""
    if retain_last < 1:
        raise IcebarrierError(f"--retain-last {retain_last} is invalid; keep at least 1 snapshot")
    with leases.expiry_lock(conn, table):
        started = time.perf_counter()
        tbl = load_table(catalog, table)
        candidates, retained, refs = plan_candidates(tbl, older_than_s=older_than_s, retain_last=retain_last)
        if tables.is_managed(conn, table):
            claim = leases.claim_expiry(conn, table, candidates, retained=retained, tagged=refs, dry_run=dry_run)
            chosen, kept = claim.removable, claim.protected
        else:  # no leases, job progress or read window: the current snapshot, the retention and refs keep
            kept = protected_set(current=tbl.metadata.current_snapshot_id, retained=retained, tagged=refs)
            chosen = tuple(c for c in candidates if c not in kept)
        protected = {s: p.reasons for s, p in kept.items()}
        planning_s = time.perf_counter() - started
        deleted = 0
        removable = list(chosen)
        if faults.mutated(faults.EXPIRE_PROTECTED):  # the checker's test of itself: a deliberate bug
            removable = [c for c in candidates if c not in retained]
        if removable and not dry_run:
            staged = job_sessions.staging(conn, table).pending
            deleted = retry_commit(lambda: _expire_and_delete(load_table(catalog, table), removable, staged, manifests))
    return ExpiryReport(
        table=table,
        candidates=len(candidates),
        expired=chosen,
        protected=protected,
        files_deleted=deleted,
        dry_run=dry_run,
        planning_s=planning_s,
    )


def reachable_files(tbl, snapshot_list, cache: MutableMapping[str, set[str]]) -> set[str]:
    """Every file path (manifest lists, manifests, data and delete files) the snapshots use.
    ``cache``: each manifest's files by its path (a dict, or a bounded cache that may refuse one)."""
    files: set[str] = set()
    for snap in snapshot_list:
        files.add(snap.manifest_list)
        for manifest in snap.manifests(tbl.io):
            listed = cache.get(manifest.manifest_path)
            if listed is None:
                entries = manifest.fetch_manifest_entry(tbl.io, discard_deleted=False)
                listed = {e.data_file.file_path for e in entries}
                with contextlib.suppress(ValueError):  # larger than a bounded cache holds
                    cache[manifest.manifest_path] = listed
            files.add(manifest.manifest_path)
            files |= listed
    return files


def staged_files(tbl, pending: tuple[tuple[str, str | None], ...], table_snapshots: set[int]) -> set[str]:
    """What the staged (unpublished) commits of ``tbl`` need until they publish (``pending``: each
    staged metadata file and the one it was built on, :class:`~icebarrier.control_plane.job_sessions.Staging`):
    both metadata files, and of the job's own snapshots (those above its base) every manifest
    list and manifest they use (a publish reads them to replay the job's snapshots) and the data
    files they added. The snapshots a staged commit carries from its base are the table's to keep
    or drop: where maintenance dropped a data file (a compaction, then the expiry of what it
    replaced), the publish replays the job's snapshots on the table as it is and needs it no
    more (kept for the staged commit, nothing referenced it once published, and it waited out the
    data files' grace); and the manifest list of a base snapshot the table expired is gone, so
    reading it failed the expiry or orphan pass beside the staged commit (issue 67). Without a
    base (a table the job created), or one the staged commit does not descend from, every
    snapshot the table does not have (``table_snapshots``) is the job's."""
    from pyiceberg.manifest import ManifestEntryStatus
    from pyiceberg.serializers import FromInputFile

    from icebarrier.iceberg_ext.rebase import NotRebasableError, job_snapshots

    def read(location: str):
        return FromInputFile.table_metadata(tbl.io.new_input(location))

    files: set[str] = set()
    for location, base in pending:
        files |= {location, *([base] if base else [])}
        metadata = read(location)
        try:
            own = job_snapshots(metadata, read(base).current_snapshot_id if base else None)
        except NotRebasableError:
            own = [s for s in metadata.snapshots if s.snapshot_id not in table_snapshots]
        for snap in own:
            files.add(snap.manifest_list)
            for manifest in snap.manifests(tbl.io):
                files.add(manifest.manifest_path)
                if manifest.added_snapshot_id == snap.snapshot_id:
                    entries = manifest.fetch_manifest_entry(tbl.io, discard_deleted=False)
                    files |= {e.data_file.file_path for e in entries if e.status == ManifestEntryStatus.ADDED}
    return files


def same_file(path: str) -> tuple[str, str, str]:
    """What names one file whatever the writer's spelling: Spark writes ``file:/tmp/t/…`` where
    PyIceberg writes ``file:///tmp/t/…`` (and a bare path is a local file). Compared as strings,
    a file Spark wrote for a table PyIceberg created looked unreferenced, and orphan removal
    deleted live compactions' files (found by `icebarrier check --maintain`)."""
    from urllib.parse import urlsplit

    parts = urlsplit(path)
    if not parts.scheme or len(parts.scheme) == 1:  # a bare path (a Windows drive letter too)
        return ("file", "", path)
    return (parts.scheme, parts.netloc, parts.path)


def delete_file(io, path: str) -> None:
    """Delete ``path``, and on a local warehouse its Hadoop checksum beside it (Spark writes
    ``.NAME.crc`` with every file; a delete through PyIceberg leaves it behind)."""
    io.delete(path)
    scheme, _, local = same_file(path)
    if scheme == "file":
        folder, name = os.path.split(local)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, f".{name}.crc"))


def _expire_and_delete(
    tbl,
    snapshot_ids: list[int],
    staged: tuple[tuple[str, str | None], ...] = (),
    cache: MutableMapping[str, set[str]] | None = None,
) -> int:
    """Expire ``snapshot_ids`` and delete the files only they used. ``cache``: each manifest's
    files by its path, kept across calls (a manifest never changes; :func:`reachable_files`)."""
    present = {s.snapshot_id for s in tbl.metadata.snapshots}
    ids = [s for s in snapshot_ids if s in present]
    if not ids:
        return 0
    cache = {} if cache is None else cache
    removed = [s for s in tbl.metadata.snapshots if s.snapshot_id in set(ids)]
    before = reachable_files(tbl, removed, cache)
    tbl.maintenance.expire_snapshots().by_ids(ids).commit()
    tbl.refresh()
    kept = reachable_files(tbl, tbl.metadata.snapshots, cache) | staged_files(tbl, staged, present)
    after = {same_file(p) for p in kept}
    doomed = {p for p in before if same_file(p) not in after}
    for path in doomed:
        delete_file(tbl.io, path)
    return len(doomed)


# -- compaction ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionReport:
    table: TableName
    barrier: int | None
    snapshot_id: int | None
    rewritten_files: int

    def to_json(self) -> dict:
        return {
            "table": str(self.table),
            "barrier": self.barrier,
            "snapshot_id": self.snapshot_id,
            "rewritten_files": self.rewritten_files,
        }


def data_barrier(tbl, snapshot) -> int | None:
    """The barrier whose content a snapshot holds: its own, or for a compaction its ancestor's."""
    for s in ancestors(tbl, snapshot):
        if not is_compaction(s) and barrier_of(s) is not None:
            return barrier_of(s)
    return None


def compact(
    spark,
    conn: db.Conn,
    catalog,
    table: TableName,
    *,
    min_input_files: int = 2,
    target_file_size: int | None = None,
    manifests: bool = False,
) -> CompactionReport:
    """Rewrite small files (Spark ``rewrite_data_files``), or with ``manifests`` the manifests
    (``rewrite_manifests``). The new snapshot carries the barrier it compacted and
    ``icebarrier.operation=compaction`` and becomes S(T, B) for new readers; older snapshots
    stay for lease-aware expiry. A table no job writes is compacted the same, with no barrier.
    A pipeline's commit that races it wins: its append makes Iceberg validate the rewrite again
    on top (or fail it: the service gives way), and a job's staged or in-flight commit built on
    the table before the rewrite is replayed over it (:mod:`icebarrier.iceberg_ext.rebase`).

    Raises :class:`CompactionDeferredError` while the table holds a commit its job has not
    completed, or a job session's staged commit (it would be rebased under the session)."""
    tbl = load_table(catalog, table)
    current = tbl.current_snapshot()
    if current is None:
        return CompactionReport(table=table, barrier=None, snapshot_id=None, rewritten_files=0)
    managed = tables.is_managed(conn, table)
    properties = {SUMMARY_OPERATION: OPERATION_COMPACTION, SUMMARY_JOB: MAINTENANCE_JOB}
    barrier = None
    if managed:  # an unmanaged table has no barrier to keep
        barrier = data_barrier(tbl, current)
        if barrier is None:
            raise IcebarrierError(f"table {table} has no barrier-tagged snapshot to compact; let its job commit first")
        state = tables.states(conn, [table])[0]
        if not state.has_completed(barrier):
            raise CompactionDeferredError(
                table,
                f"table {table} holds a commit for barrier {barrier} that its job has not completed yet; "
                f"compact after the job completes it",
            )
        if job_sessions.staging(conn, table).metadata_locations and not faults.mutated(faults.NO_REBASE):
            raise CompactionDeferredError(
                table,
                f"table {table} has a job session's commit staged and not yet published; compact after it publishes",
            )
        properties[SUMMARY_BARRIER] = str(barrier)
    from icebarrier.iceberg_ext import spark_io

    if managed and faults.mutated(faults.NO_REBASE):  # the race, aimed: the rewrite starts once a job's
        deadline = time.monotonic() + NO_REBASE_WAIT_S  # commit is staged (a long Spark run on a big
        while not job_sessions.staging(conn, table).metadata_locations and time.monotonic() < deadline:
            time.sleep(0.05)  # table meets one the same way)
    if manifests:
        spark_io.rewrite_manifests(spark, table, properties=properties)
    else:
        options = {"min-input-files": str(int(min_input_files))}
        if target_file_size is not None:
            options["target-file-size-bytes"] = str(int(target_file_size))
        spark_io.rewrite_data_files(spark, table, options=options, properties=properties)
    tbl = load_table(catalog, table)
    new = next(
        (s for s in lineage(tbl) if is_compaction(s) and (s.sequence_number or 0) > (current.sequence_number or 0)),
        None,
    )
    if new is None:
        return CompactionReport(table=table, barrier=barrier, snapshot_id=None, rewritten_files=0)
    # If the job committed meanwhile, the compaction holds the newer content: record it there.
    holds = data_barrier(tbl, new) if managed else None
    if holds is not None:
        snapshots.record(
            conn, table, barrier=holds, snapshot_id=new.snapshot_id, operation="compaction", job_name=MAINTENANCE_JOB
        )
    summary = summary_properties(new)
    rewritten = (
        int(summary.get("deleted-data-files", "0")) if not manifests else int(summary.get("manifests-replaced", "0"))
    )
    return CompactionReport(table=table, barrier=holds, snapshot_id=new.snapshot_id, rewritten_files=rewritten)


# -- reconcile ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconcileReport:
    table: TableName
    adopted: list[tuple[int, int]] = field(default_factory=list)  # (barrier, snapshot)
    pending: list[tuple[int, int, str]] = field(default_factory=list)  # (barrier, snapshot, job)
    foreign: list[tuple[int, str]] = field(default_factory=list)  # (snapshot, why)
    missing_in_iceberg: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.foreign and not self.missing_in_iceberg

    def to_json(self) -> dict:
        return {
            "table": str(self.table),
            "ok": self.ok,
            "adopted": [{"barrier": b, "snapshot_id": s} for b, s in self.adopted],
            "pending": [{"barrier": b, "snapshot_id": s, "job": j} for b, s, j in self.pending],
            "foreign": [{"snapshot_id": s, "why": w} for s, w in self.foreign],
            "missing_in_iceberg": self.missing_in_iceberg,
        }


def reconcile(conn: db.Conn, catalog, table: TableName) -> ReconcileReport:
    """Compare the control plane with the table's snapshot summaries; adopt missing records,
    report commits awaiting their job, and snapshots written by anyone else."""
    tbl = load_table(catalog, table)
    state = tables.states(conn, [table])[0]
    known = snapshots.recorded(conn, table)
    writers = snapshots.known_writers(conn, table)
    in_lineage = {s.snapshot_id for s in lineage(tbl)}
    report = ReconcileReport(table=table)
    for snap in sorted(tbl.metadata.snapshots, key=lambda s: s.sequence_number or 0):
        props = summary_properties(snap)
        sid = snap.snapshot_id
        if sid in known:
            continue
        if SUMMARY_BARRIER not in props:
            report.foreign.append(
                (sid, f"no {SUMMARY_BARRIER} in its summary (operation {snap.summary.operation.value})")
            )
            continue
        job = props.get(SUMMARY_JOB, "?")
        if job not in writers and job != MAINTENANCE_JOB and props.get(SUMMARY_OPERATION) != OPERATION_REVISION:
            report.foreign.append((sid, f"written by {job}, which does not own {table}"))
            continue
        if sid not in in_lineage:
            continue  # undone by a revision or replaced concurrently: history, not state
        barrier = data_barrier(tbl, snap) if is_compaction(snap) else int(props[SUMMARY_BARRIER])
        if state.has_completed(barrier):
            op = "compaction" if is_compaction(snap) else "data"
            same = [c for c in known.values() if c.barrier == barrier and c.operation == "data" and not c.revoked]
            if op == "data" and same:
                if same[0].run_id != props.get(SUMMARY_RUN):
                    report.foreign.append((sid, f"a second data commit for barrier {barrier}"))
                # else: an earlier snapshot of the same atomic commit (e.g. overwrite = delete + append)
                continue
            snapshots.record(conn, table, barrier=barrier, snapshot_id=sid, operation=op, job_name=job)
            report.adopted.append((barrier, sid))
        else:
            report.pending.append((barrier, sid, job))
    for sid, c in known.items():
        if not c.revoked and tbl.snapshot_by_id(sid) is None and not _tombstoned(conn, table, sid):
            report.missing_in_iceberg.append(sid)
    return report


def _tombstoned(conn, table: TableName, snapshot_id: int) -> bool:
    return (
        conn.execute(
            "SELECT 1 FROM expired_snapshots e JOIN managed_tables m USING (table_id) WHERE m.name = %s AND e.snapshot_id = %s",
            (str(table), snapshot_id),
        ).fetchone()
        is not None
    )


# -- revision ---------------------------------------------------------------------------------------------


def revise(conn: db.Conn, catalog, table: TableName, to_barrier: int, *, dry_run: bool = False):
    """Roll ``table`` and everything downstream back to their snapshots at ``to_barrier``."""
    if dry_run:
        return revisions.plan(conn, table, to_barrier)
    plan = revisions.begin(conn, table, to_barrier)
    for t in plan.tables:
        if not t.changes:
            continue
        tbl = load_table(catalog, t.table)
        current = tbl.metadata.current_snapshot_id
        if t.to_snapshot is not None:
            if current != t.to_snapshot:
                tbl.manage_snapshots().set_current_snapshot(snapshot_id=t.to_snapshot).commit()
        elif current is not None and not _is_revision_snapshot(tbl.current_snapshot(), plan):
            from pyiceberg.expressions import AlwaysTrue

            tbl.delete(
                AlwaysTrue(),
                snapshot_properties={
                    SUMMARY_BARRIER: str(plan.to_barrier),
                    SUMMARY_OPERATION: OPERATION_REVISION,
                    SUMMARY_JOB: MAINTENANCE_JOB,
                    "icebarrier.revision": str(plan.revision_id),
                },
            )
            emptied = load_table(catalog, t.table).metadata.current_snapshot_id
            if emptied is not None and emptied != current:
                revisions.record_revision_snapshot(conn, plan, t.table, emptied)
    revisions.finish(conn, plan.revision_id)
    return plan


def _is_revision_snapshot(snapshot, plan) -> bool:
    return summary_properties(snapshot).get("icebarrier.revision") == str(plan.revision_id)


# -- tags -----------------------------------------------------------------------------------------------------


def tag(
    conn: db.Conn,
    catalog,
    name: str,
    table_names: list[TableName],
    *,
    barrier: int | None = None,
    max_age_s: float | None = None,
) -> Cut:
    """Create Iceberg tag ``name`` on each table at the cut's snapshot, so any engine can read
    the consistent cut with ``VERSION AS OF 'name'``."""
    name = parse_tag_name(name)
    cut = reads.resolve(conn, table_names, level=Level.READ_COMMITTED, barrier=barrier)
    empty = [str(t) for t, s in cut.snapshots.items() if s is None]
    if empty:
        raise IcebarrierError(f"{', '.join(empty)} had no snapshot at barrier {cut.barrier}; a tag needs one")
    for t in cut.snapshots:
        tbl = load_table(catalog, t)
        if name in tbl.metadata.refs:
            raise IcebarrierError(f"table {t} already has a ref named {name}; pick another tag name")
    for t, snapshot_id in cut.snapshots.items():
        load_table(catalog, t).manage_snapshots().create_tag(
            snapshot_id, name, max_ref_age_ms=int(max_age_s * 1000) if max_age_s else None
        ).commit()
    return cut
