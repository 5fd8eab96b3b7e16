"""What a table needs from maintenance, from one look at its metadata (DESIGN.md, "The lake
maintains itself").

:func:`look` reads a table's metadata, manifest list and data manifests (each manifest once per
process: they never change) into a :class:`Seen`; :func:`due` turns what was seen and the
table's policy into the actions due now and a sentence on what comes next. Both are cheap
enough to run for every changed table every few seconds; the actions themselves are
:mod:`icebarrier.iceberg_ext.maintenance`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from icebarrier.control_plane.upkeep import Policy
from icebarrier.iceberg_ext.maintenance import plan_candidates


@dataclass(frozen=True, slots=True, kw_only=True)
class Seen:
    """One look at a table."""

    snapshots: int
    expirable: int  # snapshots past the retention (age and count) before the protected set is asked
    expirable_at_ms: int | None  # when the next one will be, if no commit comes (epoch ms)
    data_files: int  # in the current snapshot
    small_files: int  # of those, smaller than the policy's target (3/4 of it)
    manifests: int  # in the current snapshot, with live files (the next commit drops the others)
    metadata_bytes: int  # the current metadata file

    def to_json(self) -> dict:
        return {
            "snapshots": self.snapshots,
            "data_files": self.data_files,
            "small_files": self.small_files,
            "manifests": self.manifests,
            "metadata_bytes": self.metadata_bytes,
        }


class Looker:
    """Looks at tables, remembering each data manifest's live file sizes (manifests are
    immutable, so a table's next look reads only the manifests its new commits wrote)."""

    def __init__(self, *, cache_limit: int = 100_000) -> None:
        self._sizes: dict[str, tuple[int, ...]] = {}
        self._limit = cache_limit

    def look(self, tbl, policy: Policy) -> Seen:
        from pyiceberg.manifest import ManifestContent

        candidates, retained, refs = plan_candidates(tbl, older_than_s=policy.retain_s, retain_last=policy.retain_last)
        kept = set(retained) | {sid for _, sid in refs}
        expirable = [c for c in candidates if c not in kept]
        # every other snapshot is not old enough yet: it becomes a candidate at its time plus the retention
        accounted = kept | set(candidates) | {tbl.metadata.current_snapshot_id}
        later = [
            s.timestamp_ms + int(policy.retain_s * 1000)
            for s in tbl.metadata.snapshots
            if s.snapshot_id not in accounted
        ]
        current = tbl.current_snapshot()
        sizes: list[int] = []
        # A manifest of only deleted entries (a compaction's) goes at the next commit, an append's
        # too: counted, it made a rewrite due that the next append failed (issue 67).
        manifests = [
            m
            for m in (current.manifests(tbl.io) if current is not None else [])
            if m.has_added_files() or m.has_existing_files()
        ]
        for manifest in manifests:
            if manifest.content != ManifestContent.DATA:
                continue
            if manifest.manifest_path not in self._sizes:
                if len(self._sizes) >= self._limit:
                    self._sizes.clear()
                entries = manifest.fetch_manifest_entry(tbl.io, discard_deleted=True)
                self._sizes[manifest.manifest_path] = tuple(e.data_file.file_size_in_bytes for e in entries)
            sizes.extend(self._sizes[manifest.manifest_path])
        return Seen(
            snapshots=len(tbl.metadata.snapshots),
            expirable=len(expirable),
            expirable_at_ms=min(later, default=None),
            data_files=len(sizes),
            small_files=sum(1 for size in sizes if policy.small(size)),
            manifests=len(manifests),
            metadata_bytes=len(tbl.io.new_input(tbl.metadata_location)),
        )


def due(seen: Seen, policy: Policy, *, orphans_at: float, now: float) -> tuple[tuple[str, ...], str]:
    """The actions due now (in the order they run) and what comes next, in words.

    ``orphans_at``: when the table's next orphan and metadata-file removal is due (time.time())."""
    actions = []
    if seen.expirable:
        actions.append("expire")
    if seen.small_files >= policy.compact_min_files:
        actions.append("compact")
    if seen.manifests > policy.max_manifests:
        actions.append("rewrite-manifests")
    if now >= orphans_at:
        actions.append("remove-orphans")
    parts = []
    if seen.expirable_at_ms is not None:
        parts.append(f"expire in {max(0.0, seen.expirable_at_ms / 1000 - now):.0f}s")
    parts.append(f"compact at {policy.compact_min_files} small files ({seen.small_files} now)")
    parts.append(f"rewrite manifests past {policy.max_manifests} ({seen.manifests} now)")
    parts.append(f"remove orphans in {max(0.0, orphans_at - now):.0f}s")
    return tuple(actions), "; ".join(parts)


def enroll(conn, settings, table) -> None:
    """Make sure ``table`` is maintained: a managed table is; one of the catalog's tables no job
    writes is enrolled (as the maintenance service would at its next pass). Raises
    :class:`~icebarrier.control_plane.errors.TableNotFoundError` for a table that is neither."""
    from icebarrier.control_plane import tables, upkeep
    from icebarrier.control_plane.errors import TableNotFoundError
    from icebarrier.iceberg_ext.catalog import pointers

    if tables.is_managed(conn, table):
        return
    if table not in pointers(conn, settings, only=table):
        raise TableNotFoundError(str(table))
    upkeep.enroll(conn, table)
