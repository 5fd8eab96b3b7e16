"""Server-side scan planning (apps/catalog/planning.py) through a real `icebarrier serve`:
PyIceberg 0.12 planning on the server (``scan-planning-mode: server``) and plain HTTP as any
client sends it. A plan is made at the warehouse's cut and equals a client-side plan of the same
snapshot; large plans come in signed plan tasks any caller but the one they were made for is
refused; bad requests are the spec's 400 naming the field."""

from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pytest
import requests
from pyiceberg.catalog.rest import RestCatalog
from pyiceberg.expressions import EqualTo, GreaterThanOrEqual
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import LongType, NestedField, StringType

from icebarrier.control_plane import barriers, jobs, leases, reads, tokens
from icebarrier.iceberg_ext import scan_planning
from tests.iceberg_ext.catalog_server import (
    Pipeline,
    access_token,
    rest,
    scrape,
    spark_catalog,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.slow

SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=False),
    NestedField(2, "region", StringType(), required=False),
    NestedField(3, "amount", LongType(), required=False),
)
BY_REGION = PartitionSpec(PartitionField(source_id=2, field_id=1000, transform=IdentityTransform(), name="region"))


def planning(uri: str, warehouse: str, credential: str, mode: str = "server") -> RestCatalog:
    return rest(uri, warehouse, credential, **{"scan-planning-mode": mode})


def files(scan) -> list[str]:
    return sorted(t.file.file_path for t in scan.plan_files())


def _post(server, warehouse, name, path, headers, body) -> requests.Response:
    namespace, table = name.rsplit(".", 1)
    url = f"{server}/v1/{warehouse}/namespaces/{namespace}/tables/{table}/{path}"
    return requests.post(url, headers=headers, json=body, timeout=60)


def _regions(lake, name: str, appends: int):
    """An unmanaged table partitioned by region, ``appends`` appends of one row in each of 4 regions."""
    table = lake.catalog.create_table(name, schema=SCHEMA, partition_spec=BY_REGION)
    arrow = SCHEMA.as_arrow()
    for i in range(appends):
        table.append(
            pa.table({"id": [i * 4 + r for r in range(4)], "region": list("nsew"), "amount": [i] * 4}, schema=arrow)
        )
    return table


def test_pyiceberg_plans_on_the_server_as_it_would_itself(lake, server):
    """Pruning by partition and statistics, with and without a filter; a plan of more data
    manifests than one answer holds comes as plan tasks PyIceberg follows; the rows read equal a
    client-side plan's; the endpoints and the default mode are in /v1/config."""
    name = f"{lake.namespace}.regions"
    local = _regions(lake, name, appends=scan_planning.PLAN_TASK_MANIFESTS + 4)
    cred = ":".join(tokens.create(lake.conn, whole_lake=True))
    remote = planning(server, "latest", cred).load_table(name)
    assert remote.catalog.supports_server_side_planning()
    for row_filter in (None, EqualTo("region", "e"), GreaterThanOrEqual("amount", 18)):
        scan, theirs = (
            (t.scan(row_filter=row_filter) if row_filter is not None else t.scan()) for t in (remote, local)
        )
        assert files(scan) == files(theirs) and files(scan), row_filter
        assert scan.to_arrow().sort_by("id").equals(theirs.to_arrow().sort_by("id"))
    assert len(files(remote.scan(row_filter=EqualTo("region", "e")))) == scan_planning.PLAN_TASK_MANIFESTS + 4
    headers = {"Authorization": f"Bearer {access_token(server, *cred.split(':'))}"}
    answer = _post(server, "latest", name, "plan", headers, {}).json()
    assert answer["status"] == "completed" and len(answer["plan-tasks"]) == 2 and "file-scan-tasks" not in answer
    config = requests.get(f"{server}/v1/config", headers=headers, params={"warehouse": "latest"}, timeout=30).json()
    assert config["defaults"]["scan-planning-mode"] == "client"
    assert {"POST /v1/{prefix}/namespaces/{namespace}/tables/{table}/plan"} <= set(config["endpoints"])
    assert {"POST /v1/{prefix}/namespaces/{namespace}/tables/{table}/tasks"} <= set(config["endpoints"])


