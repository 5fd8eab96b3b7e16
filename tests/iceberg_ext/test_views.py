"""Views through a real `icebarrier serve` (apps/catalog/views.py): PyIceberg's REST client and
the spec's requests as any client sends them. A view is stored like a table's metadata (a file in
the warehouse, its pointer a row of the SQL catalog marked VIEW), shares the name space of
tables, is changed by an admin or a job with a write grant, and read with a read grant."""

from __future__ import annotations

import threading
import time
import uuid

import pyarrow as pa
import pytest
import requests
from pyiceberg.exceptions import (
    ForbiddenError,
    NoSuchTableError,
    NoSuchViewError,
    TableAlreadyExistsError,
    ViewAlreadyExistsError,
)
from pyiceberg.view.metadata import SQLViewRepresentation, ViewVersion

from icebarrier.control_plane import tokens
from tests.iceberg_ext.catalog_server import Pipeline, access_token, rest
from tests.iceberg_ext.test_catalog_conformance import _job_token

ROW = pa.schema([pa.field("id", pa.int64())])


def _version(sql: str, namespace: str, dialect: str = "spark", version_id: int = 1) -> ViewVersion:
    return ViewVersion(
        version_id=version_id,
        schema_id=0,
        timestamp_ms=1,
        summary={"engine-name": "test"},
        representations=[SQLViewRepresentation(type="sql", sql=sql, dialect=dialect)],
        default_namespace=[namespace],
    )


def test_a_view_is_created_loaded_replaced_renamed_and_dropped(lake, server):
    """Create (a query naming a table that does not exist: it loads all the same, an unknown
    dialect is kept as given), load, exists, list; replace it with a new version (a commit of
    add-schema, add-view-version, set-current-view-version under assert-view-uuid: version 2,
    the history grows); a stale uuid is a 409; rename; drop."""
    ns, credential = lake.namespace, _job_token(lake)
    writer = rest(server, "latest", credential)
    made = writer.create_view((ns, "v"), ROW, _version(f"SELECT * FROM {ns}.nowhere", ns, dialect="made-up"))
    loaded = writer.load_view((ns, "v"))
    assert loaded.metadata.current_version_id == 1 and loaded.metadata.view_uuid == made.metadata.view_uuid
    [representation] = loaded.metadata.versions[0].representations
    assert representation.root.dialect == "made-up" and representation.root.sql.endswith("nowhere")
    assert writer.view_exists((ns, "v")) and writer.list_views((ns,)) == [(ns, "v")]
    assert (ns, "v") not in writer.list_tables((ns,))

    cid, secret = credential.split(":")
    headers = {"Authorization": f"Bearer {access_token(server, cid, secret)}"}
    url = f"{server}/v1/latest/namespaces/{ns}/views/v"
    first = requests.get(url, headers=headers, timeout=30).json()["metadata-location"]
    schema = {"type": "struct", "schema-id": 1, "fields": [{"id": 1, "name": "n", "type": "long", "required": False}]}
    version = {
        "version-id": 2,
        "timestamp-ms": 2,
        "schema-id": -1,
        "summary": {"operation": "replace"},
        "representations": [
            {"type": "sql", "sql": "SELECT 1 AS n", "dialect": "made-up"},
            {"type": "sql", "sql": "SELECT 1 AS n", "dialect": "spark"},
        ],
        "default-namespace": [ns],
    }
    commit = {
        "requirements": [{"type": "assert-view-uuid", "uuid": str(made.metadata.view_uuid)}],
        "updates": [
            {"action": "add-schema", "schema": schema},
            {"action": "add-view-version", "view-version": version},
            {"action": "set-current-view-version", "view-version-id": -1},
            {"action": "set-properties", "updates": {"owner": "team"}},
        ],
    }
    replaced = requests.post(url, json=commit, headers=headers, timeout=30)
    assert replaced.status_code == 200, replaced.text
    metadata = replaced.json()["metadata"]
    assert metadata["current-version-id"] == 2 and [h["version-id"] for h in metadata["version-log"]] == [1, 2]
    assert [s["schema-id"] for s in metadata["schemas"]] == [0, 1] and metadata["properties"] == {"owner": "team"}
    assert replaced.json()["metadata-location"] != first and "/metadata/00001-" in replaced.json()["metadata-location"]
    stale = {**commit, "requirements": [{"type": "assert-view-uuid", "uuid": "00000000-0000-0000-0000-000000000000"}]}
    conflict = requests.post(url, json=stale, headers=headers, timeout=30)
    assert conflict.status_code == 409 and conflict.json()["error"]["type"] == "CommitFailedException", conflict.text
    v1 = requests.get(url, headers=headers, timeout=30).json()["metadata"]["versions"][0]
    back = {  # version 1's content again: its id is reused, made current, and the history says so
        "requirements": commit["requirements"],
        "updates": [
            {"action": "set-properties", "updates": {"replace.drop-dialect.allowed": "true"}},  # v1 has no spark
            {"action": "add-view-version", "view-version": {**v1, "version-id": 3}},
            {"action": "set-current-view-version", "view-version-id": 1},
        ],
    }
    again = requests.post(url, json=back, headers=headers, timeout=30)
    assert again.status_code == 200, again.text
    metadata = again.json()["metadata"]
    assert metadata["current-version-id"] == 1 and len(metadata["versions"]) == 2, metadata
    assert [h["version-id"] for h in metadata["version-log"]] == [1, 2, 1]

    body = {"source": {"namespace": [ns], "name": "v"}, "destination": {"namespace": [ns], "name": "w"}}
    assert requests.post(f"{server}/v1/latest/views/rename", json=body, headers=headers, timeout=30).status_code == 204
    assert not writer.view_exists((ns, "v")) and writer.load_view((ns, "w")).metadata.current_version_id == 1
    writer.drop_view((ns, "w"))
    with pytest.raises(NoSuchViewError):
        writer.load_view((ns, "w"))


