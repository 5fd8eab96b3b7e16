"""A server process's memory of loads (apps/catalog/load_cache.py): loads answered without a
round trip are the database's answers. Real servers, real Postgres notices, real writers (the
SQL catalog written directly, as Spark's JDBC catalog does, and the server itself)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import psycopg
import pyarrow as pa
import pytest
import requests

from icebarrier.control_plane import barriers, jobs, revisions, tokens
from icebarrier.iceberg_ext.catalog import POINTER_TRIGGER, watch_pointers
from tests.iceberg_ext.catalog_server import Pipeline, access_token, rest, scrape, start_server, stop_server
from tests.iceberg_ext.test_catalog_conformance import _job_token
from tests.iceberg_ext.test_views import _version
from tests.pg_counter import TransactionCounter

pytestmark = pytest.mark.slow

ROW = pa.schema([("id", pa.int64())])


def _snapshots(server: str, path: str, headers: dict) -> int:
    r = requests.get(f"{server}/v1/{path}", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return len(r.json()["metadata"]["snapshots"])


def _answered(server: str, headers: dict) -> dict[str, float]:
    samples = scrape(server, headers)
    return {
        "memory": samples[("icebarrier_catalog_loads_answered_total", (("from", "memory"),))],
        "database": samples[("icebarrier_catalog_loads_answered_total", (("from", "database"),))],
        "live": samples[("icebarrier_catalog_load_cache_live", ())],
    }


def _from_memory(server: str, path: str, headers: dict, snapshots: int) -> None:
    """Load until a load is answered from memory, each seeing ``snapshots`` snapshots: two loads
    back to back between two looks at the metrics (a look takes a while: a read-committed
    moment may have aged out of memory by the next load). One server process."""
    deadline = time.monotonic() + 30
    while True:
        before = _answered(server, headers)["memory"]
        assert [_snapshots(server, path, headers) for _ in range(2)] == [snapshots] * 2
        if _answered(server, headers)["memory"] > before:
            return
        assert time.monotonic() < deadline, "no load was answered from memory"


def _wait_live(server: str, headers: dict, live: float) -> None:
    deadline = time.monotonic() + 30
    while _answered(server, headers)["live"] != live:
        assert time.monotonic() < deadline, f"the load cache did not become live={live}"
        time.sleep(0.05)


@contextlib.contextmanager
def _late_notices(lake, reader: tuple[str, str]) -> Iterator[tuple[str, dict, TransactionCounter]]:
    """A server whose Postgres connections pass a proxy that holds its listener's notices (and all
    that follows them on that connection) back 300 ms; its URI, the reader's headers (``reader``:
    a token's id and secret), once its memory is live, and the proxy (which counts what the
    server asks Postgres). No traceback in its output."""
    proxy = TransactionCounter(lake.settings.dsn, notices_late_s=0.3)
    try:
        proc, server = start_server(lake, env_extra={"ICEBARRIER_DSN": proxy.dsn})
        try:
            headers = {"Authorization": f"Bearer {access_token(server, *reader)}"}
            _wait_live(server, headers, 1.0)
            yield server, headers, proxy
        finally:
            err = stop_server(proc)
    finally:
        proxy.close()
    assert "Traceback" not in err, err[-3000:]


def test_every_commit_is_seen_by_the_next_load_whoever_wrote_it(lake):
    """Two server processes; a table appended to directly in the SQL catalog (as Spark's JDBC
    catalog does) and through the server, each write followed at once by loads on new
    connections (either process): every load sees the write. Most loads came from memory."""
    Pipeline(lake, {"ingest": ["orders"]})  # a job, whose token writes the unmanaged table too
    lake.catalog.create_table(f"{lake.namespace}.events", schema=ROW)
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    jid, jsecret = tokens.create(lake.conn, job=f"{lake.namespace}_ingest", whole_lake=True)
    proc, server = start_server(lake, "--workers", "2")
    try:
        headers = {"Authorization": f"Bearer {access_token(server, rid, rsecret)}"}
        through_server = rest(server, "latest", f"{jid}:{jsecret}").load_table(f"{lake.namespace}.events")
        directly = lake.catalog.load_table(f"{lake.namespace}.events")
        path = f"latest/namespaces/{lake.namespace}/tables/events"
        for _ in range(10):  # warm both processes' memory of the token and the pointer
            _snapshots(server, path, headers)
        written = 0
        for i in range(30):
            table = directly if i % 2 else through_server
            table.refresh().append(pa.table({"id": [i]}, schema=ROW))
            written += 1
            for _ in range(4):  # new connections: either process
                assert _snapshots(server, path, headers) == written
        served = max(_answered(server, headers)["memory"] for _ in range(4))  # a scrape reaches either
    finally:
        err = stop_server(proc)
    assert "Traceback" not in err, err[-3000:]
    assert served > 0


def test_a_revoked_token_is_refused_at_the_next_load(lake, server):
    """A token whose loads the server remembers is refused as soon as it is revoked."""
    lake.catalog.create_table(f"{lake.namespace}.events", schema=ROW)
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    headers = {"Authorization": f"Bearer {access_token(server, rid, rsecret)}"}
    path = f"latest/namespaces/{lake.namespace}/tables/events"
    _from_memory(server, path, headers, 0)
    tokens.revoke(lake.conn, rid)
    r = requests.get(f"{server}/v1/{path}", headers=headers, timeout=30)
    assert r.status_code == 401, r.text


def test_a_revision_drops_the_cuts_memory_gave(lake, server):
    """S(T, B) given from memory is not given again once a revision rewinds T below B: the
    load says B is no longer valid, as without memory."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    b1, b2 = p.advance(), p.advance()
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    headers = {"Authorization": f"Bearer {access_token(server, rid, rsecret)}"}
    path = f"barrier-{b2}/namespaces/{lake.namespace}/tables/orders"
    _from_memory(server, path, headers, 2)
    revisions.begin(lake.conn, lake.T("orders"), b1)
    r = requests.get(f"{server}/v1/{path}", headers=headers, timeout=30)
    assert r.status_code >= 400 and str(b2) in r.text, r.text


