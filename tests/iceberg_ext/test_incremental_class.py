"""Which queries are incremental (docs/incremental.md's table), and the construct named for
those that are not: the analysis alone (sqlglot), no Spark."""

from __future__ import annotations

import pytest

from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.incremental import analyse

TABLES = {("orders",): "lake.s.orders", ("ships",): "lake.s.ships", ("lake", "s", "orders"): "lake.s.orders"}


def _analyse(query: str):
    return analyse(query, lambda parts: TableName.parse(TABLES[parts]) if parts in TABLES else None)


INCREMENTAL = {
    "projection and filter": "SELECT order_id, amount * 2 AS a2, upper(item) AS item FROM orders WHERE amount > 1",
    "a fully named table": "SELECT order_id FROM lake.s.orders",
    "inner join": "SELECT o.order_id, s.carrier FROM orders o JOIN ships s ON o.order_id = s.order_id",
    "join with USING": "SELECT order_id, carrier FROM orders JOIN ships USING (order_id)",
    "three-way join, one table twice": "SELECT o.order_id, p.order_id AS other FROM orders o JOIN ships s "
    "ON o.order_id = s.order_id JOIN orders p ON p.user_id = o.user_id",
    "union all": "SELECT order_id FROM orders UNION ALL SELECT order_id FROM ships",
    "group by": "SELECT user_id, count(*) AS n, count(price) AS c, sum(amount) AS s, min(item) AS lo, "
    "max(price) AS hi, avg(price) AS mean FROM orders GROUP BY user_id",
    "group by position": "SELECT user_id, item, sum(amount) AS s FROM orders GROUP BY 1, 2",
    "group by an expression": "SELECT upper(item) AS i, sum(amount) AS s FROM orders GROUP BY upper(item)",
    "no group by: one row": "SELECT count(*) AS n, sum(amount) AS s FROM orders",
    "join then aggregate": "SELECT o.user_id, o.item, sum(o.amount * o.price) AS price FROM orders o "
    "JOIN ships s ON o.order_id = s.order_id GROUP BY o.user_id, o.item",
}


@pytest.mark.parametrize("query", INCREMENTAL.values(), ids=INCREMENTAL.keys())
def test_in_the_class(query):
    analysis = _analyse(query)
    assert analysis.query is not None, analysis.reason


def test_an_avg_needs_a_state_table_and_the_rest_do_not():
    assert _analyse("SELECT user_id, avg(price) AS p FROM orders GROUP BY user_id").query.needs_state
    assert not _analyse("SELECT user_id, sum(price) AS p FROM orders GROUP BY user_id").query.needs_state


def test_a_join_has_one_delta_term_per_occurrence():
    query = _analyse(INCREMENTAL["three-way join, one table twice"]).query
    terms = query.delta(lambda table, role: f"{table.name}_{role}").split(" UNION ALL ")
    assert [[w for w in t.split() if w.endswith(("_old", "_new", "_delta"))] for t in terms] == [
        ["orders_delta", "ships_new", "orders_new"],
        ["orders_old", "ships_delta", "orders_new"],
        ["orders_old", "ships_old", "orders_delta"],
    ]


def test_the_fingerprint_follows_the_query():
    a, b = (
        _analyse(f"SELECT user_id, sum(amount) AS s FROM orders WHERE amount > {n} GROUP BY user_id") for n in (1, 2)
    )
    assert a.query.fingerprint != b.query.fingerprint
    assert (
        a.query.fingerprint
        == _analyse("select user_id, SUM(amount) as s from orders where amount > 1 group by user_id").query.fingerprint
    )


OUTSIDE = {
    "SELECT DISTINCT user_id FROM orders": "SELECT DISTINCT",
    "SELECT user_id FROM orders GROUP BY user_id": "GROUP BY without an aggregate",
    "SELECT user_id, count(DISTINCT item) AS n FROM orders GROUP BY user_id": "a DISTINCT aggregate",
    "SELECT user_id, sum(amount) AS s FROM orders GROUP BY user_id HAVING sum(amount) > 3": "HAVING",
    "SELECT user_id, sum(amount) / count(*) AS m FROM orders GROUP BY user_id": "an expression over aggregates",
    "SELECT user_id, item, sum(amount) AS s FROM orders GROUP BY user_id": "neither a GROUP BY key nor an aggregate",
    "SELECT sum(amount) AS s FROM orders GROUP BY user_id": "not in the select list",
    "SELECT user_id, stddev(amount) AS s FROM orders GROUP BY user_id": "aggregates: COUNT, SUM, MIN, MAX, AVG",
    "SELECT o.order_id FROM orders o LEFT JOIN ships s ON o.order_id = s.order_id": "LEFT JOIN",
    "SELECT order_id FROM orders UNION SELECT order_id FROM ships": "UNION (without ALL",
    "SELECT order_id FROM orders EXCEPT SELECT order_id FROM ships": "EXCEPT",
    "SELECT order_id FROM orders WHERE order_id IN (SELECT order_id FROM ships)": "a subquery",
    "SELECT order_id FROM (SELECT order_id FROM orders)": "a subquery in FROM",
    "WITH x AS (SELECT order_id FROM orders) SELECT order_id FROM x": "a WITH clause",
    "SELECT order_id, row_number() OVER (ORDER BY order_id) AS r FROM orders": "a window function",
    "SELECT order_id FROM orders ORDER BY order_id LIMIT 10": "ORDER BY",
    "SELECT order_id, current_timestamp() AS at FROM orders": "current_timestamp(), whose value depends on when",
    "SELECT order_id, now() AS at FROM orders": "now(), whose value depends on when",
    "SELECT order_id FROM elsewhere": "elsewhere, which is not a managed table",
    "SELECT user_id, sum(amount) AS s FROM orders GROUP BY ROLLUP (user_id)": "ROLLUP",
    "SELECT item AS user_id, sum(amount) AS s FROM orders GROUP BY user_id": "a select alias",
    "SELECT user_id, count(*) AS n FROM orders GROUP BY user_id UNION ALL SELECT 1, 2 FROM ships": (
        "an aggregate inside UNION ALL"
    ),
}


@pytest.mark.parametrize("query, construct", OUTSIDE.items(), ids=OUTSIDE.values())
def test_outside_the_class_names_the_construct(query, construct):
    analysis = _analyse(query)
    assert analysis.query is None and construct in analysis.reason, analysis.reason
