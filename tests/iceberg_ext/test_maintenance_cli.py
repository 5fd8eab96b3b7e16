"""Maintenance from the command line: concurrent expiries, and `db upgrade` readying plain Spark."""

import json
import os
import subprocess
import sys

import psycopg
import pytest
from click.testing import CliRunner

from icebarrier.cli.main import cli as command
from icebarrier.control_plane import schema
from icebarrier.iceberg_ext.catalog import load_table
from tests.helpers import new_database
from tests.iceberg_ext import pipeline
from tests.iceberg_ext.pipeline import run_barrier


def _expire(table):
    return subprocess.Popen(
        [sys.executable, "-m", "icebarrier.cli.main", "--output", "json", "expire", "--table", str(table)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,
    )


@pytest.mark.slow
def test_two_concurrent_expiries_of_one_table_both_succeed(lake):
    """Two `icebarrier expire --table T` processes at once, three rounds: both exit 0 with no
    traceback; together they expire each snapshot once and delete its files once."""
    pipeline.setup(lake)
    barrier_no = 0
    for _ in range(3):
        for _ in range(4):
            barrier_no += 1
            run_barrier(lake, barrier_no)
        table = lake.T("orders")
        before = {s.snapshot_id for s in load_table(lake.catalog, table).metadata.snapshots}
        procs = [_expire(table), _expire(table)]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0 and "Traceback" not in err, err[-2000:]
        expired = [set(json.loads(out)[0]["expired"]) for out, _ in outs]
        after = {s.snapshot_id for s in load_table(lake.catalog, table).metadata.snapshots}
        assert not expired[0] & expired[1], "both expiries claimed the same snapshots"
        assert expired[0] | expired[1] == before - after and before - after


@pytest.fixture
def fresh_dsn(pg_server, tmp_path, monkeypatch):
    """An empty database (nothing migrated), set in the environment for the CLI; dropped after."""
    with new_database(pg_server, "icebarrier_fresh") as dsn:
        monkeypatch.setenv("ICEBARRIER_DSN", dsn)
        monkeypatch.delenv("ICEBARRIER_SCHEMA", raising=False)
        monkeypatch.setenv("ICEBARRIER_WAREHOUSE", str(tmp_path / "warehouse"))
        yield dsn


def test_db_upgrade_readies_the_catalog_and_refused_commands_write_nothing(fresh_dsn):
    """`db upgrade` creates the Iceberg catalog's schema and tables; commands refused for bad
    input change nothing in the database (compared as a dump of every schema's objects)."""
    dsn, runner = fresh_dsn, CliRunner()
    schema.upgrade(dsn)  # the control plane only: the catalog is not there yet
    refused = [
        ["expire", "--older-than", "abc"],
        ["revise", "lake.nope.nope", "--to-barrier", "1"],
        ["tag", "bad!tag", "lake.db.t"],
    ]

    def objects():
        with psycopg.connect(dsn) as c:
            return c.execute(
                "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast') "
                "ORDER BY 1, 2"
            ).fetchall()

    before = objects()
    for args in refused:
        result = runner.invoke(command, args)
        assert result.exit_code in (1, 2) and "Traceback" not in result.output, (args, result.output)
    assert objects() == before
    result = runner.invoke(command, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    tables = {t for s, t in objects() if s == "icebarrier_catalog"}
    assert {"iceberg_tables", "iceberg_namespace_properties"} <= tables
    before = objects()
    for args in refused:
        assert runner.invoke(command, args).exit_code in (1, 2)
    assert objects() == before


PLAIN_SPARK = """
import json, sys
from pyspark.sql import SparkSession
conf = json.loads(sys.argv[1])
builder = SparkSession.builder.master("local[1]")
for k, v in conf.items():
    builder = builder.config(k, v)
spark = builder.getOrCreate()
spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.plain")
spark.sql("CREATE TABLE lake.plain.t (id bigint) USING iceberg")
spark.sql("INSERT INTO lake.plain.t VALUES (1), (2)")
print(spark.sql("SELECT count(*) FROM lake.plain.t").collect()[0][0])
"""


@pytest.mark.slow
def test_plain_spark_works_right_after_db_upgrade(fresh_dsn):
    """A fresh database, `icebarrier db upgrade`, then plain Spark with `icebarrier spark-conf`
    (no icebarrier code in the Spark process) creates and writes a table."""
    runner = CliRunner()
    assert runner.invoke(command, ["db", "upgrade"]).exit_code == 0
    conf = runner.invoke(command, ["spark-conf", "--format", "json"])
    assert conf.exit_code == 0, conf.output
    out = subprocess.run([sys.executable, "-c", PLAIN_SPARK, conf.stdout], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "2", out.stderr[-3000:]
