"""`icebarrier serve`: a real server process on a free port, real clients (PyIceberg's
RestCatalog, Spark's REST catalog client from the Iceberg runtime jar, plain HTTP)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid

import pyarrow as pa
import pytest
import requests

from icebarrier.control_plane import barriers, jobs, leases, reads, tables, tokens
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER
from tests.iceberg_ext.catalog_server import (
    Pipeline,
    access_token,
    rest,
    scrape,
    staged_change,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.slow


def test_pinned_warehouses_serve_the_cut_with_trimmed_metadata(lake, server):
    """barrier-<B>, read-committed and lease-<ID> loads equal the control plane's cut; the
    metadata (response and file) lists only the pin and its ancestors; latest is current."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    marks = [p.advance(rows=10) for _ in range(3)]
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    cred = f"{cid}:{secret}"
    name = f"{lake.namespace}.orders"
    for i, b in enumerate(marks):
        table = rest(server, f"barrier-{b}", cred).load_table(name)
        cut = reads.resolve(lake.conn, [lake.T("orders")], barrier=b)
        assert table.metadata.current_snapshot_id == cut.snapshots[lake.T("orders")]
        assert table.scan().to_arrow().num_rows == 10 * (i + 1)
        assert (
            len(table.metadata.snapshots) == i + 1
            and table.metadata.refs["main"].snapshot_id == cut.snapshots[lake.T("orders")]
        )
        from pyiceberg.serializers import FromInputFile

        on_disk = FromInputFile.table_metadata(table.io.new_input(table.metadata_location))
        assert on_disk.current_snapshot_id == table.metadata.current_snapshot_id
        assert [s.snapshot_id for s in on_disk.snapshots] == [s.snapshot_id for s in table.metadata.snapshots]
    assert rest(server, "latest", cred).load_table(name).scan().to_arrow().num_rows == 30
    assert rest(server, "read-committed", cred).load_table(name).scan().to_arrow().num_rows == 30
    lease = leases.acquire(lake.conn, [lake.T("orders")], ttl_s=600, holder="t", barrier=marks[0])
    assert rest(server, f"lease-{lease.lease_id}", cred).load_table(name).scan().to_arrow().num_rows == 10


