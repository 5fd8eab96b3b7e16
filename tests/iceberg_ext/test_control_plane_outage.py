"""The control-plane Postgres drops the catalog server's connections (a restart, a failover):
clients never see a 500. Idle connections are pinged before use and replaced; a request that
meets a dead one mid-flight is retried where that is safe (reads, the token grant, writes with
an ``Idempotency-Key``), else answered 503 with ``Retry-After`` in the error model."""

from __future__ import annotations

import time

import pytest
import requests
import uuid6

from icebarrier.control_plane import tokens
from tests.iceberg_ext.catalog_server import Pipeline, access_token, start_server, stop_server

pytestmark = pytest.mark.slow


def _drop_server_connections(lake) -> int:
    """Terminate every backend of the lake's database but the test's own (what a restart does to
    the server's pool); wait until they are gone."""
    killed = lake.conn.execute(
        "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
    ).fetchone()["n"]
    deadline = time.monotonic() + 10
    while lake.conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
        "AND backend_start < now() - interval '0.5 s'"
    ).fetchone()["n"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return killed


def _served(lake, **env):
    p = Pipeline(lake, {"solo": ["facts"]})
    p.advance()
    jid, secret = tokens.create(lake.conn, job=f"{lake.namespace}_solo", whole_lake=True)
    proc, uri = start_server(lake, env_extra=env)
    return proc, uri, jid, secret


def test_idle_connections_killed_by_a_restart_are_replaced_before_use(own_lake):
    proc, uri, jid, secret = _served(own_lake)
    try:
        auth = {"Authorization": f"Bearer {access_token(uri, jid, secret)}"}
        table = f"{uri}/v1/latest/namespaces/{own_lake.namespace}/tables/facts"
        assert requests.get(table, headers=auth, timeout=30).status_code == 200
        assert _drop_server_connections(own_lake) >= 1
        time.sleep(1.2)  # past the pool's idle check (ICEBARRIER_POOL_CHECK_IDLE, 1 s)
        for _ in range(5):
            assert requests.get(table, headers=auth, timeout=30).status_code == 200
        assert access_token(uri, jid, secret)
    finally:
        stderr = stop_server(proc)
    assert "Traceback" not in stderr, stderr[-3000:]


def test_a_request_meeting_a_dead_connection_is_retried_if_safe_else_answered_503(own_lake):
    """The pool's idle check off (an hour), so every pooled connection the drop killed is met
    mid-request."""
    proc, uri, jid, secret = _served(own_lake, ICEBARRIER_POOL_CHECK_IDLE="1h")
    try:
        auth = {"Authorization": f"Bearer {access_token(uri, jid, secret)}"}
        ns = f"{uri}/v1/latest/namespaces/{own_lake.namespace}"
        table = f"{ns}/tables/facts"
        assert requests.get(table, headers=auth, timeout=30).status_code == 200

        _drop_server_connections(own_lake)  # a read: retried on a fresh connection
        assert requests.get(table, headers=auth, timeout=30).status_code == 200

        _drop_server_connections(own_lake)  # the token grant: retried
        assert access_token(uri, jid, secret)

        _drop_server_connections(own_lake)  # a write without a key: 503, Retry-After, nothing applied
        change = {"updates": {"outage": "keyless"}, "removals": []}
        answer = requests.post(f"{ns}/properties", json=change, headers=auth, timeout=30)
        assert answer.status_code == 503, answer.text
        assert answer.headers["Retry-After"] == "1"
        error = answer.json()["error"]
        assert error["type"] == "ServiceUnavailableException" and "retry" in error["message"]
        assert "outage" not in requests.get(ns, headers=auth, timeout=30).json()["properties"]

        _drop_server_connections(own_lake)  # a write with a key: retried, applied once
        keyed = {**auth, "Idempotency-Key": str(uuid6.uuid7())}
        change = {"updates": {"outage": "keyed"}, "removals": []}
        answer = requests.post(f"{ns}/properties", json=change, headers=keyed, timeout=30)
        assert answer.status_code == 200, answer.text
        assert requests.get(ns, headers=auth, timeout=30).json()["properties"]["outage"] == "keyed"
    finally:
        stderr = stop_server(proc)
    assert "internal error" not in stderr, stderr[-3000:]
