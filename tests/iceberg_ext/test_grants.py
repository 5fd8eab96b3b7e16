"""Least privilege in the catalog (DESIGN.md, "Least privilege, end to end"): a reader reaches
what it was granted, a job its sources (read), its sinks (write) and its grants; lists show only
that; everything else is a 403 naming the table and the grant, whether or not the table exists,
and changes nothing. Grants change on every server at once. A real `icebarrier serve`, real
PyIceberg clients and raw HTTP, as a hostile client would send it."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import requests
from click.testing import CliRunner
from pyiceberg.exceptions import ForbiddenError

from icebarrier.cli.main import cli as command
from icebarrier.control_plane import audit, barriers, jobs, tokens
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER
from tests.iceberg_ext.catalog_server import access_token, rest

pytestmark = pytest.mark.slow

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False)])


def _cli(lake, *args: str) -> dict:
    result = CliRunner().invoke(
        command,
        ["--output", "json", *args],
        env={"ICEBARRIER_SCHEMA": lake.settings.schema, "ICEBARRIER_WAREHOUSE": lake.settings.warehouse},
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _refused(lake, *args: str) -> str:
    result = CliRunner().invoke(
        command,
        list(args),
        env={"ICEBARRIER_SCHEMA": lake.settings.schema, "ICEBARRIER_WAREHOUSE": lake.settings.warehouse},
    )
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    return result.output


def _lake_of_three(lake) -> tuple[str, str]:
    """Namespaces ``<ns>`` (tables a, b) and ``<ns>_other`` (tables c, c_new): the second's name."""
    other = f"{lake.namespace}_other"
    lake.catalog.create_namespace(other)
    for name in (f"{lake.namespace}.a", f"{lake.namespace}.b", f"{other}.c", f"{other}.c_new"):
        lake.catalog.create_table(name, schema=SCHEMA).append(pa.table({"id": [1]}, schema=SCHEMA))
    return lake.namespace, other


def _headers(server: str, credential: str) -> dict:
    client_id, secret = credential.split(":")
    return {"Authorization": f"Bearer {access_token(server, client_id, secret)}"}


def test_a_reader_reaches_what_it_was_granted_and_nothing_else(lake, server):
    """Granted namespace ns and table other.c: lists show ns, other (it holds c) and their granted
    tables only; c_new (a prefix sibling of c) and a table that does not exist are both a 403 naming
    the table and the grant, through every warehouse; a grant added or taken back applies at once,
    also to a load memory would answer."""
    ns, other = _lake_of_three(lake)
    made = _cli(lake, "token", "create", "--reader", "--namespace", ns, "--table", f"lake.{other}.c")
    assert sorted(made["grants"]) == [f"read namespace {ns}", f"read table lake.{other}.c"]
    credential = f"{made['client_id']}:{made['client_secret']}"
    reader = rest(server, "latest", credential)
    assert {n for n in reader.list_namespaces() if n[0].startswith(ns)} == {(ns,), (other,)}
    assert sorted(t[-1] for t in reader.list_tables(ns)) == ["a", "b"]
    assert [t[-1] for t in reader.list_tables(other)] == ["c"]
    assert reader.load_table(f"{other}.c").scan().to_arrow().num_rows == 1
    for warehouse in ("latest", "read-committed", f"read-committed:{other}"):
        catalog = rest(server, warehouse, credential)
        for name in (f"{other}.c_new", f"{other}.ghost"):
            with pytest.raises(ForbiddenError, match=f"may not read lake.{name}: it has no grant.*token grant"):
                catalog.load_table(name)
    headers = _headers(server, credential)
    head = requests.head(f"{server}/v1/latest/namespaces/{other}/tables/c_new", headers=headers, timeout=30)
    assert head.status_code == 403
    before = _pointers(lake)
    c_new = lake.catalog.load_table(f"{other}.c_new")
    for what, attempt in {
        "credentials": lambda: requests.get(
            f"{server}/v1/latest/namespaces/{other}/tables/c_new/credentials", headers=headers, timeout=30
        ),
        "list": lambda: requests.get(f"{server}/v1/latest/namespaces/{other}_x/tables", headers=headers, timeout=30),
        "register": lambda: requests.post(
            f"{server}/v1/latest/namespaces/{other}/register",
            json={"name": "mine", "metadata-location": c_new.metadata_location},
            headers=headers,
            timeout=30,
        ),
        "rename": lambda: requests.post(
            f"{server}/v1/latest/tables/rename",
            json={
                "source": {"namespace": [other], "name": "c_new"},
                "destination": {"namespace": [other], "name": "d"},
            },
            headers=headers,
            timeout=30,
        ),
        "drop": lambda: requests.delete(
            f"{server}/v1/latest/namespaces/{other}/tables/c_new", headers=headers, timeout=30
        ),
    }.items():
        r = attempt()
        assert r.status_code == 403, (what, r.status_code, r.text)
    assert _pointers(lake) == before  # nothing changed
    # a grant applies at once, and taking it back too, though memory answered the load before
    _cli(lake, "token", "grant", made["client_id"], "--table", f"lake.{other}.c_new")
    for _ in range(3):
        assert reader.load_table(f"{other}.c_new") is not None
    _cli(lake, "token", "ungrant", made["client_id"], "--table", f"lake.{other}.c_new")
    with pytest.raises(ForbiddenError):
        reader.load_table(f"{other}.c_new")
    _cli(lake, "token", "ungrant", made["client_id"], "--namespace", ns)
    assert not [n for n in reader.list_namespaces() if n == (ns,)]
    with pytest.raises(ForbiddenError, match=f"may not see namespace {ns}"):
        reader.list_tables(ns)


