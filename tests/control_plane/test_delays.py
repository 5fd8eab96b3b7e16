"""Delays, freshness, lag and the bottleneck, from recorded completion times."""

from datetime import timedelta

from icebarrier.control_plane import delays, jobs
from tests.helpers import T, new_barrier, register_chain


def _complete_at(conn, job_name, barrier, sink, offset_s):
    """Complete, then pin the completion time to issue time + offset (deterministic delays)."""
    jobs.complete(conn, job_name, barrier, {T(sink): barrier % 100000})
    conn.execute(
        """UPDATE table_completion c SET completed_at = b.issued_at + make_interval(secs => %s)
           FROM barrier b, managed_table m
           WHERE c.barrier = b.barrier AND c.table_id = m.table_id AND m.name = %s AND c.barrier = %s""",
        (offset_s, str(T(sink)), barrier),
    )


def test_table_and_job_delays_and_bottleneck(conn):
    """Table delay is end-to-end; job delay is own work; the slowest job is flagged."""
    register_chain(conn)
    for _ in range(3):
        b = new_barrier(conn)
        _complete_at(conn, "ingest_orders", b, "orders", 1)
        _complete_at(conn, "ingest_payments", b, "payments", 2)
        _complete_at(conn, "agg", b, "revenue", 7)  # own delay 5 (after payments at 2)
        _complete_at(conn, "report", b, "report", 8)  # own delay 1
    new_barrier(conn)  # issued, completed by nobody: everyone is one behind
    tables = {d.name: d for d in delays.table_delays(conn)}
    assert tables["lake.db.report"].p50_s == 8 and tables["lake.db.orders"].max_s == 1
    assert all(d.barriers_behind == 1 and d.barriers == 3 for d in tables.values())
    by_job = {d.name: d for d in delays.job_delays(conn)}
    assert {n: d.p50_s for n, d in by_job.items()} == {"agg": 5, "report": 1, "ingest_orders": 1, "ingest_payments": 2}
    assert [n for n, d in by_job.items() if d.bottleneck] == ["agg"]
    assert [d.name for d in delays.job_delays(conn, job="report")] == ["report"]


def test_views_answer_plain_sql(conn):
    """Users can query the documented views and columns with plain SQL."""
    register_chain(conn)
    b = new_barrier(conn)
    _complete_at(conn, "ingest_orders", b, "orders", 1)
    row = conn.execute("SELECT barrier, table_name, issued_at, completed_at, delay FROM barrier_delay").fetchone()
    assert row["delay"] == timedelta(seconds=1) and row["table_name"] == "lake.db.orders"
    row = conn.execute(
        "SELECT table_name, table_kind, watermark_barrier, current_snapshot_id, last_commit_at "
        "FROM table_versions WHERE table_name = 'lake.db.revenue'"
    ).fetchone()
    assert row["table_kind"] == "intermediate" and row["watermark_barrier"] is None
    assert conn.execute("SELECT barrier, issued_at FROM consistent_barrier").fetchone()["barrier"] is None
    edges = conn.execute("SELECT from_node, to_node, edge_kind FROM topology_edges").fetchall()
    assert {"from_node": "agg", "to_node": "lake.db.revenue", "edge_kind": "writes"} in edges
    assert conn.execute("SELECT job_name, barrier, delay FROM job_delay").fetchall()[0]["job_name"] == "ingest_orders"
    assert conn.execute("SELECT job_name, table_name FROM job_sources WHERE job_name = 'agg'").fetchall()
    assert conn.execute("SELECT job_name, table_name FROM job_sinks").fetchall()
    assert (
        conn.execute(
            "SELECT lease_id, holder, table_name, snapshot_id, barrier, expires_at FROM active_leases"
        ).fetchall()
        == []
    )
