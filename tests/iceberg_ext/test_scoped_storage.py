"""Storage credentials open one table, proven on an object store that enforces session policies
(SeaweedFS, tests/seaweedfs.py; moto enforces none). Each attempt is made with the credentials
the server hands out, and what must be refused is refused by the store itself."""

from __future__ import annotations

import json
import time
import uuid

import pyarrow as pa
import pytest
import requests
from botocore.exceptions import ClientError

from icebarrier.apps.catalog.delegation import REFRESH_ENDPOINT, ScopedVendor, table_policy
from icebarrier.control_plane import audit, barriers, jobs, tokens
from icebarrier.control_plane.model import JobDefinition
from icebarrier.iceberg_ext import storage as s3
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER
from icebarrier.iceberg_ext.config import Settings
from tests.iceberg_ext.catalog_server import access_token, rest
from tests.seaweedfs import ADMIN_KEY, ADMIN_SECRET, BUCKET, ROLE_ARN, seaweed

pytestmark = pytest.mark.slow

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False)])


def _denied(call) -> None:
    with pytest.raises(ClientError) as caught:
        call()
    assert caught.value.response["Error"]["Code"] in ("AccessDenied", "403"), caught.value.response


def _client(weed, config: dict):
    return weed.client(
        aws_access_key_id=config[s3.ACCESS_KEY_ID],
        aws_secret_access_key=config[s3.SECRET_ACCESS_KEY],
        aws_session_token=config[s3.SESSION_TOKEN],
    )


def test_a_table_credential_opens_that_table_and_that_access_only(weed, tmp_path):
    """Credentials for table t (read) read and list t only: not t_new (a sibling whose name t
    prefixes), not u, and they write nothing; t's write credentials write and delete under t only."""
    admin = weed.client()
    wh = f"wh-{uuid.uuid4().hex[:8]}/ns"
    for table in ("t", "t_new", "u"):
        admin.put_object(Bucket=BUCKET, Key=f"{wh}/{table}/data/f.parquet", Body=b"x")
    storage = Settings.load_storage(_toml(weed, tmp_path))
    vendor = ScopedVendor(storage)
    reading = _client(weed, vendor.credentials(f"s3://{BUCKET}/{wh}/t", write=False).config)
    assert reading.get_object(Bucket=BUCKET, Key=f"{wh}/t/data/f.parquet")["Body"].read() == b"x"
    assert [o["Key"] for o in reading.list_objects_v2(Bucket=BUCKET, Prefix=f"{wh}/t/")["Contents"]]
    _denied(lambda: reading.get_object(Bucket=BUCKET, Key=f"{wh}/t_new/data/f.parquet"))
    _denied(lambda: reading.get_object(Bucket=BUCKET, Key=f"{wh}/u/data/f.parquet"))
    _denied(lambda: reading.list_objects_v2(Bucket=BUCKET, Prefix=f"{wh}/u/"))
    _denied(lambda: reading.list_objects_v2(Bucket=BUCKET, Prefix=f"{wh}/t"))  # would show t_new
    _denied(lambda: reading.put_object(Bucket=BUCKET, Key=f"{wh}/t/data/g.parquet", Body=b"y"))
    writing = _client(weed, vendor.credentials(f"s3://{BUCKET}/{wh}/t", write=True).config)
    writing.put_object(Bucket=BUCKET, Key=f"{wh}/t/data/g.parquet", Body=b"y")
    writing.delete_object(Bucket=BUCKET, Key=f"{wh}/t/data/g.parquet")
    _denied(lambda: writing.put_object(Bucket=BUCKET, Key=f"{wh}/u/data/f.parquet", Body=b"overwritten"))
    _denied(lambda: writing.put_object(Bucket=BUCKET, Key=f"{wh}/t_new/data/f.parquet", Body=b"overwritten"))
    _denied(lambda: writing.delete_object(Bucket=BUCKET, Key=f"{wh}/u/data/f.parquet"))
    assert admin.get_object(Bucket=BUCKET, Key=f"{wh}/u/data/f.parquet")["Body"].read() == b"x"
    # one AssumeRole per (table, access): the second load of each is served from the cache
    vendor.credentials(f"s3://{BUCKET}/{wh}/t", write=False)
    assert vendor.calls == 2