def test_a_pinned_warehouse_at_a_coalesced_barrier_is_refused(lake, server):
    """barrier-<B> of a barrier a table coalesced: a 400 naming the table, the barrier it was
    coalesced into and the nearest valid cuts; the barriers around it load."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    b1 = p.advance()
    b2, b3 = barriers.issue(lake.conn).barrier, barriers.issue(lake.conn).barrier
    table = lake.catalog.load_table(f"{lake.namespace}.orders")
    table.append(pa.table({"id": [1], "barrier": [b3]}), snapshot_properties={SUMMARY_BARRIER: str(b3)})
    jobs.complete(
        lake.conn,
        f"{lake.namespace}_ingest",
        b3,
        {lake.T("orders"): table.current_snapshot().snapshot_id},
        coalesce=True,
    )
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    headers = {"Authorization": f"Bearer {access_token(server, cid, secret)}"}
    r = requests.get(f"{server}/v1/barrier-{b2}/namespaces/{lake.namespace}/tables/orders", headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert (
        f"lake.{lake.namespace}.orders coalesced it into barrier {b3}" in r.json()["error"]["message"]
        and f"the nearest valid cuts are {b1} (before) and {b3} (after)" in r.json()["error"]["message"]
    )
    for b, rows in ((b1, 1), (b3, 2)):
        assert (
            rest(server, f"barrier-{b}", f"{cid}:{secret}")
            .load_table(f"{lake.namespace}.orders")
            .scan()
            .to_arrow()
            .num_rows
            == rows
        )


def test_bad_requests_are_spec_errors_with_one_line(lake, server):
    """Unknown warehouse, a barrier not valid for the table (named), a foreign or missing token,
    a malformed request: each a spec error whose message is our one line; nothing written."""
    p = Pipeline(lake, {"ingest": ["orders"], "late": ["late"]})
    b1 = p.advance(only={f"{lake.namespace}_ingest"})
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    headers = {"Authorization": f"Bearer {access_token(server, cid, secret)}"}

    def get(path):
        return requests.get(f"{server}{path}", headers=headers, timeout=30)

    r = get("/v1/config?warehouse=nightly")
    assert r.status_code == 400 and "warehouse 'nightly' is unknown" in r.json()["error"]["message"]
    r = get(f"/v1/barrier-{b1}/namespaces/{lake.namespace}/tables/late")
    assert (
        r.status_code == 400
        and f"lake.{lake.namespace}.late has completed no barrier yet" in r.json()["error"]["message"]
    )
    r = requests.get(f"{server}/v1/latest/namespaces", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "NotAuthorizedException"
    r = requests.post(
        f"{server}/v1/oauth/tokens",
        data={"grant_type": "client_credentials", "client_id": cid, "client_secret": "wrong"},
        timeout=30,
    )
    assert r.status_code == 401
    r = requests.post(
        f"{server}/v1/latest/namespaces/{lake.namespace}/tables/orders",
        json={"updates": "x"},
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 403 and "a reader token writes nothing" in r.json()["error"]["message"]
    jid, jsecret = tokens.create(lake.conn, job=f"{lake.namespace}_ingest", whole_lake=True)
    r = requests.post(
        f"{server}/v1/latest/namespaces/{lake.namespace}/tables/orders",
        json={"updates": "x"},
        headers={"Authorization": f"Bearer {access_token(server, jid, jsecret)}"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestException"
    assert r.json()["error"]["message"].startswith("malformed CommitTableRequest: requirements: Field required")
    r = get(f"/v1/latest/namespaces/{lake.namespace}/tables/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NoSuchTableException"
    lease = leases.acquire(lake.conn, [lake.T("orders")], ttl_s=600, holder="t")
    leases.release(lake.conn, lease.lease_id)
    r = get(f"/v1/lease-{lease.lease_id}/namespaces/{lake.namespace}/tables/orders")
    assert r.status_code == 400 and f"lease {lease.lease_id} is released" in r.json()["error"]["message"]
    r = get(f"/v1/lease-{uuid.uuid4()}/namespaces/{lake.namespace}/tables/orders")
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    for error in (get("/v1/config?warehouse=nightly").json()["error"],):
        assert "\n" not in error["message"]


def test_writes_need_the_owning_jobs_token_and_a_barrier(lake, server):
    """A job token commits to its sink with a barrier and the commit is recorded (completing the
    barrier) in the same transaction; a reader, another job's token, a commit without a barrier
    and any write through a pinned warehouse are refused; revoked tokens stop working."""
    p = Pipeline(lake, {"ingest": ["orders"], "other": ["other"]})
    p.advance()
    job = f"{lake.namespace}_ingest"
    jid, jsecret = tokens.create(lake.conn, job=job, whole_lake=True)
    oid, osecret = tokens.create(lake.conn, job=f"{lake.namespace}_other", whole_lake=True)
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    name = f"{lake.namespace}.orders"
    rows = pa.table({"id": [7], "barrier": [0]})

    b = barriers.issue(lake.conn).barrier
    table = rest(server, "latest", f"{jid}:{jsecret}").load_table(name)
    table.append(rows, snapshot_properties={SUMMARY_BARRIER: str(b)})
    info = jobs.show(lake.conn, job)
    assert info.progress == b
    cut = reads.resolve(lake.conn, [lake.T("orders")], barrier=b)
    assert cut.snapshots[lake.T("orders")] == table.current_snapshot().snapshot_id

    from pyiceberg.exceptions import ForbiddenError

    for cred, fragment in [
        (f"{rid}:{rsecret}", "a reader token writes nothing"),
        (f"{oid}:{osecret}", f"it is written by job {job}"),
    ]:
        with pytest.raises(ForbiddenError, match=fragment):
            rest(server, "latest", cred).load_table(name).append(
                rows, snapshot_properties={SUMMARY_BARRIER: str(barriers.issue(lake.conn).barrier)}
            )
    with pytest.raises(ForbiddenError, match=f"must carry snapshot property {SUMMARY_BARRIER}"):
        rest(server, "latest", f"{jid}:{jsecret}").load_table(name).append(rows)
    with pytest.raises(ForbiddenError, match="is read-only"):
        rest(server, f"barrier-{b}", f"{jid}:{jsecret}").load_table(name).append(
            rows, snapshot_properties={SUMMARY_BARRIER: str(b)}
        )
    assert lake.catalog.load_table(name).current_snapshot().snapshot_id == table.current_snapshot().snapshot_id

    access = access_token(server, rid, rsecret)
    tokens.revoke(lake.conn, rid)
    r = requests.get(f"{server}/v1/latest/namespaces", headers={"Authorization": f"Bearer {access}"}, timeout=30)
    assert r.status_code == 401
    assert (
        requests.post(
            f"{server}/v1/oauth/tokens",
            data={"grant_type": "client_credentials", "client_id": rid, "client_secret": rsecret},
            timeout=30,
        ).status_code
        == 401
    )


def test_read_committed_sessions_never_mix_cuts_across_two_servers(lake):
    """Two tables advance together every 200 ms. One session loads both, alternating between two
    server processes: every pair whose loads came less than the quiet period apart is from one
    barrier; after a quiet moment the session sees a newer cut."""
    quiet_s = 2.0
    p = Pipeline(lake, {"ingest": ["orders", "payments"]})
    p.advance()
    servers = [start_server(lake, "--session-quiet", f"{quiet_s}s") for _ in range(2)]
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            p.advance()
            time.sleep(0.2)

    cid, secret = tokens.create(lake.conn, whole_lake=True)
    try:
        access = access_token(servers[0][1], cid, secret)
        headers = {"Authorization": f"Bearer {access}"}
        for _, uri in servers:  # each process's first load opens its pool: not in the measured pairs
            requests.get(
                f"{uri}/v1/latest/namespaces/{lake.namespace}/tables/orders", headers=headers, timeout=30
            ).raise_for_status()
        thread = threading.Thread(target=writer)
        thread.start()
        pairs = []
        for i in range(200):
            snaps, started = [], time.monotonic()
            for k, t in enumerate(("orders", "payments")):
                uri = servers[(i + k) % 2][1]
                r = requests.get(
                    f"{uri}/v1/read-committed/namespaces/{lake.namespace}/tables/{t}", headers=headers, timeout=30
                )
                assert r.status_code == 200, r.text
                snaps.append(len(r.json()["metadata"]["snapshots"]))
            if time.monotonic() - started < quiet_s:  # else the session may rightly have moved between them
                pairs.append(snaps)
        stop.set()
        thread.join()
        assert len(pairs) > 150, f"only {len(pairs)} of 200 pairs came within {quiet_s} s"
        mixed = [pair for pair in pairs if pair[0] != pair[1]]
        assert not mixed, mixed[:5]
        before = pairs[-1][0]
        time.sleep(quiet_s + 0.5)  # quiet: the session moves on to the newest cut
        r = requests.get(
            f"{servers[1][1]}/v1/read-committed/namespaces/{lake.namespace}/tables/orders", headers=headers, timeout=30
        )
        assert len(r.json()["metadata"]["snapshots"]) == len(p.marks) > before
    finally:
        stop.set()
        for proc, _ in servers:
            stop_server(proc)


def test_spark_reads_consistent_cuts_through_the_rest_catalog(lake, server, spark):
    """Spark's own REST client, configured as `icebarrier connect --engine spark` says: a join
    through read-committed while barriers advance shows no mixed cut; barrier-<B> equals the cut."""
    from icebarrier.apps.catalog.clients import configuration

    p = Pipeline(lake, {"ingest": ["orders", "payments"]})
    first = p.advance(rows=3)
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    name = f"rest_{uuid.uuid4().hex[:6]}"
    for line in configuration("spark", "read-committed", server, f"{cid}:{secret}", name).splitlines():
        key, value = line.split(" ", 1)
        if key.startswith(f"spark.sql.catalog.{name}"):
            spark.conf.set(key, value)
    pinned = f"rest_{uuid.uuid4().hex[:6]}"
    for line in configuration("spark", f"barrier-{first}", server, f"{cid}:{secret}", pinned).splitlines():
        key, value = line.split(" ", 1)
        if key.startswith(f"spark.sql.catalog.{pinned}"):
            spark.conf.set(key, value)
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            p.advance(rows=3)
            time.sleep(0.5)

    thread = threading.Thread(target=writer)
    thread.start()
    query = (
        f"SELECT o.b AS o, p.b AS p FROM (SELECT max(barrier) AS b FROM {name}.{lake.namespace}.orders) o "
        f"CROSS JOIN (SELECT max(barrier) AS b FROM {name}.{lake.namespace}.payments) p"
    )
    seen = []
    try:
        for i in range(60):  # each commit of the writer makes the next query a little slower
            seen.append(spark.sql(query).collect()[0])
            if i == 29:
                time.sleep(1.5)  # quiet: the session moves on (without a pause it keeps its cut)
    finally:
        stop.set()
        thread.join()
    assert [r for r in seen if r.o != r.p] == []
    assert len({r.o for r in seen}) > 1  # the reads did move along with the pipeline
    time.sleep(1.5)  # a quiet moment: the session moves on to the newest cut
    assert spark.sql(query).collect()[0].o == p.marks[-1] > seen[-1].o
    assert spark.table(f"{pinned}.{lake.namespace}.orders").count() == 3
    # Nothing commits now: Iceberg 1.12's client sends the ETags it kept and is answered 304
    metrics = {"Authorization": f"Bearer {access_token(server, cid, secret)}"}
    counts = [
        (f"icebarrier_catalog_{m}", (("warehouse", "read-committed"),))
        for m in ("load_seconds_count", "loads_not_modified_total")
    ]
    before = scrape(server, metrics)
    assert spark.sql(query).collect()[0].o == p.marks[-1]
    after = scrape(server, metrics)
    loads, not_modified = (after[k] - before.get(k, 0) for k in counts)
    assert loads >= 2 and not_modified == loads, (loads, not_modified)  # every load of the query


def test_without_session_stability_the_same_reads_do_mix(lake):
    """The check above can fail: with a session that is never stable (quiet 1 ms), a barrier
    completed between a query's two loads splits it across two cuts, every time; with a quiet
    longer than a barrier takes, the same sequence stays on one cut."""
    p = Pipeline(lake, {"ingest": ["orders", "payments"]})
    p.advance()
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    for quiet, mixes in (("1ms", True), ("10s", False)):
        proc, uri = start_server(lake, "--session-quiet", quiet)
        try:
            headers = {"Authorization": f"Bearer {access_token(uri, cid, secret)}"}

            def snapshots(t: str) -> int:
                r = requests.get(
                    f"{uri}/v1/read-committed/namespaces/{lake.namespace}/tables/{t}", headers=headers, timeout=30
                )
                return len(r.json()["metadata"]["snapshots"])

            mixed = 0
            for _ in range(3):
                first = snapshots("orders")
                p.advance()  # takes far longer than 1 ms, far less than 10 s
                mixed += first != snapshots("payments")
        finally:
            stop_server(proc)
        assert mixed == (3 if mixes else 0), quiet  # each server: a new access token, a new session


def test_a_lease_warehouse_keeps_its_snapshots_through_expire(lake, server):
    """Snapshots pinned by a lease survive `icebarrier expire` and read through lease-<ID>; an
    expired barrier is refused by name."""
    from click.testing import CliRunner

    from icebarrier.cli.main import cli as command

    p = Pipeline(lake, {"ingest": ["orders"]})
    marks = [p.advance(rows=5) for _ in range(4)]
    lease = leases.acquire(lake.conn, [lake.T("orders")], ttl_s=600, holder="report", barrier=marks[0])
    result = CliRunner().invoke(command, ["expire", "--table", str(lake.T("orders")), "--older-than", "0s"])
    assert result.exit_code == 0, result.output
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    table = rest(server, f"lease-{lease.lease_id}", f"{cid}:{secret}").load_table(f"{lake.namespace}.orders")
    assert table.scan().to_arrow().num_rows == 5
    from pyiceberg.exceptions import BadRequestError

    with pytest.raises(BadRequestError, match="was already expired"):
        rest(server, f"barrier-{marks[1]}", f"{cid}:{secret}").load_table(f"{lake.namespace}.orders")


def test_a_multi_table_commit_is_atomic_for_readers_of_latest(lake, server):
    """A job's two sinks committed in one transaction (carrying barrier B) complete B in the same
    Postgres transaction; a reader polling latest throughout never sees the first swapped
    without the second."""
    p = Pipeline(lake, {"pair": ["left", "right"]})
    p.advance()
    job = f"{lake.namespace}_pair"
    jid, jsecret = tokens.create(lake.conn, job=job, whole_lake=True)
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    writer = rest(server, "latest", f"{jid}:{jsecret}")
    headers = {"Authorization": f"Bearer {access_token(server, rid, rsecret)}"}
    access = {"Authorization": f"Bearer {access_token(server, jid, jsecret)}"}
    stop, seen = threading.Event(), []

    def poll():
        while not stop.is_set():
            counts = [
                len(
                    requests.get(
                        f"{server}/v1/latest/namespaces/{lake.namespace}/tables/{t}", headers=headers, timeout=30
                    ).json()["metadata"]["snapshots"]
                )
                for t in ("left", "right")
            ]
            seen.append(counts)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        for _ in range(8):
            b = barriers.issue(lake.conn).barrier
            changes = [staged_change(writer, f"{lake.namespace}.{t}", b) for t in ("left", "right")]
            body = '{"table-changes": [' + ", ".join(c.model_dump_json() for c in changes) + "]}"
            r = requests.post(
                f"{server}/v1/latest/transactions/commit",
                data=body,
                timeout=60,
                headers={**access, "Content-Type": "application/json"},
            )
            assert r.status_code == 204, r.text
            assert jobs.show(lake.conn, job).progress == b
    finally:
        stop.set()
        thread.join()
    # Loads are left then right: a commit landing between them shows [n, n+1]; a half-applied
    # one (left swapped, right not yet) would show [n+1, n].
    assert len(seen) > 10 and [c for c in seen if c[0] > c[1]] == []
    assert [len(writer.load_table(f"{lake.namespace}.{t}").metadata.snapshots) for t in ("left", "right")] == [9, 9]


def test_a_server_killed_mid_commit_leaves_both_or_neither(lake):
    """kill -9 between the pointer swap and the record (a fault point in the server): neither
    is there afterwards; the same commit through a healthy server then lands with its record."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    p.advance()
    job = f"{lake.namespace}_ingest"
    jid, jsecret = tokens.create(lake.conn, job=job, whole_lake=True)
    name = f"{lake.namespace}.orders"
    before = lake.catalog.load_table(name).metadata_location
    proc, uri = start_server(lake, env_extra={"ICEBARRIER_FAULT": "in-catalog-commit"})
    b = barriers.issue(lake.conn).barrier
    try:
        with pytest.raises(Exception):  # noqa: B017 - a dropped connection: the client's error type varies
            rest(uri, "latest", f"{jid}:{jsecret}").load_table(name).append(
                pa.table({"id": [1], "barrier": [b]}), snapshot_properties={SUMMARY_BARRIER: str(b)}
            )
        assert proc.wait(timeout=30) == 137
    finally:
        stop_server(proc) if proc.poll() is None else None
    assert lake.catalog.load_table(name).metadata_location == before
    assert jobs.show(lake.conn, job).progress == p.marks[-1]
    proc, uri = start_server(lake)
    try:
        table = rest(uri, "latest", f"{jid}:{jsecret}").load_table(name)
        table.append(pa.table({"id": [1], "barrier": [b]}), snapshot_properties={SUMMARY_BARRIER: str(b)})
    finally:
        stop_server(proc)
    assert jobs.show(lake.conn, job).progress == b
    assert (
        reads.resolve(lake.conn, [lake.T("orders")], barrier=b).snapshots[lake.T("orders")]
        == lake.catalog.load_table(name).current_snapshot().snapshot_id
    )