def test_tables_and_views_share_one_name_space(lake, server):
    """A view named like a table, a table named like a view, and a rename of either onto the
    other are one 409 naming it; a table load of a view's name finds no table; a namespace
    holding a view is not empty."""
    ns, credential = lake.namespace, _job_token(lake)
    writer = rest(server, "latest", credential)
    writer.create_table((ns, "t"), ROW)
    writer.create_view((ns, "v"), ROW, _version(f"SELECT * FROM {ns}.t", ns))
    with pytest.raises(ViewAlreadyExistsError, match=f"Table with same name already exists: {ns}.t"):
        writer.create_view((ns, "t"), ROW, _version("SELECT 1", ns))
    with pytest.raises(TableAlreadyExistsError, match=f"View with same name already exists: {ns}.v"):
        writer.create_table((ns, "v"), ROW)
    with pytest.raises(NoSuchTableError):
        writer.load_table((ns, "v"))
    cid, secret = credential.split(":")
    headers = {"Authorization": f"Bearer {access_token(server, cid, secret)}"}
    for what, source, destination, message in (
        ("views", "v", "t", f"Cannot rename {ns}.v to {ns}.t. Table already exists"),
        ("tables", "t", "v", f"Cannot rename {ns}.t to {ns}.v. View already exists"),
    ):
        body = {"source": {"namespace": [ns], "name": source}, "destination": {"namespace": [ns], "name": destination}}
        r = requests.post(f"{server}/v1/latest/{what}/rename", json=body, headers=headers, timeout=30)
        assert r.status_code == 409 and r.json()["error"]["message"] == message, r.text
    writer.drop_table((ns, "t"))
    gone = requests.delete(f"{server}/v1/latest/namespaces/{ns}", headers=headers, timeout=30)
    assert gone.status_code == 409 and gone.json()["error"]["type"] == "NamespaceNotEmptyException", gone.text
    assert writer.view_exists((ns, "v"))


def test_who_may_change_and_read_a_view(lake, server):
    """A reader changes nothing; a job without a write grant on the namespace may not create a
    view there (403 naming the grant), an admin may; a reader without a read grant may not load
    it, one granted the namespace may, and lists only what it may read."""
    ns = lake.namespace
    admin = rest(server, "latest", ":".join(tokens.create(lake.conn, admin=True)))
    admin.create_view((ns, "v"), ROW, _version("SELECT 1", ns))
    _job_token(lake)  # registers the job conformance
    narrow = rest(server, "latest", ":".join(tokens.create(lake.conn, job=f"{ns}_conformance")))
    with pytest.raises(ForbiddenError, match="write grant"):
        narrow.create_view((ns, "w"), ROW, _version("SELECT 1", ns))
    reader_id, reader_secret = tokens.create(lake.conn)
    reader = rest(server, "latest", f"{reader_id}:{reader_secret}")
    with pytest.raises(ForbiddenError):
        reader.load_view((ns, "v"))
    with pytest.raises(ForbiddenError):
        reader.create_view((ns, "x"), ROW, _version("SELECT 1", ns))
    tokens.grant(lake.conn, reader_id, [tokens.Grant("namespace", ns, "read")])
    assert rest(server, "latest", f"{reader_id}:{reader_secret}").load_view((ns, "v")).metadata.current_version_id == 1
    assert reader.list_views((ns,)) == [(ns, "v")]


