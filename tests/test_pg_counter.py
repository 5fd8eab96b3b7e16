"""The wire-level transaction counter the idle-cost test relies on counts what its clients ran,
one per transaction, and nothing else."""

from __future__ import annotations

import time

import psycopg

from tests.pg_counter import TransactionCounter


def test_the_counter_counts_each_transaction_once(pg_server):
    """Two autocommit statements, an explicit transaction of two statements, a failed statement
    and a rolled-back transaction are five transactions; a connection alone and another client
    of the same server are none."""
    counter = TransactionCounter(pg_server)
    try:
        with psycopg.connect(counter.dsn, autocommit=True) as conn, psycopg.connect(pg_server) as other:
            assert counter.transactions == 0
            other.execute("SELECT 1")
            other.commit()
            conn.execute("SELECT 1")
            conn.execute("SELECT 2")
            with conn.transaction():
                conn.execute("SELECT 3")
                conn.execute("SELECT 4")
            try:
                conn.execute("SELECT no_such_column")
            except psycopg.errors.UndefinedColumn:
                pass
            try:
                with conn.transaction():
                    conn.execute("SELECT 5")
                    raise RuntimeError
            except RuntimeError:
                pass
            assert counter.transactions == 5  # counted before the client had its answer
            time.sleep(0.2)
            assert counter.transactions == 5
    finally:
        counter.close()
