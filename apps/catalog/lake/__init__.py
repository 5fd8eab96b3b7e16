"""The server's view of the lake: the SQL catalog (PyIceberg) plus the control plane.

The server serves the tables of the JDBC/SQL catalog in the control-plane database, so Spark's
JDBC catalog, PyIceberg's SQL catalog and REST clients all see one lake. It keeps no state of
its own: sessions live in Postgres; what it caches in memory (metadata files, pinned metadata)
is immutable.

Writes go through ``latest`` only. A commit to a managed table must come from a token of its
writer job and carry ``icebarrier.barrier``; the pointer swap and the commit's record in the
control plane are one Postgres transaction, and a commit of all of a job's sinks carrying
barrier B also completes B for the job in that transaction. A multi-sink job committing its
sinks one by one has them staged (``catalog_pending``, seen only by its own tokens) until it
publishes the barrier; then all pointers swap and B completes in one transaction.

Through warehouse ``job`` a job works in its *session* (:mod:`icebarrier.control_plane.job_sessions`):
its sources load at ``S(T, B)`` of the session's barrier B, its sinks with what the session
staged, and every commit to its sinks is staged for B (stamped with the barrier, job and run
when the client did not) until the session is published: all staged pointers swap and B
completes in one transaction, sinks it did not write completing B unchanged.
"""

from __future__ import annotations

from icebarrier.apps.catalog.lake.admin import Admin
from icebarrier.apps.catalog.lake.commits import Commits
from icebarrier.apps.catalog.lake.core import LATEST, LakeCore, NeedsStorage, memory_only
from icebarrier.apps.catalog.lake.loads import Loads
from icebarrier.apps.catalog.lake.views import Views

__all__ = ["LATEST", "Lake", "LakeCore", "NeedsStorage", "memory_only"]


class Lake(Loads, Commits, Admin, Views):
    """The lake as the server serves it: loads (:mod:`.loads`), job sessions (:mod:`.sessions`)
    and their staged commits (:mod:`.staging`), commits and publish (:mod:`.commits`), table
    administration (:mod:`.admin`) and views (:mod:`.views`) over one core (:mod:`.core`)."""
