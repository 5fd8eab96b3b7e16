"""Every client we support, over https with a certificate from a CA of the operator's own
(`serve --tls-cert/--tls-key`, the clients given `--ca-cert`): `job exec` running a Spark, a
DuckDB and a PyIceberg job (each engine told to trust the CA by the environment job exec gives
it), `schedule` starting a job's run, and `icebarrier connect`'s printed configuration for
DuckDB, PyIceberg and Spark."""

from __future__ import annotations

import json
import subprocess
import sys

import duckdb
import pytest
import yaml
from click.testing import CliRunner

from icebarrier.apps.catalog.clients import TRUSTSTORE_PASSWORD
from icebarrier.apps.embedded import CLI
from icebarrier.cli.main import cli as command
from icebarrier.control_plane import barriers, jobs, targets, tokens
from icebarrier.control_plane.model import JobDefinition
from icebarrier.control_plane.targets import Runner
from tests.helpers import LoggedProcess
from tests.iceberg_ext.catalog_server import start_server, stop_server
from tests.iceberg_ext.test_job_exec import ENGINES, SINKS, check_cut, job_exec, setup_pipeline
from tests.iceberg_ext.test_job_exec import command as job_command

pytestmark = pytest.mark.slow


@pytest.fixture
def tls_server(lake, tmp_path):
    """`icebarrier serve` over https (its certificate from a trustme CA); (its https URI, the CA's PEM)."""
    import trustme

    ca = trustme.CA()
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    pem = str(tmp_path / "server.pem")
    proc, plain = start_server(lake, "--tls-cert", pem, "--tls-key", pem)
    yield plain.replace("http://", "https://"), str(tmp_path / "ca.pem")
    err = stop_server(proc)
    assert "Traceback" not in err, err[-3000:]


def connect(engine: str, uri: str, credential: str, ca: str | None, warehouse: str = "latest") -> str:
    args = ["--output", "json", "connect", "--engine", engine, "--uri", uri, "--credential", credential]
    done = CliRunner().invoke(command, [*args, "--warehouse", warehouse, *(["--ca-cert", ca] if ca else [])])
    assert done.exit_code == 0, done.output
    return json.loads(done.output)["configuration"]


def test_job_exec_runs_spark_duckdb_and_pyiceberg_jobs_over_https(lake, tls_server, monkeypatch):
    """The three-engine pipeline through an https catalog: Spark writes the root (its JVM trusts
    the CA through the truststore job exec writes), DuckDB counts it (``ca_cert_file``), PyIceberg
    summarizes (``REQUESTS_CA_BUNDLE``); every barrier reads as an exact cut. Without --ca-cert,
    job exec refuses to talk to a server it cannot verify, and says so in one line."""
    uri, ca = tls_server
    monkeypatch.delenv("ICEBARRIER_CA_CERT", raising=False)
    creds = setup_pipeline(lake)
    barriers.issue(lake.conn)
    refused = job_exec(uri, creds["ingest"], "ingest", job_command(lake, "ingest"), expect=1)
    assert "CERTIFICATE_VERIFY_FAILED" in refused["stderr"] and "Traceback" not in refused["stderr"]
    for job in SINKS:
        out = job_exec(uri, creds[job], job, job_command(lake, job, rows=3, spark=job == "ingest"), "--ca-cert", ca)
        assert [s["outcome"] for s in out["steps"]] == ["published"], out
    reader = ":".join(tokens.create(lake.conn, whole_lake=True))
    config = yaml.safe_load(connect("pyiceberg", uri, reader, ca).split("\n", 1)[1])["catalog"]["lake"]
    from pyiceberg.catalog import load_catalog

    monkeypatch.setenv("REQUESTS_CA_BUNDLE", ca)  # PyIceberg's first request (its /v1/config) is outside its session
    assert check_cut(load_catalog("lake", **config), lake.namespace)[0] == 3


def test_connect_prints_what_each_engine_needs_to_trust_the_ca(lake, tls_server, tmp_path):
    """DuckDB and PyIceberg read through https exactly as `connect --ca-cert` prints; Spark's
    configuration names a truststore `connect` wrote beside the CA, and the JVM's own tool reads
    the CA in it. Without the CA, DuckDB fails the handshake."""
    import pyarrow as pa

    uri, ca = tls_server
    lake.catalog.create_table(f"{lake.namespace}.t", schema=pa.schema([("n", pa.int64())])).append(
        pa.table({"n": [1, 2]})
    )
    reader = ":".join(tokens.create(lake.conn, whole_lake=True))
    con = duckdb.connect()
    for statement in connect("duckdb", uri, reader, ca).splitlines():
        con.execute(statement)
    assert con.execute(f"SELECT count(*) FROM lake.{lake.namespace}.t").fetchone()[0] == 2
    untrusting = duckdb.connect()
    with pytest.raises(duckdb.Error, match="(?i)certificate|ssl|handshake"):
        for statement in connect("duckdb", uri, reader, None).splitlines():
            untrusting.execute(statement)
        untrusting.execute(f"SELECT count(*) FROM lake.{lake.namespace}.t").fetchone()
    spark = dict(line.split(" ", 1) for line in connect("spark", uri, reader, ca).splitlines())
    truststore = tmp_path / "ca.p12"
    assert spark["spark.driver.extraJavaOptions"] == spark["spark.executor.extraJavaOptions"]
    assert f"-Djavax.net.ssl.trustStore={truststore}" in spark["spark.driver.extraJavaOptions"]
    listed = subprocess.run(
        ["keytool", "-list", "-keystore", str(truststore), "-storetype", "PKCS12", "-storepass", TRUSTSTORE_PASSWORD],
        capture_output=True,
        text=True,
    )
    assert listed.returncode == 0 and "trustedCertEntry" in listed.stdout, listed.stdout + listed.stderr


def test_schedule_runs_its_jobs_over_https(lake, tls_server, tmp_path):
    """`schedule --ca-cert`: the run it starts of a root job (`job exec` of a PyIceberg command)
    publishes through the https catalog; the same schedule without the CA gets no run done."""
    uri, ca = tls_server
    barriers.set_interval_s(lake.conn, 3600)
    jobs.register(
        lake.conn,
        JobDefinition(name="ingest", sinks=frozenset([lake.T("orders")]), external_inputs=frozenset(["ext:orders"])),
    )
    spec = f"{sys.executable} {ENGINES / 'pyiceberg_root.py'} {lake.namespace} 5"
    targets.set_runner(lake.conn, "ingest", Runner(kind="command", spec=spec))
    targets.set_target_lag(lake.conn, lake.T("orders"), 12)
    admin = ":".join(tokens.create(lake.conn, admin=True))
    args = [*CLI, "schedule", "--catalog-uri", uri, "--credential", admin]
    untrusting = LoggedProcess(args, tmp_path / "untrusting.log")
    try:
        untrusting.wait_for("job ingest: run failed")
    finally:
        untrusting.kill_group()
    assert "does not trust" in untrusting.log(), untrusting.log()[-3000:]
    schedule = LoggedProcess([*args, "--ca-cert", ca], tmp_path / "schedule.log")
    try:
        schedule.wait_for("job ingest: run done")
    finally:
        schedule.kill_group()
    assert jobs.show(lake.conn, "ingest").progress is not None
