"""The Iceberg catalog's pointer table is guarded by row-level security: a job role runs its own
job end to end (Spark, the JDBC catalog, the control plane) and commits to unmanaged tables,
but even plain Spark SQL cannot commit to another job's table; a reader commits nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg
import pytest
from click.testing import CliRunner

from icebarrier.cli.main import cli as command
from icebarrier.control_plane import barriers, db, jobs
from icebarrier.iceberg_ext import catalog as ib_catalog
from icebarrier.iceberg_ext.config import Settings
from tests.helpers import job, login_roles

AS_JOB_ROLE = """
import json, sys
from icebarrier import RootJob, Settings
from icebarrier.iceberg_ext.runtime import Runtime
from icebarrier.iceberg_ext.sources import FileSource
from icebarrier.iceberg_ext.spark import spark_session

inbox = sys.argv[1]
settings = Settings.load()
spark = spark_session(settings, master="local[1]")
spark.sql("CREATE TABLE IF NOT EXISTS lake.rls.a (id bigint, v string) USING iceberg")
job = RootJob(name="ingest_a", sinks=["lake.rls.a"], source=FileSource(inbox, "id bigint, v string"))
with Runtime(job, settings=settings, spark=spark, log=lambda _: None) as rt:
    completed = rt.run().completed
out = {"completed": completed, "a_rows": spark.table("lake.rls.a").count()}
try:
    spark.sql("INSERT INTO lake.rls.b VALUES (777, 'forged')")
    out["forged"] = "committed"
except Exception as exc:
    out["forged"] = str(exc)
spark.sql("CREATE TABLE lake.rls.scratch (id bigint) USING iceberg")
spark.sql("INSERT INTO lake.rls.scratch VALUES (1), (2)")
out["scratch_rows"] = spark.table("lake.rls.scratch").count()
print(json.dumps(out))
"""


@pytest.fixture
def roles(dsn, pg_server):
    with login_roles(pg_server, dsn, "job_a", "reader") as names:
        yield names


@pytest.mark.slow
def test_a_job_role_runs_its_job_but_plain_spark_cannot_commit_to_another_jobs_table(dsn, roles, tmp_path):
    """As a role granted only ingest_a: the job registers, writes lake.rls.a and completes its
    barrier; an unmanaged table is created and written; INSERT INTO another job's table through
    Spark's JDBC catalog is refused naming that job, and its pointer does not move."""
    warehouse = (tmp_path / "warehouse").as_uri()
    settings = Settings(dsn=dsn, warehouse=warehouse).validated()
    runner = CliRunner()
    granted = runner.invoke(command, ["db", "grant-job", roles["job_a"], "ingest_a"])
    assert granted.exit_code == 0, granted.output
    assert runner.invoke(command, ["db", "grant-reader", roles["reader"]]).exit_code == 0
    with db.connect(dsn) as conn:
        jobs.register(conn, job("ingest_b", sinks=["lake.rls.b"]))
        barriers.set_interval_s(conn, 3600)  # no new barrier falls due while Spark starts: exactly one to do
        barriers.issue(conn)
    lake = ib_catalog.load_catalog(settings)
    lake.create_namespace_if_not_exists("rls")
    import pyarrow as pa

    b = lake.create_table("rls.b", schema=pa.schema([("id", pa.int64()), ("v", pa.string())]))
    b.append(pa.table({"id": [1], "v": ["real"]}))
    pointer = _pointer(dsn, "b")

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "1.json").write_text('{"id": 1, "v": "x"}\n{"id": 2, "v": "y"}\n')
    env = {
        **os.environ,
        "ICEBARRIER_DSN": psycopg.conninfo.make_conninfo(dsn, user=roles["job_a"]),
        "ICEBARRIER_WAREHOUSE": warehouse,
    }
    run = subprocess.run(
        [sys.executable, "-c", AS_JOB_ROLE, str(inbox)], capture_output=True, text=True, timeout=600, env=env
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(out["completed"]) == 1 and out["a_rows"] == 2 and out["scratch_rows"] == 2
    assert f"role {roles['job_a']} may not commit to lake.rls.b: it is written by job ingest_b" in out["forged"]
    assert _pointer(dsn, "b") == pointer
    with db.connect(dsn) as conn:
        assert jobs.show(conn, "ingest_a").progress == out["completed"][0]
    # A reader may read the catalog but write none of it, managed or not.
    with psycopg.connect(psycopg.conninfo.make_conninfo(dsn, user=roles["reader"]), autocommit=True) as reader:
        assert reader.execute("SELECT count(*) FROM icebarrier_catalog.iceberg_tables").fetchone()[0] == 3
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.execute(
                "UPDATE icebarrier_catalog.iceberg_tables SET metadata_location = 'x' WHERE table_name = 'scratch'"
            )


def test_catalog_policies_guard_each_row_for_a_job_role(dsn, roles):
    """Plain SQL as a job role: insert and update pass for its sink and unmanaged tables and are
    refused for another job's table (update and rename included); deletes skip foreign rows."""
    settings = Settings(dsn=dsn).validated()
    ib_catalog.grant(settings, roles["job_a"], job="ingest_a")
    with db.connect(dsn) as conn:
        jobs.register(conn, job("ingest_b", sinks=["lake.rls.b"]))
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("INSERT INTO icebarrier_catalog.iceberg_tables VALUES ('lake', 'rls', 'b', 'm1', NULL, 'TABLE')")
    table = "icebarrier_catalog.iceberg_tables"
    with psycopg.connect(psycopg.conninfo.make_conninfo(dsn, user=roles["job_a"]), autocommit=True) as a:
        a.execute(
            f"INSERT INTO {table} VALUES ('lake', 'rls', 'a', 'm1', NULL, 'TABLE'), "
            f"('lake', 'rls', 'free', 'm1', NULL, 'TABLE')"
        )
        a.execute(
            f"UPDATE {table} SET metadata_location = 'm2', previous_metadata_location = 'm1' "
            f"WHERE table_name IN ('a', 'free')"
        )
        with pytest.raises(psycopg.DatabaseError, match="may not commit to lake.rls.b: it is written by job ingest_b"):
            a.execute(f"UPDATE {table} SET metadata_location = 'm2' WHERE table_name = 'b'")
        with pytest.raises(psycopg.DatabaseError, match="written by job ingest_b"):
            a.execute(f"INSERT INTO {table} VALUES ('lake', 'RLS', 'B', 'm9', NULL, 'TABLE')")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            a.execute(f"UPDATE {table} SET table_name = 'gone' WHERE table_name = 'b'")
        assert a.execute(f"DELETE FROM {table} WHERE table_name IN ('b', 'free')").rowcount == 1
    assert _pointer(dsn, "b") == "m1" and _pointer(dsn, "a") == "m2"


def _pointer(dsn: str, name: str) -> str | None:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT metadata_location FROM icebarrier_catalog.iceberg_tables "
            "WHERE table_namespace = 'rls' AND table_name = %s",
            (name,),
        ).fetchone()
    return row[0] if row else None