def test_a_job_reads_its_sources_writes_its_sinks_and_nothing_else_without_a_grant(lake, server):
    """Job j reads a (written by job w) and writes b: it loads both and commits to b; another
    table is a 403 to load, list, create, register, rename, drop or commit, and nothing changes;
    with a write grant on a namespace it creates and writes unmanaged tables there."""
    ns, other = _lake_of_three(lake)
    jobs.register(lake.conn, JobDefinition(name="w", sinks=frozenset([lake.T("a")]), external_inputs=frozenset(["x"])))
    jobs.register(lake.conn, JobDefinition(name="j", sources=frozenset([lake.T("a")]), sinks=frozenset([lake.T("b")])))
    client_id, secret = tokens.create(lake.conn, job="j")
    job = rest(server, "latest", f"{client_id}:{secret}")
    assert job.load_table(f"{ns}.a") is not None and job.load_table(f"{ns}.b") is not None
    b = barriers.issue(lake.conn).barrier
    jobs.complete(lake.conn, "w", b, {})
    job.load_table(f"{ns}.b").append(
        pa.table({"id": [2]}, schema=SCHEMA), snapshot_properties={SUMMARY_BARRIER: str(b)}
    )
    assert sorted(t[-1] for t in job.list_tables(ns)) == ["a", "b"]
    assert not [n for n in job.list_namespaces() if n == (other,)]
    before = _pointers(lake)
    c = lake.catalog.load_table(f"{other}.c")
    attempts = {
        "load": lambda: job.load_table(f"{other}.c"),
        "list": lambda: job.list_tables(other),
        "create": lambda: job.create_table(f"{other}.mine", schema=SCHEMA),
        "create namespace": lambda: job.create_namespace(f"{other}_x"),
        "register": lambda: job.register_table(f"{other}.copy", c.metadata_location),
        "rename": lambda: job.rename_table(f"{other}.c", f"{other}.d"),
        "drop": lambda: job.drop_table(f"{other}.c"),
        "drop namespace": lambda: job.drop_namespace(other),
    }
    for what, attempt in attempts.items():
        with pytest.raises(ForbiddenError):
            attempt()
            pytest.fail(f"{what} was allowed")
    headers = {**_headers(server, f"{client_id}:{secret}"), "Content-Type": "application/json"}
    for path in (f"{other}/tables/c/credentials", f"{other}/tables/c_new/credentials", f"{other}/tables/ghost"):
        r = requests.get(f"{server}/v1/latest/namespaces/{path}", headers=headers, timeout=30)
        assert r.status_code == 403 and "no grant" in r.text, (path, r.text)
    commit = {"requirements": [], "updates": [{"action": "set-properties", "updates": {"owned": "yes"}}]}
    r = requests.post(f"{server}/v1/latest/namespaces/{other}/tables/c", json=commit, headers=headers, timeout=30)
    assert r.status_code == 403 and f"lake.{other}.c" in r.text and "--write" in r.text, r.text
    assert _pointers(lake) == before  # nothing changed
    _cli(lake, "token", "grant", client_id, "--write", "--namespace", other)
    made = job.create_table(f"{other}.mine", schema=SCHEMA)
    made.append(pa.table({"id": [3]}, schema=SCHEMA))
    assert job.load_table(f"{other}.c").scan().to_arrow().num_rows == 1  # write implies read


