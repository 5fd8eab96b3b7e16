"""Errors of the Iceberg side (the control plane's are in :mod:`icebarrier.control_plane.errors`)."""

from __future__ import annotations

from icebarrier.control_plane.errors import IcebarrierError


class StatementNotPinnableError(IcebarrierError):
    """A Spark SQL statement references a managed table in a way a consistent read cannot pin."""

    def __init__(self, table: str | None, reason: str) -> None:
        self.table, self.reason = table, reason
        super().__init__(f"table {table}: {reason}" if table else reason)


class LeaseLostError(IcebarrierError):
    """A repeatable-read lease could not be renewed; its snapshots are no longer protected."""

    def __init__(self, lease_id: str, reason: str) -> None:
        self.lease_id, self.reason = lease_id, reason
        super().__init__(
            f"lease {lease_id} was not renewed ({reason}); its snapshots may be expired, so this read "
            f"stopped instead of reading unprotected. Start a new repeatable-read session"
        )


class ArtifactUnavailableError(IcebarrierError):
    """A pinned artifact (a jar Spark needs…) is not in the cache and could not be fetched, or a
    copy fails its checksum."""

    def __init__(self, message: str, *, coordinates: str) -> None:
        super().__init__(message)
        self.coordinates = coordinates


class SparkUnavailableError(IcebarrierError):
    """PySpark or a jar Spark needs is missing, or the PySpark installed is of a Spark line
    Iceberg serves no runtime for."""


class CompactionDeferredError(IcebarrierError):
    """A compaction that must wait: the table's newest commit is not completed yet, or a job
    session's commit is staged on it (a rewrite would land under the session)."""

    def __init__(self, table, message: str) -> None:
        super().__init__(message)
        self.table = table