def _job_through_catalog(lake, server: str, job: str, folder) -> dict:
    """The environment of a job process that writes through the catalog with a token of its own
    (an icebarrier.toml with [catalog_properties], as `spark-conf --via rest` prints)."""
    jid, jsecret = tokens.create(lake.conn, job=job, whole_lake=True)
    config = folder / "icebarrier.toml"
    config.write_text(
        f'dsn = "{lake.settings.dsn}"\nschema = "{lake.settings.schema}"\n'
        f'warehouse = "{lake.settings.warehouse}"\n[catalog_properties]\ntype = "rest"\n'
        f'uri = "{server}"\nwarehouse = "latest"\ncredential = "{jid}:{jsecret}"\n'
        f'oauth2-server-uri = "{server}/v1/oauth/tokens"\n'
    )
    return {k: v for k, v in os.environ.items() if not k.startswith("ICEBARRIER_")} | {"ICEBARRIER_CONFIG": str(config)}


RUN_VIA_REST = """
import json, sys
from icebarrier import RootJob, Settings
from icebarrier.iceberg_ext.runtime import Runtime
from icebarrier.iceberg_ext.sources import FileSource
from icebarrier.iceberg_ext.spark import spark_session

settings = Settings.load()
spark = spark_session(settings, master="local[1]")
job = RootJob(name=sys.argv[2], sinks=[sys.argv[3]], source=FileSource(sys.argv[1], "id bigint, barrier bigint"))
with Runtime(job, settings=settings, spark=spark, log=lambda _: None) as rt:
    print(json.dumps({"completed": rt.run().completed}))
"""


