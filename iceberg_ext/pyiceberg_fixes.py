"""A fix to PyIceberg that icebarrier carries until a PyIceberg release has it.

PyIceberg 0.12's ``Transaction.table_metadata`` replays the staged updates and deep-copies the
whole metadata, every snapshot included, on each read, and one append reads it about twenty
times: an append's cost grows with the snapshots a table keeps (at 160 snapshots, 81 ms of
which three quarters were deep copies). apache/iceberg-python#3302 and #3784 cache the result
between reads, keyed on the identity of its two inputs; this is the same cache. The staged
updates are a tuple that every staging rebinds, and a commit or refresh replaces the table's
metadata object, so a changed input is a different object and the cache misses by itself.
"""

from __future__ import annotations

_installed = False


def install() -> None:
    """Cache ``Transaction.table_metadata`` between reads of an unchanged transaction (idempotent)."""
    global _installed
    if _installed:
        return
    from pyiceberg.table import Transaction
    from pyiceberg.table.update import update_table_metadata

    def table_metadata(self):
        cached = self.__dict__.get("_icebarrier_metadata")
        if cached is not None and cached[0] is self._table.metadata and cached[1] is self._updates:
            return cached[2]
        metadata = update_table_metadata(self._table.metadata, self._updates)
        self._icebarrier_metadata = (self._table.metadata, self._updates, metadata)
        return metadata

    Transaction.table_metadata = property(table_metadata)  # type: ignore[method-assign,assignment]
    _installed = True
