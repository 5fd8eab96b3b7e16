"""Root-job sources against a real Postgres: event-time barriers and the source watermark."""

import uuid

import psycopg
import psycopg.conninfo
import pytest

from icebarrier.control_plane import barriers, runs, tables
from icebarrier.control_plane.model import TableName, barrier_time
from icebarrier.iceberg_ext.job import RootJob
from icebarrier.iceberg_ext.runtime import Runtime
from icebarrier.iceberg_ext.sources import PostgresSource, SourceError


@pytest.fixture
def transfers(lake_dsn):
    name = f"transfers_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(lake_dsn, autocommit=True) as c:
        c.execute(
            f"CREATE TABLE public.{name} (id bigserial, account int, delta bigint, "
            f"ts timestamptz NOT NULL DEFAULT now())"
        )
    yield name
    with psycopg.connect(lake_dsn, autocommit=True) as c:
        c.execute(f"DROP TABLE public.{name}")


def _transfer(conn, table, a, b, amount):
    """One source transaction: two legs stamped with the same event time (now() = transaction start)."""
    with conn.transaction():
        conn.execute(f"INSERT INTO public.{table} (account, delta) VALUES (%s, %s), (%s, %s)", (a, -amount, b, amount))


def test_event_time_barrier_waits_for_open_transactions_and_keeps_them_whole(lake, spark, lake_dsn, transfers):
    """A barrier closes only when no open source transaction started before it; it takes
    exactly the rows stamped <= B, so a transfer's two legs land in the same barrier."""
    sink = f"lake.{lake.namespace}.ledger"
    spark.sql(f"CREATE TABLE {sink} (id bigint, account int, delta bigint, ts timestamp) USING iceberg")
    source = PostgresSource(lake_dsn, f"public.{transfers}", ["id", "account", "delta", "ts"], event_time="ts")
    job = RootJob(name=f"{lake.namespace}_ledger", sinks=[sink], source=source)
    rt = Runtime(job, settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None)
    with psycopg.connect(lake_dsn, autocommit=True) as writer, psycopg.connect(lake_dsn) as slow:
        _transfer(writer, transfers, 1, 2, 10)
        slow.execute(f"INSERT INTO public.{transfers} (account, delta) VALUES (3, -5)")  # open transaction
        b1 = barriers.issue(lake.conn).barrier
        _transfer(writer, transfers, 2, 3, 7)  # committed, but stamped after b1
        assert not source.ready(b1)  # the open transaction started before b1 and may still commit
        assert rt.run().completed == []
        slow.execute(f"INSERT INTO public.{transfers} (account, delta) VALUES (4, 5)")
        slow.commit()  # the slow transfer lands, stamped before b1
    assert source.ready(b1)
    assert rt.run().completed == [b1]
    rows = spark.table(sink).collect()
    assert sorted(r.delta for r in rows) == [-10, -5, 5, 10]  # both transfers before b1, whole; not the later one
    assert sum(r.delta for r in rows) == 0
    spec = runs.recorded_range(lake.conn, job.name, b1)
    assert spec["event_time_le"] == barrier_time(b1).isoformat()
    b2 = barriers.issue(lake.conn).barrier
    assert rt.run().completed == [b2]
    assert sum(r.delta for r in spark.table(sink).collect()) == 0 and spark.table(sink).count() == 6
    assert tables.states(lake.conn, [TableName.parse(sink)])[0].watermark == b2


def test_source_needs_one_strategy(lake_dsn):
    """A Postgres source takes a key (system-time) or an event-time column, not both or neither."""
    with pytest.raises(SourceError, match="exactly one"):
        PostgresSource(lake_dsn, "public.t", ["a"])


def test_key_interval_source_reads_new_rows_and_replays_its_recorded_range(lake, spark, lake_dsn, transfers):
    """System-time by a monotone key: each barrier takes the key interval since the last one;
    re-reading a recorded range returns exactly the same rows, whatever arrived since."""
    sink = f"lake.{lake.namespace}.keyed"
    spark.sql(f"CREATE TABLE {sink} (id bigint, account int, delta bigint) USING iceberg")
    source = PostgresSource(lake_dsn, f"public.{transfers}", ["id", "account", "delta"], key="id")
    job = RootJob(name=f"{lake.namespace}_keyed", sinks=[sink], source=source)
    rt = Runtime(job, settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None)
    with psycopg.connect(lake_dsn, autocommit=True) as writer:
        _transfer(writer, transfers, 1, 2, 10)
        b1 = barriers.issue(lake.conn).barrier
        assert rt.run().completed == [b1]
        _transfer(writer, transfers, 2, 3, 7)
        b2 = barriers.issue(lake.conn).barrier
        assert rt.run().completed == [b2]
        spec = runs.recorded_range(lake.conn, job.name, b2)
        assert (spec["key_gt"], spec["key_le"]) == (2, 4)
        _transfer(writer, transfers, 3, 4, 1)  # after the range: not part of b2 on replay
    assert sorted(r.id for r in source.read(spark, spec).collect()) == [3, 4]
    assert spark.table(sink).count() == 4


def test_event_time_watermark_is_scoped_and_job_list_says_what_holds_it(lake, spark, lake_dsn, pg_server, transfers):
    """Open writing transactions in another database, or of a role that cannot write the source
    table, do not hold the watermark; one that can write it does, and `job list` names it."""
    import threading

    from icebarrier.control_plane import jobs

    sink = f"lake.{lake.namespace}.ledger"
    spark.sql(f"CREATE TABLE {sink} (id bigint, account int, delta bigint, ts timestamp) USING iceberg")
    source = PostgresSource(lake_dsn, f"public.{transfers}", ["id", "account", "delta", "ts"], event_time="ts")
    job = RootJob(name=f"{lake.namespace}_ledger", sinks=[sink], source=source)
    barriers.set_interval_s(lake.conn, 3600)  # only the test issues barriers
    reader_role = f"ro_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(lake_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {reader_role} LOGIN")
        admin.execute(f"GRANT SELECT ON public.{transfers} TO {reader_role}")
    try:
        ro_dsn = psycopg.conninfo.make_conninfo(lake_dsn, user=reader_role)
        with psycopg.connect(pg_server) as elsewhere, psycopg.connect(ro_dsn) as reader:
            elsewhere.execute("SELECT txid_current()")  # a writing transaction in another database
            reader.execute("SELECT txid_current()")  # one by a role that cannot write the table
            b1 = barriers.issue(lake.conn).barrier
            assert source.waiting_for(b1) is None
            with Runtime(job, settings=lake.settings, spark=spark, log=lambda _: None) as rt:
                assert rt.run().completed == [b1]
        with psycopg.connect(lake_dsn) as writer:
            writer.execute("SELECT txid_current()")  # the table's writer (superuser), still open
            b2 = barriers.issue(lake.conn).barrier
            pid = writer.info.backend_pid
            assert f"transaction pid {pid}" in source.waiting_for(b2)
            with Runtime(job, settings=lake.settings, spark=spark, log=lambda _: None) as rt:
                follower = threading.Thread(target=rt.run, kwargs={"follow": True, "poll_s": 0.1})
                follower.start()
                try:
                    for _ in range(100):
                        info = jobs.show(lake.conn, job.name)
                        if info.waiting_for:
                            break
                        threading.Event().wait(0.1)
                    assert info.status == "running" and f"transaction pid {pid}" in info.waiting_for
                finally:
                    rt.stop.set()
                    follower.join(30)
    finally:
        with psycopg.connect(lake_dsn, autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {reader_role}")
            admin.execute(f"DROP ROLE {reader_role}")