def test_read_committed_moves_on_after_a_quiet_moment_with_memory(lake):
    """A read-committed session's moment comes from memory while its loads come quickly, and
    moves to the newest cut after a quiet moment, as without memory."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    p.advance()
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    proc, server = start_server(lake, "--session-quiet", "5s")  # memory gives the moment for 0.5 s
    try:
        headers = {"Authorization": f"Bearer {access_token(server, rid, rsecret)}"}
        path = f"read-committed/namespaces/{lake.namespace}/tables/orders"
        _from_memory(server, path, headers, 1)
        p.advance()
        assert _snapshots(server, path, headers) == 1  # moments later: the session's moment holds
        time.sleep(6)  # past 1.1 times the quiet interval, where it moves (between quiet and that: either)
        assert _snapshots(server, path, headers) == 2  # quiet: the newest cut
    finally:
        err = stop_server(proc)
    assert "Traceback" not in err, err[-3000:]


@contextlib.contextmanager
def _session_in_memory(lake) -> Iterator[tuple[Pipeline, str, str, dict, str]]:
    """``orders`` at one barrier, a server that holds a read-committed moment 1 s past each touch
    (touched every 0.5 s), and a reader's session whose moment memory holds: the pipeline, the
    reader's id, the server, the reader's headers and the table's path. No traceback."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    p.advance()
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    proc, server = start_server(lake, "--session-quiet", "10s")
    try:
        headers = {"Authorization": f"Bearer {access_token(server, rid, rsecret)}"}
        path = f"read-committed/namespaces/{lake.namespace}/tables/orders"
        _from_memory(server, path, headers, 1)
        yield p, rid, server, headers, path
    finally:
        err = stop_server(proc)
    assert "Traceback" not in err, err[-3000:]


def test_a_session_loading_without_pause_stays_in_memory_and_the_database_knows_its_last_load(lake):
    """A read-committed session loading without pause for five times as long as memory holds a
    moment it asked for (a tenth of the quiet interval) is not answered by the database: memory's
    touches (every twentieth of the interval, one statement) keep the moment, and write the
    session's last load, so the database would keep the moment for it too."""
    with _session_in_memory(lake) as (p, rid, server, headers, path):
        before = _answered(server, headers)["database"]
        mark = lake.conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
        p.advance()  # a newer cut: the session keeps its moment
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert _snapshots(server, path, headers) == 1
        assert _answered(server, headers)["database"] - before <= 1  # one, if a touch came late
        last_load = "SELECT t.rc_loaded_at FROM catalog_token t WHERE t.client_id = %s"
        deadline = time.monotonic() + 30
        while lake.conn.execute(last_load, (rid,)).fetchone()["rc_loaded_at"] <= mark:
            assert time.monotonic() < deadline, "no touch wrote the session's last load"
            time.sleep(0.05)
        samples = scrape(server, headers)
        assert samples[("icebarrier_catalog_moment_touches_total", ())] > 0


