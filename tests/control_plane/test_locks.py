"""Lock waits are bounded: a control-plane lock not granted within lock_timeout fails with
the backend that holds it named, and nothing written."""

import psycopg
import pytest

from icebarrier.control_plane import db, jobs
from icebarrier.control_plane.errors import ConfigurationError, LockTimeoutError
from tests.helpers import T, job


def test_a_held_topology_lock_times_out_naming_its_holder(dsn, cli, monkeypatch):
    """Another session holds the topology lock (any role that can connect can take advisory
    locks): registration waits ICEBARRIER_LOCK_TIMEOUT, then fails naming that backend."""
    monkeypatch.setenv("ICEBARRIER_LOCK_TIMEOUT", "1s")
    with db.connect(dsn) as conn, psycopg.connect(dsn) as holder:
        holder.execute("SELECT set_config('application_name', 'someone-else', false)")
        holder.execute("SELECT pg_advisory_xact_lock(icebarrier.lock_key('topology'), 0)")  # held until rollback
        with pytest.raises(
            LockTimeoutError,
            match=f"registering job late: waited 1s for a lock held by backend "
            f"{holder.info.backend_pid} .*'someone-else'",
        ) as caught:
            jobs.register(conn, job("late", sinks=["late_t"]))
        assert caught.value.holders[0]["pid"] == holder.info.backend_pid
        result = cli("job", "register", "late", "--external", "x", "--sink", str(T("late_t")))
        assert result.exit_code == 1 and f"backend {holder.info.backend_pid}" in result.stderr
        assert result.stderr.count("\n") == 1
        holder.rollback()
        assert "late" not in jobs.load_definitions(conn)
        jobs.register(conn, job("late", sinks=["late_t"]))  # released: it goes through


def test_timeouts_are_set_on_every_connection_and_validated(dsn, monkeypatch):
    """Connections carry lock_timeout and statement_timeout; a malformed setting is refused."""
    monkeypatch.setenv("ICEBARRIER_STATEMENT_TIMEOUT", "2s")
    with db.connect(dsn) as conn:
        assert conn.execute("SHOW lock_timeout").fetchone()["lock_timeout"] == "10s"
        assert conn.execute("SHOW statement_timeout").fetchone()["statement_timeout"] == "2s"
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(5)")
    monkeypatch.setenv("ICEBARRIER_LOCK_TIMEOUT", "soon")
    with pytest.raises(ConfigurationError, match="ICEBARRIER_LOCK_TIMEOUT='soon' is not a duration"):
        db.connect(dsn)