def test_an_expired_credential_is_refused(tmp_path):
    """The store refuses a table's credentials once they expire, and forged ones at once (a store
    whose STS makes 10-s credentials when asked for no duration: STS's floor for a duration asked
    is 900 s). 10 s: the first read must come before they expire, on a loaded machine too."""
    import boto3

    with seaweed(tmp_path / "short", token_duration="10s") as short:
        key = "wh/ns/t/data/f.parquet"
        short.client().put_object(Bucket=BUCKET, Key=key, Body=b"x")
        sts = boto3.client(
            "sts",
            endpoint_url=short.endpoint,
            region_name="us-east-1",
            aws_access_key_id=ADMIN_KEY,
            aws_secret_access_key=ADMIN_SECRET,
        )
        policy = table_policy(f"s3://{BUCKET}/wh/ns/t", write=False)
        made = sts.assume_role(RoleArn=ROLE_ARN, RoleSessionName="expiry", Policy=policy)["Credentials"]
        keys = {
            s3.ACCESS_KEY_ID: made["AccessKeyId"],
            s3.SECRET_ACCESS_KEY: made["SecretAccessKey"],
            s3.SESSION_TOKEN: made["SessionToken"],
        }
        assert _client(short, keys).get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"x"
        forged = {**keys, s3.SESSION_TOKEN: made["SessionToken"][:-8] + "AAAAAAAA"}
        with pytest.raises(ClientError):
            _client(short, forged).get_object(Bucket=BUCKET, Key=key)
        time.sleep(max(0.0, made["Expiration"].timestamp() - time.time()) + 1.5)
        with pytest.raises(ClientError) as expired:
            _client(short, keys).get_object(Bucket=BUCKET, Key=key)
        assert expired.value.response["Error"]["Code"] in ("InvalidAccessKeyId", "ExpiredToken", "AccessDenied")


