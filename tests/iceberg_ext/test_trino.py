"""Trino through `icebarrier serve`: a real Trino server (tests/trino.py) whose Iceberg connector
uses our REST catalog exactly as `icebarrier connect --engine trino` prints it (OAuth2 client
credentials against our token endpoint; vended credentials on S3)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from icebarrier.control_plane import barriers, reads, tokens
from icebarrier.iceberg_ext.catalog import SUMMARY_RUN, summary_properties
from tests.iceberg_ext.catalog_server import Pipeline, every_warehouse
from tests.iceberg_ext.test_job_exec import ENGINES, assert_written_once, command, job_exec, setup_pipeline
from tests.trino import catalog_file, connect, trino_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trino")]  # one Trino at a time on 2 cores


@pytest.fixture(scope="module")
def trino(tmp_path_factory):
    """One Trino for the module's tests (a start costs 20-30 s), catalogs made per test
    (:meth:`Trino.catalogs`); the view test starts one of its own, from catalog files."""
    with trino_server(tmp_path_factory.mktemp("trino"), {}, dynamic=True) as server:
        yield server


@pytest.fixture
def s3_sessions(s3_lake, s3):
    """The S3 lake's server vends STS session credentials ([storage.sessions])."""
    with open(os.environ["ICEBARRIER_CONFIG"], "w") as config:
        config.write(s3.storage_toml(sessions=True))


def lake_and_server(request, storage: str):
    """The test's lake and a server over it, on a local warehouse, on S3 (moto), or on SeaweedFS
    with per-table credentials."""
    if storage == "seaweed":
        return request.getfixturevalue("weed_lake"), request.getfixturevalue("weed_server")
    lake = request.getfixturevalue("lake" if storage == "local" else "s3_lake")
    if storage == "s3":  # Trino takes vended keys only with a session token: the server makes them with STS
        request.getfixturevalue("s3_sessions")
    return lake, request.getfixturevalue("server" if storage == "local" else "s3_server")


@pytest.mark.parametrize("storage", ["local", "s3", "seaweed"])
def test_trino_reads_every_warehouse_at_exact_counts(request, storage, trino):
    """Each warehouse a catalog of its own, its properties exactly as `connect` printed them:
    latest, read-committed, read-committed:<ns>, barrier-<B> and lease-<ID> give exact row counts,
    on a local warehouse, on S3 (where Trino gets the keys with each load) and on SeaweedFS with
    a reader granted the namespace, whose credentials open each table alone."""
    lake, server = lake_and_server(request, storage)
    p = Pipeline(lake, {"ingest": ["orders", "payments"]})
    marks = [p.advance(rows=10) for _ in range(3)]
    reader = ":".join(tokens.create(lake.conn, whole_lake=storage != "seaweed"))
    if storage == "seaweed":
        tokens.grant(lake.conn, reader.split(":")[0], [tokens.Grant("namespace", lake.namespace, "read")])
    expected = every_warehouse(lake, marks)
    catalogs = {f"w{i}": catalog_file(server, w, reader, f"w{i}") for i, w in enumerate(expected)}
    with trino.catalogs(catalogs):
        for (name, _), (warehouse, rows) in zip(catalogs.items(), expected.items()):
            got = trino.query(f"SELECT count(*) FROM {name}.{lake.namespace}.orders")
            assert got == [[rows]], (warehouse, got)


