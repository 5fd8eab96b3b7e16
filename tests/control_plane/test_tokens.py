"""Catalog tokens and the read-committed session's moment, as several server processes share them."""

from __future__ import annotations

import threading
import time

from icebarrier.control_plane import catalog_loads, db, tokens
from tests.helpers import T, complete_all, new_barrier, register_chain


def moment(conn, access: str, table: str, quiet_ms: int = 60_000) -> tuple[int | None, int | None]:
    """(the session's barrier, S(table, it)) of a read-committed load by ``access``."""
    query = catalog_loads.LoadQuery(
        catalog_schema=None,
        table=T(table),
        managed_key=str(T(table)),
        mode="read-committed",
        access_token=access,
        quiet_ms=quiet_ms,
    )
    state = catalog_loads.load_state(conn, query)
    return state.cut, state.snapshot_id


def test_a_session_barrier_another_server_chose_resolves_in_a_snapshot_that_sees_it(conn, dsn):
    """Two server processes serve one read-committed session, quiet for a while. While one (B)
    holds the session's row and moves it to barrier b2, the other (A) starts its load; b2 completes, B commits, A takes
    b2 — and resolves S(orders, b2) in a statement that sees b2's completion (``catalog_load`` is
    one call, but each statement inside it takes a snapshot of its own; S(orders, b2) resolved in
    the snapshot the load started with would find b2 not valid: a 400 for the client)."""
    register_chain(conn)
    b1 = new_barrier(conn)
    complete_all(conn, b1)
    client_id, secret = tokens.create(conn, whole_lake=True)
    access = tokens.open_session(conn, client_id, secret)
    assert moment(conn, access, "orders")[0] == b1
    b2 = new_barrier(conn)
    found: dict = {}

    def load_on_server_a() -> None:
        with db.connect(dsn) as a:
            try:
                found["cut"] = moment(a, access, "orders")
            except Exception as exc:  # noqa: BLE001 - the assertion below shows it
                found["error"] = exc

    conn.execute("UPDATE catalog_token SET rc_loaded_at = clock_timestamp() - interval '2 minutes'")  # quiet since
    with db.connect(dsn) as server_b:
        server_b.execute("BEGIN")
        server_b.execute(
            "UPDATE catalog_token SET rc_barrier = %s, rc_loaded_at = clock_timestamp() "
            "WHERE client_id = (SELECT client_id FROM catalog_session WHERE token_hash = %s)",
            (b2, tokens.token_hash(access)),
        )
        a = threading.Thread(target=load_on_server_a)
        a.start()
        deadline = time.monotonic() + 10
        while not conn.execute(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()["n"]:
            assert time.monotonic() < deadline, "server A's load never waited for the session's row"
            time.sleep(0.01)
        complete_all(conn, b2)
        server_b.execute("COMMIT")
        a.join(timeout=10)
    assert "error" not in found, found.get("error")
    barrier, snapshot = found["cut"]
    assert barrier == b2
    assert (
        snapshot
        == conn.execute(
            "SELECT snapshot_ids[1] AS s FROM resolve_cut(ARRAY[%s], %s, true)", (str(T("orders")), b2)
        ).fetchone()["s"]
    )


def test_every_access_token_of_one_client_shares_its_read_committed_moment(conn):
    """Two access tokens of one client (Trino takes one per table it loads) see the client's
    barrier while its loads keep coming; another client's first load takes the newest cut."""
    register_chain(conn)
    b1 = new_barrier(conn)
    complete_all(conn, b1)
    client_id, secret = tokens.create(conn, whole_lake=True)
    first, second = (tokens.open_session(conn, client_id, secret) for _ in range(2))
    assert moment(conn, first, "orders")[0] == b1
    b2 = new_barrier(conn)
    complete_all(conn, b2)
    assert moment(conn, second, "payments")[0] == b1
    other = tokens.open_session(conn, *tokens.create(conn, whole_lake=True))
    assert moment(conn, other, "orders")[0] == b2
    assert moment(conn, second, "orders", quiet_ms=0)[0] == b2  # quiet: it moves


def test_a_read_committed_moment_in_use_is_protected_from_expiry(conn):
    """A client's moment at b1 keeps S(orders, b1) in the read window after b2 is valid (a load of
    its next table may still resolve it); once no client holds b1, only b2's cut is kept."""
    register_chain(conn)
    b1 = new_barrier(conn)
    first = complete_all(conn, b1)
    b2 = new_barrier(conn)
    complete_all(conn, b2, snapshot_base=10)

    def window() -> list[int]:
        table_id = conn.execute("SELECT table_id FROM managed_table WHERE name = %s", (str(T("orders")),)).fetchone()
        return conn.execute("SELECT read_window FROM protection(%s)", (table_id["table_id"],)).fetchone()["read_window"]

    assert first["orders"] not in window()  # no client reads b1
    access = tokens.open_session(conn, *tokens.create(conn, whole_lake=True))
    conn.execute(
        "UPDATE catalog_token SET rc_barrier = %s, rc_loaded_at = clock_timestamp() "
        "WHERE client_id = (SELECT client_id FROM catalog_session WHERE token_hash = %s)",
        (b1, tokens.token_hash(access)),
    )  # the client chose b1 before b2 was valid and keeps loading
    assert first["orders"] in window()
    conn.execute("UPDATE catalog_token SET rc_loaded_at = clock_timestamp() - interval '2 minutes'")
    assert first["orders"] not in window()  # the client went away: its moment is not protected
