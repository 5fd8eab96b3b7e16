"""The checker's model: every table's rows at every barrier, a pure function of the seed.

Events are numbered; event i has event time i. The k-th barrier issued closes the events with
time <= k * WINDOW, so a barrier's input is a pure function of the barrier and can be replayed
after a crash. Root tables: ``orders``, ``payments`` (event time: a payment may come after its
order, never before), ``ledger`` (a transfer's two legs land together). Derived tables:
``balances`` (opening balance + ledger) and ``paid`` (payments, and how many have their order).
"""

from __future__ import annotations

import random
from collections import Counter

import pyarrow as pa

WINDOW = 4
ACCOUNTS = 5
OPENING = 100
SCHEMAS = {
    "orders": pa.schema([("order_id", pa.int64())]),
    "payments": pa.schema([("order_id", pa.int64()), ("t", pa.int64())]),
    "ledger": pa.schema([("transfer_id", pa.int64()), ("account", pa.int64()), ("delta", pa.int64())]),
    "balances": pa.schema([("account", pa.int64()), ("balance", pa.int64())]),
    "paid": pa.schema([("payments", pa.int64()), ("with_order", pa.int64())]),
}
ROOTS = {"orders_in": "orders", "payments_in": "payments", "ledger_in": "ledger"}
DERIVED = {"balances_job": (["ledger"], "balances"), "paid_job": (["orders", "payments"], "paid")}
JOBS = [*ROOTS, *DERIVED]


def payment_time(seed: int, order_id: int) -> int:
    return order_id + random.Random(seed * 7919 + order_id).randrange(0, 3 * WINDOW)


def transfer(seed: int, transfer_id: int) -> tuple[int, int, int]:
    rng = random.Random(seed * 104729 + transfer_id)
    a, b = rng.sample(range(ACCOUNTS), 2)
    return a, b, rng.randrange(1, 20)


def events(seed: int, table: str, t_from: int, t_to: int) -> pa.Table:
    """The model's rows of a root table with event time in (t_from, t_to]."""
    if table == "orders":
        return pa.table({"order_id": pa.array(range(t_from + 1, t_to + 1), pa.int64())}, schema=SCHEMAS["orders"])
    if table == "payments":
        ids = [o for o in range(max(1, t_from - 3 * WINDOW), t_to + 1) if t_from < payment_time(seed, o) <= t_to]
        return pa.table(
            {"order_id": pa.array(ids, pa.int64()), "t": pa.array([payment_time(seed, o) for o in ids], pa.int64())},
            schema=SCHEMAS["payments"],
        )
    rows = []
    for tid in range(t_from + 1, t_to + 1):
        a, b, amount = transfer(seed, tid)
        rows += [(tid, a, -amount), (tid, b, amount)]
    return pa.table(
        {
            "transfer_id": pa.array([r[0] for r in rows], pa.int64()),
            "account": pa.array([r[1] for r in rows], pa.int64()),
            "delta": pa.array([r[2] for r in rows], pa.int64()),
        },
        schema=SCHEMAS["ledger"],
    )


def derive(sink: str, data: dict[str, pa.Table]) -> pa.Table:
    """What a derived job writes from its sources' rows (the jobs and the model share this)."""
    if sink == "balances":
        totals = Counter({a: OPENING for a in range(ACCOUNTS)})
        for account, delta in zip(data["ledger"]["account"].to_pylist(), data["ledger"]["delta"].to_pylist()):
            totals[account] += delta
        return pa.table(
            {
                "account": pa.array(sorted(totals), pa.int64()),
                "balance": pa.array([totals[a] for a in sorted(totals)], pa.int64()),
            },
            schema=SCHEMAS[sink],
        )
    orders = set(data["orders"]["order_id"].to_pylist())
    pays = data["payments"]["order_id"].to_pylist()
    return pa.table(
        {
            "payments": pa.array([len(pays)], pa.int64()),
            "with_order": pa.array([sum(1 for p in pays if p in orders)], pa.int64()),
        },
        schema=SCHEMAS[sink],
    )


def expected(seed: int, barrier_no: int) -> dict[str, pa.Table]:
    """Every table's rows at the ``barrier_no``-th barrier (root tables from the events up to
    it, derived tables from those)."""
    roots = {table: events(seed, table, 0, barrier_no * WINDOW) for table in ROOTS.values()}
    return {**roots, **{sink: derive(sink, roots) for _, sink in DERIVED.values()}}


def rows(table: pa.Table) -> list[tuple]:
    """A table's rows as sorted tuples (order does not matter; duplicates do)."""
    return sorted(tuple(r.values()) for r in table.to_pylist())


def compare(seed: int, barrier_no: int, data: dict[str, pa.Table]) -> str | None:
    """None if the cut holds exactly the model's rows at the barrier, else the first difference."""
    for table, want in expected(seed, barrier_no).items():
        got, exp = rows(data[table]), rows(want)
        if got != exp:
            duplicated = len(got) - len(set(got))
            return f"{table} at barrier #{barrier_no}: {len(got)} rows ({duplicated} duplicated), model has {len(exp)}"
    return None


def check_cut(data: dict[str, pa.Table]) -> str | None:
    """The invariants every consistent cut satisfies, whatever its barrier; None, or the first violation."""
    orders = set(data["orders"]["order_id"].to_pylist())
    orphan = [o for o in data["payments"]["order_id"].to_pylist() if o not in orders]
    if orphan:
        return f"payment for order {orphan[0]} visible without its order"
    balances = dict(zip(data["balances"]["account"].to_pylist(), data["balances"]["balance"].to_pylist()))
    if balances and sum(balances.values()) != ACCOUNTS * OPENING:
        return f"total balance {sum(balances.values())} != {ACCOUNTS * OPENING}"
    ledger = Counter()
    for account, delta in zip(data["ledger"]["account"].to_pylist(), data["ledger"]["delta"].to_pylist()):
        ledger[account] += delta
    for account, balance in balances.items():
        if balance != OPENING + ledger[account]:
            return f"account {account}: balances {balance} but ledger gives {OPENING + ledger[account]}"
    paid = data["paid"].to_pylist()
    if paid and (paid[0]["payments"] != data["payments"].num_rows or paid[0]["with_order"] != paid[0]["payments"]):
        return f"paid says {paid[0]} but payments has {data['payments'].num_rows} rows"
    return None