def test_a_plan_is_made_at_the_warehouses_cut(lake, server):
    """barrier-<B>, read-committed and a lease plan the cut (never the newest snapshot), latest
    the newest; a snapshot id the warehouse does not serve is a 400 naming the cut; one it
    serves (an ancestor of the cut) is planned."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    first, second = p.advance(rows=2), p.advance(rows=2)
    job = p.tables["orders"][0]
    b = barriers.issue(lake.conn).barrier  # committed, not completed: only latest sees it
    table = lake.catalog.load_table(f"{lake.namespace}.orders")
    table.append(pa.table({"id": [9], "barrier": [b]}))
    cred = ":".join(tokens.create(lake.conn, whole_lake=True))
    lease = leases.acquire(lake.conn, [lake.T("orders")], ttl_s=600, holder="t", barrier=first)
    name = f"{lake.namespace}.orders"
    rows = {
        "latest": 5,
        f"barrier-{first}": 2,
        f"barrier-{second}": 4,
        "read-committed": 4,
        f"lease-{lease.lease_id}": 2,
    }
    for warehouse, expected in rows.items():
        remote = planning(server, warehouse, cred).load_table(name)
        assert remote.scan().to_arrow().num_rows == expected, warehouse
    headers = {"Authorization": f"Bearer {access_token(server, *cred.split(':'))}"}
    newest = lake.catalog.load_table(name).current_snapshot().snapshot_id
    refused = _post(server, f"barrier-{second}", name, "plan", headers, {"snapshot-id": newest})
    assert refused.status_code == 400 and f"snapshot-id {newest} is not served" in refused.json()["error"]["message"]
    oldest = lake.catalog.load_table(name).history()[0].snapshot_id
    ancestor = _post(server, f"barrier-{second}", name, "plan", headers, {"snapshot-id": oldest}).json()
    assert sum(t["data-file"]["record-count"] for t in ancestor["file-scan-tasks"]) == 2
    jobs.complete(lake.conn, job, b, {lake.T("orders"): table.current_snapshot().snapshot_id})


def test_bad_plans_and_forged_tasks_are_the_specs_errors(lake, server):
    """A malformed or mistyped filter, an unknown select or stats field, snapshot-id with a
    start, a start without an end: 400 naming it. A plan task altered, forged, or sent for
    another table, through another warehouse or with another token: the same 404. A reader not
    granted the table: the load's 403, for the plan and its tasks."""
    name = f"{lake.namespace}.regions"
    _regions(lake, name, appends=scan_planning.PLAN_TASK_MANIFESTS + 1)
    _regions(lake, f"{lake.namespace}.other", appends=1)
    cred = tokens.create(lake.conn, whole_lake=True)
    headers = {"Authorization": f"Bearer {access_token(server, *cred)}"}
    bad = {
        "filter": {"type": "eq", "term": "nowhere", "value": 1},
        "select": ["id", "nowhere"],
        "stats-fields": ["nowhere"],
        "snapshot-id": "latest",
        "case-sensitive": "yes",
        "min-rows-requested": -1,
    }
    for key, value in bad.items():
        r = _post(server, "latest", name, "plan", headers, {key: value})
        assert r.status_code == 400 and key.split("-")[0] in r.json()["error"]["message"], (key, r.text)
        assert r.json()["error"]["type"] == "BadRequestException"
    for body in (
        {"filter": {"type": "eq", "term": "id"}},
        {"filter": {"type": "bogus", "term": "id", "value": 1}},
        {"filter": {"type": "eq", "term": "id", "value": "x"}},
        {"snapshot-id": 1, "start-snapshot-id": 1, "end-snapshot-id": 2},
        {"start-snapshot-id": 1},
    ):
        r = _post(server, "latest", name, "plan", headers, body)
        assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)
    deep = '{"filter":' + '{"type":"not","child":' * 5000 + '{"type":"eq","term":"id","value":1}' + "}" * 5001
    namespace, table = name.rsplit(".", 1)
    r = requests.post(
        f"{server}/v1/latest/namespaces/{namespace}/tables/{table}/plan", headers=headers, data=deep, timeout=60
    )
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    [task, _] = _post(server, "latest", name, "plan", headers, {}).json()["plan-tasks"]
    assert _post(server, "latest", name, "tasks", headers, {"plan-task": task}).status_code == 200
    other = {"Authorization": f"Bearer {access_token(server, *tokens.create(lake.conn, whole_lake=True))}"}
    payload, mac = task.split(".")
    for warehouse, table, who, sent in (
        ("latest", name, headers, payload[:-2] + ("AA" if payload[-2:] != "AA" else "BB") + "." + mac),
        ("latest", name, headers, "forged.token"),
        ("latest", name, headers, "not a task"),
        ("latest", f"{lake.namespace}.other", headers, task),
        ("read-committed", name, headers, task),
        ("latest", name, other, task),
    ):
        r = _post(server, warehouse, table, "tasks", who, {"plan-task": sent})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NoSuchPlanTaskException", r.text
    ungranted = {"Authorization": f"Bearer {access_token(server, *tokens.create(lake.conn))}"}
    load = requests.get(f"{server}/v1/latest/namespaces/{lake.namespace}/tables/regions", headers=ungranted, timeout=30)
    plan = _post(server, "latest", name, "plan", ungranted, {})
    assert load.status_code == plan.status_code == 403 and load.json() == plan.json()


