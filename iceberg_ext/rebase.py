"""A pipeline's commit rebased over maintenance (DESIGN.md, "The lake maintains itself": a
pipeline's own commit always wins a race with maintenance).

A job builds its snapshots on the table as it loaded it (base snapshot X). If, meanwhile, the
maintenance service compacted the table or rewrote its manifests (snapshots marked
``icebarrier.operation=compaction``, which change no rows), the job's snapshots no longer apply:
their parent is X, the table's ``main`` is now a compaction of X. This module replays them on the
table as it is now, with the same data files and the same summary properties: each job snapshot
becomes a new snapshot on top of the compaction that adds the files it added and removes the
files it removed. No data file is written again; new manifests and manifest lists are.

A job snapshot that replaced the whole table (removed every file X held: a full recompute)
removes every file the table holds now: maintenance rewrote X's rows, and only those. It refuses
(:class:`NotRebasableError`) whatever is not that: anything but maintenance moved ``main`` since
X, the job wrote delete files, or the job removed some of X's files and the compaction rewrote
one of them (its rows now live in another file with other rows). Those are real conflicts: the
job computes again.
"""

from __future__ import annotations

from collections.abc import Sequence

from icebarrier.iceberg_ext.catalog import is_compaction, summary_properties

_MAIN = "main"
# Summary fields Iceberg computes for each snapshot: the replay computes them again.
_COMPUTED = frozenset(
    {
        "operation",
        "added-data-files",
        "added-delete-files",
        "added-equality-deletes",
        "added-equality-delete-files",
        "added-files-size",
        "added-position-deletes",
        "added-position-delete-files",
        "added-records",
        "changed-partition-count",
        "deleted-data-files",
        "deleted-records",
        "partition-summaries-included",
        "removed-delete-files",
        "removed-equality-deletes",
        "removed-equality-delete-files",
        "removed-files-size",
        "removed-position-deletes",
        "removed-position-delete-files",
        "total-data-files",
        "total-delete-files",
        "total-equality-deletes",
        "total-files-size",
        "total-position-deletes",
        "total-records",
    }
)


class NotRebasableError(Exception):
    """The job's snapshots cannot be replayed on the table as it is (``why``: one line)."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(why)


def maintenance_since(metadata, base_snapshot_id: int | None) -> list[int]:
    """The maintenance snapshots on ``main`` above ``base_snapshot_id``, newest first; raises
    :class:`NotRebasableError` if anything else moved ``main`` since then."""
    if base_snapshot_id is None:
        raise NotRebasableError("the job built on an empty table, which has commits now")
    found, snapshot = [], metadata.snapshot_by_name(_MAIN)
    while snapshot is not None and snapshot.snapshot_id != base_snapshot_id:
        if not is_compaction(snapshot):
            raise NotRebasableError(
                f"snapshot {snapshot.snapshot_id} ({snapshot.summary.operation.value if snapshot.summary else '?'}) "
                f"was committed on top of the job's base, and it is not maintenance"
            )
        found.append(snapshot.snapshot_id)
        parent = snapshot.parent_snapshot_id
        snapshot = metadata.snapshot_by_id(parent) if parent is not None else None
    if snapshot is None:
        raise NotRebasableError(f"the job's base snapshot {base_snapshot_id} is no longer an ancestor of main")
    return found


def replay(table, base_snapshot_id: int | None, job_snapshots: Sequence, io) -> tuple[tuple, tuple]:
    """(requirements, updates) that commit ``job_snapshots`` (oldest first, built on
    ``base_snapshot_id``; their manifest lists readable through ``io``) on ``table`` (a PyIceberg
    Table at the metadata to build on), which maintenance alone moved since the base.

    Raises :class:`NotRebasableError` where that is not so or a replay could change what the job
    meant (see the module docstring)."""
    from pyiceberg.manifest import ManifestContent, ManifestEntryStatus

    from icebarrier.iceberg_ext import faults

    if faults.mutated(faults.NO_REBASE):  # the checker's test of itself: maintenance wins the race
        raise NotRebasableError("the server was started with the no-rebase mutation")
    maintenance_since(table.metadata, base_snapshot_id)
    live = _live_files(table.metadata.snapshot_by_name(_MAIN), table.io)  # as the table holds them now
    tx = table.transaction()
    for i, snapshot in enumerate(job_snapshots):
        added, removed = [], []
        for manifest in snapshot.manifests(io):
            if manifest.added_snapshot_id != snapshot.snapshot_id:
                continue  # carried from the base
            if manifest.content != ManifestContent.DATA:
                raise NotRebasableError(f"the job's snapshot {snapshot.snapshot_id} writes delete files")
            for entry in manifest.fetch_manifest_entry(io, discard_deleted=False):
                if entry.status == ManifestEntryStatus.ADDED:
                    added.append(entry.data_file)
                elif entry.status == ManifestEntryStatus.DELETED:
                    removed.append(entry.data_file.file_path)
        if i == 0 and removed and set(removed) == _base_files(table.metadata, base_snapshot_id, io):
            removed = list(live)  # it replaced the whole table: maintenance rewrote those rows, not others
        gone = [path for path in removed if path not in live]
        if gone:
            raise NotRebasableError(
                f"the job's snapshot {snapshot.snapshot_id} removes {len(gone)} file(s) maintenance rewrote "
                f"(e.g. {gone[0]})"
            )
        properties = {k: v for k, v in summary_properties(snapshot).items() if k not in _COMPUTED}
        properties = {k: v for k, v in properties.items() if not k.startswith("partitions.")}
        update = tx.update_snapshot(snapshot_properties=properties)
        if removed:
            with update.overwrite() as overwrite:
                for path in removed:
                    overwrite.delete_data_file(live.pop(path))
                for data_file in added:
                    overwrite.append_data_file(data_file)
        elif added:
            with update.fast_append() as append:
                for data_file in added:
                    append.append_data_file(data_file)
        live.update((f.file_path, f) for f in added)
    return tuple(tx._requirements), tuple(tx._updates)


def _live_files(snapshot, io) -> dict:
    """path -> DataFile of every data file ``snapshot`` holds (none for no snapshot)."""
    from pyiceberg.manifest import ManifestContent

    live = {}
    for manifest in snapshot.manifests(io) if snapshot is not None else ():
        if manifest.content == ManifestContent.DATA:
            for entry in manifest.fetch_manifest_entry(io, discard_deleted=True):
                live[entry.data_file.file_path] = entry.data_file
    return live


def _base_files(metadata, base_snapshot_id: int | None, io) -> set[str]:
    """The data files the job's base snapshot held (empty if expiry removed it meanwhile)."""
    try:
        return set(_live_files(metadata.snapshot_by_id(base_snapshot_id) if base_snapshot_id else None, io))
    except OSError:  # its files went with it
        return set()


def job_snapshots(metadata, base_snapshot_id: int | None) -> list:
    """The snapshots on ``metadata``'s ``main`` above ``base_snapshot_id``, oldest first (what a
    staged commit added on top of the table as the job loaded it)."""
    chain, snapshot = [], metadata.snapshot_by_name(_MAIN)
    while snapshot is not None and snapshot.snapshot_id != base_snapshot_id:
        chain.append(snapshot)
        parent = snapshot.parent_snapshot_id
        snapshot = metadata.snapshot_by_id(parent) if parent is not None else None
    if snapshot is None and base_snapshot_id is not None:
        raise NotRebasableError(f"the staged commit does not descend from the job's base snapshot {base_snapshot_id}")
    return chain[::-1]