def test_the_job_runtime_writes_through_the_catalog(lake, server, tmp_path):
    """A job run with `spark-conf --via rest`'s catalog (a job token, warehouse latest): its
    commit is recorded by the server in the pointer swap's transaction (run rest-catalog), and
    the runtime's own completion of the barrier is then a no-op."""
    import json
    import sys

    job, sink = f"{lake.namespace}_ingest", f"lake.{lake.namespace}.orders"
    jobs.register(
        lake.conn,
        JobDefinition(name=job, sinks=frozenset([TableName.parse(sink)]), external_inputs=frozenset(["files"])),
    )
    lake.catalog.create_table(
        f"{lake.namespace}.orders", schema=pa.schema([("id", pa.int64()), ("barrier", pa.int64())])
    )
    barriers.set_interval_s(lake.conn, 3600)
    b = barriers.issue(lake.conn).barrier
    env = _job_through_catalog(lake, server, job, tmp_path)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "1.json").write_text('{"id": 1, "barrier": 0}\n{"id": 2, "barrier": 0}\n')
    run = subprocess.run(
        [sys.executable, "-c", RUN_VIA_REST, str(inbox), job, sink],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["completed"] == [b]
    row = lake.conn.execute(
        "SELECT c.snapshot_id, c.run_id FROM table_commit c JOIN managed_table m USING (table_id) "
        "WHERE m.name = %s AND c.barrier = %s",
        (sink, b),
    ).fetchone()
    assert row["run_id"] == "rest-catalog"
    assert row["snapshot_id"] == lake.catalog.load_table(f"{lake.namespace}.orders").current_snapshot().snapshot_id


def test_anonymous_clients_read_only_when_allowed(lake):
    """With --allow-anonymous-read a client without a token reads pinned and latest tables but
    writes nothing (a request with a body and no token is answered 401 before the body is read);
    read-committed (a session) still needs a token."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    b = p.advance(rows=2)
    proc, uri = start_server(lake, "--allow-anonymous-read")
    try:
        base = f"{uri}/v1"
        assert requests.get(f"{base}/config?warehouse=barrier-{b}", timeout=30).status_code == 200
        r = requests.get(f"{base}/barrier-{b}/namespaces/{lake.namespace}/tables/orders", timeout=30)
        assert (
            r.status_code == 200
            and r.json()["metadata"]["current-snapshot-id"]
            == reads.resolve(lake.conn, [lake.T("orders")], barrier=b).snapshots[lake.T("orders")]
        )
        r = requests.post(f"{base}/latest/namespaces", json={"namespace": ["anon"]}, timeout=30)
        assert r.status_code == 401 and "needs a token" in r.json()["error"]["message"]
        r = requests.get(f"{base}/read-committed/namespaces/{lake.namespace}/tables/orders", timeout=30)
        assert r.status_code == 401 and "needs a token" in r.json()["error"]["message"]
    finally:
        stop_server(proc)
    assert "anon" not in [n[0] for n in lake.catalog.list_namespaces()]


SPLIT_VIA_REST = """
import json, sys
from icebarrier import Settings
from icebarrier.iceberg_ext.job import TransformJob, overwrite
from icebarrier.iceberg_ext.runtime import Runtime
from icebarrier.iceberg_ext.spark import spark_session

source, left, right = sys.argv[2:5]
settings = Settings.load()
spark = spark_session(settings, master="local[1]")
job = TransformJob(name=sys.argv[1], sources=[source], sinks=[left, right],
                   transform=lambda ctx: {left: overwrite(ctx.table(source)), right: overwrite(ctx.table(source))})
with Runtime(job, settings=settings, spark=spark, log=lambda _: None) as rt:
    print(json.dumps({"completed": rt.run().completed}))
"""


def test_a_multi_sink_job_through_the_catalog_publishes_each_barrier_in_one_transaction(lake, server, tmp_path):
    """A job writing two sinks with Spark through the catalog: its commits are staged until it
    publishes the barrier, then both pointers and the completion land in one transaction (two
    barriers behind, it coalesces them: the snapshots say so and the completion records it); a
    reader polling latest meanwhile never sees one sink ahead of the other."""
    import json
    import sys

    p = Pipeline(lake, {"ingest": ["events"]})
    job = f"{lake.namespace}_split"
    left, right = (f"lake.{lake.namespace}.{t}" for t in ("left", "right"))
    jobs.register(
        lake.conn,
        JobDefinition(
            name=job, sources=frozenset([lake.T("events")]), sinks=frozenset(map(TableName.parse, (left, right)))
        ),
    )
    for t in ("left", "right"):
        lake.catalog.create_table(
            f"{lake.namespace}.{t}", schema=pa.schema([("id", pa.int64()), ("barrier", pa.int64())])
        )
    marks = [p.advance(rows=i + 1) for i in range(3)]
    env = _job_through_catalog(lake, server, job, tmp_path)
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    headers = {"Authorization": f"Bearer {access_token(server, rid, rsecret)}"}
    stop, seen = threading.Event(), []

    def poll():
        while not stop.is_set():
            seen.append(
                [
                    len(
                        requests.get(
                            f"{server}/v1/latest/namespaces/{lake.namespace}/tables/{t}", headers=headers, timeout=30
                        ).json()["metadata"]["snapshots"]
                    )
                    for t in ("left", "right")
                ]
            )

    def run_job() -> list[int]:
        run = subprocess.run(
            [sys.executable, "-c", SPLIT_VIA_REST, job, str(lake.T("events")), left, right],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert run.returncode == 0, run.stderr[-4000:]
        return json.loads(run.stdout.strip().splitlines()[-1])["completed"]

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        completed = run_job()  # bootstraps at the newest barrier of its source
        assert completed == marks[-1:]
        more = [p.advance(rows=4 + i) for i in range(2)]
        completed += run_job()
    finally:
        stop.set()
        thread.join()
    assert completed == [marks[-1], more[-1]]
    assert [s.coalesced for s in tables.states(lake.conn, [TableName.parse(left), TableName.parse(right)])] == [
        ((marks[-1], more[-1]),)
    ] * 2
    assert seen and [c for c in seen if c[0] > c[1]] == []
    rows = lake.conn.execute(
        "SELECT m.name, c.barrier, c.snapshot_id, c.run_id FROM table_commit c JOIN managed_table m USING (table_id) "
        "WHERE m.name IN (%s, %s) ORDER BY c.barrier, m.name",
        (left, right),
    ).fetchall()
    assert [(r["barrier"], r["run_id"]) for r in rows] == [(b, "rest-catalog") for b in completed for _ in (0, 1)]
    assert lake.conn.execute("SELECT count(*) AS n FROM catalog_pending").fetchone()["n"] == 0
    for t in (left, right):
        name = TableName.parse(t)
        assert lake.catalog.load_table(".".join(name.identifier)).scan().to_arrow().num_rows == 1 + 2 + 3 + 4 + 5


def test_requests_waiting_for_postgres_do_not_hold_the_event_loop(lake, server):
    """Every thread-pool connection of the server held by a request that waits for a lock, more
    requests queued behind them: the server still answers what needs no lock, and each waiting
    request answers once the lock goes. Callers' tokens are checked on the async pool; on the
    thread pool's connections the check held the event loop (every request, every long poll's
    lines) until one came free (found at 2,000 jobs: freshness stalled for tens of seconds)."""
    import concurrent.futures

    import psycopg

    client_id, secret = tokens.create(lake.conn, admin=True)
    auth = {"Authorization": f"Bearer {access_token(server, client_id, secret)}"}
    show = f"{server}/icebarrier/v1/jobs/ingest/session"
    with (
        psycopg.connect(lake.settings.dsn, autocommit=True) as blocker,
        concurrent.futures.ThreadPoolExecutor(12) as ex,
    ):
        blocker.execute(f'BEGIN; LOCK TABLE "{lake.settings.schema}".job_session IN ACCESS EXCLUSIVE MODE')
        waiting = [ex.submit(requests.get, show, headers=auth, timeout=60) for _ in range(12)]  # > the pool's 8
        time.sleep(2)
        assert not any(w.done() for w in waiting), "the lock holds them"
        # the loop serves meanwhile (held, it answered only when the lock timeout, 10 s, freed a connection)
        assert requests.get(f"{server}/healthz", timeout=5).status_code == 200
        assert not any(w.done() for w in waiting)
        blocker.execute("ROLLBACK")
        assert [w.result().status_code for w in waiting] == [200] * 12
