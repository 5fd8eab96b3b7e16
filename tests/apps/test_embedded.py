"""The embedded Postgres (tests' last resort and the zero-config demo's server)."""

import socket

import psycopg
import pytest

from icebarrier.apps.embedded import EmbeddedPostgres
from icebarrier.control_plane import schema, schema_version

# embedded servers one at a time (tests/conftest.py, pytest_collection_modifyitems)
pytestmark = pytest.mark.xdist_group("embedded-postgres")


def test_embedded_postgres_starts_on_tcp_restarts_and_stops(tmp_path):
    """It listens on 127.0.0.1, takes migrations, is reused while running, and stops."""
    server = EmbeddedPostgres(state_dir=tmp_path / "state")
    dsn = server.start()
    try:
        assert dsn.startswith("postgresql://postgres@127.0.0.1:")
        assert server.start() == dsn  # reused, not started twice
        assert schema.upgrade(dsn).up_to_date
        with psycopg.connect(dsn) as c:
            assert c.execute("SHOW listen_addresses").fetchone()[0] == "127.0.0.1"
    finally:
        server.stop()
    port = int(dsn.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert list((tmp_path / "state").iterdir())  # data stays inside the state directory


def test_removing_it_leaves_nothing_behind(tmp_path):
    """remove(): the state directory is gone, every directory mode it changed on the way is as
    before, and the OS user (as root) exists only if it existed before."""
    import os
    import pwd
    import stat

    state = tmp_path / "deep" / "state"
    state.parent.mkdir(mode=0o700)
    # the directories of this test only: those above tmp_path are shared with the other xdist
    # workers, whose embedded servers open and restore them meanwhile (a race, not a leak)
    before = {p: stat.S_IMODE(p.stat().st_mode) for p in (state.parent, tmp_path)}
    user = EmbeddedPostgres.runs_as()
    existed = user is None or any(u.pw_name == user for u in pwd.getpwall())
    server = EmbeddedPostgres(state_dir=state)
    server.start()
    if os.geteuid() == 0:
        assert stat.S_IMODE(state.parent.stat().st_mode) & stat.S_IXOTH  # opened for the server's user
    server.remove()
    assert not state.exists()
    assert {p: stat.S_IMODE(p.stat().st_mode) for p in before} == before
    if user is not None:
        assert any(u.pw_name == user for u in pwd.getpwall()) == existed


def test_the_postgres_command_runs_one_to_try_icebarrier_between_commands(tmp_path):
    """`icebarrier postgres start` prints a DSN alone (for `export ICEBARRIER_DSN=$(…)`), of a
    database `icebarrier` on a server that outlives the command and is found again; `stop` stops
    it with its data kept (the control plane's schema is there after the next start); `remove`
    leaves nothing under the state directory."""
    import os
    import subprocess

    from icebarrier.apps.embedded import CLI

    env = {**os.environ, "ICEBARRIER_HOME": str(tmp_path / "home")}
    env.pop("ICEBARRIER_DSN", None)

    def icebarrier(*args: str) -> str:
        done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    dsn = icebarrier("postgres", "start")
    try:
        assert dsn.startswith("postgresql://postgres@127.0.0.1:") and dsn.endswith("/icebarrier"), dsn
        assert icebarrier("postgres", "start") == dsn  # running: found, not started again
        icebarrier("--dsn", dsn, "db", "upgrade")
        assert "stopped" in icebarrier("postgres", "stop")
        port = int(dsn.rsplit(":", 1)[1].split("/")[0])
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
        assert icebarrier("postgres", "start") == dsn  # the same port, its data kept:
        with psycopg.connect(dsn) as conn:
            assert schema_version.status(conn, "icebarrier").up_to_date
    finally:
        icebarrier("postgres", "remove")
    assert not (tmp_path / "home" / "postgres").exists()
