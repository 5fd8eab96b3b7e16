"""Names with a '.' inside a namespace level or a table name, as the REST spec allows (DESIGN.md,
"The server on a network": names). ["p.q"] and ["p", "q"] are two namespaces with their own
tables and locations; icebarrier writes such names quoted (lake.`p.q`.`ta.ble`) in the CLI, the
logs and the control plane; a managed table with a dotted name keeps every rule. Through a real
`icebarrier serve`, PyIceberg's REST client, the CLI and Postgres."""

from __future__ import annotations

import json
import re
import subprocess

import pyarrow as pa
import pytest
from pyiceberg.exceptions import ForbiddenError

from icebarrier.control_plane import barriers, jobs, tokens
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER
from tests.iceberg_ext.catalog_server import rest
from tests.iceberg_ext.test_catalog_conformance import _job_token

ROW = pa.schema([("id", pa.int64())])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["icebarrier", *args], capture_output=True, text=True, timeout=120)


def test_a_dotted_level_and_two_levels_are_two_namespaces(lake, server):
    """Through the REST catalog: ["p.q"] and ["p", "q"] each exist, list and hold a table
    "ta.ble" of their own, with rows of their own at locations that do not overlap. PyIceberg's
    SQL catalog (as Spark's JDBC catalog reads it) holds the dotted level escaped: p%2Eq."""
    writer = rest(server, "latest", _job_token(lake))
    dotted, nested = (f"{lake.namespace}.p",), (lake.namespace, "p", "q")
    for ns in (dotted, nested):
        writer.create_namespace(ns)
    assert dotted in writer.list_namespaces() and (lake.namespace,) in writer.list_namespaces()
    assert writer.list_namespaces((lake.namespace,)) == [(lake.namespace, "p")]
    assert writer.list_namespaces((lake.namespace, "p")) == [nested]
    made = {ns: writer.create_table((*ns, "ta.ble"), schema=ROW) for ns in (dotted, nested)}
    for i, table in enumerate(made.values()):
        table.append(pa.table({"id": [i]}, schema=ROW))
    for i, ns in enumerate(made):
        assert writer.load_table((*ns, "ta.ble")).scan().to_arrow()["id"].to_pylist() == [i]
        assert writer.list_tables(ns) == [(*ns, "ta.ble")]
    a, b = (t.metadata.location.rstrip("/") for t in made.values())
    assert a != b and not a.startswith(b + "/") and not b.startswith(a + "/"), (a, b)
    stored = TableName(catalog="lake", namespace=dotted, name="ta.ble")
    assert stored.identifier == (f"{lake.namespace}%2Ep", "ta.ble")
    assert lake.catalog.load_table(stored.identifier).scan().to_arrow()["id"].to_pylist() == [0]
    writer.drop_table((*dotted, "ta.ble"))
    assert writer.list_tables(nested) == [(*nested, "ta.ble")]  # the other one stays
    writer.drop_namespace(dotted)
    assert writer.namespace_exists(nested) and not writer.namespace_exists(dotted)


def test_a_managed_table_with_a_dotted_name_keeps_every_rule(lake, server):
    """A job registered (CLI) with the sink lake.<ns>.`raw.v1`.`orders.eu` commits to it through
    the catalog; the control plane names it quoted, its cut is read through barrier-<B>, another
    job may not write it (403 naming it), a reader granted the dotted namespace sees it and not
    the two-level namespace raw, v1. The database names the SQL catalog's row the same way."""
    name = TableName(catalog="lake", namespace=(lake.namespace, "raw.v1"), name="orders.eu")
    quoted = f"lake.{lake.namespace}.`raw.v1`.`orders.eu`"
    assert str(name) == quoted
    registered = _cli("job", "register", "dotted", "--sink", quoted, "--external", "ext:eu")
    assert registered.returncode == 0, registered.stderr
    _cli("job", "register", "other", "--sink", f"lake.{lake.namespace}.other", "--external", "ext:o")
    job = rest(server, "latest", ":".join(tokens.create(lake.conn, job="dotted", whole_lake=True)))
    job.create_namespace((lake.namespace, "raw.v1"))
    table = job.create_table(name.levels, schema=ROW)
    b = barriers.issue(lake.conn).barrier
    table.append(pa.table({"id": [1, 2]}, schema=ROW), snapshot_properties={SUMMARY_BARRIER: str(b)})
    jobs.complete(lake.conn, "dotted", b, {name: table.current_snapshot().snapshot_id})
    listed = json.loads(_cli("--output", "json", "table", "list").stdout)
    assert quoted in {t["table"] for t in listed}, listed
    shown = _cli("table", "show", quoted)
    assert shown.returncode == 0 and quoted in shown.stdout, shown.stdout + shown.stderr

    reader_id, reader_secret = tokens.create(lake.conn)
    granted = _cli("token", "grant", reader_id, "--namespace", f"{lake.namespace}.`raw.v1`")
    assert granted.returncode == 0, granted.stderr
    reader = rest(server, f"barrier-{b}", f"{reader_id}:{reader_secret}")
    assert reader.load_table(name.levels).scan().to_arrow()["id"].to_pylist() == [1, 2]
    assert reader.list_namespaces((lake.namespace,)) == [(lake.namespace, "raw.v1")]

    other = rest(server, "latest", ":".join(tokens.create(lake.conn, job="other", whole_lake=True)))
    with pytest.raises(ForbiddenError, match=re.escape(f"may not write {quoted}: it is written by job dotted")):
        other.load_table(name.levels).append(pa.table({"id": [3]}, schema=ROW))
    row = lake.conn.execute(
        "SELECT catalog_table_name('lake', %s, 'orders.eu') AS name", (name.sql_namespace,)
    ).fetchone()
    assert row["name"] == quoted
