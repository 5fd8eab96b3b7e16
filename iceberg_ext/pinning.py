"""Table metadata pinned to one snapshot, for engines that only know a catalog.

A pinned load must say the same thing everywhere an engine may look: the current snapshot
and the ``main`` ref are the pinned snapshot, and the snapshot list, snapshot log, statistics
and last sequence number hold only the pinned snapshot and its ancestors (an engine that
reads "the newest snapshot listed" then reads the pin). The metadata file is written once per
(table, snapshot), next to the table's own metadata, and reused; its content is the response.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

PINNED_PREFIX = "icebarrier-pinned-"


@dataclass(frozen=True, slots=True)
class PinnedMetadata:
    metadata_location: str
    metadata: Any  # pyiceberg TableMetadata


def pin_metadata(metadata, snapshot_id: int | None):
    """``metadata`` as of ``snapshot_id`` (None: the table had no snapshot at the cut)."""
    from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRef, SnapshotRefType

    if snapshot_id is None:
        return metadata.model_copy(
            update={
                "current_snapshot_id": None,
                "snapshots": [],
                "refs": {},
                "snapshot_log": [],
                "statistics": [],
                "partition_statistics": [],
            }
            | ({"last_sequence_number": 0} if metadata.format_version > 1 else {})
        )
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    kept, current = [], by_id.get(snapshot_id)
    if current is None:
        raise KeyError(snapshot_id)
    while current is not None:
        kept.append(current)
        current = by_id.get(current.parent_snapshot_id) if current.parent_snapshot_id is not None else None
    ids = {s.snapshot_id for s in kept}
    update = {
        "current_snapshot_id": snapshot_id,
        "snapshots": list(reversed(kept)),
        "refs": {
            MAIN_BRANCH: SnapshotRef(
                snapshot_id=snapshot_id,
                snapshot_ref_type=SnapshotRefType.BRANCH,
                min_snapshots_to_keep=None,
                max_snapshot_age_ms=None,
                max_ref_age_ms=None,
            )
        },
        "snapshot_log": [e for e in metadata.snapshot_log if e.snapshot_id in ids],
        "statistics": [s for s in metadata.statistics if s.snapshot_id in ids],
        "partition_statistics": [s for s in metadata.partition_statistics if s.snapshot_id in ids],
    }
    if metadata.format_version > 1:
        update["last_sequence_number"] = by_id[snapshot_id].sequence_number
    return metadata.model_copy(update=update)


def pinned(io, metadata, snapshot_id: int | None) -> PinnedMetadata:
    """The pinned metadata and its file (written now if this (table, snapshot) has none yet)."""
    from pyiceberg.serializers import FromInputFile, ToOutputFile

    location = f"{metadata.location.rstrip('/')}/metadata/{PINNED_PREFIX}{snapshot_id or 'empty'}.metadata.json"
    existing = io.new_input(location)
    if existing.exists():
        return PinnedMetadata(location, FromInputFile.table_metadata(existing))
    result = pin_metadata(metadata, snapshot_id)
    try:
        local = _local_path(location)
        if local is None:  # object storage: a PUT is seen whole or not at all
            ToOutputFile.table_metadata(result, io.new_output(location), overwrite=False)
        else:
            _create_whole(local, result.model_dump_json().encode())
    except FileExistsError:  # another server wrote it first: use theirs
        return PinnedMetadata(location, FromInputFile.table_metadata(io.new_input(location)))
    return PinnedMetadata(location, result)


def _local_path(location: str) -> Path | None:
    parsed = urlparse(location)
    return Path(unquote(parsed.path)) if parsed.scheme in ("", "file") else None


def _create_whole(path: Path, content: bytes) -> None:
    """Create ``path`` with ``content`` so that nobody sees it before it is whole (another server
    process may read it the moment it exists): written aside, then linked into place, which fails
    with FileExistsError if the file is there already."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(content)
    os.chmod(f.name, 0o644)  # as a metadata file PyIceberg writes (a temporary file is private)
    try:
        os.link(f.name, path)
    finally:
        os.unlink(f.name)
