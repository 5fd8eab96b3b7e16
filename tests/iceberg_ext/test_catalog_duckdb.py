"""DuckDB (its C++ `iceberg` extension, a REST client nobody here wrote) through `icebarrier
serve`, configured exactly as `icebarrier connect --engine duckdb` prints: every warehouse at
exact row counts, a join through read-committed while barriers advance, and writes."""

from __future__ import annotations

import threading
import time

import duckdb
import pyarrow as pa
import pytest

from icebarrier.apps.catalog.clients import configuration
from icebarrier.control_plane import barriers, jobs, leases, tokens
from icebarrier.control_plane.model import JobDefinition, TableName
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER
from tests.iceberg_ext.catalog_server import Pipeline, access_token, scrape

pytestmark = pytest.mark.slow

JOIN = (
    "SELECT (SELECT max(barrier) FROM lake.{ns}.orders) AS o, (SELECT max(barrier) FROM lake.{ns}.payments) AS p, "
    "(SELECT count(*) FROM lake.{ns}.orders) AS n"
)


def duck(server: str, warehouse: str, credential: str) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection set up by running `icebarrier connect --engine duckdb` as printed."""
    con = duckdb.connect()
    for statement in configuration("duckdb", warehouse, server, credential, "lake").splitlines():
        con.execute(statement)
    return con


def count(con, table: str) -> int:
    return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_duckdb_reads_every_warehouse_at_its_cut(lake, server):
    """latest, read-committed, read-committed:<ns>, barrier-<B> and lease-<ID> give exact row
    counts at past barriers; a commit not yet completed shows only through latest, where a
    join mixes barriers and read-committed's does not."""
    p = Pipeline(lake, {"ingest": ["orders", "payments"]})
    marks = [p.advance(rows=10) for _ in range(3)]
    other = f"{lake.namespace}_x"  # a lagging job in another namespace holds the whole lake back
    lake.catalog.create_namespace(other)
    try:
        late = TableName.parse(f"lake.{other}.late")
        jobs.register(
            lake.conn,
            JobDefinition(name=f"{other}_late", sinks=frozenset([late]), external_inputs=frozenset(["ext:late"])),
        )
        lake.catalog.create_table(f"{other}.late", schema=pa.schema([("id", pa.int64())]))
        jobs.complete(lake.conn, f"{other}_late", marks[0], {})  # and no further
        # orders moves on to a barrier its job has not completed: only latest shows it
        pending = barriers.issue(lake.conn).barrier
        lake.catalog.load_table(f"{lake.namespace}.orders").append(
            pa.table({"id": [0] * 5, "barrier": [pending] * 5}), snapshot_properties={SUMMARY_BARRIER: str(pending)}
        )
        cid, secret = tokens.create(lake.conn, whole_lake=True)
        cred = f"{cid}:{secret}"
        orders = f"lake.{lake.namespace}.orders"
        for i, b in enumerate(marks):
            assert count(duck(server, f"barrier-{b}", cred), orders) == 10 * (i + 1)
        assert count(duck(server, "latest", cred), orders) == 35
        assert count(duck(server, "read-committed", cred), orders) == 10  # the lake's cut: marks[0]
        assert count(duck(server, f"read-committed:{lake.namespace}", cred), orders) == 30
        lease = leases.acquire(
            lake.conn, [lake.T("orders"), lake.T("payments")], ttl_s=600, holder="t", barrier=marks[1]
        )
        assert count(duck(server, f"lease-{lease.lease_id}", cred), orders) == 20
        o, q, n = duck(server, "latest", cred).execute(JOIN.format(ns=lake.namespace)).fetchone()
        assert (o, q, n) == (pending, marks[2], 35)  # read-uncommitted mixes: the check can fail
        o, q, n = (
            duck(server, f"read-committed:{lake.namespace}", cred).execute(JOIN.format(ns=lake.namespace)).fetchone()
        )
        assert (o, q, n) == (marks[2], marks[2], 30)
        with pytest.raises(duckdb.Error, match=f"lake.{other}.late has completed no barrier|not a valid cut"):
            count(duck(server, f"barrier-{marks[2]}", cred), f"lake.{other}.late")
        with pytest.raises(duckdb.Error, match=f"reads only namespace {lake.namespace}"):
            count(duck(server, f"read-committed:{lake.namespace}", cred), f"lake.{other}.late")
    finally:
        for t in lake.catalog.list_tables(other):
            lake.catalog.drop_table(t)
        lake.catalog.drop_namespace(other)


