"""``db.transaction``: statements left for a transaction's end ride with its COMMIT."""

from __future__ import annotations

import psycopg
import pytest

from icebarrier.control_plane import db
from tests.helpers import new_database
from tests.pg_counter import TransactionCounter


@pytest.fixture
def counted(pg_server):
    """A connection through the transaction counter, to a fresh database with a table ``t``."""
    with new_database(pg_server, "icebarrier_db") as dsn:
        counter = TransactionCounter(dsn)
        try:
            with psycopg.connect(counter.dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE t (k int PRIMARY KEY)")
                yield conn, counter
        finally:
            counter.close()


def _exchanges(counter: TransactionCounter, block) -> int:
    before = counter.round_trips
    block()
    return counter.round_trips - before


def test_the_tail_goes_out_with_the_commit_in_one_round_trip(counted):
    """A statement left to the tail commits with the block and costs no round trip of its own:
    the same two inserts take one exchange fewer than as two statements."""
    conn, counter = counted

    def plain():
        with conn.transaction():
            conn.execute("INSERT INTO t VALUES (1)")
            conn.execute("INSERT INTO t VALUES (2)")

    def tailed():
        with db.transaction(conn) as tail:
            conn.execute("INSERT INTO t VALUES (3)")
            tail.then("INSERT INTO t VALUES (%s)", (4,))

    assert _exchanges(counter, tailed) == _exchanges(counter, plain) - 1
    assert [r[0] for r in conn.execute("SELECT k FROM t ORDER BY k")] == [1, 2, 3, 4]
    assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_failing_tail_rolls_the_whole_block_back_and_raises(counted):
    """The tail's error is raised at the end of the block, nothing of the block stands, and the
    connection is ready for the next transaction; an error in the block sends no tail."""
    conn, counter = counted
    conn.execute("INSERT INTO t VALUES (1)")
    for after in range(3):  # the failing statement first, then statements the pipeline aborts
        with pytest.raises(psycopg.errors.UniqueViolation):  # never PipelineAborted, whenever results arrive
            with db.transaction(conn) as tail:
                conn.execute("INSERT INTO t VALUES (2)")
                tail.then("INSERT INTO t VALUES (%s)", (1,))
                for k in range(after):
                    tail.then("INSERT INTO t VALUES (%s)", (10 + k,))
        assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with pytest.raises(psycopg.errors.UndefinedColumn):
        with db.transaction(conn) as tail:
            tail.then("INSERT INTO t VALUES (3)")
            conn.execute("SELECT no_such_column")
    assert [r[0] for r in conn.execute("SELECT k FROM t")] == [1]


def test_it_is_the_outermost_transaction(counted):
    """Inside another transaction it is refused (its failed tail would roll back the outer one)."""
    conn, _ = counted
    with conn.transaction():
        with pytest.raises(psycopg.ProgrammingError, match="already in one"):
            with db.transaction(conn):
                pass


def test_control_plane_connections_never_jit_compile(conn, dsn):
    """JIT is off on every control-plane connection, plain and pooled: the status page's query
    over views (costed high for its set-returning functions) spent ~1 s compiling for 30 ms of
    work with it on."""
    assert conn.execute("SHOW jit").fetchone()["jit"] == "off"
    with db.pool(dsn, None, max_size=1) as pool, pool.connection() as pooled:
        assert pooled.execute("SHOW jit").fetchone()["jit"] == "off"
