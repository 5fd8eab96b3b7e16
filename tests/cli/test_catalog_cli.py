"""`icebarrier token` and `icebarrier connect`: tokens printed once and stored hashed, and a
configuration for each engine that names the warehouse, the server and the credential."""

import json

import pytest

from icebarrier.apps.catalog.clients import ENGINES


def test_a_token_is_printed_once_and_stored_hashed(cli, conn):
    """`token create` prints CLIENT_ID:SECRET (JSON: client_id, client_secret, role, job); the
    database holds only a hash; `token list` never shows the secret; `revoke` marks it."""
    made = json.loads(cli("token", "create", "--job", "ingest", "--name", "nightly", output="json").stdout)
    assert made["role"] == "job" and made["job"] == "ingest" and len(made["client_secret"]) >= 40
    stored = conn.execute("SELECT secret_hash FROM catalog_token WHERE client_id = %s", (made["client_id"],)).fetchone()
    assert made["client_secret"] not in stored["secret_hash"]
    listed = cli("token", "list").stdout
    assert made["client_id"] in listed and made["client_secret"] not in listed and "nightly" in listed
    text = cli("token", "create", "--reader", "--whole-lake").stdout.strip()
    assert text.count(":") == 1 and text.startswith("ib-")
    assert cli("token", "revoke", made["client_id"]).exit_code == 0
    assert json.loads(cli("token", "list", output="json").stdout)[0]["revoked_at"] is not None


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "trino"])
def test_connect_prints_a_configuration_for_each_engine(cli, engine):
    """Each engine's configuration names the warehouse, the URI and the credential; Spark's
    turns its table cache off (a query's tables load in one session moment). (Trino's asks a
    live server where the files live: tests/iceberg_ext/test_trino.py runs it.)"""
    out = cli(
        "connect",
        "--engine",
        engine,
        "--warehouse",
        "read-committed:shop",
        "--uri",
        "http://cat:8181",
        "--credential",
        "ib-1:s3cret",
    ).stdout
    assert "read-committed:shop" in out and "http://cat:8181" in out and "s3cret" in out
    if engine == "spark":
        assert "spark.sql.catalog.lake.cache-enabled false" in out and "spark.sql.catalog.lake.type rest" in out


def test_spark_conf_via_rest_writes_through_the_catalog(cli):
    """`spark-conf --via rest` points the job's catalog at the server's latest warehouse with the
    job token (kept out of sight unless --show-secrets), table cache off."""
    conf = json.loads(
        cli(
            "spark-conf",
            "--via",
            "rest",
            "--uri",
            "http://cat:8181",
            "--credential",
            "ib-1:s3cret",
            "--format",
            "json",
            "--show-secrets",
        ).stdout
    )
    assert conf["spark.sql.catalog.lake.type"] == "rest" and conf["spark.sql.catalog.lake.uri"] == "http://cat:8181"
    assert conf["spark.sql.catalog.lake.warehouse"] == "latest"
    assert conf["spark.sql.catalog.lake.credential"] == "ib-1:s3cret"
    assert conf["spark.sql.catalog.lake.cache-enabled"] == "false"
    hidden = cli("spark-conf", "--via", "rest", "--credential", "ib-1:s3cret", "--format", "json").stdout
    assert "s3cret" not in hidden