BOTH = pa.schema([pa.field("o", pa.int64()), pa.field("p", pa.int64())])
BOTH_SQL = (
    "SELECT o.b AS o, p.b AS p FROM (SELECT max(barrier) AS b FROM orders) o "
    "CROSS JOIN (SELECT max(barrier) AS b FROM payments) p"
)


def two_table_view(lake, server, *dialects: str, catalog: str | None = None) -> Pipeline:
    """orders and payments, written by two jobs (one commits, then the other: a moment between
    shows them at two barriers); the view ``both`` over them, its SQL naming them relative to its
    default namespace (and ``catalog``, the engine's catalog it names), in each of ``dialects``."""
    p = Pipeline(lake, {"orders": ["orders"], "payments": ["payments"]})
    p.advance(rows=3)
    version = _version(BOTH_SQL, lake.namespace)
    version = version.model_copy(
        update={
            "representations": [SQLViewRepresentation(type="sql", sql=BOTH_SQL, dialect=d) for d in dialects],
            "default_catalog": catalog,
        }
    )
    rest(server, "latest", ":".join(tokens.create(lake.conn, admin=True))).create_view(
        (lake.namespace, "both"), BOTH, version
    )
    return p


def _spark_catalog(spark, server: str, warehouse: str, credential: str) -> str:
    """A Spark catalog over ``warehouse``, configured as `icebarrier connect --engine spark` says."""
    from icebarrier.apps.catalog.clients import configuration

    name = f"rest_{uuid.uuid4().hex[:6]}"
    for line in configuration("spark", warehouse, server, credential, name).splitlines():
        key, value = line.split(" ", 1)
        if key.startswith(f"spark.sql.catalog.{name}"):
            spark.conf.set(key, value)
    return name


@pytest.mark.slow
def test_a_spark_query_on_a_two_table_view_reads_one_barrier_through_read_committed(lake, server, spark):
    """Spark reads the view `both` (over two tables two jobs commit one after the other) while
    the pipeline commits: through read-committed every read sees both tables at one barrier and
    the reads move with the pipeline; through latest, for contrast, the share of mixed reads is
    measured and printed; through barrier-<B> the view shows both tables at B."""
    p = two_table_view(lake, server, "spark")
    reader = ":".join(tokens.create(lake.conn, whole_lake=True))
    rc, latest = (_spark_catalog(spark, server, w, reader) for w in ("read-committed", "latest"))
    stop = threading.Event()

    def commit() -> None:
        while not stop.is_set():
            p.advance(rows=3)

    writer = threading.Thread(target=commit, daemon=True)
    writer.start()
    seen: dict[str, list] = {rc: [], latest: []}
    try:
        for i in range(12):
            for catalog in (rc, latest):
                seen[catalog].append(spark.sql(f"SELECT o, p FROM {catalog}.{lake.namespace}.both").collect()[0])
            if i % 3 == 2:  # four groups of reads: one may find the pipeline where the last left it
                time.sleep(1.5)  # quiet: the session moves on (the server's --session-quiet is 1 s)
    finally:
        stop.set()
        writer.join(timeout=60)
    mixed = {c: [r for r in rows if r.o != r.p] for c, rows in seen.items()}
    print(
        f"spark on a two-table view: mixed reads {len(mixed[rc])}/12 through read-committed, "
        f"{len(mixed[latest])}/12 through latest"
    )
    assert mixed[rc] == [], mixed[rc][:5]
    assert len({r.o for r in seen[rc]}) >= 3  # the reads moved with the pipeline
    pinned = _spark_catalog(spark, server, f"barrier-{p.marks[1]}", reader)  # the view at B: both tables at B
    row = spark.sql(f"SELECT o, p FROM {pinned}.{lake.namespace}.both").collect()[0]
    assert (row.o, row.p) == (p.marks[1], p.marks[1])
