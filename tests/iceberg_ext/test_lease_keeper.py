"""Repeatable-read leases cannot lapse while their reader runs, and never lapse silently."""

import time

import psycopg
import pytest

from icebarrier.control_plane import leases
from icebarrier.control_plane.model import Level
from icebarrier.iceberg_ext.errors import LeaseLostError
from icebarrier.iceberg_ext.reads import ConsistentRead
from tests.iceberg_ext import pipeline
from tests.iceberg_ext.pipeline import run_barrier

TTL_S = 1.5


def _lease_state(lake, lease_id):
    with psycopg.connect(lake.settings.dsn, autocommit=True, options=f"-c search_path={lake.settings.schema}") as c:
        row = c.execute(
            "SELECT released_at IS NULL AND expires_at > now() FROM lease WHERE lease_id = %s", (lease_id,)
        ).fetchone()
    return row[0]


def test_lease_survives_a_caller_holding_transactions_open(lake):
    """TTL 1.5 s, 6 s session while the caller keeps a transaction open (and then rolls one
    back): the lease stays active, is renewed on its own connection, and reads keep working."""
    pipeline.setup(lake)
    run_barrier(lake, 1)
    names = [lake.T("orders"), lake.T("totals"), lake.T("report")]
    with ConsistentRead(lake.conn, lake.catalog, names, level=Level.REPEATABLE_READ, ttl_s=TTL_S) as r:
        lease_id = r.cut().lease_id
        first = r.read()[1][lake.T("orders")].num_rows
        with lake.conn.transaction():
            lake.conn.execute("SELECT 1")
            time.sleep(3 * TTL_S)
            assert _lease_state(lake, lease_id), "the lease lapsed while the caller's transaction was open"
        with pytest.raises(ZeroDivisionError):
            with lake.conn.transaction():
                time.sleep(TTL_S)
                raise ZeroDivisionError  # the caller's transaction rolls back; the lease must not go with it
        time.sleep(TTL_S)
        assert _lease_state(lake, lease_id)
        run_barrier(lake, 2)  # new commits do not move a repeatable read
        assert r.read()[1][lake.T("orders")].num_rows == first
        assert r.lease_renewals >= 5
    assert leases.get(lake.conn, lease_id).state == "released"


def test_renewal_survives_a_dropped_connection(lake):
    """The keeper's backend is terminated: it reconnects and renews before the TTL runs out."""
    pipeline.setup(lake)
    run_barrier(lake, 1)
    with ConsistentRead(lake.conn, lake.catalog, [lake.T("orders")], level=Level.REPEATABLE_READ, ttl_s=TTL_S) as r:
        lease_id = r.cut().lease_id
        pid = r._keeper.conn.info.backend_pid
        lake.conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        time.sleep(3 * TTL_S)
        assert _lease_state(lake, lease_id)
        r.read()


def test_a_lost_lease_stops_the_next_statement(lake):
    """A lease that could not be renewed (here: released behind the reader's back) makes the
    next statement raise LeaseLostError instead of reading unprotected snapshots."""
    pipeline.setup(lake)
    run_barrier(lake, 1)
    with ConsistentRead(lake.conn, lake.catalog, [lake.T("orders")], level=Level.REPEATABLE_READ, ttl_s=TTL_S) as r:
        r.read()
        leases.release(lake.conn, r.cut().lease_id)
        time.sleep(TTL_S)
        with pytest.raises(LeaseLostError, match="was not renewed .*Start a new repeatable-read session"):
            r.read()
        with pytest.raises(LeaseLostError):
            r.arrow(lake.T("orders"))