def test_an_incremental_plan_between_two_barriers_is_what_the_pipeline_added(lake, server):
    """start-snapshot-id and end-snapshot-id of two barriers' cuts: the data files the snapshots
    after the first up to the second added, through latest and through barrier-<B> of the
    second; a range the warehouse does not serve, or backwards, is a 400."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    marks = [p.advance(rows=i + 1) for i in range(4)]
    cut = {b: reads.resolve(lake.conn, [lake.T("orders")], barrier=b).snapshots[lake.T("orders")] for b in marks}
    headers = {"Authorization": f"Bearer {access_token(server, *tokens.create(lake.conn, whole_lake=True))}"}
    name = f"{lake.namespace}.orders"
    body = {"start-snapshot-id": cut[marks[0]], "end-snapshot-id": cut[marks[2]]}
    for warehouse in ("latest", f"barrier-{marks[2]}"):
        answer = _post(server, warehouse, name, "plan", headers, body).json()
        assert sorted(t["data-file"]["record-count"] for t in answer["file-scan-tasks"]) == [2, 3], warehouse
    ahead = {"start-snapshot-id": cut[marks[0]], "end-snapshot-id": cut[marks[3]]}
    r = _post(server, f"barrier-{marks[2]}", name, "plan", headers, ahead)
    assert r.status_code == 400 and "end-snapshot-id" in r.json()["error"]["message"], r.text
    backwards = {"start-snapshot-id": cut[marks[2]], "end-snapshot-id": cut[marks[0]]}
    r = _post(server, "latest", name, "plan", headers, backwards)
    assert r.status_code == 400 and "does not descend" in r.json()["error"]["message"], r.text


def test_both_filter_forms_prune_alike(lake, server):
    """The older form (term, value) and the newer (left/right or child, references by name or
    field id, typed literals, a literal on the left) plan the same files; what cannot prune (a
    function, a transform) plans every file, also under a NOT."""
    name = f"{lake.namespace}.regions"
    _regions(lake, name, appends=3)
    headers = {"Authorization": f"Bearer {access_token(server, *tokens.create(lake.conn, whole_lake=True))}"}

    def planned(row_filter) -> int:
        answer = _post(server, "latest", name, "plan", headers, {"filter": row_filter})
        assert answer.status_code == 200, answer.text
        return len(answer.json()["file-scan-tasks"])

    region = {"type": "reference", "name": "region"}
    east = [
        {"type": "eq", "term": "region", "value": "e"},
        {"type": "eq", "left": region, "right": {"type": "literal", "value": "e", "data-type": "string"}},
        {"type": "eq", "left": {"type": "reference", "id": 2}, "right": "e"},
        {"type": "eq", "left": "e", "right": region},
        {"type": "in", "child": region, "values": {"type": "literals", "values": ["e"], "data-type": "string"}},
        {"type": "and", "left": True, "right": {"type": "not-eq", "term": "region", "value": "x"}}
        | {"right": {"type": "in", "term": "region", "values": ["e"]}},
    ]
    assert [planned(f) for f in east] == [3] * len(east)
    assert planned({"type": "gt", "left": 1, "right": {"type": "reference", "name": "amount"}}) == 4  # amount < 1
    function = {"type": "eq", "left": {"type": "apply", "function": "lower", "arguments": [region]}, "right": "e"}
    transform = {"type": "eq", "term": {"type": "transform", "transform": "identity", "term": "region"}, "value": "e"}
    for unprunable in (function, transform, {"type": "not", "child": function}):
        assert planned(unprunable) == 12, unprunable
    assert planned({"type": "and", "left": function, "right": east[0]}) == 3


def test_each_request_field_shapes_the_plan_as_the_spec_says(lake, server):
    """stats-fields: each file with the statistics of those fields only (none without it);
    case-sensitive false: a filter and stats field named in capitals bind (true: 400 naming it);
    select: checked, every file still planned (a projection prunes no file); min-rows-requested:
    tasks until that many rows; use-snapshot-schema: a filter on a column added after the
    snapshot planned binds to the current schema, and with it to the snapshot's (400)."""
    name = f"{lake.namespace}.regions"
    table = _regions(lake, name, appends=3)  # 12 files of one row: 4 regions x 3 appends
    old = table.current_snapshot().snapshot_id
    headers = {"Authorization": f"Bearer {access_token(server, *tokens.create(lake.conn, whole_lake=True))}"}

    def plan(body: dict) -> list[dict]:
        answer = _post(server, "latest", name, "plan", headers, body)
        assert answer.status_code == 200, (body, answer.text)
        return answer.json()["file-scan-tasks"]

    def stats(task: dict) -> set[int]:
        file = task["data-file"]
        return {
            k for key in ("lower-bounds", "upper-bounds", "value-counts") for k in file.get(key, {}).get("keys", [])
        }

    assert {frozenset(stats(t)) for t in plan({"stats-fields": ["amount"]})} == {frozenset({3})}
    assert {frozenset(stats(t)) for t in plan({})} == {frozenset()}
    east = {"type": "eq", "term": "REGION", "value": "e"}
    assert len(plan({"filter": east, "case-sensitive": False, "stats-fields": ["AMOUNT"]})) == 3
    refused = _post(server, "latest", name, "plan", headers, {"filter": east})
    assert refused.status_code == 400 and "REGION" in refused.json()["error"]["message"], refused.text
    assert len(plan({"select": ["id", "region"]})) == 12
    assert len(plan({"min-rows-requested": 5})) == 5
    with table.update_schema() as update:
        update.add_column("note", StringType())
    noted = {"type": "is-null", "term": "note"}
    assert len(plan({"snapshot-id": old, "filter": noted})) == 12  # the current schema: every row's note is null
    refused = _post(
        server, "latest", name, "plan", headers, {"snapshot-id": old, "filter": noted, "use-snapshot-schema": True}
    )
    assert refused.status_code == 400 and "note" in refused.json()["error"]["message"], refused.text


