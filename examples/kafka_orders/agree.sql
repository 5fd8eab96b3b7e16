-- Per user, the orders table against user_totals, and user_totals against user_shares, at one cut:
-- at read-committed agree is true whatever moment the query catches; at read-uncommitted the
-- three tables may come from three moments.
SELECT count(*) AS users, sum(o.total) AS total, round(sum(s.percent), 6) AS percent,
       bool_and(o.n = t.orders AND o.total = t.total AND s.orders = t.orders AND s.total = t.total) AS agree
FROM (SELECT user_id, count(*) AS n, sum(amount) AS total FROM lake.kshop.orders GROUP BY user_id) o
JOIN lake.kshop.user_totals t ON t.user_id = o.user_id
JOIN lake.kshop.user_shares s ON s.user_id = o.user_id
