"""Fixtures for the Iceberg side: one catalog database and one SparkSession per run.

Every test gets its own control-plane schema and its own Iceberg namespace in the shared
catalog ``lake`` (Spark's catalog configuration is fixed when the session starts, so the
catalog stays and the namespaces change).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql

from icebarrier.control_plane import db, schema
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.catalog import load_catalog, watch_pointers
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.storage import Storage
from tests.helpers import calm_anchors, new_database
from tests.iceberg_ext.catalog_server import start_server, stop_server
from tests.seaweedfs import BUCKET, seaweed


@pytest.fixture(scope="session")
def lake_dsn(pg_server):
    with new_database(pg_server, "icebarrier_lake") as dsn:
        Settings(dsn=dsn).ensure_catalog_schema()  # what `db upgrade` adds for the Iceberg side
        yield dsn


@pytest.fixture(scope="session")
def warehouse(tmp_path_factory):
    return tmp_path_factory.mktemp("warehouse")


@pytest.fixture(scope="session")
def spark(lake_dsn, warehouse):
    """One local[2] SparkSession for the whole run, on the shared catalog (with the AWS bundle, so
    catalogs added later reach tables on S3)."""
    from icebarrier.iceberg_ext.spark import aws_bundle_jar, spark_conf, spark_session

    settings = Settings(dsn=lake_dsn, warehouse=str(warehouse)).validated()
    jars = f"{spark_conf(settings)['spark.jars']},{aws_bundle_jar()}"
    session = spark_session(settings, app_name="icebarrier-tests", extra={"spark.jars": jars})
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@dataclass
class Lake:
    settings: Settings
    conn: psycopg.Connection
    catalog: object
    namespace: str

    def T(self, name: str) -> TableName:
        return TableName.parse(f"lake.{self.namespace}.{name}")


_SCHEMA_SQL: dict[tuple, tuple[str, str]] = {}  # by server: made once per worker and server


def _control_plane_sql(dsn: str) -> tuple[str, str]:
    """The control-plane schema at head as SQL, made once per worker and server: ``schema.upgrade``
    (what ``db upgrade`` does) into a schema of its own, dumped by the server's own ``pg_dump``;
    the schema's name, and the SQL. A lake's schema is that SQL under its own name: about 0.25 s,
    where alembic's 36 migrations (their DDL, function replaced after function) take 0.5-0.8 s,
    for each of ~400 tests."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    server = (info.get("host"), info.get("port"))
    if server not in _SCHEMA_SQL:
        template = f"cp_{uuid.uuid4().hex[:10]}"
        schema.upgrade(dsn, template)
        with psycopg.connect(dsn, autocommit=True) as admin:
            bindir = admin.execute("SELECT setting FROM pg_config WHERE name = 'BINDIR'").fetchone()[0]
            dumped = subprocess.run(
                [os.path.join(bindir, "pg_dump"), "--schema", template, "--inserts", "--no-owner", "--dbname", dsn],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(template)))
        sql_only = "\n".join(line for line in dumped.splitlines() if not line.startswith("\\"))  # not psql's
        _SCHEMA_SQL[server] = (template, sql_only)
    return _SCHEMA_SQL[server]