def test_spark_plans_on_the_server_at_the_cut(lake, server, spark):
    """Spark through Iceberg 1.12's REST client with ``scan-planning-mode=server``: a filtered
    aggregate over a partitioned table planned in plan tasks equals the same query planned by
    Spark itself; through barrier-<B> it reads the cut; an incremental read between two
    barriers' cuts (which Spark plans itself) reads what the pipeline added."""

    name = f"{lake.namespace}.regions"
    _regions(lake, name, appends=scan_planning.PLAN_TASK_MANIFESTS + 2)
    p = Pipeline(lake, {"ingest": ["orders"]})
    first = p.advance(rows=2)
    p.advance(rows=3)
    cred = ":".join(tokens.create(lake.conn, whole_lake=True))
    catalogs = {
        (warehouse, mode): spark_catalog(spark, warehouse, server, cred, **{"scan-planning-mode": mode})
        for warehouse, mode in (("latest", "server"), ("latest", "client"), (f"barrier-{first}", "server"))
    }
    query = (
        "SELECT region, count(*) AS n, sum(amount) AS total FROM {}.{} "
        "WHERE region IN ('e', 'w') AND amount >= 3 GROUP BY region ORDER BY region"
    )
    on_server = spark.sql(query.format(catalogs[("latest", "server")], name)).collect()
    on_client = spark.sql(query.format(catalogs[("latest", "client")], name)).collect()
    assert on_server == on_client and [r.n for r in on_server] == [15, 15]
    headers = {"Authorization": f"Bearer {access_token(server, *cred.split(':'))}"}
    plans = scrape(server, headers)[("icebarrier_catalog_plans_total", (("warehouse", "latest"),))]
    assert plans >= 1
    pinned = spark.table(f"{catalogs[(f'barrier-{first}', 'server')]}.{lake.namespace}.orders").count()
    assert pinned == 2
    # an incremental read between two barriers' cuts, planned by the server and by Spark
    third = p.advance(rows=4)
    start, end = (
        reads.resolve(lake.conn, [lake.T("orders")], barrier=b).snapshots[lake.T("orders")] for b in (first, third)
    )
    increments = [
        spark.read.format("iceberg")
        .option("start-snapshot-id", str(start))
        .option("end-snapshot-id", str(end))
        .load(f"{catalogs[('latest', mode)]}.{lake.namespace}.orders")
        .count()
        for mode in ("server", "client")
    ]
    assert increments == [3 + 4, 3 + 4]
    # Iceberg 1.12's REST table plans only its point-in-time scans on the server: an incremental
    # read is planned by Spark itself (RESTTable overrides newScan, not newIncrementalAppendScan)
    assert scrape(server, headers)[("icebarrier_catalog_plans_total", (("warehouse", "latest"),))] == plans


