"""A service's fence (control_plane/fences.py) across a failover of the control plane's Postgres
(apps/pg_pair.py): the advisory lock dies with the primary, the lease in the state row does not.
At no moment may two holders act; without waiting for the lease (the fence broken on purpose)
they do, and this test sees it."""

from __future__ import annotations

import threading
import time

import pytest

from icebarrier.control_plane import schema
from icebarrier.control_plane.fences import TTL_ENV, Fence

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("wait_for_lease", [True, False], ids=["lease", "no-lease"])
def test_no_two_holders_act_across_a_failover(pg_pair, monkeypatch, wait_for_lease):
    # without the wait (broken on purpose) the new holder takes over inside the old one's lease: a
    # lease long enough that a slow promotion on a loaded machine still falls inside it
    monkeypatch.setenv(TTL_ENV, "3s" if wait_for_lease else "20s")
    dsn = pg_pair.dsn()
    schema.upgrade(dsn, "icebarrier")
    said: list[str] = []
    old = Fence("maintenance", "maintenance_state", dsn=dsn, schema="icebarrier", log=said.append)
    assert old.acquire(threading.Event())
    new = Fence(
        "maintenance", "maintenance_state", dsn=dsn, schema="icebarrier", log=said.append, wait_for_lease=wait_for_lease
    )
    took: dict[str, float] = {}
    stop = threading.Event()
    waiter = threading.Thread(target=lambda: new.acquire(stop, poll_s=0.2) and took.setdefault("at", time.monotonic()))
    waiter.start()
    try:
        time.sleep(1)
        assert not took, "the lock is held: nobody else takes the service"
        assert old.alive()  # a look, its lease renewed, just before the primary dies
        pg_pair.fail_over()
        waiter.join(30)
        assert "at" in took, said
        both_act = took["at"] < old.valid_until  # the old holder may still act then (its lease runs)
        assert both_act is not wait_for_lease, said
        assert not old.alive()  # its next look finds the lock gone
        if wait_for_lease:
            assert any("may still act until its lease lapses" in line for line in said), said
    finally:
        stop.set()
        waiter.join(30)
        new.release()
        old.release()