def _lake(lake_dsn, warehouse: str, monkeypatch, storage: Storage | None = None):
    """A fresh control-plane schema and Iceberg namespace (env set for the CLI too)."""
    cp_schema = f"cp_{uuid.uuid4().hex[:10]}"
    template, ddl = _control_plane_sql(lake_dsn)
    with psycopg.connect(lake_dsn, autocommit=True) as admin:
        admin.execute(ddl.replace(template, cp_schema))
    settings = Settings(dsn=lake_dsn, schema=cp_schema, warehouse=warehouse, storage=storage or Storage()).validated()
    monkeypatch.setenv("ICEBARRIER_DSN", lake_dsn)
    monkeypatch.setenv("ICEBARRIER_SCHEMA", cp_schema)
    monkeypatch.setenv("ICEBARRIER_WAREHOUSE", warehouse)
    catalog = load_catalog(settings)
    watch_pointers(settings)  # what `db upgrade` does once for the catalog: servers keep pointers in memory
    namespace = f"ns_{uuid.uuid4().hex[:10]}"
    catalog.create_namespace(namespace)
    with db.connect(lake_dsn, cp_schema) as conn:
        calm_anchors(conn)
        yield Lake(settings=settings, conn=conn, catalog=catalog, namespace=namespace)
    with psycopg.connect(lake_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(cp_schema)))
        # the namespace leaves the worker's shared catalog (its files stay): what lists every
        # table of the catalog (orphan removal's nested tables) then reads the test's own, not
        # every table of the run's earlier tests (on S3 servers since stopped, some)
        for table, column in (("iceberg_tables", "table_namespace"), ("iceberg_namespace_properties", "namespace")):
            admin.execute(
                sql.SQL("DELETE FROM {}.{} WHERE catalog_name = %s AND ({} = %s OR {} LIKE %s)").format(
                    sql.Identifier(settings.catalog_schema), sql.Identifier(table), *[sql.Identifier(column)] * 2
                ),
                (settings.catalog, namespace, f"{namespace}.%"),
            )


@pytest.fixture
def lake(lake_dsn, warehouse, monkeypatch):
    """A fresh control-plane schema and Iceberg namespace on the local warehouse."""
    yield from _lake(lake_dsn, str(warehouse), monkeypatch)


@pytest.fixture
def own_lake(pg_server, warehouse, monkeypatch):
    """The same as ``lake``, in a database of its own: what Postgres counts for that database
    (transactions) is the test's alone — the worker's shared lake database also counts whatever
    earlier tests left running."""
    with new_database(pg_server, "icebarrier_own") as dsn:
        Settings(dsn=dsn).ensure_catalog_schema()
        yield from _lake(dsn, str(warehouse), monkeypatch)


@pytest.fixture
def s3_lake(lake_dsn, s3, tmp_path, monkeypatch):
    """The same as ``lake``, with the warehouse on S3: the storage settings in an icebarrier.toml
    that ICEBARRIER_CONFIG names (for the CLI and the servers the test starts)."""
    yield from _configured_lake(lake_dsn, s3.storage_toml(), f"s3://{s3.bucket}/wh", tmp_path, monkeypatch)


def _configured_lake(lake_dsn, storage_toml: str, warehouse: str, tmp_path, monkeypatch):
    """A lake whose storage settings are in an icebarrier.toml that ICEBARRIER_CONFIG names."""
    config = tmp_path / "icebarrier.toml"
    config.write_text(storage_toml)
    monkeypatch.setenv("ICEBARRIER_CONFIG", str(config))
    yield from _lake(lake_dsn, warehouse, monkeypatch, Settings.load_storage(config))


@pytest.fixture
def s3_server(s3_lake):
    """A real `icebarrier serve` process over the test's S3 lake; its URI."""
    yield from _serve(s3_lake)


@pytest.fixture(scope="session")
def weed(tmp_path_factory):
    """SeaweedFS (tests/seaweedfs.py): S3 whose STS session policies are enforced."""
    with seaweed(tmp_path_factory.mktemp("seaweedfs")) as store:
        yield store


@pytest.fixture
def weed_lake(lake_dsn, weed, tmp_path, monkeypatch):
    """The same as ``lake``, on SeaweedFS, served with per-table credentials (role-arn)."""
    warehouse = f"s3://{BUCKET}/wh-{uuid.uuid4().hex[:8]}"
    yield from _configured_lake(lake_dsn, weed.storage_toml(), warehouse, tmp_path, monkeypatch)


@pytest.fixture
def weed_server(weed_lake):
    """A real `icebarrier serve` process over the test's SeaweedFS lake; its URI."""
    yield from _serve(weed_lake)


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    """The URL of a Spark standalone cluster (one worker) for this run."""
    from tests.spark_cluster import standalone_cluster

    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster")) as url:
        yield url


@pytest.fixture
def server(lake):
    """A real `icebarrier serve` process over the test's lake; its URI."""
    yield from _serve(lake)


def _serve(lake):
    proc, uri = start_server(lake, "--session-quiet", "1s")
    yield uri
    err = stop_server(proc)
    assert "Traceback" not in err, err[-3000:]