def test_duckdb_join_through_read_committed_never_mixes_cuts(lake, server):
    """Two tables advance every 200 ms, committed 100 ms apart. 90 DuckDB join queries
    through read-committed: each sees one barrier in both tables. DuckDB loads table metadata
    anew for every query (no cache across statements), so a session that queries without a
    pause keeps its cut; after a quiet moment it reads the newest. Each commit replaces its
    table's row, so a query reads one data file a table however long the run (appended, the
    files grew with every commit and the queries with them: 281 s on a loaded machine)."""
    p = Pipeline(lake, {"ingest": ["orders"], "pay": ["payments"]})
    p.advance()
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            b = barriers.issue(lake.conn).barrier
            p.marks.append(b)
            for name in ("orders", "payments"):
                job, _ = p.tables[name]
                table = lake.catalog.load_table(f"{lake.namespace}.{name}")
                table.overwrite(pa.table({"id": [1], "barrier": [b]}), snapshot_properties={SUMMARY_BARRIER: str(b)})
                jobs.complete(lake.conn, job, b, {lake.T(name): table.current_snapshot().snapshot_id})
                time.sleep(0.1)

    cid, secret = tokens.create(lake.conn, whole_lake=True)
    rc = duck(server, "read-committed", f"{cid}:{secret}")
    ru = duck(server, "latest", f"{cid}:{secret}")
    query = JOIN.format(ns=lake.namespace)
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        seen, uncommitted = [], []
        for i in range(90):
            seen.append(rc.execute(query).fetchone())
            uncommitted.append(ru.execute(query).fetchone())
            if i % 30 == 29:
                time.sleep(1.5)  # quiet: the session moves on
    finally:
        stop.set()
        thread.join()
    assert [r for r in seen if r[0] != r[1]] == []
    assert len({r[0] for r in seen}) >= 3  # it moved after each quiet moment, and only then
    assert [r for r in uncommitted if r[0] != r[1]]  # latest, read at the same moments, does mix
    time.sleep(1.5)
    o, q, _ = rc.execute(query).fetchone()
    assert o == q == p.marks[-1]


def test_duckdb_writes_are_refused_or_recorded_like_any_client(lake, server):
    """Through latest, DuckDB's INSERT into a managed table is refused (its commit carries no
    barrier; with another job's or a reader's token, refused naming the owner / the role) and
    nothing moves; into an unmanaged table, a job token writes like any catalog client."""
    p = Pipeline(lake, {"ingest": ["orders"], "other": ["other"]})
    p.advance(rows=3)
    job = f"{lake.namespace}_ingest"
    jid, jsecret = tokens.create(lake.conn, job=job, whole_lake=True)
    oid, osecret = tokens.create(lake.conn, job=f"{lake.namespace}_other", whole_lake=True)
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    orders = f"lake.{lake.namespace}.orders"
    before = lake.catalog.load_table(f"{lake.namespace}.orders").metadata_location
    for cred, fragment in [
        (f"{jid}:{jsecret}", f"must carry snapshot property {SUMMARY_BARRIER}"),
        (f"{oid}:{osecret}", f"it is written by job {job}"),
        (f"{rid}:{rsecret}", "a reader token writes nothing"),
    ]:
        with pytest.raises(duckdb.Error, match=fragment):
            duck(server, "latest", cred).execute(f"INSERT INTO {orders} VALUES (1, 1)")
    assert lake.catalog.load_table(f"{lake.namespace}.orders").metadata_location == before
    with pytest.raises(duckdb.Error, match="is read-only"):
        duck(server, f"barrier-{p.marks[0]}", f"{jid}:{jsecret}").execute(f"INSERT INTO {orders} VALUES (1, 1)")
    con = duck(server, "latest", f"{jid}:{jsecret}")
    con.execute(f"CREATE TABLE lake.{lake.namespace}.scratch (a INTEGER)")
    con.execute(f"INSERT INTO lake.{lake.namespace}.scratch VALUES (1), (2)")
    assert lake.catalog.load_table(f"{lake.namespace}.scratch").scan().to_arrow().num_rows == 2


