-- Per user, the orders table against user_totals and order_shares, at one cut: every row says
-- agree = true at read-committed; at read-uncommitted the three tables may mix moments.
SELECT count(DISTINCT o.user_id) AS users, sum(o.total) AS total,
       bool_and(o.n = t.orders AND o.total = t.total AND s.user_total = t.total AND s.n = t.orders) AS agree
FROM (SELECT user_id, count(*) AS n, sum(amount) AS total FROM lake.kshop.orders GROUP BY user_id) o
JOIN lake.kshop.user_totals t ON t.user_id = o.user_id
JOIN (SELECT user_id, count(*) AS n, max(user_total) AS user_total FROM lake.kshop.order_shares GROUP BY user_id) s
  ON s.user_id = o.user_id
