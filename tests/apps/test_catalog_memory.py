"""The catalog serves a load on its event loop only while memory suffices."""

from __future__ import annotations

import pytest

from icebarrier.apps.catalog.lake.core import _LRU, NeedsStorage, memory_only


def test_a_cache_miss_under_memory_only_reads_nothing_and_says_so():
    """Under memory_only a miss raises NeedsStorage without calling the loader (no file is read
    on the event loop); a hit is served; outside, the loader fills the cache."""
    cache, reads = _LRU(2), []

    def read():
        reads.append(1)
        return "metadata"

    with memory_only(), pytest.raises(NeedsStorage):
        cache.get("s3://lake/t/metadata/1.json", read)
    assert reads == []
    assert cache.get("s3://lake/t/metadata/1.json", read) == "metadata"
    with memory_only():
        assert cache.get("s3://lake/t/metadata/1.json", read) == "metadata"
    assert reads == [1]