def test_a_trino_join_in_a_view_through_read_committed_never_mixes_barriers_while_the_pipeline_commits(
    lake, server, tmp_path
):
    """Trino, started with the catalog files exactly as `connect` printed them, reads a view
    joining orders and payments (written by two jobs, committed one after the other) through
    read-committed while the pipeline advances (docs/views.md): every read sees
    both tables at one barrier. The same join through latest, for contrast, mixes. Trino takes a
    new access token for each table it loads; the moment is the client's. Trino resolves a view's
    tables only in the catalog the view names: the view names `rc`. A quiet moment every 4 rounds
    lets the reads move with the pipeline."""
    from tests.iceberg_ext.test_views import BOTH_SQL, two_table_view

    p = two_table_view(lake, server, "spark", "trino", catalog="rc")
    reader = ":".join(tokens.create(lake.conn, whole_lake=True))
    stop = threading.Event()

    def commit() -> None:
        while not stop.is_set():
            p.advance(rows=2)

    def join(catalog: str) -> str:
        ns = lake.namespace
        return BOTH_SQL.replace("FROM orders", f"FROM {catalog}.{ns}.orders").replace(
            "FROM payments", f"FROM {catalog}.{ns}.payments"
        )

    queries = {"view": f"SELECT o, p FROM rc.{lake.namespace}.both", "latest": join("lt")}
    catalogs = {
        "rc": catalog_file(server, "read-committed", reader, "rc"),
        "lt": catalog_file(server, "latest", reader, "lt"),
    }
    seen: dict[str, list] = {kind: [] for kind in queries}
    with trino_server(tmp_path, catalogs) as trino:
        writer = threading.Thread(target=commit, daemon=True)
        writer.start()
        try:
            for i in range(12):
                for kind, query in queries.items():
                    seen[kind].append(trino.query(query)[0])
                if i % 4 == 3:
                    time.sleep(1.5)  # the server's --session-quiet is 1 s
        finally:
            stop.set()
            writer.join(timeout=60)
    mixed = {kind: [r for r in rows if r[0] != r[1]] for kind, rows in seen.items()}
    print(
        f"trino: mixed reads {len(mixed['view'])}/12 through the view in read-committed, "
        f"{len(mixed['latest'])}/12 joining through latest"
    )
    assert mixed["view"] == [], mixed["view"][:5]
    assert len({r[0] for r in seen["view"]}) >= 3  # the reads moved with the pipeline


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_trino_runs_as_a_job_under_job_exec(request, storage, trino):
    """A Trino SQL transform (tests/iceberg_ext/engines/trino_by_barrier.py) as the `count` job
    of test_job_exec's pipeline, under `icebarrier job exec`, through a catalog it creates for
    the run from `connect`'s output (Trino's dynamic catalogs): its sources read at the barrier,
    its commits staged and published with the barrier, each barrier written by one run; on a
    local warehouse and on S3."""
    lake, server = lake_and_server(request, storage)
    creds = setup_pipeline(lake)
    count = [sys.executable, str(ENGINES / "trino_by_barrier.py"), lake.namespace]
    for rows in (10, 7):
        b = barriers.issue(lake.conn).barrier
        job_exec(server, creds["ingest"], "ingest", command(lake, "ingest", rows=rows))
        [done] = job_exec(server, creds["count"], "count", [*count, str(trino.port)])["steps"]
        assert done["barrier"] == b and done["outcome"] == "published", done
        sink = lake.catalog.load_table(f"{lake.namespace}.by_barrier")
        assert_written_once(lake, "by_barrier", b, summary_properties(sink.current_snapshot())[SUMMARY_RUN])
    assert trino.query("SHOW CATALOGS") == [["system"]]  # each run dropped its catalog
    cut = reads.resolve(lake.conn, [lake.T("orders"), lake.T("by_barrier")])
    assert cut.barrier == b
    orders = lake.catalog.load_table(f"{lake.namespace}.orders").scan(snapshot_id=cut.snapshots[lake.T("orders")])
    counted = lake.catalog.load_table(f"{lake.namespace}.by_barrier").scan(
        snapshot_id=cut.snapshots[lake.T("by_barrier")]
    )
    per_barrier = {}
    for r in orders.to_arrow().to_pylist():
        per_barrier[r["barrier"]] = per_barrier.get(r["barrier"], 0) + 1
    assert {r["barrier"]: r["n"] for r in counted.to_arrow().to_pylist()} == per_barrier
    assert sorted(per_barrier.values()) == [7, 10]


def test_connect_needs_only_the_uri_and_a_token_and_names_a_refused_token(lake, server):
    """`connect --engine trino` without DSN or configuration file: a refused credential is one
    line naming --credential, exit 1, nothing printed on stdout; a real one prints the file."""
    refused = connect(server, "ib-nobody:secret")
    assert refused.returncode == 1 and not refused.stdout, refused
    assert refused.stderr.count("\n") == 1 and "--credential ib-nobody" in refused.stderr, refused.stderr
    printed = catalog_file(server, "read-committed", ":".join(tokens.create(lake.conn, whole_lake=True)), "lake")
    assert "fs.hadoop.enabled=true" in printed and "s3." not in printed  # a local warehouse