def test_grants_are_refused_where_they_make_no_sense(lake):
    """A write grant to a reader, any grant to an admin or a whole-lake token, and taking back a
    grant the token does not hold: one line each, nothing written."""
    ns = lake.namespace
    lake.catalog.create_table(f"{ns}.a", schema=SCHEMA)
    reader = _cli(lake, "token", "create", "--reader", "--namespace", ns)["client_id"]
    assert "writes nothing" in _refused(lake, "token", "grant", reader, "--write", "--table", f"lake.{ns}.a")
    admin, _ = tokens.create(lake.conn, admin=True)
    everything, _ = tokens.create(lake.conn, whole_lake=True)
    for who in (admin, everything):
        assert "whole lake already" in _refused(lake, "token", "grant", who, "--namespace", ns)
    assert "holds no grant on table" in _refused(lake, "token", "ungrant", reader, "--table", f"lake.{ns}.a")
    assert [
        e.detail["grants"] for e in audit.events(lake.conn) if e.action == "token grant" and e.object == reader
    ] == [[f"read namespace {ns}"]]
    listed = {t["client_id"]: t for t in _cli(lake, "token", "list")}
    assert listed[reader]["grants"] == [f"read namespace {ns}"] and not listed[everything]["grants"]
    shown = (
        CliRunner()
        .invoke(command, ["token", "list"], env={"ICEBARRIER_SCHEMA": lake.settings.schema}, terminal_width=300)
        .output
    )
    assert f"read namespace {ns}" in shown and "the whole lake" in shown, shown


def _pointers(lake) -> dict:
    rows = lake.conn.execute(
        f"SELECT table_namespace, table_name, metadata_location FROM {lake.settings.catalog_schema}.iceberg_tables "
        "WHERE table_namespace LIKE %s",
        (f"{lake.namespace}%",),
    ).fetchall()
    return {(r["table_namespace"], r["table_name"]): r["metadata_location"] for r in rows}


def test_the_admin_makes_a_new_pipelines_namespace(lake, server):
    """The first hour (issue 70): a new pipeline's sink lives in a namespace nobody made yet. The
    job's token may not make it (a 403 naming `icebarrier namespace create`), nor can a reader be
    granted it; the admin makes it (again: it exists, nothing changes), the job's token then
    creates its sink there, and the reader is granted the namespace."""
    ns = f"{lake.namespace}_new"
    sink = TableName.parse(f"lake.{ns}.out")
    jobs.register(lake.conn, JobDefinition(name="fresh", sinks=frozenset([sink]), external_inputs=frozenset(["x"])))
    job = rest(server, "latest", ":".join(tokens.create(lake.conn, job="fresh")))
    with pytest.raises(ForbiddenError, match=f"icebarrier namespace create {ns}"):
        job.create_namespace(ns)
    reader = _cli(lake, "token", "create", "--reader", "--namespace", lake.namespace)["client_id"]
    assert f"icebarrier namespace create {ns}" in _refused(lake, "token", "grant", reader, "--namespace", ns)
    assert _cli(lake, "namespace", "create", ns) == {"created": [ns], "existed": []}
    assert _cli(lake, "namespace", "create", ns) == {"created": [], "existed": [ns]}
    job.create_table(f"{ns}.out", schema=SCHEMA)
    assert lake.catalog.table_exists(f"{ns}.out")
    assert _cli(lake, "token", "grant", reader, "--namespace", ns)["client_id"] == reader