def test_a_session_whose_touches_are_slow_waits_for_them_and_never_asks_the_database(lake):
    """Every touch answered 0.8 s late (Postgres' function made to sleep first): longer than the
    margin memory keeps a moment past a touch's start, shorter than a catch-up's longest wait. A
    session loading without pause for 5 s is still answered by memory, every load: one whose
    moment's time ran out while a touch carrying it was out waits for the touch, which keeps the
    moment. (Before, each such load asked the database, and under 16 clients their writes of
    the session queued behind one another for up to half a second.)"""
    touch = "session_touch(text[], text[], bigint[], double precision[])"
    lake.conn.execute(f"ALTER FUNCTION {touch} RENAME TO session_touch_at_once")
    lake.conn.execute(
        """CREATE FUNCTION session_touch(a text[], b text[], c bigint[], d double precision[])
        RETURNS TABLE (token_hash text, scope text) LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_sleep(0.8); RETURN QUERY SELECT * FROM session_touch_at_once(a, b, c, d); END $$"""
    )
    with _session_in_memory(lake) as (_, _, server, headers, path):
        before = _answered(server, headers)
        deadline = time.monotonic() + 5
        loads = 0
        while time.monotonic() < deadline:
            assert _snapshots(server, path, headers) == 1
            loads += 1
        after = _answered(server, headers)
        assert after["database"] == before["database"], (before, after)
        assert after["memory"] - before["memory"] == loads
        assert scrape(server, headers)[("icebarrier_catalog_moment_touches_total", ())] >= 3


def test_memory_is_dropped_while_its_listener_is_cut_off(lake, server):
    """The listening connection killed: memory is off at once (a write meanwhile is seen), then
    on again, empty, once it listens again."""
    lake.catalog.create_table(f"{lake.namespace}.events", schema=ROW)
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    headers = {"Authorization": f"Bearer {access_token(server, rid, rsecret)}"}
    path = f"latest/namespaces/{lake.namespace}/tables/events"
    _wait_live(server, headers, 1.0)
    for _ in range(3):
        assert _snapshots(server, path, headers) == 0
    with psycopg.connect(lake.settings.dsn, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = 'icebarrier-load-cache' AND datname = current_database()"
        ).fetchone()[0]
    assert killed >= 1
    # Notices raised now reach nobody in this server; its memory must not answer from before.
    lake.catalog.load_table(f"{lake.namespace}.events").append(pa.table({"id": [1]}, schema=ROW))
    assert _snapshots(server, path, headers) == 1
    _wait_live(server, headers, 1.0)
    assert _snapshots(server, path, headers) == 1


def test_without_the_announcing_trigger_every_load_asks_the_database(lake):
    """A catalog whose pointer table does not announce its changes (a database not upgraded): the
    server says so in one line and answers every load from the database."""
    lake.catalog.create_table(f"{lake.namespace}.events", schema=ROW)
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    with psycopg.connect(lake.settings.dsn, autocommit=True) as admin:
        admin.execute(f'DROP TRIGGER {POINTER_TRIGGER} ON "{lake.settings.catalog_schema}".iceberg_tables')
    try:
        proc, server = start_server(lake)
        try:
            headers = {"Authorization": f"Bearer {access_token(server, rid, rsecret)}"}
            path = f"latest/namespaces/{lake.namespace}/tables/events"
            for _ in range(3):
                _snapshots(server, path, headers)
            lake.catalog.load_table(f"{lake.namespace}.events").append(pa.table({"id": [1]}, schema=ROW))
            assert _snapshots(server, path, headers) == 1
            answered = _answered(server, headers)
        finally:
            err = stop_server(proc)
    finally:
        watch_pointers(lake.settings)  # the other tests' catalog again
    assert answered["live"] == 0 and answered["memory"] == 0 and answered["database"] >= 4
    assert "does not announce its changes" in err and "icebarrier db upgrade" in err, err
    assert "Traceback" not in err, err[-3000:]