def test_a_duckdb_join_through_read_committed_costs_what_it_costs_through_latest(lake):
    """What a read costs, counted, not timed: a two-table join in DuckDB makes the same table
    loads through read-committed as through latest. A new client's first join makes one round
    trip to Postgres a load (the token, the session's moment, S(T, B) and the pointer in one
    statement: ``catalog_load``); its later joins none but memory's catch-ups (the server's
    memory of loads, kept by notices, answers after one ``SELECT 1`` on its listening connection)
    and its touches of the sessions' moments (one statement every twentieth of the quiet interval,
    however many loads); both are counted in /metrics and not here. Before the one statement, a
    read-committed load made eight round trips and a latest one two, and the join took 1.6-1.8x
    as long. The server talks to Postgres through a proxy
    that counts round trips (tests/pg_counter.py)."""
    from tests.iceberg_ext.catalog_server import start_server, stop_server
    from tests.pg_counter import TransactionCounter

    p = Pipeline(lake, {"ingest": ["orders", "payments"]})
    p.advance(rows=10)
    p.advance(rows=10)
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    join = f"SELECT count(*) FROM lake.{lake.namespace}.orders o JOIN lake.{lake.namespace}.payments p USING (id)"
    proxy = TransactionCounter(lake.settings.dsn)
    try:
        # no pool pings: a connection idle past ICEBARRIER_POOL_CHECK_IDLE (1 s) is pinged before
        # use, a round trip that depends on how long the client took between joins, not on the load
        env = {"ICEBARRIER_DSN": proxy.dsn, "ICEBARRIER_POOL_CHECK_IDLE": "1h"}
        # touches every three minutes (a twentieth of the quiet hour): none in the test's seconds,
        # so none straddles the edge of a count (a touch is counted in /metrics when it returns)
        proc, server = start_server(lake, "--session-quiet", "1h", env_extra=env)
        try:
            costs = {}
            for warehouse in ("latest", "read-committed"):
                con = duck(server, warehouse, f"{cid}:{secret}")  # a client of its own: a token of its own

                def joined(times: int) -> tuple[int, int]:
                    (loads, background), trips = _loads(server, cid, secret, warehouse), proxy.round_trips
                    for _ in range(times):
                        con.execute(join).fetchall()
                    trips = proxy.round_trips - trips  # before the metrics' own
                    (loads_after, background_after) = _loads(server, cid, secret, warehouse)
                    return loads_after - loads, trips - (background_after - background)

                costs[warehouse] = (joined(1), joined(10))  # a new token; then known
        finally:
            err = stop_server(proc)
    finally:
        proxy.close()
    assert "Traceback" not in err, err[-3000:]
    assert costs["latest"] == costs["read-committed"], costs
    (first_loads, first_trips), (later_loads, later_trips) = costs["read-committed"]
    assert first_loads == 2 and later_loads == 20, costs  # two tables a query
    # one round trip a load (one more at most: the pool pings a connection idle for a while)
    assert first_loads <= first_trips <= first_loads + 1, costs
    assert later_trips == 0, costs


def _loads(server: str, cid: str, secret: str, warehouse: str) -> tuple[int, int]:
    """Loads the server has served through ``warehouse``'s kind, and the round trips its memory
    makes whatever the loads (catch-ups and touches; its /metrics)."""
    token = access_token(server, cid, secret)
    samples = scrape(server, {"Authorization": f"Bearer {token}"})
    loads = samples.get(("icebarrier_catalog_load_seconds_count", (("warehouse", warehouse),)), 0)
    background = ("icebarrier_catalog_load_cache_catch_ups_total", "icebarrier_catalog_moment_touches_total")
    return int(loads), sum(int(samples[(name, ())]) for name in background)