def test_manifests_are_read_once_for_every_client_and_the_cache_is_bounded(lake, server):
    """A second plan of the same snapshot, by another client, reads no manifest from storage
    (every read a hit in /metrics); the cache keeps at most its bound of entries, dropping the
    least recently used manifests, and answers alike when a manifest no longer fits."""
    name = f"{lake.namespace}.regions"
    table = _regions(lake, name, appends=6)
    clients = [
        {"Authorization": f"Bearer {access_token(server, *tokens.create(lake.conn, whole_lake=True))}"}
        for _ in range(2)
    ]
    reads = {k: ("icebarrier_catalog_plan_manifest_reads_total", (("from", k),)) for k in ("hit", "miss")}
    before = scrape(server, clients[0])
    first = _post(server, "latest", name, "plan", clients[0], {}).json()
    middle = scrape(server, clients[0])
    second = _post(server, "latest", name, "plan", clients[1], {}).json()
    after = scrape(server, clients[0])
    assert first == second and len(first["file-scan-tasks"]) == 24
    assert middle[reads["miss"]] - before.get(reads["miss"], 0) == 6
    assert (after[reads["hit"]] - middle[reads["hit"]], after[reads["miss"]] - middle[reads["miss"]]) == (6, 0)

    small = scan_planning.ManifestCache(max_entries=9)  # room for two manifests of 4 entries
    manifests = table.current_snapshot().manifests(table.io)
    for manifest in manifests:
        assert len(small.get(manifest, table.io)) == 4
    assert small.entries == 8 and (small.hits, small.misses) == (0, 6)
    assert len(small.get(manifests[-1], table.io)) == 4 and small.hits == 1  # the most recent is kept
    assert len(small.get(manifests[0], table.io)) == 4 and small.misses == 7  # the oldest was dropped