def test_a_barrier_completed_meanwhile_does_not_disturb_memory(lake, server):
    """Barriers issued and completed (watermarks moving on, no new commit) keep what memory gave
    for a barrier already completed: the next load is answered from memory, not the database."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    b1 = p.advance()
    rid, rsecret = tokens.create(lake.conn, whole_lake=True)
    headers = {"Authorization": f"Bearer {access_token(server, rid, rsecret)}"}
    path = f"barrier-{b1}/namespaces/{lake.namespace}/tables/orders"
    _from_memory(server, path, headers, 1)
    for _ in range(3):
        jobs.complete(lake.conn, f"{lake.namespace}_ingest", barriers.issue(lake.conn).barrier, {})
    before = _answered(server, headers)
    assert _snapshots(server, path, headers) == 1
    after = _answered(server, headers)
    assert (after["memory"] - before["memory"], after["database"] - before["database"]) == (1, 0)


def _two_tables(lake) -> Callable[[int], None]:
    """Tables ``left`` and ``right`` of one snapshot each, and a function that swaps both pointers
    in one transaction, as another writer would: to 0 (before their append) or 1 (after). Both
    are at 0 when it returns."""
    cs = lake.settings.catalog_schema
    locations = {}
    for name in ("left", "right"):
        table = lake.catalog.create_table(f"{lake.namespace}.{name}", schema=ROW)
        old = table.metadata_location
        table.append(pa.table({"id": [1]}, schema=ROW))
        locations[name] = (old, table.metadata_location)

    def swap(to: int) -> None:
        with psycopg.connect(lake.settings.dsn, autocommit=True) as conn, conn.transaction():
            for name, both in locations.items():
                conn.execute(
                    f'UPDATE "{cs}".iceberg_tables SET metadata_location = %s '
                    "WHERE catalog_name = 'lake' AND table_namespace = %s AND table_name = %s",
                    (both[to], lake.namespace, name),
                )

    swap(0)
    return swap


def test_a_two_table_commit_is_never_half_seen_while_its_notices_are_late(lake):
    """The listening connection's notices come 300 ms late (a proxy holds them). Two pointers
    swapped in one transaction by another writer: a load that asks the database sees the first
    table's new state, and the next load, of the second table, which memory still remembers as
    it was, is not answered from memory before memory has caught up: never the new first with
    the old second."""
    swap = _two_tables(lake)
    with _late_notices(lake, tokens.create(lake.conn, whole_lake=True)) as (server, headers, _):
        right = f"latest/namespaces/{lake.namespace}/tables/right"
        _from_memory(server, right, headers, 0)  # memory holds the second table as it was
        swap(1)
        assert _snapshots(server, f"latest/namespaces/{lake.namespace}/tables/left", headers) == 1
        assert _snapshots(server, right, headers) == 1


def test_a_load_does_not_share_a_catch_up_sent_before_it_came(lake):
    """As above, while four other clients load the second table all the time, so that catch-ups
    are always out (each 300 ms, the listening connection's stream late from a first notice on).
    A catch-up sent before the swap committed is answered ahead of the swap's notice: the load
    after the swap must wait for one sent after it came, not join one already out."""
    swap = _two_tables(lake)
    with _late_notices(lake, tokens.create(lake.conn, whole_lake=True)) as (server, headers, _):
        right = f"latest/namespaces/{lake.namespace}/tables/right"
        lake.catalog.create_table(f"{lake.namespace}.first_notice", schema=ROW)  # the stream is late from now
        _from_memory(server, right, headers, 0)
        stop = threading.Event()

        def load_all_the_time() -> None:
            with requests.Session() as s:
                while not stop.is_set():
                    assert s.get(f"{server}/v1/{right}", headers=headers, timeout=30).status_code == 200

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            loaders = [pool.submit(load_all_the_time) for _ in range(4)]
            try:
                time.sleep(1.0)  # catch-ups out all the time
                swap(1)
                assert _snapshots(server, f"latest/namespaces/{lake.namespace}/tables/left", headers) == 1
                assert _snapshots(server, right, headers) == 1
            finally:
                stop.set()
            for loader in loaders:
                loader.result()


def test_a_write_through_the_server_is_read_back_while_its_notice_is_late(lake):
    """Notices 300 ms late: a commit through the server, then at once a load from another
    connection to the same server sees it (memory catches up with the server's own writes before
    it answers again)."""
    Pipeline(lake, {"ingest": ["orders"]})  # a job, whose token writes the unmanaged table
    lake.catalog.create_table(f"{lake.namespace}.events", schema=ROW)
    jid, jsecret = tokens.create(lake.conn, job=f"{lake.namespace}_ingest", whole_lake=True)
    with _late_notices(lake, tokens.create(lake.conn, whole_lake=True)) as (server, headers, _):
        path = f"latest/namespaces/{lake.namespace}/tables/events"
        table = rest(server, "latest", f"{jid}:{jsecret}").load_table(f"{lake.namespace}.events")
        for i in range(3):
            _from_memory(server, path, headers, i)  # memory holds the table as it is
            table.append(pa.table({"id": [i]}, schema=ROW))
        assert _snapshots(server, path, headers) == 3


def test_a_callers_token_is_answered_from_memory_and_refused_as_soon_as_it_is_revoked(lake):
    """Who holds a token (every route's caller) comes from memory: a job's requests ask the
    database nothing for it once it is known. Revoked, while the server's notices come 300 ms
    late, it is refused at once: memory catches up before it answers. A job's own loads still
    ask the database (they see its staged commits)."""
    Pipeline(lake, {"ingest": ["orders"]})
    lake.catalog.create_table(f"{lake.namespace}.events", schema=ROW)
    job = tokens.create(lake.conn, job=f"{lake.namespace}_ingest", whole_lake=True)
    with _late_notices(lake, job) as (server, headers, proxy):
        lake.catalog.create_table(f"{lake.namespace}.first_notice", schema=ROW)  # the stream is late from now

        def config() -> int:
            return requests.get(f"{server}/v1/config", headers=headers, timeout=30).status_code

        assert config() == 200
        before = proxy.transactions
        assert [config() for _ in range(5)] == [200] * 5
        assert proxy.transactions == before, "a known token was asked of the database again"
        loads = _answered(server, headers)["database"]
        path = f"latest/namespaces/{lake.namespace}/tables/events"
        assert [_snapshots(server, path, headers) for _ in range(3)] == [0] * 3
        assert _answered(server, headers)["database"] == loads + 3, "a job's load was answered from memory"
        tokens.revoke(lake.conn, job[0])
        assert config() == 401


def test_a_namespaces_list_comes_from_memory_and_shows_every_change_at_once(lake):
    """Lists of tables and views ask the database nothing once a process holds the namespace's
    names, yet every change committed before a list came is in it, whoever wrote it and while
    the server's notices come 300 ms late: a table created and dropped directly in the SQL
    catalog (as Spark's JDBC catalog writes), renamed into another namespace, a view created.
    An empty namespace lists nothing; a missing one is the 404."""
    ns = lake.namespace
    other = f"{ns}_other"
    lake.catalog.create_namespace(other)
    lake.catalog.create_table(f"{ns}.a", schema=ROW)
    with _late_notices(lake, tokens.create(lake.conn, whole_lake=True)) as (server, headers, proxy):

        def listed(namespace: str, kind: str = "tables") -> list[str]:
            r = requests.get(f"{server}/v1/latest/namespaces/{namespace}/{kind}", headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            return [i["name"] for i in r.json()["identifiers"]]

        assert listed(ns) == ["a"]
        before = proxy.transactions
        assert [listed(ns) for _ in range(3)] == [["a"]] * 3 and listed(ns, "views") == []
        assert proxy.transactions == before, "a list was asked of the database again"
        lake.catalog.create_table(f"{ns}.b", schema=ROW)
        assert listed(ns) == ["a", "b"]
        lake.catalog.drop_table(f"{ns}.a")
        assert listed(ns) == ["b"]
        assert listed(other) == []
        lake.catalog.rename_table(f"{ns}.b", f"{other}.b")
        assert (listed(ns), listed(other)) == ([], ["b"])
        writer = rest(server, "latest", _job_token(lake))
        writer.create_view((other, "v"), ROW, _version("SELECT 1", other))
        assert (listed(other), listed(other, "views")) == (["b"], ["v"])
        missing = requests.get(f"{server}/v1/latest/namespaces/{ns}_nowhere/tables", headers=headers, timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "NoSuchNamespaceException"
        writer.drop_view((other, "v"))  # the worker's catalog is shared: the other namespace goes too
    lake.catalog.drop_table(f"{other}.b")
    lake.catalog.drop_namespace(other)
