"""Orphan-file removal deletes the files under a table's location that nothing references (failed
and killed runs leave them: commits staged and never published; so do commits replayed over a
maintenance commit, and expiries that kept what a staged commit still named), older than a grace
period and older than any session or staging of the table still open; a metadata file a live
idempotency key names (a keyed commit's answer, read back for a retry) is kept. Everything under
the table's metadata folder (metadata files, manifest lists, manifests) is written by a commit
moments before it swaps the pointer, so it goes after the metadata grace; data files after the
orphan grace. It works the same on a local directory and on object storage (it lists through the
table's own FileIO).

On a local warehouse Spark writes a Hadoop checksum ``.NAME.crc`` beside each file NAME. It
belongs to NAME: referenced when NAME is, an orphan of NAME's kind when NAME is not, and deleted
with NAME when maintenance deletes NAME.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

from icebarrier.control_plane import db, idempotency, job_sessions, leases
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.catalog import load_table
from icebarrier.iceberg_ext.locations import inside, normalized, reader
from icebarrier.iceberg_ext.maintenance import reachable_files, same_file, staged_files


def checked_by(key: tuple[str, str, str]) -> tuple[str, str, str] | None:
    """The file a Hadoop checksum file checks (``.NAME.crc`` beside NAME, as :func:`same_file`
    gives them), or None if ``key`` is not one."""
    scheme, netloc, path = key
    folder, name = os.path.split(path)
    if scheme == "file" and name.startswith(".") and name.endswith(".crc") and len(name) > len("..crc"):
        return (scheme, netloc, os.path.join(folder, name[1 : -len(".crc")]))
    return None


ORPHAN_GRACE_S = 3 * 86400.0  # Iceberg's own default for remove_orphan_files


@dataclass(frozen=True, slots=True, kw_only=True)
class OrphanReport:
    table: TableName
    listed: int
    orphans: tuple[str, ...]
    kept_recent: int
    dry_run: bool
    metadata_files: int  # under the table's metadata folder, after the removal (a dry run: none removed)
    data_files: int | None  # the rest of the table's location, after the removal (None: not listed)

    def to_json(self) -> dict:
        return {
            "table": str(self.table),
            "listed": self.listed,
            "orphans": list(self.orphans),
            "kept_recent": self.kept_recent,
            "dry_run": self.dry_run,
            "metadata_files": self.metadata_files,
            "data_files": self.data_files,
        }


def referenced_files(
    tbl, staged: tuple[tuple[str, str | None], ...], manifests: MutableMapping[str, set[str]] | None = None
) -> set[str]:
    """Every file the table's metadata reaches: snapshots' files, metadata files (current,
    logged, statistics, pinned ones of live snapshots) and what its staged commits use
    (``staged``: :func:`~icebarrier.iceberg_ext.maintenance.staged_files`).
    ``manifests``: the data files of manifests read before (a manifest never changes), by path."""
    from icebarrier.iceberg_ext.pinning import PINNED_PREFIX

    cache = manifests if manifests is not None else {}
    metadata = tbl.metadata
    table_snapshots = {s.snapshot_id for s in metadata.snapshots}
    files = reachable_files(tbl, metadata.snapshots, cache) | staged_files(tbl, staged, table_snapshots)
    files |= {tbl.metadata_location, *(e.metadata_file for e in metadata.metadata_log)}
    files |= {s.statistics_path for s in metadata.statistics}
    files |= {s.statistics_path for s in metadata.partition_statistics}
    base = f"{metadata.location.rstrip('/')}/metadata/{PINNED_PREFIX}"
    files |= {f"{base}{s.snapshot_id}.metadata.json" for s in metadata.snapshots} | {f"{base}empty.metadata.json"}
    return files


def _listing(tbl, nested: list[str], folder: str):
    """(path as the table names it, what it names (:func:`same_file`), modified time) of every file
    under ``folder`` (the table's location or a folder in it), skipping other tables' locations
    nested inside it (``nested``: their paths, as :func:`same_file` gives them)."""
    from pyarrow.fs import FileSelector, FileType
    from pyiceberg.io.pyarrow import PyArrowFileIO

    scheme, netloc, path = PyArrowFileIO.parse_location(folder)
    io = tbl.io if isinstance(tbl.io, PyArrowFileIO) else PyArrowFileIO(tbl.io.properties)
    fs = io.fs_by_scheme(scheme, netloc)
    prefix = folder[: len(folder) - len(path)] if folder.endswith(path) else f"{scheme}://"
    for info in fs.get_file_info(FileSelector(path, recursive=True, allow_not_found=True)):
        if info.type != FileType.File:
            continue
        name = f"{prefix}{info.path}"
        key = same_file(name)
        if not any(key[2].startswith(f"{n}/") for n in nested):
            yield name, key, info.mtime


def remove_orphans(
    conn: db.Conn,
    catalog,
    table: TableName,
    *,
    catalog_schema: str,
    older_than_s: float = ORPHAN_GRACE_S,
    metadata_older_than_s: float | None = None,
    dry_run: bool = False,
    metadata_only: bool = False,
    manifests: MutableMapping[str, set[str]] | None = None,
) -> OrphanReport:
    """Delete the files under ``table``'s location that nothing references, modified more than
    ``older_than_s`` ago (files under the metadata folder: ``metadata_older_than_s``, if given; a
    commit writes its manifests, manifest list and metadata file moments before it swaps the
    pointer) and before any session or staging of the table opened (its files may not be
    referenced yet). Runs under the table's expiry lock (one maintenance at a time).
    A table living inside this one's folder keeps its files (:func:`~icebarrier.iceberg_ext.locations.inside`:
    the placements under the location of the catalog in ``catalog_schema``). ``metadata_only``: list only
    the metadata folder (what a commit every second piles up), if it lies in the table's location;
    the report then counts no data files. ``manifests``: see :func:`referenced_files`."""
    import datetime as dt

    with leases.expiry_lock(conn, table):
        staging = job_sessions.staging(conn, table)
        tbl = load_table(catalog, table)
        referenced = {
            same_file(p)
            for p in referenced_files(tbl, staging.pending, manifests)
            | idempotency.referenced(conn, tbl.metadata.location)
        }
        now = dt.datetime.now(dt.UTC)
        cutoff = now - dt.timedelta(seconds=older_than_s)
        metadata_cutoff = now - dt.timedelta(seconds=metadata_older_than_s or older_than_s)
        if staging.open_since is not None:
            cutoff, metadata_cutoff = min(cutoff, staging.open_since), min(metadata_cutoff, staging.open_since)
        location = same_file(tbl.metadata.location.rstrip("/"))[2]
        spot = normalized(tbl.metadata.location)
        read = reader(catalog.properties)
        nested = [same_file(p.location)[2] for p in inside(conn, catalog_schema, table.catalog, spot, read)]
        metadata_path = metadata_folder_of(tbl)
        metadata_folder = same_file(metadata_path)[2] + "/"
        metadata_only = metadata_only and metadata_folder.startswith(f"{location}/")
        folder = metadata_path if metadata_only else tbl.metadata.location.rstrip("/")
        listed, orphans, recent, counts = 0, [], 0, {True: 0, False: 0}
        for path, key, modified in _listing(tbl, nested, folder):
            listed += 1
            in_metadata = key[2].startswith(metadata_folder)
            counts[in_metadata] += 1
            if (checked_by(key) or key) in referenced:
                continue
            limit = metadata_cutoff if in_metadata else cutoff
            if modified is not None and modified.astimezone(dt.UTC) >= limit:
                recent += 1
                continue
            orphans.append(path)
            if not dry_run:  # the count is of what the table holds after the removal
                counts[in_metadata] -= 1
        if not dry_run:
            for path in orphans:  # a checksum is listed, and goes, on its own
                tbl.io.delete(path)
    return OrphanReport(
        table=table,
        listed=listed,
        orphans=tuple(sorted(orphans)),
        kept_recent=recent,
        dry_run=dry_run,
        metadata_files=counts[True],
        data_files=None if metadata_only else counts[False],
    )


def metadata_folder_of(tbl) -> str:
    """Where the table writes its metadata files, manifest lists and manifests."""
    from pyiceberg.table import TableProperties

    location = tbl.metadata.location.rstrip("/")
    return tbl.properties.get(TableProperties.WRITE_METADATA_PATH, f"{location}/metadata").rstrip("/")
