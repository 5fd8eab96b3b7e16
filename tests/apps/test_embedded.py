"""The embedded Postgres (tests' last resort and the zero-config demo's server)."""

import socket

import psycopg

from icebarrier.control_plane import schema
from icebarrier.apps.embedded import EmbeddedPostgres


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
