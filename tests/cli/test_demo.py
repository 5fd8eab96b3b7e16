"""The zero-config demo, run as a user would (its own process, its own Spark)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_shows_anomalies_only_at_read_uncommitted(pg_server):
    """The transfers demo: read-uncommitted sees anomalies, read-committed and repeatable-read
    none; the lease keeps its snapshot through expiry; the demo database is dropped after."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "icebarrier.cli.main",
            "--dsn",
            pg_server,
            "--output",
            "json",
            "demo",
            "--scenario",
            "transfers",
            "--rounds",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    levels = out["results"][0]["levels"]
    assert levels["read-uncommitted"]["anomalies"] > 0
    assert levels["read-committed"]["anomalies"] == 0 and levels["read-committed"]["queries"] > 0
    assert levels["repeatable-read"]["anomalies"] == 0 and out["results"][0]["repeatable_read_changes"] == 0
    assert out["results"][0]["expiry"]["kept_by_lease"]
    import psycopg

    with psycopg.connect(pg_server) as c:
        assert c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (out["database"],)).fetchone() is None