def test_pyiceberg_reads_and_writes_through_serve_with_table_credentials_only(weed_lake, weed_server, weed):
    """Through `icebarrier serve` on SeaweedFS with per-table credentials: a job creates and
    writes its sink with what it is handed; a reader granted the namespace reads it, and a plan
    on the server gives it the table's own credentials, which read the planned file and no other
    table's; the reader's credentials write nothing, the job's open no other table;
    loadCredentials gives fresh ones; each one made is in the audit trail."""
    lake = weed_lake
    ns = lake.namespace
    jobs.register(lake.conn, JobDefinition(name="w", sinks=frozenset([lake.T("t")]), external_inputs=frozenset(["x"])))
    lake.catalog.create_table(f"{ns}.other", schema=SCHEMA).append(pa.table({"id": [9]}, schema=SCHEMA))
    job_cred = ":".join(tokens.create(lake.conn, job="w"))
    job = rest(weed_server, "latest", job_cred)
    b = barriers.issue(lake.conn).barrier
    table = job.create_table(f"{ns}.t", schema=SCHEMA)
    table.append(pa.table({"id": [1, 2]}, schema=SCHEMA), snapshot_properties={SUMMARY_BARRIER: str(b)})
    reader_cred = ":".join(tokens.create(lake.conn))
    tokens.grant(lake.conn, reader_cred.split(":")[0], [tokens.Grant("namespace", ns, "read")])
    assert rest(weed_server, "latest", reader_cred).load_table(f"{ns}.t").scan().to_arrow().num_rows == 2
    answer = _load(weed_server, reader_cred, f"{ns}/tables/t")
    [credential] = answer["storage-credentials"]
    location = answer["metadata"]["location"]
    assert credential["prefix"] == location.rstrip("/") + "/" and s3.SESSION_TOKEN in credential["config"]
    assert answer["config"][REFRESH_ENDPOINT].endswith(f"/namespaces/{ns}/tables/t/credentials")
    plan = requests.post(
        f"{weed_server}/v1/latest/namespaces/{ns}/tables/t/plan",
        json={},
        headers={**_headers(weed_server, reader_cred), "X-Iceberg-Access-Delegation": "vended-credentials"},
        timeout=30,
    ).json()
    [planned] = plan["storage-credentials"]  # a plan on the server carries the table's own, as its load
    assert planned["prefix"] == credential["prefix"] and s3.SESSION_TOKEN in planned["config"]
    [task] = plan["file-scan-tasks"]
    data_key = task["data-file"]["file-path"].removeprefix(f"s3://{BUCKET}/")
    assert _client(weed, planned["config"]).get_object(Bucket=BUCKET, Key=data_key)["ContentLength"] > 0
    key = location.removeprefix(f"s3://{BUCKET}/") + "/data/planted.parquet"
    _denied(lambda: _client(weed, answer["config"]).put_object(Bucket=BUCKET, Key=key, Body=b"x"))
    job_answer = _load(weed_server, job_cred, f"{ns}/tables/t")
    _client(weed, job_answer["config"]).put_object(Bucket=BUCKET, Key=key, Body=b"x")  # its own sink
    other = lake.catalog.load_table(f"{ns}.other").metadata.location.removeprefix(f"s3://{BUCKET}/")
    _denied(lambda: _client(weed, job_answer["config"]).get_object(Bucket=BUCKET, Key=other + "/x"))
    _denied(lambda: _client(weed, planned["config"]).get_object(Bucket=BUCKET, Key=other + "/x"))
    refreshed = requests.get(
        f"{weed_server}/{answer['config'][REFRESH_ENDPOINT]}", headers=_headers(weed_server, reader_cred), timeout=30
    )
    assert refreshed.status_code == 200, refreshed.text
    [again] = refreshed.json()["storage-credentials"]
    assert again["prefix"] == credential["prefix"] and s3.SESSION_TOKEN in again["config"]
    issued = [e for e in audit.events(lake.conn, table=str(lake.T("t"))) if e.action == "storage credentials"]
    assert {e.detail["access"] for e in issued} == {"read", "write"}, issued
    assert all(e.detail["expires_at_ms"] > time.time() * 1000 for e in issued)


def _headers(server: str, credential: str) -> dict:
    return {"Authorization": f"Bearer {access_token(server, *credential.split(':'))}"}