def test_a_submitted_plan_is_fetched_or_cancelled_from_any_server(lake):
    """With ``--plan-submit-above 2`` a plan of more data manifests is answered submitted; its
    result, fetched from another server process, is the plan (its tasks give the files a client
    plan gives); another token, another table or an altered id gets the same 404; once cancelled
    (through either process) it answers cancelled; a plan id is no plan task and the reverse."""
    name = f"{lake.namespace}.regions"
    local = _regions(lake, name, appends=5)
    _regions(lake, f"{lake.namespace}.other", appends=5)
    servers = [start_server(lake, "--plan-submit-above", "2") for _ in range(2)]
    try:
        (_, one), (_, two) = servers
        cred = tokens.create(lake.conn, whole_lake=True)
        headers = {"Authorization": f"Bearer {access_token(one, *cred)}"}
        submitted = _post(
            one, "latest", name, "plan", headers, {"filter": {"type": "eq", "term": "region", "value": "n"}}
        )
        assert submitted.json()["status"] == "submitted", submitted.text
        plan_id = submitted.json()["plan-id"]
        url = f"{two}/v1/latest/namespaces/{lake.namespace}/tables/regions/plan/{plan_id}"
        result = requests.get(url, headers=headers, timeout=30).json()
        assert result["status"] == "completed" and result["plan-id"] == plan_id and "file-scan-tasks" not in result
        found = []
        for task in result["plan-tasks"]:
            answer = _post(two, "latest", name, "tasks", headers, {"plan-task": task}).json()
            found += [t["data-file"]["file-path"] for t in answer["file-scan-tasks"]]
        assert sorted(found) == files(local.scan(row_filter=EqualTo("region", "n"))) and len(found) == 5

        other = {"Authorization": f"Bearer {access_token(two, *tokens.create(lake.conn, whole_lake=True))}"}
        elsewhere = f"{two}/v1/latest/namespaces/{lake.namespace}/tables/other/plan/{plan_id}"
        for target, who in ((url, other), (elsewhere, headers), (url[:-3] + "xyz", headers)):
            r = requests.get(target, headers=who, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["type"] == "NoSuchPlanIdException", r.text
        as_task = _post(two, "latest", name, "tasks", headers, {"plan-task": plan_id})
        assert as_task.status_code == 404 and as_task.json()["error"]["type"] == "NoSuchPlanTaskException"
        task_url = f"{two}/v1/latest/namespaces/{lake.namespace}/tables/regions/plan/{result['plan-tasks'][0]}"
        assert requests.get(task_url, headers=headers, timeout=30).status_code == 404

        assert requests.delete(url.replace(two, one), headers=other, timeout=30).status_code == 404
        assert requests.delete(url.replace(two, one), headers=headers, timeout=30).status_code == 204
        assert requests.get(url, headers=headers, timeout=30).json() == {"status": "cancelled"}
    finally:
        for proc, _ in servers:
            stop_server(proc)


def test_deletes_and_an_evolved_schema_plan_as_on_the_client(lake, server, spark):
    """A table Spark wrote with position deletes (merge-on-read) and then evolved (a column added,
    a partition field added): the server's plan has the same data files and the same delete
    files for each as PyIceberg's own, with and without a filter, and the rows read agree (an
    older snapshot planned with its own schema too)."""
    name = f"{lake.namespace}.changes"
    spark.sql(
        f"CREATE TABLE lake.{name} (id bigint, region string) USING iceberg PARTITIONED BY (region) "
        "TBLPROPERTIES ('format-version'='2', 'write.delete.mode'='merge-on-read')"
    )
    spark.sql(f"INSERT INTO lake.{name} SELECT id, CASE WHEN id % 2 = 0 THEN 'e' ELSE 'w' END FROM range(40)")
    spark.sql(f"DELETE FROM lake.{name} WHERE id % 5 = 0")
    before = lake.catalog.load_table(name).current_snapshot().snapshot_id
    spark.sql(f"ALTER TABLE lake.{name} ADD COLUMN amount bigint")
    spark.sql(f"ALTER TABLE lake.{name} ADD PARTITION FIELD bucket(4, id)")
    spark.sql(f"INSERT INTO lake.{name} SELECT id, 'n', id * 10 FROM range(40, 50)")
    spark.sql(f"DELETE FROM lake.{name} WHERE id = 41")
    cred = ":".join(tokens.create(lake.conn, whole_lake=True))
    local = planning(server, "latest", cred, mode="client").load_table(name)
    remote = planning(server, "latest", cred).load_table(name)

    def plan(scan) -> list[tuple[str, list[str]]]:
        return sorted((t.file.file_path, sorted(d.file_path for d in t.delete_files)) for t in scan.plan_files())

    for row_filter in (None, EqualTo("region", "e"), GreaterThanOrEqual("id", 41)):
        mine, theirs = (t.scan(row_filter=row_filter) if row_filter is not None else t.scan() for t in (remote, local))
        assert plan(mine) == plan(theirs), row_filter
        assert mine.to_arrow().sort_by("id").equals(theirs.to_arrow().sort_by("id"))
    assert any(deletes for _, deletes in plan(remote.scan())), "the table has position deletes"
    assert remote.scan().to_arrow().num_rows == 40 - 8 + 9
    old = remote.scan(snapshot_id=before)
    assert plan(old) == plan(local.scan(snapshot_id=before)) and old.to_arrow().num_rows == 32


def _equality_delete(spark, name: str, ids: list[int], region: str) -> str:
    """An equality-delete file (rows whose ``id`` is in ``ids``) in partition ``region``, written
    with PyArrow and committed with Iceberg Java's RowDelta, as Flink's upserts write them (Spark
    and PyIceberg write none). Its path."""
    import pyarrow.parquet as pq

    jvm = spark.sparkContext._jvm
    table = jvm.org.apache.iceberg.spark.Spark3Util.loadIcebergTable(spark._jsparkSession, f"lake.{name}")
    field_id = table.schema().findField("id").fieldId()
    path = f"{table.location()}/data/region={region}/eq-{uuid.uuid4().hex[:8]}.parquet"
    local = path.removeprefix("file:").removeprefix("//")
    column = pa.field("id", pa.int64(), metadata={"PARQUET:field_id": str(field_id)})
    pq.write_table(pa.table({"id": ids}, schema=pa.schema([column])), local)
    field_ids = spark.sparkContext._gateway.new_array(jvm.int, 1)
    field_ids[0] = field_id
    delete = (
        jvm.org.apache.iceberg.FileMetadata.deleteFileBuilder(table.spec())
        .ofEqualityDeletes(field_ids)
        .withPath(path)
        .withFormat("parquet")
        .withFileSizeInBytes(os.path.getsize(local))
        .withRecordCount(len(ids))
        .withPartitionPath(f"region={region}")
        .build()
    )
    table.newRowDelta().addDeletes(delete).commit()
    return path


def test_equality_deletes_apply_to_the_files_written_before_them_in_their_partition(lake, server, spark):
    """Equality deletes (Flink's upserts): a plan on the server gives each data file the equality
    deletes of its partition written after it (a greater sequence number), as Iceberg Java does;
    a file written after a delete, or in another partition, is not given it. Spark planning on
    the server reads the rows Spark planning itself reads."""

    name = f"{lake.namespace}.upserts"
    spark.sql(
        f"CREATE TABLE lake.{name} (id bigint, region string) USING iceberg PARTITIONED BY (region) "
        "TBLPROPERTIES ('format-version'='2')"
    )
    spark.sql(f"INSERT INTO lake.{name} SELECT id, IF(id % 2 = 0, 'e', 'w') FROM range(10)")
    deletes = _equality_delete(spark, name, [2, 3, 4], region="e")  # 3 is in w: not deleted
    spark.sql(f"INSERT INTO lake.{name} VALUES (2, 'e')")  # written after the delete: kept
    cred = ":".join(tokens.create(lake.conn, whole_lake=True))
    headers = {"Authorization": f"Bearer {access_token(server, *cred.split(':'))}"}
    plan = _post(server, "latest", name, "plan", headers, {})
    assert plan.status_code == 200, plan.text
    body = plan.json()
    given = {
        (t["data-file"]["partition"][0], t["data-file"]["record-count"]): [
            body["delete-files"][i]["file-path"] for i in t.get("delete-file-references", [])
        ]
        for t in body["file-scan-tasks"]
    }
    assert given == {("e", 5): [deletes], ("w", 5): [], ("e", 1): []}, given
    assert body["delete-files"][0]["content"] == "equality-deletes" and body["delete-files"][0]["equality-ids"] == [1]
    read = {}
    for mode in ("server", "client"):
        catalog = spark_catalog(spark, "latest", server, cred, **{"scan-planning-mode": mode})
        read[mode] = [r.id for r in spark.sql(f"SELECT id FROM {catalog}.{name} ORDER BY id").collect()]
    assert read["server"] == read["client"] == [0, 1, 2, 3, 5, 6, 7, 8, 9], read


def test_runs_bound_a_plan_by_manifests_and_files():
    """A run holds at most 16 manifests and 10,000 files; a larger manifest is a run alone."""
    from types import SimpleNamespace

    def manifests(*counts):
        return [SimpleNamespace(added_files_count=c, existing_files_count=0) for c in counts]

    assert scan_planning.runs([]) == []
    assert scan_planning.runs(manifests(*[1] * 40)) == [(0, 16), (16, 32), (32, 40)]
    assert scan_planning.runs(manifests(6_000, 5_000, 20_000, 1, 1)) == [(0, 1), (1, 2), (2, 3), (3, 5)]
    assert scan_planning.runs(manifests(4_000, 6_000, 1)) == [(0, 2), (2, 3)]