def _load(server: str, credential: str, path: str) -> dict:
    r = requests.get(
        f"{server}/v1/latest/namespaces/{path}",
        headers={**_headers(server, credential), "X-Iceberg-Access-Delegation": "vended-credentials"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _toml(weed, tmp_path):
    path = tmp_path / "icebarrier.toml"
    path.write_text(weed.storage_toml())
    return path


def test_the_policy_ends_each_prefix_in_a_slash_and_makes_wildcards_literal():
    """A location with IAM's wildcards opens only itself; the policy names nothing else."""
    policy = json.loads(table_policy("s3://lake/wh/ns/t*?$x", write=True))
    [objects, listing, _] = policy["Statement"]
    assert objects["Resource"] == ["arn:aws:s3:::lake/wh/ns/t${*}${?}${$}x/*"]
    assert set(objects["Action"]) == {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"}
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["wh/ns/t${*}${?}${$}x/*"]}}
    assert json.loads(table_policy("s3://lake/wh/ns/t", write=False))["Statement"][0]["Action"] == ["s3:GetObject"]


def test_a_role_sts_refuses_or_a_malformed_one_stops_the_server_with_one_line(weed_lake, weed, tmp_path):
    """`icebarrier serve` with a role STS will not assume, or a role-arn that is no ARN: one line
    naming role-arn, a non-zero exit, no traceback."""
    import os
    import subprocess

    from tests.iceberg_ext.catalog_server import free_port

    for role, said in (
        ("arn:aws:iam::role/Nobody", "refused to assume it"),
        ("arn:aws:s3:::lake", "is not a role's ARN"),
    ):
        config = tmp_path / "bad.toml"
        config.write_text(weed.storage_toml().replace(ROLE_ARN, role))
        done = subprocess.run(
            ["icebarrier", "serve", "--port", str(free_port())],
            env={**os.environ, "ICEBARRIER_CONFIG": str(config)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0 and len(lines) == 1 and "role-arn" in lines[0] and said in lines[0], done.stderr


def test_spark_and_duckdb_read_every_warehouse_with_table_credentials_only(weed_lake, weed_server, spark):
    """Spark's REST client and DuckDB as `icebarrier connect` prints them, with a reader token
    granted the namespace: each table's own read credentials are all they get, and they read
    latest, read-committed and barrier-<B> at exact row counts."""
    from icebarrier.apps.catalog.clients import configuration
    from tests.iceberg_ext.catalog_server import Pipeline
    from tests.iceberg_ext.test_storage import duck

    lake = weed_lake
    p = Pipeline(lake, {"ingest": ["orders", "payments"]})
    marks = [p.advance(rows=10) for _ in range(3)]
    reader = ":".join(tokens.create(lake.conn))
    tokens.grant(lake.conn, reader.split(":")[0], [tokens.Grant("namespace", lake.namespace, "read")])
    orders = f"{lake.namespace}.orders"
    for warehouse, count in {"latest": 30, "read-committed": 30, f"barrier-{marks[0]}": 10}.items():
        name = f"w_{uuid.uuid4().hex[:8]}"
        conf = dict(
            line.split(" ", 1) for line in configuration("spark", warehouse, weed_server, reader, name).splitlines()
        )
        for key, value in conf.items():
            if key.startswith(f"spark.sql.catalog.{name}"):
                spark.conf.set(key, value)
        assert spark.table(f"{name}.{orders}").count() == count, warehouse
        assert (
            duck(weed_server, warehouse, reader).execute(f"SELECT count(*) FROM lake.{orders}").fetchone()[0] == count
        )
    issued = [e for e in audit.events(lake.conn) if e.action == "storage credentials"]
    assert issued and {e.detail["access"] for e in issued} == {"read"}


def test_spark_root_and_sql_jobs_write_their_sinks_through_serve_with_their_table_credentials_only(
    weed_lake, weed_server, weed, tmp_path
):
    """The job runtime's Spark writing through `icebarrier serve` (`spark-conf --via rest`) with no
    storage keys of its own: a root job and a SQL job downstream each get read credentials for a
    source and write credentials for its sink, nothing more, and the barrier is written and
    completed by both."""
    import os
    import subprocess
    import sys

    from icebarrier.control_plane.model import TableName
    from tests.iceberg_ext.test_catalog_server import RUN_VIA_REST

    lake = weed_lake
    job, sink = "ingest", f"lake.{lake.namespace}.orders"
    jobs.register(
        lake.conn, JobDefinition(name=job, sinks=frozenset([TableName.parse(sink)]), external_inputs=frozenset(["f"]))
    )
    lake.catalog.create_table(
        f"{lake.namespace}.orders", schema=pa.schema([("id", pa.int64()), ("barrier", pa.int64())])
    )
    barriers.set_interval_s(lake.conn, 3600)
    b = barriers.issue(lake.conn).barrier
    jid, secret = tokens.create(lake.conn, job=job)
    config = tmp_path / "job.toml"
    config.write_text(  # the endpoint, no keys: the job's storage access comes from the catalog
        f'dsn = "{lake.settings.dsn}"\nschema = "{lake.settings.schema}"\nwarehouse = "{lake.settings.warehouse}"\n'
        f'[catalog_properties]\ntype = "rest"\nuri = "{weed_server}"\nwarehouse = "latest"\n'
        f'credential = "{jid}:{secret}"\noauth2-server-uri = "{weed_server}/v1/oauth/tokens"\n'
        f'"header.X-Iceberg-Access-Delegation" = "vended-credentials"\n'
        f'[storage]\n"s3.endpoint" = "{weed.endpoint}"\n"s3.region" = "us-east-1"\n"s3.path-style-access" = "true"\n'
    )
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "1.json").write_text('{"id": 1, "barrier": 0}\n{"id": 2, "barrier": 0}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ICEBARRIER_", "AWS_"))}

    def completed(script: str, *args: str) -> list[int]:
        """The barriers a job process (only ``config``: no keys of its own) completed."""
        run = subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            timeout=600,
            env={**env, "ICEBARRIER_CONFIG": str(config)},
        )
        assert run.returncode == 0, run.stderr[-4000:]
        return json.loads(run.stdout.strip().splitlines()[-1])["completed"]

    assert completed(RUN_VIA_REST, str(inbox), job, sink) == [b]
    assert lake.catalog.load_table(f"{lake.namespace}.orders").scan().to_arrow().num_rows == 2
    issued = [e for e in audit.events(lake.conn, table=sink) if e.action == "storage credentials"]
    assert [e.detail["access"] for e in issued] == ["write"] and issued[0].object == jid
    # a SQL job downstream: its source read, its sink written, each with that table's credentials
    totals = f"lake.{lake.namespace}.totals"
    jobs.register(
        lake.conn,
        JobDefinition(
            name="totals", sources=frozenset([TableName.parse(sink)]), sinks=frozenset([TableName.parse(totals)])
        ),
    )
    lake.catalog.create_table(f"{lake.namespace}.totals", schema=pa.schema([("n", pa.int64())]))
    sql_id, sql_secret = tokens.create(lake.conn, job="totals")
    config.write_text(config.read_text().replace(f"{jid}:{secret}", f"{sql_id}:{sql_secret}"))
    assert completed(RUN_SQL, "totals", f"INSERT OVERWRITE {totals} SELECT count(*) AS n FROM {sink}") == [b]
    assert lake.catalog.load_table(f"{lake.namespace}.totals").scan().to_arrow().to_pylist() == [{"n": 2}]
    access = {
        (e.table, e.detail["access"])
        for e in audit.events(lake.conn)
        if e.action == "storage credentials" and e.object == sql_id
    }
    assert access == {(sink, "read"), (totals, "write")}, access


RUN_SQL = """
import json, sys
from icebarrier import SqlJob, Settings
from icebarrier.iceberg_ext.runtime import Runtime
from icebarrier.iceberg_ext.spark import spark_session

settings = Settings.load()
spark = spark_session(settings, master="local[1]")
with Runtime(SqlJob(sys.argv[1], sys.argv[2]), settings=settings, spark=spark, log=lambda _: None) as rt:
    print(json.dumps({"completed": rt.run().completed}))
"""


def test_a_spark_query_outlives_its_first_credentials_through_the_refresh_endpoint(
    lake_dsn, tmp_path, monkeypatch, spark
):
    """On a store whose STS makes 20-s credentials (no duration-s: STS's default), a Spark query
    planned with the credentials of its load runs after they expired: Iceberg's client fetched
    fresh ones from the table's /credentials (the server's log shows it) and reads every row."""
    from icebarrier.apps.catalog.clients import configuration
    from tests.iceberg_ext.catalog_server import Pipeline, start_server, stop_server
    from tests.iceberg_ext.conftest import _configured_lake

    with seaweed(tmp_path / "short", token_duration="20s") as short:
        toml = short.storage_toml().replace('"duration-s" = 900\n', "")
        lakes = _configured_lake(lake_dsn, toml, f"s3://{BUCKET}/wh", tmp_path, monkeypatch)
        lake = next(lakes)
        try:
            Pipeline(lake, {"ingest": ["orders"]}).advance(rows=10)
            proc, server = start_server(lake, "--log-format", "json")
            try:
                reader = ":".join(tokens.create(lake.conn))
                tokens.grant(lake.conn, reader.split(":")[0], [tokens.Grant("namespace", lake.namespace, "read")])
                name = f"w_{uuid.uuid4().hex[:8]}"
                for line in configuration("spark", "latest", server, reader, name).splitlines():
                    key, value = line.split(" ", 1)
                    if key.startswith(f"spark.sql.catalog.{name}"):
                        spark.conf.set(key, value)
                planned = spark.table(f"{name}.{lake.namespace}.orders")  # loaded now, with 20-s credentials
                issued = [e for e in audit.events(lake.conn) if e.action == "storage credentials"]
                expires_at = max(e.detail["expires_at_ms"] for e in issued) / 1000
                time.sleep(max(0.0, expires_at - time.time()) + 2)
                assert planned.count() == 10
            finally:
                log = stop_server(proc)
            refreshes = [line for line in log.splitlines() if "/credentials" in line and '"status": 200' in line]
            assert refreshes, log[-3000:]
        finally:
            next(lakes, None)


def test_a_policy_past_sts_size_is_refused_naming_the_table():
    """STS takes 2,048 characters of inline policy: a location too long for it is refused before STS
    is asked, naming it."""
    from icebarrier.apps.catalog.errors import MalformedRequestError

    with pytest.raises(MalformedRequestError, match="too long for a storage session policy"):
        table_policy("s3://lake/" + "x" * 1200, write=True)


def test_an_sts_outage_is_a_503_naming_the_setting(lake_dsn, weed, tmp_path, monkeypatch):
    """STS out of reach (the store up): the server starts; a load asking for vended credentials is
    a 503 naming [storage.sessions] role-arn; a load without delegation is answered."""
    from tests.iceberg_ext.catalog_server import free_port, start_server, stop_server
    from tests.iceberg_ext.conftest import _configured_lake

    toml = weed.storage_toml() + f'"sts.endpoint" = "http://127.0.0.1:{free_port()}"\n'  # nobody there
    lakes = _configured_lake(lake_dsn, toml, f"s3://{BUCKET}/wh-{uuid.uuid4().hex[:8]}", tmp_path, monkeypatch)
    lake = next(lakes)
    try:
        lake.catalog.create_table(f"{lake.namespace}.a", schema=SCHEMA)
        proc, server = start_server(lake)
        try:
            reader = ":".join(tokens.create(lake.conn))
            tokens.grant(lake.conn, reader.split(":")[0], [tokens.Grant("namespace", lake.namespace, "read")])
            url = f"{server}/v1/latest/namespaces/{lake.namespace}/tables/a"
            r = requests.get(
                url,
                headers={**_headers(server, reader), "X-Iceberg-Access-Delegation": "vended-credentials"},
                timeout=60,
            )
            assert r.status_code == 503 and "role-arn" in r.text, r.text
            assert requests.get(url, headers=_headers(server, reader), timeout=60).status_code == 200
        finally:
            stop_server(proc)
    finally:
        next(lakes, None)


def test_a_job_session_stages_and_publishes_with_its_sink_credentials_only(weed_lake, weed_server):
    """Through a job's session (what `job exec` opens) a PyIceberg script with no keys of its own
    creates its sink and appends to it (staged, with the sink's write credentials), and the
    publish completes the barrier."""
    from icebarrier.apps.session_client import SessionClient

    lake = weed_lake
    jobs.register(lake.conn, JobDefinition(name="w", sinks=frozenset([lake.T("t")]), external_inputs=frozenset(["x"])))
    credential = ":".join(tokens.create(lake.conn, job="w"))
    b = barriers.issue(lake.conn).barrier
    client = SessionClient(weed_server, credential)
    session = client.open("w", skip=False, coalesce=False, hold_s=60)["session"]
    staged = rest(weed_server, f"job:w@{session['run_id']}", credential)
    table = staged.create_table(f"{lake.namespace}.t", schema=SCHEMA)
    table.append(pa.table({"id": [1, 2, 3]}, schema=SCHEMA))
    assert client.publish("w", session["run_id"])["barrier"] == b
    assert lake.catalog.load_table(f"{lake.namespace}.t").scan().to_arrow().num_rows == 3
    issued = [e for e in audit.events(lake.conn, table=str(lake.T("t"))) if e.action == "storage credentials"]
    assert {e.detail["access"] for e in issued} == {"write"}
